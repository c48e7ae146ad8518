// Package testenv is the end-to-end test harness: internal/devenv's private
// registry, containerd and envsnap daemon, tied to a test's life cycle. New
// skips the test where the machine cannot run them, fails it when they do
// not start, and tears everything down with t.Cleanup, failing the test if
// the daemons left mounts behind.
package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/prereq"
)

// The harness's types and options are devenv's.
type (
	EnvletConfig = devenv.EnvletConfig
	File         = devenv.File
	LayerBlob    = devenv.LayerBlob
	OutputBuffer = devenv.OutputBuffer
	Image        = devenv.Image
	ImageOption  = devenv.ImageOption
	Option       = devenv.Option
	Process      = devenv.Process
	Registry     = devenv.Registry
	RunOptions   = devenv.RunOptions
	RunResult    = devenv.RunResult
)

var (
	WithEnvsnap            = devenv.WithEnvsnap
	WithEnvsnapBinary      = devenv.WithEnvsnapBinary
	WithEnvsnapRoot        = devenv.WithEnvsnapRoot
	WithDefaultLazyMinSize = devenv.WithDefaultLazyMinSize
	WithEnvlet             = devenv.WithEnvlet
	WithContainerdEnv      = devenv.WithContainerdEnv
	WithConfig             = devenv.WithConfig
	WithImports            = devenv.WithImports
	WithoutSnapshotLabels  = devenv.WithoutSnapshotLabels
	WithProxyName          = devenv.WithProxyName
	WithEntrypoint         = devenv.WithEntrypoint
	WithCmd                = devenv.WithCmd
	WithImageEnv           = devenv.WithImageEnv
	WithoutBusybox         = devenv.WithoutBusybox
	WithLazyLayers         = devenv.WithLazyLayers
	RandomFile             = devenv.RandomFile
	LayerTar               = devenv.LayerTar
	GzipLayer              = devenv.GzipLayer
	BusyboxFiles           = devenv.BusyboxFiles
	MountsBelow            = devenv.MountsBelow
)

// Env is one isolated stack for a test.
type Env struct {
	*devenv.Env
	t testing.TB
}

// New starts a registry and a containerd for t (and the envsnap daemon
// with WithEnvsnap). It skips t unless the machine can run them (root,
// /dev/fuse, overlayfs) and fails it if they do not start.
func New(t testing.TB, opts ...Option) *Env {
	t.Helper()
	RequireRoot(t)
	Binary(t, "containerd-envsnap") // a clear message before anything starts
	de, err := devenv.Start(context.Background(), opts...)
	if err != nil {
		t.Fatalf("start test environment: %v", err)
	}
	de.Logf = t.Logf
	t.Cleanup(func() {
		// Logs live in the env's directory, which Close removes; a mount
		// Close finds left behind fails the test after it, and then the
		// daemons' logs (containerd's above all) say why.
		var tails []string
		for _, p := range de.Processes() {
			tails = append(tails, fmt.Sprintf("--- tail of %s log (%s) ---\n%s", p.Name, p.LogPath, p.LogTail(60)))
		}
		leaked := de.Close()
		if len(leaked) > 0 {
			t.Errorf("teardown: mounts left below %s after the daemons stopped (now unmounted): %s", de.Dir, strings.Join(leaked, ", "))
		}
		if t.Failed() {
			for _, tail := range tails {
				t.Log(tail)
			}
		}
	})
	return &Env{Env: de, t: t}
}

