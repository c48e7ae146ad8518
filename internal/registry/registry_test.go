package registry

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

func TestCredentials(t *testing.T) {
	dir := t.TempDir()
	cfg := `{"auths": {
		"127.0.0.1:5000": {"auth": "dXNlcjpwYXNzOndvcmQ="},
		"https://index.docker.io/v1/": {"username": "hub", "password": "secret"},
		"tok.example": {"identitytoken": "refresh"}
	}}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		host, user, pass string
	}{
		{"127.0.0.1:5000", "user", "pass:word"},
		{"registry-1.docker.io", "hub", "secret"},
		{"tok.example", "", "refresh"},
		{"other.example", "", ""},
	} {
		for _, loc := range []string{dir, filepath.Join(dir, "config.json")} {
			u, p, err := Credentials(loc)(tc.host)
			if err != nil || u != tc.user || p != tc.pass {
				t.Errorf("%s via %s: %q %q %v, want %q %q", tc.host, loc, u, p, err, tc.user, tc.pass)
			}
		}
	}
	// A missing config means anonymous access, not an error.
	if u, p, err := Credentials(filepath.Join(dir, "nope"))("x"); u != "" || p != "" || err != nil {
		t.Errorf("missing config: %q %q %v", u, p, err)
	}
}

func TestConfigureHostsPlainHTTP(t *testing.T) {
	ctx := context.Background()
	hostsDir := t.TempDir()
	mirror := filepath.Join(hostsDir, "example.com")
	if err := os.MkdirAll(mirror, 0o755); err != nil {
		t.Fatal(err)
	}
	toml := "server = \"https://example.com\"\n[host.\"http://mirror.local:5000\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
	if err := os.WriteFile(filepath.Join(mirror, "hosts.toml"), []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	hosts, err := ConfigureHosts(ctx, Options{HostsDir: hostsDir, PlainHTTP: true})("example.com")
	if err != nil {
		t.Fatal(err)
	}
	if len(hosts) != 2 || hosts[0].Host != "mirror.local:5000" || hosts[0].Scheme != "http" || hosts[1].Host != "example.com" {
		t.Errorf("hosts.toml not honoured: %+v", hosts)
	}
	plain, err := ConfigureHosts(ctx, Options{HostsDir: hostsDir, PlainHTTP: true})("reg.test:5000")
	if err != nil || len(plain) != 1 || plain[0].Scheme != "http" {
		t.Errorf("plain HTTP default: %+v %v", plain, err)
	}
	if _, err := NewResolver(ctx, Options{HostsDir: hostsDir}); err != nil {
		t.Error(err)
	}
}
