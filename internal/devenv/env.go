// Package devenv runs a private envsnap stack on one machine: a registry
// behind a counting proxy, a containerd configured for envsnap (proxy
// snapshotter, remote-snapshot labels, the envlet runtime, CRI) and, on
// request, the envsnap daemon. The end-to-end tests (through tests/testenv),
// `make demo` and `make bench` all run on it. Close tears everything down by
// PID and mountpoint and reports mounts the daemons left behind.
package devenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/errdefs"
)

// Env is one isolated set of daemons.
type Env struct {
	Dir        string
	Namespace  string
	HostsDir   string
	Registry   *Registry
	Containerd *Process
	// Address is containerd's gRPC socket.
	Address string
	Client  *client.Client
	// SnapshotterSocket is where containerd expects the envsnap daemon.
	SnapshotterSocket string
	// Envsnap is the envsnap daemon when started with WithEnvsnap.
	Envsnap *Process
	// EnvsnapRoot is the daemon's state directory.
	EnvsnapRoot string
	// EnvletConfig is the shim's config file and Arbiter the node arbiter,
	// with WithEnvlet.
	EnvletConfig string
	Arbiter      *Process
	// PauseImage is the CRI sandbox image, pushed to the registry.
	PauseImage   string
	ContentStore content.Store
	// Logf receives teardown notes; default discards them.
	Logf func(format string, args ...any)

	opts      options
	mu        sync.Mutex
	closing   sync.Mutex // held by Close: a second Close waits for the first
	cleanups  []func()
	processes []*Process
	leaked    []string
}

type options struct {
	envsnap      bool
	envsnapArgs  []string
	envsnapBin   string
	envsnapRoot  string
	lazyDefault  bool
	containerEnv []string
	extraConfig  string
	imports      []string
	dirPrefix    string
	registryNet  RegistryNetwork
	registryIP   string
	netns        string
	envlet       *EnvletConfig
	noLabels     bool
	proxyName    string
}

// Option configures Start.
type Option func(*options)

// WithEnvsnap starts `bin/containerd-envsnap serve` on SnapshotterSocket
// (root, hosts dir and socket are set by the env; args are appended).
func WithEnvsnap(args ...string) Option {
	return func(o *options) { o.envsnap = true; o.envsnapArgs = args }
}

// WithEnvsnapRoot puts the daemon's state directory at dir instead of in
// the env's directory (e.g. on a small file system the test made).
func WithEnvsnapRoot(dir string) Option {
	return func(o *options) { o.envsnapRoot = dir }
}

// WithDefaultLazyMinSize keeps the daemon's default lazy_min_size, so
// layers below it are unpacked by containerd, as on a node. Without it the
// env's daemon serves every layer in the envsnap format lazily: test
// images are a few KiB, and tests are about the lazy path.
func WithDefaultLazyMinSize() Option {
	return func(o *options) { o.lazyDefault = true }
}

// WithEnvsnapBinary runs bin instead of `bin/containerd-envsnap` (a
// benchmark comparing a baseline build with the current one in one run).
func WithEnvsnapBinary(bin string) Option {
	return func(o *options) { o.envsnapBin = bin }
}

// WithContainerdEnv adds environment variables to containerd's process,
// which its shims inherit (e.g. ENVLET_CONFIG for our shim).
func WithContainerdEnv(env ...string) Option {
	return func(o *options) { o.containerEnv = append(o.containerEnv, env...) }
}

// WithConfig appends TOML to containerd's generated config.
func WithConfig(toml string) Option {
	return func(o *options) { o.extraConfig += "\n" + toml }
}

// WithImports lists config files in containerd's top-level `imports`, the
// way a node's config.toml pulls in /etc/containerd/conf.d/*.toml: they are
// merged over the generated config (containerd's merge rules, not TOML
// concatenation, so they can replace generated settings).
func WithImports(paths ...string) Option {
	return func(o *options) { o.imports = append(o.imports, paths...) }
}

// EnvletConfig configures the envlet shim and the node arbiter.
type EnvletConfig struct {
	// NodeCPU and NodeMemory size the node for the arbiter (e.g. "2",
	// "4Gi"); empty means the machine's.
	NodeCPU, NodeMemory string
	// Policy holds [policy] keys of envlet.toml (docs/shim.md), e.g.
	// "initial-cpu": "0.5".
	Policy map[string]string
	// Protected is [guard] protected: paths no environment may open or
	// connect to, besides the node's sockets.
	Protected []string
	// ArbiterMetrics is the arbiter's --metrics-address ("" for none).
	ArbiterMetrics string
	// AllowHostNetwork is [guard] allow-host-network: containers and CRI
	// pods on the node's network (the only network a CRI pod has on a
	// test node without CNI) are refused without it.
	AllowHostNetwork bool
}

