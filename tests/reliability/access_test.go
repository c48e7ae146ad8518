package reliability_test

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestAccess: the daemon's sockets and state are root-only; inside a
// container an unprivileged agent cannot read what the file modes forbid,
// writes to lower-layer files land in the container's upper directory only
// (the shared layer mount is read-only and unchanged), and the daemon's
// sockets do not exist in the container's mount namespace.
func TestAccess(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	secret := testenv.RandomFile("/data/secret.bin", 64<<10, 31)
	secret.Mode = 0o600
	public := testenv.RandomFile("/data/public.bin", 64<<10, 32)
	img := pushLazy(t, env, "rel/access:1", []testenv.File{secret, public})
	image := env.Pull(t, img.Ref, "envsnap")

	t.Run("host modes", func(t *testing.T) {
		for _, p := range []struct {
			path string
			want os.FileMode
		}{
			{env.SnapshotterSocket, 0o600},
			{daemon.StatusSocket(env.SnapshotterSocket), 0o600},
			{daemon.KeeperSocket(env.SnapshotterSocket), 0o600},
			{env.EnvsnapRoot, 0o700},
		} {
			st, err := os.Stat(p.path)
			if err != nil {
				t.Errorf("stat %s: %v", p.path, err)
				continue
			}
			if got := st.Mode().Perm(); got != p.want {
				t.Errorf("%s has mode %o, want %o", p.path, got, p.want)
			}
			if sys := st.Sys().(*syscall.Stat_t); sys.Uid != 0 {
				t.Errorf("%s is owned by uid %d, want root", p.path, sys.Uid)
			}
		}
	})

	t.Run("unprivileged reader", func(t *testing.T) {
		res := env.RunContainer(t, image, testenv.RunOptions{
			Snapshotter: "envsnap",
			SpecOpts:    []oci.SpecOpts{oci.WithUser("65534:65534")},
			Args:        []string{"/bin/sh", "-c", "id -u; sha256sum " + public.Path + "; cat " + secret.Path + " >/dev/null && echo SECRET-READ; echo x >> " + public.Path + " && echo LOWER-WRITTEN; true"},
		})
		if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, "65534\n") {
			t.Fatalf("exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		if !strings.Contains(res.Stdout, public.Digest().Encoded()) {
			t.Errorf("readable file not read correctly: %q", res.Stdout)
		}
		if strings.Contains(res.Stdout, "SECRET-READ") || !strings.Contains(res.Stderr, "Permission denied") {
			t.Errorf("uid 65534 read a 0600 root file: stdout %q stderr %q", res.Stdout, res.Stderr)
		}
		if strings.Contains(res.Stdout, "LOWER-WRITTEN") {
			t.Errorf("uid 65534 wrote a 0644 root file: %q", res.Stdout)
		}
	})

	t.Run("copy-up leaves the layer alone", func(t *testing.T) {
		script := "echo changed >> " + public.Path + " && tail -c 8 " + public.Path + " && rm " + secret.Path + " && ls /data"
		res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", script}})
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, "changed") || strings.Contains(res.Stdout, "secret.bin") {
			t.Fatalf("root in the container could not modify its own rootfs: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		// The shared layer mount on the host still has both files,
		// unchanged, and refuses writes.
		mnt := layerMount(t, env, img)
		for _, f := range []testenv.File{public, secret} {
			if got := fileSHA(t, filepath.Join(mnt, f.Path)); got != f.Digest().Encoded() {
				t.Errorf("layer file %s changed: sha256 %s", f.Path, got)
			}
		}
		err := os.WriteFile(filepath.Join(mnt, public.Path), []byte("x"), 0o644)
		if !errors.Is(err, unix.EROFS) {
			t.Errorf("writing into the layer mount on the host: %v, want EROFS", err)
		}
		// A new container sees the original layer.
		res = env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", public.Path, secret.Path}})
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, public.Digest().Encoded()) || !strings.Contains(res.Stdout, secret.Digest().Encoded()) {
			t.Errorf("next container: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		// Both containers of this subtest were prepared over the layer.
		top := img.Layers[len(img.Layers)-1].Digest
		for _, l := range envsnapStatus(t, env).Layers {
			if l.Digest == top && l.Environments < 2 {
				t.Errorf("layer %s: status counts %d environments after two containers", top, l.Environments)
			}
		}
	})

	t.Run("sockets invisible in the container", func(t *testing.T) {
		paths := []string{env.SnapshotterSocket, daemon.StatusSocket(env.SnapshotterSocket), daemon.KeeperSocket(env.SnapshotterSocket), env.Address, env.EnvsnapRoot}
		script := ""
		for _, p := range paths {
			script += "[ -e " + p + " ] && echo VISIBLE " + p + "; "
		}
		script += "true"
		res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", script}})
		if res.ExitCode != 0 || strings.Contains(res.Stdout, "VISIBLE") {
			t.Errorf("daemon paths visible in the container: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
	})
}

// layerMount returns the host mountpoint of the image's top layer.
func layerMount(t *testing.T, env *testenv.Env, img lazyImage) string {
	t.Helper()
	top := img.Layers[len(img.Layers)-1].Digest
	for _, l := range envsnapStatus(t, env).Layers {
		if l.Digest == top && l.Mounted {
			return l.Mountpoint
		}
	}
	t.Fatalf("layer %s not mounted", top)
	return ""
}

func fileSHA(t *testing.T, p string) string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatalf("open %s: %v", p, err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatalf("read %s: %v", p, err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// TestStatusNotOnNetwork: the TCP metrics address serves the Prometheus
// metrics and nothing else. A container on the host's network (as the
// DaemonSet's neighbours are, under host networking) gets 404 for /status
// and /footprints, which name the node's images and what their workloads
// read; the root-only unix socket still serves them. An address without a
// host listens on loopback only.
func TestStatusNotOnNetwork(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	env := testenv.New(t, testenv.WithEnvsnap("--metrics-address", ":"+port))
	f := testenv.RandomFile("/data/f.bin", 64<<10, 33)
	img := pushLazy(t, env, "rel/netstatus:1", []testenv.File{f})
	image := env.Pull(t, img.Ref, "envsnap")

	script := ""
	for _, p := range []string{"/status", "/footprints", "/healthz", "/metrics"} {
		script += "echo '=='" + p + "; wget -q -O - http://127.0.0.1:" + port + p + " 2>&1; "
	}
	res := env.RunContainer(t, image, testenv.RunOptions{
		Snapshotter: "envsnap",
		SpecOpts:    []oci.SpecOpts{oci.WithHostNamespace(specs.NetworkNamespace)},
		Args:        []string{"/bin/sh", "-c", script},
	})
	out := res.Stdout
	if res.ExitCode != 0 || !strings.Contains(out, "envsnap_chunkcache_size_bytes") {
		t.Fatalf("the container did not read the metrics over the network (the test proves nothing): exit %d stdout %q stderr %q", res.ExitCode, out, res.Stderr)
	}
	for _, leak := range []string{img.Ref, f.Path, "\"layers\"", "mountpoint"} {
		if strings.Contains(out, leak) {
			t.Errorf("a container read %q over the network:\n%s", leak, out)
		}
	}
	sections := map[string]string{}
	for _, sec := range strings.Split(out, "==")[1:] {
		p, body, _ := strings.Cut(sec, "\n")
		sections[p] = body
	}
	for _, p := range []string{"/status", "/footprints", "/healthz"} {
		if !strings.Contains(sections[p], "404 Not Found") {
			t.Errorf("GET %s from a container on the host network: %q, want 404", p, sections[p])
		}
	}

	for _, p := range []string{"/status", "/footprints", "/healthz"} {
		resp, err := http.Get("http://127.0.0.1:" + port + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET %s on the metrics address: %s, want 404", p, resp.Status)
		}
	}
	st, err := daemon.GetStatus(env.Context(), env.SnapshotterSocket)
	if err != nil || len(st.Layers) != len(img.Layers) {
		t.Fatalf("status over the unix socket: %+v, %v", st.Layers, err)
	}
	if _, err := daemon.GetStatus(env.Context(), "http://127.0.0.1:"+port); err == nil {
		t.Error("the status client accepted an HTTP address")
	}
	// Loopback only: not reachable on the node's other addresses.
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.IsLoopback() || ipn.IP.To4() == nil {
			continue
		}
		if c, err := net.DialTimeout("tcp", net.JoinHostPort(ipn.IP.String(), port), 2*time.Second); err == nil {
			c.Close()
			t.Errorf("metrics address %q answers on %s", ":"+port, ipn.IP)
		}
	}
}
