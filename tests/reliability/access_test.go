package reliability_test

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/containerd/containerd/v2/pkg/oci"
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