// WithEnvlet writes an envlet.toml for the shim (containerd passes
// ENVLET_CONFIG to it) and runs `containerd-envsnap arbiter` with it.
func WithEnvlet(c EnvletConfig) Option {
	return func(o *options) { o.envlet = &c }
}

// WithoutSnapshotLabels runs containerd as it comes: CRI's
// disable_snapshot_annotations at its default (true) and no
// enable_remote_snapshot_annotations export for the envsnap proxy plugin,
// so no pull path of containerd adds the remote-snapshot labels; only an
// image's own hint annotations can make a pull lazy.
func WithoutSnapshotLabels() Option {
	return func(o *options) { o.noLabels = true }
}

// WithProxyName registers the envsnap daemon in containerd under name
// instead of "envsnap" (its proxy plugin, the transfer service's unpack
// entry and the envlet runtime's snapshotter), e.g. "stargz", the one name
// for which BuildKit passes layer annotations to Prepare. ProxyName
// reports it.
func WithProxyName(name string) Option {
	return func(o *options) { o.proxyName = name }
}

// ProxyName is the snapshotter name containerd knows the envsnap daemon by.
func (e *Env) ProxyName() string { return e.opts.proxyName }

// WithNetNS runs containerd, the envsnap daemon and the arbiter (and so
// the shims and containers they start) in the network namespace at path
// (e.g. /run/netns/NAME), without a mount namespace of their own: their
// mounts stay visible to each other and to the caller, who still reaches
// them over their unix sockets. The namespace must reach the registry
// (WithRegistryListenIP).
func WithNetNS(path string) Option {
	return func(o *options) { o.netns = path }
}

// WithRegistryListenIP serves the registry's counting proxy (Registry.Host)
// on ip instead of 127.0.0.1, e.g. a bridge address that daemons in other
// network namespaces reach.
func WithRegistryListenIP(ip string) Option {
	return func(o *options) { o.registryIP = ip }
}

// WithDirPrefix names the temporary directory (default "envsnap-e2e-").
func WithDirPrefix(prefix string) Option {
	return func(o *options) { o.dirPrefix = prefix }
}

var envCounter atomic.Int64

