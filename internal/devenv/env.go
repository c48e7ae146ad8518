// Package testenv is the end-to-end test harness: it starts a private
// registry, a private containerd configured for envsnap (proxy snapshotter,
// remote-snapshot labels, the envlet runtime, CRI) and, on request, the
// envsnap daemon; builds hermetic test images; and tears all of it down by
// PID and mountpoint when the test ends, whether it passed or not.
package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/plugins/content/local"
)

// Env is one isolated set of daemons for a test.
type Env struct {
	t          testing.TB
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
	// PauseImage is the CRI sandbox image, pushed to the registry.
	PauseImage   string
	ContentStore content.Store
	opts         options
}

type options struct {
	envsnap      bool
	envsnapArgs  []string
	containerEnv []string
	extraConfig  string
	imports      []string
}

// Option configures New.
type Option func(*options)

// WithEnvsnap starts `bin/containerd-envsnap serve` on SnapshotterSocket
// (root, hosts dir and socket are set by the harness; args are appended).
func WithEnvsnap(args ...string) Option {
	return func(o *options) { o.envsnap = true; o.envsnapArgs = args }
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
// concatenation, so they can replace harness settings).
func WithImports(paths ...string) Option {
	return func(o *options) { o.imports = append(o.imports, paths...) }
}

var envCounter atomic.Int64

// New starts a registry and a containerd for t. It skips t unless the
// machine can run them (root, /dev/fuse, overlayfs, the tools from
// `make deps`).
func New(t testing.TB, opts ...Option) *Env {
	t.Helper()
	RequireRoot(t)
	e := &Env{t: t}
	for _, o := range opts {
		o(&e.opts)
	}
	// Unix socket paths are limited to 108 bytes: keep the directory short
	// instead of under t.TempDir().
	dir, err := os.MkdirTemp("", "envsnap-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	e.Dir = dir
	e.Namespace = fmt.Sprintf("envsnap-test-%d-%d", os.Getpid(), envCounter.Add(1))
	t.Cleanup(e.teardownDir)

	e.HostsDir = filepath.Join(dir, "certs.d")
	e.Registry = StartRegistry(t, dir)
	WriteHostsDir(t, e.HostsDir, e.Registry.Host)

	cs, err := local.NewStore(filepath.Join(dir, "content"))
	if err != nil {
		t.Fatal(err)
	}
	e.ContentStore = cs

	pause := e.PushImage(t, "envsnap-test/pause:1", nil,
		WithEntrypoint("/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"))
	e.PauseImage = pause.Ref

	e.SnapshotterSocket = filepath.Join(dir, "envsnap.sock")
	e.EnvsnapRoot = filepath.Join(dir, "envsnap")
	if e.opts.envsnap {
		e.StartEnvsnap(t)
	}
	e.startContainerd(t)
	return e
}

// Context returns a context in the test's containerd namespace.
func (e *Env) Context() context.Context {
	return namespaces.WithNamespace(context.Background(), e.Namespace)
}

// Hosts resolves registries the way containerd and envsnap do here.
func (e *Env) Hosts() docker.RegistryHosts {
	return config.ConfigureHosts(context.Background(), config.HostOptions{HostDir: config.HostDirFromRoot(e.HostsDir)})
}

// Resolver is a registry resolver using the harness hosts dir.
func (e *Env) Resolver() remotes.Resolver {
	return docker.NewResolver(docker.ResolverOptions{Hosts: e.Hosts()})
}

// StartEnvsnap starts the envsnap daemon (again, after a Kill or Stop).
func (e *Env) StartEnvsnap(t testing.TB) *Process {
	t.Helper()
	_ = os.Remove(e.SnapshotterSocket)
	args := append([]string{"serve",
		"--root", e.EnvsnapRoot,
		"--address", e.SnapshotterSocket,
		"--hosts-dir", e.HostsDir,
		"--log-level", "debug",
	}, e.opts.envsnapArgs...)
	e.Envsnap = StartProcess(t, e.Dir, "envsnap", nil, Binary(t, "containerd-envsnap"), args...)
	if err := waitFor(20*time.Second, "envsnap socket", func() error {
		if exited, err := e.Envsnap.Exited(); exited {
			return fmt.Errorf("containerd-envsnap exited: %v", err)
		}
		_, err := os.Stat(e.SnapshotterSocket)
		return err
	}); err != nil {
		t.Fatalf("start envsnap: %v\n%s", err, e.Envsnap.LogTail(40))
	}
	return e.Envsnap
}

func (e *Env) startContainerd(t testing.TB) {
	t.Helper()
	e.Address = filepath.Join(e.Dir, "containerd.sock")
	cfgPath := filepath.Join(e.Dir, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(e.containerdConfig()), 0o600); err != nil {
		t.Fatal(err)
	}
	// containerd finds shims (ours and runc's) and runc on PATH.
	path := "PATH=" + BinDir(t) + ":" + ToolsDir(t) + ":" + os.Getenv("PATH")
	env := append([]string{path}, e.opts.containerEnv...)
	e.Containerd = StartProcess(t, e.Dir, "containerd", env, Tool(t, "containerd"), "--config", cfgPath)
	if err := waitFor(30*time.Second, "containerd to serve", func() error {
		if exited, err := e.Containerd.Exited(); exited {
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
		t.Fatalf("start containerd: %v\n%s", err, e.Containerd.LogTail(40))
	}
	// Runs before the Process cleanup that stops containerd (cleanups are
	// LIFO): tasks, containers and images go first, so shims exit and
	// snapshots are released while containerd can still do it.
	t.Cleanup(e.removeContainers)
}

// containerdConfig is the config every e2e test runs containerd with: the
// one config.toml.example documents, pointed at this env's directories.
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
  [proxy_plugins.envsnap]
    type = "snapshot"
    address = %[5]q
    [proxy_plugins.envsnap.exports]
      enable_remote_snapshot_annotations = "true"

[plugins]
  [plugins."io.containerd.transfer.v1.local"]
    config_path = %[6]q
    [[plugins."io.containerd.transfer.v1.local".unpack_config]]
      platform = "linux/%[9]s"
      snapshotter = "overlayfs"
    [[plugins."io.containerd.transfer.v1.local".unpack_config]]
      platform = "linux/%[9]s"
      snapshotter = "envsnap"

  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"

  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "overlayfs"
    disable_snapshot_annotations = false
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
        snapshotter = "envsnap"
%[10]s
`, filepath.Join(d, "root"), filepath.Join(d, "state"), e.Address, e.Address+".ttrpc",
		e.SnapshotterSocket, e.HostsDir, e.PauseImage, filepath.Join(d, "cni"), runtime.GOARCH, e.opts.extraConfig, imports)
}

// CRIEndpoint is the CRI socket (crictl --runtime-endpoint).
func (e *Env) CRIEndpoint() string { return "unix://" + e.Address }

// Crictl runs crictl against this containerd and returns its output.
func (e *Env) Crictl(t testing.TB, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--runtime-endpoint", e.CRIEndpoint(), "--image-endpoint", e.CRIEndpoint(), "--timeout", "60s"}, args...)
	cmd := exec.Command(Tool(t, "crictl"), full...)
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
	if _, err := e.Crictl(e.t, "rmp", "--all", "--force"); err != nil {
		e.t.Logf("teardown: crictl rmp: %v", err)
	}
	nss, err := e.Client.NamespaceService().List(ctx)
	if err != nil {
		e.t.Logf("teardown: list namespaces: %v", err)
	}
	for _, ns := range nss {
		nctx := namespaces.WithNamespace(ctx, ns)
		containers, err := e.Client.Containers(nctx)
		if err != nil {
			e.t.Logf("teardown: list containers in %s: %v", ns, err)
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
					e.t.Logf("teardown: delete task %s: %v", c.ID(), err)
				}
			}
			if err := c.Delete(nctx, client.WithSnapshotCleanup); err != nil {
				e.t.Logf("teardown: delete container %s: %v", c.ID(), err)
			}
		}
		is := e.Client.ImageService()
		imgs, _ := is.List(nctx)
		for _, img := range imgs {
			_ = is.Delete(nctx, img.Name)
		}
	}
	e.Client.Close()
}

// teardownDir runs last: it kills leftover shims of this containerd,
// unmounts whatever is still mounted below Dir, removes cgroups named after
// the namespace, and deletes Dir.
func (e *Env) teardownDir() {
	killShims(e.t, e.Dir)
	if leaked := unmountBelow(e.Dir); len(leaked) > 0 {
		e.t.Errorf("teardown: mounts left below %s after the daemons stopped (now unmounted): %s", e.Dir, strings.Join(leaked, ", "))
	}
	removeCgroups(e.t, e.Namespace)
	// CRI puts pod cgroups under the k8s.io namespace; only empty
	// directories go, so another harness's live pods are safe.
	removeEmptyCgroups("k8s.io")
	if err := os.RemoveAll(e.Dir); err != nil {
		e.t.Logf("teardown: remove %s: %v", e.Dir, err)
	}
}
