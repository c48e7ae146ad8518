// Package registry builds containerd registry resolvers the way containerd
// itself does: hosts from a certs.d directory (hosts.toml, certificates)
// through core/remotes/docker/config, credentials from the Docker client
// configuration (config.json auths, credsStore and credHelpers). Every
// envsnap component that talks to a registry (converter, lazy fetcher,
// group publishing) uses it so that they all honour the same mirrors,
// certificates and credentials as the node's containerd.
package registry

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/distribution/reference"
)

// DefaultHostsDir is where containerd's CRI plugin and ctr look for
// certs.d host directories.
const DefaultHostsDir = "/etc/containerd/certs.d"

// Options configure registry access.
type Options struct {
	// HostsDir is a certs.d tree (<host>/hosts.toml, <host>/*.crt, with
	// "host:port" spelled "host_port_"); "" means no host configuration.
	HostsDir string
	// DockerConfig is the Docker client configuration: a directory holding
	// config.json or the file itself. "" means $DOCKER_CONFIG, else
	// ~/.docker. A missing file means anonymous access.
	DockerConfig string
	// PlainHTTP makes hosts without a hosts.toml use http:// (test
	// registries). Loopback hosts with a port already fall back to HTTP.
	PlainHTTP bool
}

// ConfigureHosts returns the RegistryHosts for o. The credentials are read
// from the Docker configuration on every authorization, so tokens refreshed
// on disk (by a credential helper or a re-login) are picked up by
// long-running processes.
func ConfigureHosts(ctx context.Context, o Options) docker.RegistryHosts {
	ho := config.HostOptions{
		Credentials: Credentials(o.DockerConfig),
	}
	if o.HostsDir != "" {
		ho.HostDir = config.HostDirFromRoot(o.HostsDir)
	}
	if o.PlainHTTP {
		ho.DefaultScheme = "http"
	}
	return config.ConfigureHosts(ctx, ho)
}

// NewResolver returns a resolver (fetch, push, resolve) for o.
func NewResolver(ctx context.Context, o Options) (remotes.Resolver, error) {
	if o.HostsDir != "" {
		if _, err := os.Stat(o.HostsDir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("hosts dir %s: %w", o.HostsDir, err)
		}
	}
	return docker.NewResolver(docker.ResolverOptions{Hosts: ConfigureHosts(ctx, o)}), nil
}

// dockerConfigFile is the subset of ~/.docker/config.json used here.
type dockerConfigFile struct {
	Auths map[string]struct {
		Auth          string `json:"auth"`
		Username      string `json:"username"`
		Password      string `json:"password"`
		IdentityToken string `json:"identitytoken"`
	} `json:"auths"`
	CredsStore  string            `json:"credsStore"`
	CredHelpers map[string]string `json:"credHelpers"`
}

func configPath(dockerConfig string) string {
	if dockerConfig == "" {
		dockerConfig = os.Getenv("DOCKER_CONFIG")
	}
	if dockerConfig == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return ""
		}
		dockerConfig = filepath.Join(home, ".docker")
	}
	if strings.HasSuffix(dockerConfig, ".json") {
		return dockerConfig
	}
	return filepath.Join(dockerConfig, "config.json")
}

// Credentials returns a containerd credentials callback backed by the
// Docker configuration at dockerConfig (see Options.DockerConfig). It
// returns ("", "", nil) for hosts without credentials (anonymous), and
// ("", token, nil) for identity tokens, which containerd's authorizer
// exchanges as OAuth refresh tokens.
func Credentials(dockerConfig string) func(host string) (string, string, error) {
	return func(host string) (string, string, error) {
		path := configPath(dockerConfig)
		if path == "" {
			return "", "", nil
		}
		b, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			return "", "", nil
		}
		if err != nil {
			return "", "", fmt.Errorf("read docker config: %w", err)
		}
		var cfg dockerConfigFile
		if err := json.Unmarshal(b, &cfg); err != nil {
			return "", "", fmt.Errorf("parse docker config %s: %w", path, err)
		}
		return lookup(&cfg, host)
	}
}

// configKeys returns the keys Docker uses in config.json for host.
func configKeys(host string) []string {
	if host == "registry-1.docker.io" || host == "docker.io" || host == "index.docker.io" {
		return []string{"https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io"}
	}
	return []string{host, "https://" + host, "http://" + host, "https://" + host + "/v1/", "https://" + host + "/v2/"}
}