// CheckMachine reports why this machine cannot run the stack, if it can't:
// it needs root, /dev/fuse and overlayfs.
func CheckMachine() error {
	if os.Geteuid() != 0 {
		return errors.New("needs root (containerd, FUSE and overlayfs mounts)")
	}
	var st syscall.Stat_t
	if err := syscall.Stat("/dev/fuse", &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFCHR {
		return fmt.Errorf("needs /dev/fuse as a character device (stat: %v)", err)
	}
	if !hasFilesystem("overlay") {
		return errors.New("needs overlayfs (modprobe overlay)")
	}
	return nil
}

// Start brings up a registry and a containerd (and the envsnap daemon with
// WithEnvsnap). On error, whatever was started is torn down.
func Start(ctx context.Context, opts ...Option) (_ *Env, retErr error) {
	if err := CheckMachine(); err != nil {
		return nil, err
	}
	e := &Env{Logf: func(string, ...any) {}, opts: options{dirPrefix: "envsnap-e2e-", proxyName: "envsnap", registryIP: "127.0.0.1"}}
	for _, o := range opts {
		o(&e.opts)
	}
	// Unix socket paths are limited to 108 bytes: keep the directory short
	// (not under a test's long temp dir).
	dir, err := os.MkdirTemp("", e.opts.dirPrefix)
	if err != nil {
		return nil, err
	}
	e.Dir = dir
	e.Namespace = fmt.Sprintf("envsnap-test-%d-%d", os.Getpid(), envCounter.Add(1))
	e.onClose(e.teardownDir)
	track(e)
	defer func() {
		if retErr != nil {
			e.Close()
		}
	}()

	e.HostsDir = filepath.Join(dir, "certs.d")
	if e.Registry, err = e.startRegistry(); err != nil {
		return nil, err
	}
	if err := WriteHostsDir(e.HostsDir, e.Registry.Host); err != nil {
		return nil, err
	}
	if e.ContentStore, err = local.NewStore(filepath.Join(dir, "content")); err != nil {
		return nil, err
	}
	pause, err := e.PushImage(e.Context(), "envsnap-test/pause:1", nil,
		WithEntrypoint("/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"))
	if err != nil {
		return nil, fmt.Errorf("push pause image: %w", err)
	}
	e.PauseImage = pause.Ref

	e.SnapshotterSocket = filepath.Join(dir, "envsnap.sock")
	e.EnvsnapRoot = filepath.Join(dir, "envsnap")
	if e.opts.envsnapRoot != "" {
		e.EnvsnapRoot = e.opts.envsnapRoot
	}
	if e.opts.envsnap {
		if _, err := e.StartEnvsnap(); err != nil {
			return nil, err
		}
	}
	if e.opts.envlet != nil {
		if err := e.startArbiter(*e.opts.envlet); err != nil {
			return nil, err
		}
	}
	if err := e.startContainerd(); err != nil {
		return nil, err
	}
	return e, nil
}

func (e *Env) startArbiter(c EnvletConfig) error {
	socket := filepath.Join(e.Dir, "arbiter.sock")
	// The arbiter timeouts are the defaults a user gets: the rollout
	// benchmark counts the gaps they leave on a crowded node.
	cfg := "[policy]\n"
	keys := make([]string, 0, len(c.Policy))
	for k := range c.Policy {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		cfg += fmt.Sprintf("%s = %q\n", k, c.Policy[k])
	}
	cfg += "[node]\n"
	if c.NodeCPU != "" {
		cfg += fmt.Sprintf("cpu = %q\n", c.NodeCPU)
	}
	if c.NodeMemory != "" {
		cfg += fmt.Sprintf("memory = %q\n", c.NodeMemory)
	}
	cfg += fmt.Sprintf("[arbiter]\nsocket = %q\n", socket)
	cfg += "[guard]\n"
	if len(c.Protected) > 0 {
		quoted := make([]string, len(c.Protected))
		for i, p := range c.Protected {
			quoted[i] = strconv.Quote(p)
		}
		cfg += "protected = [" + strings.Join(quoted, ", ") + "]\n"
	}
	if c.AllowHostNetwork {
		cfg += "allow-host-network = true\n"
	}
	e.EnvletConfig = filepath.Join(e.Dir, "envlet.toml")
	if err := os.WriteFile(e.EnvletConfig, []byte(cfg), 0o600); err != nil {
		return err
	}
	e.opts.containerEnv = append(e.opts.containerEnv, "ENVLET_CONFIG="+e.EnvletConfig)
	bin, err := Binary("containerd-envsnap")
	if err != nil {
		return err
	}
	args := []string{"arbiter", "--config", e.EnvletConfig}
	if c.ArbiterMetrics != "" {
		args = append(args, "--metrics-address", c.ArbiterMetrics)
	}
	p, err := e.StartProcess("arbiter", nil, bin, args...)
	if err != nil {
		return err
	}
	e.Arbiter = p
	return waitFor(20*time.Second, "arbiter socket", func() error {
		if exited, err := p.Exited(); exited {
			return fmt.Errorf("arbiter exited: %v\n%s", err, p.LogTail(20))
		}
		_, err := os.Stat(socket)
		return err
	})
}

// EnvsnapCLI runs containerd-envsnap with the env's envlet config (e.g.
// "envs", "--json") and returns its standard output.
func (e *Env) EnvsnapCLI(args ...string) (string, error) {
	bin, err := Binary("containerd-envsnap")
	if err != nil {
		return "", err
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "ENVLET_CONFIG="+e.EnvletConfig)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("containerd-envsnap %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

// onClose registers f to run at Close, before what was registered earlier.
func (e *Env) onClose(f func()) {
	e.mu.Lock()
	e.cleanups = append(e.cleanups, f)
	e.mu.Unlock()
}

// Close stops everything Start started, in reverse order, and returns the
// mounts that were still present below Dir once the daemons had stopped
// (Close unmounts them; a non-empty result is a leak to report).
func (e *Env) Close() (leaked []string) {
	e.closing.Lock()
	defer e.closing.Unlock()
	defer untrack(e)
	e.mu.Lock()
	cleanups := e.cleanups
	e.cleanups = nil
	e.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	return e.leaked
}

// Processes lists the daemons this env started.
func (e *Env) Processes() []*Process {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*Process(nil), e.processes...)
}

// StartProcess starts a daemon that Close stops.
func (e *Env) StartProcess(name string, env []string, bin string, args ...string) (*Process, error) {
	cmd := exec.Command(bin, args...)
	if e.opts.netns != "" {
		// nsenter enters the network namespace only (ip netns exec would
		// also give the daemon a mount namespace, hiding its mounts from
		// containerd) and execs bin: the PID stays the daemon's.
		cmd = exec.Command("nsenter", append([]string{"--net=" + e.opts.netns, "--", bin}, args...)...)
	}
	p, err := StartCommand(e.Dir, name, env, cmd)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	e.processes = append(e.processes, p)
	e.mu.Unlock()
	e.onClose(func() { p.Stop(10 * time.Second) })
	return p, nil
}

// Context returns a context in the env's containerd namespace.
func (e *Env) Context() context.Context {
	return namespaces.WithNamespace(context.Background(), e.Namespace)
}

// Hosts resolves registries the way containerd and envsnap do here.
func (e *Env) Hosts() docker.RegistryHosts {
	return config.ConfigureHosts(context.Background(), config.HostOptions{HostDir: config.HostDirFromRoot(e.HostsDir)})
}

// Resolver is a registry resolver using the env's hosts dir.
func (e *Env) Resolver() remotes.Resolver {
	return docker.NewResolver(docker.ResolverOptions{Hosts: e.Hosts()})
}

// SetEnvsnapArgs replaces the extra arguments the next StartEnvsnap passes
// to the daemon (e.g. to restart it in another mode).
func (e *Env) SetEnvsnapArgs(args ...string) {
	e.opts.envsnapArgs = args
}

// StartEnvsnap starts the envsnap daemon (again, after a Kill or Stop).
func (e *Env) StartEnvsnap() (*Process, error) {
	bin, err := Binary("containerd-envsnap")
	if err != nil {
		return nil, err
	}
	if e.opts.envsnapBin != "" {
		bin = e.opts.envsnapBin
	}
	args := []string{"serve",
		"--root", e.EnvsnapRoot,
		"--address", e.SnapshotterSocket,
		"--hosts-dir", e.HostsDir,
		"--log-level", "debug",
	}
	// Before the extra arguments, which may set it again. A baseline
	// build (WithEnvsnapBinary) may predate the flag; builds without it
	// serve every layer lazily.
	if !e.opts.lazyDefault && e.opts.envsnapBin == "" {
		args = append(args, "--lazy-min-size", "0")
	}
	args = append(args, e.opts.envsnapArgs...)
	p, err := e.StartProcess("envsnap", nil, bin, args...)
	if err != nil {
		return nil, err
	}
	e.Envsnap = p
	if e.Client != nil {
		// A restarted daemon is stopped at Close before what was
		// registered earlier, containerd's teardown included: clear the
		// containers, and collect their snapshots (disk caps are mounts),
		// while this daemon still serves.
		e.onClose(e.removeContainers)
	}
	// A socket file alone may be the one a killed daemon left (the new
	// one removes it as it starts): wait for an answer.
	if err := waitFor(20*time.Second, "envsnap socket", func() error {
		if exited, err := p.Exited(); exited {
			return fmt.Errorf("containerd-envsnap exited: %v", err)
		}
		c, err := net.Dial("unix", e.SnapshotterSocket)
		if err == nil {
			c.Close()
		}
		return err
	}); err != nil {
		return nil, fmt.Errorf("start envsnap: %w\n%s", err, p.LogTail(40))
	}
	if e.Client != nil {
		if err := waitFor(60*time.Second, "containerd to reach the restarted envsnap daemon", e.probeEnvsnap); err != nil {
			return nil, err
		}
	}
	return p, nil
}

var probeCounter atomic.Int64

// probeEnvsnap makes one snapshot call that containerd must forward to the
// envsnap daemon. containerd keeps one gRPC connection to the proxy plugin
// and gives each connection attempt only its backoff delay (about 1 s,
// growing to 3 s: the plugin sets no MinConnectTimeout). A call it made
// while the daemon was down, as its garbage collector does at any time,
// leaves that connection failing every call at once with "dial ...:
// timeout" until a later attempt succeeds: the daemon is up for containerd
// only once a call through it gets an answer from the daemon. A Stat of a
// missing key does not prove that (containerd's metadata store answers it
// alone); a Prepare reaches the daemon. The probe snapshot is removed at
// once, and from the daemon at containerd's next collection.
func (e *Env) probeEnvsnap() error {
	sn := e.Client.SnapshotService(e.opts.proxyName)
	ctx, cancel := context.WithTimeout(e.Context(), 5*time.Second)
	defer cancel()
	key := fmt.Sprintf("envsnap-devenv-probe-%d", probeCounter.Add(1))
	if _, err := sn.Prepare(ctx, key, ""); err != nil {
		return err
	}
	if err := sn.Remove(ctx, key); err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("remove probe snapshot %s: %w", key, err)
	}
	return nil
}

func (e *Env) startContainerd() error {
	e.Address = filepath.Join(e.Dir, "containerd.sock")
	cfgPath := filepath.Join(e.Dir, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(e.containerdConfig()), 0o600); err != nil {
		return err
	}
	bin, err := Tool("containerd")
	if err != nil {
		return err
	}
	binDir, err := BinDir()
	if err != nil {
		return err
	}
	// containerd finds shims (ours and runc's) and runc on PATH.
	path := "PATH=" + binDir + ":" + ToolsDir(binDir) + ":" + os.Getenv("PATH")
	env := append([]string{path}, e.opts.containerEnv...)
	p, err := e.StartProcess("containerd", env, bin, "--config", cfgPath)
	if err != nil {
		return err
	}
	e.Containerd = p
	if err := waitFor(30*time.Second, "containerd to serve", func() error {
		if exited, err := p.Exited(); exited {
			return fmt.Errorf("containerd exited: %v", err)
		}
		if _, err := os.Stat(e.Address); err != nil {
			return err
		}
		c, err := client.New(e.Address, client.WithDefaultNamespace(e.Namespace), client.WithTimeout(5*time.Second))
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if ok, err := c.IsServing(ctx); !ok || err != nil {
			c.Close()
			return fmt.Errorf("not serving: %v", err)
		}
		e.Client = c
		return nil
	}); err != nil {
		return fmt.Errorf("start containerd: %w\n%s", err, p.LogTail(40))
	}
	// Runs before containerd is stopped: tasks, containers and images go
	// first, so shims exit and snapshots are released while containerd can
	// still do it.
	e.onClose(e.removeContainers)
	return nil
}

// containerdConfig is the config the stack runs containerd with: the one
// config.toml.example documents, pointed at this env's directories.
func (e *Env) containerdConfig() string {
	d := e.Dir
	var imports string
	if len(e.opts.imports) > 0 {
		quoted := make([]string, len(e.opts.imports))
		for i, p := range e.opts.imports {
			quoted[i] = fmt.Sprintf("%q", p)
		}
		// Top-level keys must precede the first table.
		imports = "imports = [" + strings.Join(quoted, ", ") + "]\n"
	}
	proxyExports := fmt.Sprintf(`
    [proxy_plugins.%s.exports]
      enable_remote_snapshot_annotations = "true"`, e.opts.proxyName)
	criAnnotations := "\n    disable_snapshot_annotations = false"
	if e.opts.noLabels {
		proxyExports, criAnnotations = "", ""
	}
	return fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
%[11]s
[grpc]
  address = %[3]q
[ttrpc]
  address = %[4]q
[debug]
  level = "info"

[proxy_plugins]
  [proxy_plugins.%[14]s]
    type = "snapshot"
    address = %[5]q%[12]s

[plugins]
  [plugins."io.containerd.transfer.v1.local"]
    config_path = %[6]q
    [[plugins."io.containerd.transfer.v1.local".unpack_config]]
      platform = "linux/%[9]s"
      snapshotter = "overlayfs"
    [[plugins."io.containerd.transfer.v1.local".unpack_config]]
      platform = "linux/%[9]s"
      snapshotter = %[14]q

  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"

  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "overlayfs"%[13]s
    [plugins."io.containerd.cri.v1.images".pinned_images]
      sandbox = %[7]q
    [plugins."io.containerd.cri.v1.images".registry]
      config_path = %[6]q

  [plugins."io.containerd.cri.v1.runtime"]
    restrict_oom_score_adj = true
    enable_selinux = false
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = [%[8]q]
      conf_dir = %[8]q
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.envlet]
        runtime_type = "io.containerd.envlet.v2"
        snapshotter = %[14]q
        # CRI copies only these pod/container annotations into the OCI
        # spec, where the shim reads its per-environment overrides.
        pod_annotations = ["io.envsnap.envlet.*", "io.envsnap.shim.*", "io.envsnap.egress"]
        container_annotations = ["io.envsnap.envlet.*", "io.envsnap.shim.*", "io.kubernetes.container.terminationMessagePath"]
%[10]s
`, filepath.Join(d, "root"), filepath.Join(d, "state"), e.Address, e.Address+".ttrpc",
		e.SnapshotterSocket, e.HostsDir, e.PauseImage, filepath.Join(d, "cni"), runtime.GOARCH, e.opts.extraConfig, imports, proxyExports, criAnnotations, e.opts.proxyName)
}

// CRIEndpoint is the CRI socket (crictl --runtime-endpoint).
func (e *Env) CRIEndpoint() string { return "unix://" + e.Address }

// Crictl runs crictl against this containerd and returns its output.
func (e *Env) Crictl(args ...string) (string, error) {
	bin, err := Tool("crictl")
	if err != nil {
		return "", err
	}
	full := append([]string{"--runtime-endpoint", e.CRIEndpoint(), "--image-endpoint", e.CRIEndpoint(), "--timeout", "60s"}, args...)
	cmd := exec.Command(bin, full...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("crictl %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

func (e *Env) removeContainers() {
	if e.Client == nil {
		return
	}
	ctx, cancel := context.WithTimeout(e.Context(), 60*time.Second)
	defer cancel()
	// CRI pods first, through CRI, so it releases what it set up around
	// them (sandbox shm mounts, network namespaces).
	if _, err := e.Crictl("rmp", "--all", "--force"); err != nil {
		e.Logf("teardown: crictl rmp: %v", err)
	}
	nss, err := e.Client.NamespaceService().List(ctx)
	if err != nil {
		e.Logf("teardown: list namespaces: %v", err)
	}
	for _, ns := range nss {
		nctx := namespaces.WithNamespace(ctx, ns)
		containers, err := e.Client.Containers(nctx)
		if err != nil {
			e.Logf("teardown: list containers in %s: %v", ns, err)
			continue
		}
		for _, c := range containers {
			if task, err := c.Task(nctx, nil); err == nil {
				_ = task.Kill(nctx, syscall.SIGKILL, client.WithKillAll)
				if ch, err := task.Wait(nctx); err == nil {
					select {
					case <-ch:
					case <-time.After(10 * time.Second):
					}
				}
				if _, err := task.Delete(nctx, client.WithProcessKill); err != nil {
					e.Logf("teardown: delete task %s: %v", c.ID(), err)
				}
			}
			if err := c.Delete(nctx, client.WithSnapshotCleanup); err != nil {
				e.Logf("teardown: delete container %s: %v", c.ID(), err)
			}
		}
		is := e.Client.ImageService()
		imgs, _ := is.List(nctx)
		for _, img := range imgs {
			_ = is.Delete(nctx, img.Name)
		}
		// Leases a client left (BuildKit keeps its snapshots under its
		// own) hold snapshots, and a container snapshot's disk cap is a
		// mount.
		ls, _ := e.Client.LeasesService().List(nctx)
		for _, l := range ls {
			_ = e.Client.LeasesService().Delete(nctx, l)
		}
	}
	if err := e.CollectGarbage(ctx); err != nil {
		e.Logf("teardown: %v", err)
	}
	e.Client.Close()
}

// CollectGarbage runs containerd's garbage collection and returns when it
// is done. A deleted container's snapshot leaves the snapshotter only at
// the next collection, and a writable layer's disk cap is a mount: run one
// before stopping the daemons so that nothing stays mounted (a synchronous
// lease delete collects before it returns).
func (e *Env) CollectGarbage(ctx context.Context) error {
	gctx := namespaces.WithNamespace(ctx, e.Namespace)
	l, err := e.Client.LeasesService().Create(gctx, leases.WithRandomID())
	if err != nil {
		return fmt.Errorf("create a lease to collect garbage: %w", err)
	}
	if err := e.Client.LeasesService().Delete(gctx, l, leases.SynchronousDelete); err != nil {
		return fmt.Errorf("collect garbage: %w", err)
	}
	return nil
}

// teardownDir runs last: it kills leftover processes naming Dir (shims of
// this containerd, the daemon's descriptor keeper), unmounts whatever is
// still mounted below Dir, removes cgroups named after the namespace, and
// deletes Dir.
func (e *Env) teardownDir() {
	e.leaked = RemoveLeftovers(e.Logf, e.Dir)
	removeCgroups(e.Logf, e.Namespace)
	// CRI puts pod cgroups under the k8s.io namespace; only empty
	// directories go, so another env's live pods are safe.
	removeEmptyCgroups("k8s.io")
}