// PushImage builds a busybox-based image with files and pushes it as name.
func (e *Env) PushImage(t testing.TB, name string, files []File, opts ...ImageOption) Image {
	t.Helper()
	img, err := e.Env.PushImage(e.Context(), name, files, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// PushImageLayers is PushImage with one layer per file list.
func (e *Env) PushImageLayers(t testing.TB, name string, layers [][]File, opts ...ImageOption) Image {
	t.Helper()
	img, err := e.Env.PushImageLayers(e.Context(), name, layers, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// Pull pulls ref with client.Pull and the image-info labels that let a
// remote snapshotter serve layers lazily (snapshotters.AppendInfoHandlerWrapper).
func (e *Env) Pull(t testing.TB, ref, snapshotter string) client.Image {
	t.Helper()
	img, err := e.Env.Pull(e.Context(), ref, snapshotter)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// RunContainer runs a container from img to completion; a non-zero exit
// is in the result, not a failure.
func (e *Env) RunContainer(t testing.TB, img client.Image, o RunOptions) RunResult {
	t.Helper()
	res, err := e.Run(e.Context(), img, o)
	if err != nil {
		t.Fatalf("run container from %s: %v", img.Name(), err)
	}
	return res
}

// StartEnvsnap starts the envsnap daemon (again, after a Kill or Stop).
func (e *Env) StartEnvsnap(t testing.TB) *Process {
	t.Helper()
	p, err := e.Env.StartEnvsnap()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// Crictl runs crictl against this containerd.
func (e *Env) Crictl(t testing.TB, args ...string) (string, error) {
	t.Helper()
	return e.Env.Crictl(args...)
}

// RequireRoot stops t (prereq.Missing) unless it runs as root on a
// machine with /dev/fuse and overlayfs, which every end-to-end test needs.
func RequireRoot(t testing.TB) {
	t.Helper()
	if err := devenv.CheckMachine(); err != nil {
		prereq.Missing(t, "%v", err)
	}
}

// RepoRoot is the module root.
func RepoRoot(t testing.TB) string {
	t.Helper()
	root, err := devenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// BinDir is where `make build` puts our binaries.
func BinDir(t testing.TB) string {
	t.Helper()
	d, err := devenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// ToolsDir is where `make deps` puts the external tools.
func ToolsDir(t testing.TB) string { return devenv.ToolsDir(BinDir(t)) }

// Tool returns the path of a tool installed by `make deps`.
func Tool(t testing.TB, name string) string {
	t.Helper()
	p, err := devenv.Tool(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// Binary returns the path of one of our binaries built by `make build`.
func Binary(t testing.TB, name string) string {
	t.Helper()
	p, err := devenv.Binary(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// StartProcess starts a daemon for t, stopped by PID at cleanup; on
// failure the tail of its log is printed.
func StartProcess(t testing.TB, dir, name string, env []string, bin string, args ...string) *Process {
	t.Helper()
	p, err := devenv.StartProcess(dir, name, env, bin, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop(10 * time.Second)
		if t.Failed() {
			t.Logf("--- tail of %s log (%s) ---\n%s", name, p.LogPath, p.LogTail(60))
		}
	})
	return p
}

// WriteHostsDir writes a certs.d entry making host reachable over HTTP.
func WriteHostsDir(t testing.TB, dir, host string) {
	t.Helper()
	if err := devenv.WriteHostsDir(dir, host); err != nil {
		t.Fatal(err)
	}
}

// StartRegistry starts a registry (behind the counting proxy) storing below
// dir, stopped at cleanup: for tests that need a registry but no containerd.
func StartRegistry(t testing.TB, dir string) *Registry {
	t.Helper()
	r, err := devenv.StartRegistry(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

// MustCrictl runs crictl against this containerd and returns its trimmed
// output, failing the test on error.
func (e *Env) MustCrictl(t testing.TB, args ...string) string {
	t.Helper()
	out, err := e.Env.Crictl(args...)
	if err != nil {
		t.Fatalf("crictl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(out)
}

// WriteJSON writes v as JSON to dir/name (crictl pod and container
// configs) and returns the path.
func WriteJSON(t testing.TB, dir, name string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// PushLayerBlobs pushes an image made of already encoded layers as name.
func (e *Env) PushLayerBlobs(t testing.TB, name string, layers []LayerBlob, opts ...ImageOption) Image {
	t.Helper()
	img, err := e.Env.PushLayerBlobs(e.Context(), name, layers, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return img
}