func lookup(cfg *dockerConfigFile, host string) (string, string, error) {
	keys := configKeys(host)
	for _, k := range keys {
		if helper, ok := cfg.CredHelpers[k]; ok && helper != "" {
			return fromHelper(helper, keys[0])
		}
	}
	for _, k := range keys {
		a, ok := cfg.Auths[k]
		if !ok {
			continue
		}
		if a.IdentityToken != "" {
			return "", a.IdentityToken, nil
		}
		if a.Auth != "" {
			dec, err := base64.StdEncoding.DecodeString(a.Auth)
			if err != nil {
				return "", "", fmt.Errorf("docker config auth for %s: %w", host, err)
			}
			user, pass, ok := strings.Cut(string(dec), ":")
			if !ok {
				return "", "", fmt.Errorf("docker config auth for %s is not user:password", host)
			}
			return user, pass, nil
		}
		if a.Username != "" {
			return a.Username, a.Password, nil
		}
	}
	if cfg.CredsStore != "" {
		return fromHelper(cfg.CredsStore, keys[0])
	}
	return "", "", nil
}

// fromHelper runs docker-credential-<helper> get, the Docker credential
// helper protocol: server URL on stdin, JSON on stdout.
func fromHelper(helper, server string) (string, string, error) {
	cmd := exec.Command("docker-credential-"+helper, "get")
	cmd.Stdin = strings.NewReader(server)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if strings.Contains(stdout.String()+stderr.String(), "credentials not found") {
			return "", "", nil
		}
		return "", "", fmt.Errorf("credential helper %s for %s: %w: %s", helper, server, err, strings.TrimSpace(stderr.String()))
	}
	var out struct{ Username, Secret string }
	if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
		return "", "", fmt.Errorf("credential helper %s output: %w", helper, err)
	}
	if out.Username == "<token>" {
		return "", out.Secret, nil
	}
	return out.Username, out.Secret, nil
}

// SourcePolicy decides which repositories a node daemon may fetch from on
// the word of an image alone: the hint annotations of a layer
// (layerfmt.AnnotationHintSource) name a repository that no client vouched
// for, and the daemon sends its own credentials there.
type SourcePolicy struct {
	// Allowed lists registry hosts ("registry.example.com",
	// "127.0.0.1:5000") and repository prefixes ending in "/"
	// ("registry.example.com/envsnap/"). Nil means every registry host
	// with its own directory in HostsDir (as containerd names them:
	// "host" or "host_port_"; "_default" does not count): the registries
	// the node's operator configured. Empty (non-nil) allows none.
	Allowed []string
	// HostsDir is the certs.d tree the default reads.
	HostsDir string
}

// ErrSourceNotAllowed is returned by SourcePolicy.Check for a source the
// policy does not allow.
var ErrSourceNotAllowed = errors.New("source not allowed")

// Check returns nil if the policy allows fetching from source, a
// repository "host/path".
func (p SourcePolicy) Check(source string) error {
	named, err := reference.ParseNamed(source)
	if err != nil || !reference.IsNameOnly(named) {
		return fmt.Errorf("source %q: not a canonical repository name (host/path): %w", source, ErrSourceNotAllowed)
	}
	host := reference.Domain(named)
	if p.Allowed == nil {
		if p.HostsDir != "" && host != "_default" {
			for _, dir := range []string{hostDirectory(host), host} {
				if st, err := os.Stat(filepath.Join(p.HostsDir, dir)); err == nil && st.IsDir() {
					return nil
				}
			}
		}
		return fmt.Errorf("source %q: %s has no directory in the hosts dir %q: %w", source, host, p.HostsDir, ErrSourceNotAllowed)
	}
	for _, a := range p.Allowed {
		if a == host || (strings.HasSuffix(a, "/") && strings.HasPrefix(source, a)) {
			return nil
		}
	}
	return fmt.Errorf("source %q: not in the allowed sources %q: %w", source, p.Allowed, ErrSourceNotAllowed)
}

// hostDirectory is how containerd names the certs.d directory of a host
// with a port ("host:5000" -> "host_5000_").
func hostDirectory(host string) string {
	if i := strings.LastIndex(host, ":"); i > 0 {
		return host[:i] + "_" + host[i+1:] + "_"
	}
	return host
}
