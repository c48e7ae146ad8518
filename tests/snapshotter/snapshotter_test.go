// Package snapshotter_test runs containerd against the envsnap daemon:
// converted images are served lazily, plain images unpack normally, corrupt
// chunks fail loudly, and nothing stays mounted.
package snapshotter_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	timage "github.com/containerd/containerd/v2/core/transfer/image"
	tregistry "github.com/containerd/containerd/v2/core/transfer/registry"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/platforms"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

// lazyImage is a converted image pushed to the harness registry.
type lazyImage struct {
	testenv.Image
	Results []*layerfmt.WriteResult // per layer, lowest first
}

// pushLazyImage builds busybox plus files, converts every layer to the
// envsnap format and pushes the image as name.
func pushLazyImage(t testing.TB, env *testenv.Env, name string, files []testenv.File, cmd ...string) lazyImage {
	t.Helper()
	return pushLazyLayers(t, env, name, [][]testenv.File{files}, cmd...)
}

// pushLazyLayers is pushLazyImage with one layer per file list.
func pushLazyLayers(t testing.TB, env *testenv.Env, name string, layers [][]testenv.File, cmd ...string) lazyImage {
	t.Helper()
	img := env.PushImageLayers(t, name, layers, testenv.WithLazyLayers(), testenv.WithCmd(cmd...))
	return lazyImage{Image: img, Results: img.LayerResults}
}

// transferPull pulls ref the way `ctr images pull --snapshotter envsnap`
// does: through containerd's transfer service.
func transferPull(t testing.TB, env *testenv.Env, ref string) client.Image {
	t.Helper()
	ctx := env.Context()
	reg, err := tregistry.NewOCIRegistry(ctx, ref, tregistry.WithHostDir(env.HostsDir), tregistry.WithDefaultScheme("http"))
	if err != nil {
		t.Fatal(err)
	}
	p := platforms.DefaultSpec()
	is := timage.NewStore(ref, timage.WithPlatforms(p), timage.WithUnpack(p, "envsnap"))
	if err := env.Client.Transfer(ctx, reg, is); err != nil {
		t.Fatalf("transfer pull %s: %v", ref, err)
	}
	img, err := env.Client.GetImage(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func layerBytes(img lazyImage) int64 {
	var n int64
	for _, l := range img.Layers {
		n += l.Size
	}
	return n
}

func servedForLayers(env *testenv.Env, img lazyImage) int64 {
	var n int64
	for _, l := range img.Layers {
		n += env.Registry.BlobBytesServedFor(l.Digest.String())
	}
	return n
}

func envsnapStatus(t testing.TB, env *testenv.Env) daemon.Status {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := daemon.GetStatus(ctx, env.SnapshotterSocket)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// removeImage deletes the image and lets containerd's GC remove its
// snapshots (which unmounts the lazy layers).
func removeImage(t testing.TB, env *testenv.Env, ref string) {
	t.Helper()
	if err := env.Client.ImageService().Delete(env.Context(), ref, images.SynchronousDelete()); err != nil {
		t.Fatalf("delete image %s: %v", ref, err)
	}
}

// waitNoLayers waits for containerd's garbage collector to have removed the
// snapshots, and with them the daemon's layer mounts.
func waitNoLayers(t testing.TB, env *testenv.Env) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := envsnapStatus(t, env)
		if len(st.Layers) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("layers still mounted after removing the image: %+v", st.Layers)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func TestLazyPullRun(t *testing.T) {
	for _, tc := range []struct {
		name string
		pull func(testing.TB, *testenv.Env, string) client.Image
	}{
		{"client.Pull", func(t testing.TB, env *testenv.Env, ref string) client.Image { return env.Pull(t, ref, "envsnap") }},
		{"transfer", transferPull},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := testenv.New(t, testenv.WithEnvsnap("--fill=false"))
			big := testenv.RandomFile("/data/big.bin", 64<<20, 7)
			img := pushLazyImage(t, env, "lazy/app:1", []testenv.File{big}, "/bin/echo", "hello from a lazy layer")
			env.Registry.ResetCounters()

			image := tc.pull(t, env, img.Ref)
			res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap"})
			served := servedForLayers(env, img)
			total := layerBytes(img)
			if res.ExitCode != 0 || strings.TrimSpace(res.Stdout) != "hello from a lazy layer" {
				t.Fatalf("container: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
			}
			t.Logf("first output after %d of %d layer bytes (%.2f%%)", served, total, 100*float64(served)/float64(total))
			if served*20 >= total {
				t.Fatalf("fetched %d of %d layer bytes before first output, want < 5%%", served, total)
			}

			st := envsnapStatus(t, env)
			if len(st.Layers) != len(img.Layers) {
				t.Fatalf("daemon serves %d layers, want %d: %+v", len(st.Layers), len(img.Layers), st.Layers)
			}
			for _, l := range st.Layers {
				if !l.Mounted {
					t.Errorf("layer %s not mounted: %s", l.Digest, l.Error)
				}
			}

			// /data is only in the data layer, not read yet, so served by
			// its FUSE mount (not a native copy): overlayfs passes that
			// listing through, which must hold "." and ".." as any
			// directory's does.
			res = env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"ls", "-a1", "/data"}})
			if res.ExitCode != 0 || res.Stdout != ".\n..\nbig.bin\n" {
				t.Errorf("ls -a1 /data: exit %d stdout %q stderr %q, want . .. big.bin", res.ExitCode, res.Stdout, res.Stderr)
			}

			res = env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", big.Path}})
			if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, big.Digest().Encoded()) {
				t.Fatalf("sha256sum: exit %d stdout %q stderr %q, want %s", res.ExitCode, res.Stdout, res.Stderr, big.Digest().Encoded())
			}

			out, err := exec.Command(testenv.Binary(t, "containerd-envsnap"), "status", "--address", env.SnapshotterSocket).CombinedOutput()
			if err != nil {
				t.Fatalf("status: %v\n%s", err, out)
			}
			t.Logf("containerd-envsnap status:\n%s", out)
			if !strings.Contains(string(out), img.Layers[1].Digest.Encoded()[:12]) || !strings.Contains(string(out), "100.0%") {
				t.Errorf("status does not show the fully read data layer:\n%s", out)
			}

			removeImage(t, env, img.Ref)
			waitNoLayers(t, env)
			if mps := testenv.MountsBelow(env.EnvsnapRoot); len(mps) != 0 {
				t.Errorf("mounts left below %s: %v", env.EnvsnapRoot, mps)
			}
		})
	}
}

// TestPlainImage: an image in an ordinary format unpacks normally under the
// envsnap snapshotter.
func TestPlainImage(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	img := env.PushImage(t, "plain/app:1", []testenv.File{{Path: "/etc/greeting", Data: []byte("plain layers work\n")}},
		testenv.WithCmd("/bin/cat", "/etc/greeting"))
	image := env.Pull(t, img.Ref, "envsnap")
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap"})
	if res.ExitCode != 0 || res.Stdout != "plain layers work\n" {
		t.Fatalf("container: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	if st := envsnapStatus(t, env); len(st.Layers) != 0 {
		t.Fatalf("plain layers were mounted lazily: %+v", st.Layers)
	}
}

// TestCorruptChunk: a chunk whose bytes in the registry do not match the
// TOC is never served: the read fails with EIO and the daemon logs the
// mismatch.
func TestCorruptChunk(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false", "--read-timeout=20s"))
	f := testenv.RandomFile("/data/f.bin", 8<<20, 3)
	img := pushLazyImage(t, env, "lazy/corrupt:1", []testenv.File{f}, "/bin/true")

	// Flip one byte in the middle of the file's first chunk, in the
	// registry's own storage.
	layer := img.Layers[1]
	blob, err := os.ReadFile(env.Registry.BlobPath(layer.Digest.String()))
	if err != nil {
		t.Fatal(err)
	}
	r, err := layerfmt.NewReader(bytes.NewReader(blob), int64(len(blob)), img.Results[1].TOCDigest)
	if err != nil {
		t.Fatal(err)
	}
	idx, ok := r.TOC().Lookup("data/f.bin")
	if !ok {
		t.Fatal("data/f.bin not in TOC")
	}
	c := r.TOC().Chunks(idx)[0]
	off := c.Offset + c.CompressedSize/2
	blob[off] ^= 0xff
	if err := os.WriteFile(env.Registry.BlobPath(layer.Digest.String()), blob, 0o644); err != nil {
		t.Fatal(err)
	}

	image := env.Pull(t, img.Ref, "envsnap")
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"cat", f.Path}})
	if res.ExitCode == 0 {
		t.Fatalf("reading a corrupt chunk succeeded (%d bytes)", len(res.Stdout))
	}
	if !strings.Contains(res.Stderr, "Input/output error") {
		t.Errorf("cat stderr %q, want an I/O error", res.Stderr)
	}
	if !env.Envsnap.LogContains(c.Digest.String()) || !env.Envsnap.LogContains("mismatch") {
		t.Errorf("daemon log does not name the mismatching chunk %s:\n%s", c.Digest, env.Envsnap.LogTail(30))
	}
}

// TestRestart: a stopped daemon unmounts its layers; a restarted one
// remounts them from its metadata and serves the same image again.
func TestRestart(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := testenv.RandomFile("/data/f.bin", 4<<20, 5)
	img := pushLazyImage(t, env, "lazy/restart:1", []testenv.File{f}, "/bin/true")
	image := env.Pull(t, img.Ref, "envsnap")
	if st := envsnapStatus(t, env); len(st.Layers) != 2 {
		t.Fatalf("layers before restart: %+v", st.Layers)
	}

	env.Envsnap.Stop(20 * time.Second)
	if mps := testenv.MountsBelow(env.EnvsnapRoot); len(mps) != 0 {
		t.Fatalf("mounts left after a clean shutdown: %v", mps)
	}
	env.StartEnvsnap(t)
	st := envsnapStatus(t, env)
	if len(st.Layers) != 2 {
		t.Fatalf("layers after restart: %+v", st.Layers)
	}
	for _, l := range st.Layers {
		if !l.Mounted || l.Snapshots != 1 {
			t.Errorf("restored layer %+v", l)
		}
	}
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Fatalf("after restart: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
}

// TestSharedLayer: one layer in two images on different parents (so under
// two chainIDs) is served by one FUSE mount; it goes away with the last
// image. Also checks the daemon's HTTP endpoints.
func TestSharedLayer(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"))
	shared := []testenv.File{testenv.RandomFile("/data/shared.bin", 2<<20, 9)}
	a := pushLazyLayers(t, env, "lazy/a:1", [][]testenv.File{shared}, "/bin/true")
	b := pushLazyLayers(t, env, "lazy/b:1", [][]testenv.File{{{Path: "/etc/b", Data: []byte("b")}}, shared}, "/bin/true")
	sharedDigest := a.Layers[1].Digest
	if b.Layers[2].Digest != sharedDigest {
		t.Fatalf("the shared layer converted differently: %s vs %s", sharedDigest, b.Layers[2].Digest)
	}
	imgA := env.Pull(t, a.Ref, "envsnap")
	imgB := env.Pull(t, b.Ref, "envsnap")

	st := envsnapStatus(t, env)
	mounts := 0
	for _, l := range st.Layers {
		if l.Digest == sharedDigest {
			mounts++
			if l.Snapshots != 2 {
				t.Errorf("shared layer used by %d snapshots, want 2", l.Snapshots)
			}
		}
	}
	if mounts != 1 || len(testenv.MountsBelow(filepath.Join(env.EnvsnapRoot, "layers"))) != 3 {
		t.Fatalf("want one mount of the shared layer and 3 in all (busybox, b/etc, shared): status %+v, mounts %v",
			st.Layers, testenv.MountsBelow(env.EnvsnapRoot))
	}
	for _, img := range []client.Image{imgA, imgB} {
		res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", shared[0].Path}})
		if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, shared[0].Digest().Encoded()) {
			t.Fatalf("%s: exit %d stdout %q stderr %q", img.Name(), res.ExitCode, res.Stdout, res.Stderr)
		}
	}

	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", daemon.StatusSocket(env.SnapshotterSocket))
	}}}
	for path, want := range map[string]string{
		"/healthz": "ok",
		"/metrics": "envsnap_fetch_registry_bytes_total{layer=\"" + sharedDigest.String() + "\"}",
	} {
		resp, err := hc.Get("http://envsnap" + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
			t.Errorf("GET %s: %s, body does not contain %q", path, resp.Status, want)
		}
	}

	removeImage(t, env, a.Ref)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var refs int
		for _, l := range envsnapStatus(t, env).Layers {
			if l.Digest == sharedDigest {
				refs = l.Snapshots
			}
		}
		if refs == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("shared layer refs %d after removing image a, want 1", refs)
		}
		time.Sleep(200 * time.Millisecond)
	}
	removeImage(t, env, b.Ref)
	waitNoLayers(t, env)
	if mps := testenv.MountsBelow(env.EnvsnapRoot); len(mps) != 0 {
		t.Errorf("mounts left: %v", mps)
	}
}

// TestCRIPull: a CRI pull for a pod of the envlet runtime handler (whose
// snapshotter is envsnap) is served lazily: CRI sends the remote-snapshot
// labels on its own.
func TestCRIPull(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"))
	img := pushLazyImage(t, env, "lazy/cri:1", []testenv.File{testenv.RandomFile("/data/f.bin", 16<<20, 4)}, "/bin/true")
	pod := filepath.Join(env.Dir, "pod.json")
	if err := os.WriteFile(pod, []byte(`{
  "metadata": {"name": "cri-pull", "namespace": "default", "uid": "cri-pull-uid"},
  "annotations": {"io.containerd.cri.runtime-handler": "envlet"}
}`), 0o644); err != nil {
		t.Fatal(err)
	}
	env.Registry.ResetCounters()
	if out, err := env.Crictl(t, "pull", "--pod-config", pod, img.Ref); err != nil {
		t.Fatalf("crictl pull: %v\n%s", err, out)
	}
	st := envsnapStatus(t, env)
	if len(st.Layers) != len(img.Layers) {
		t.Fatalf("CRI pull mounted %d lazy layers, want %d: %+v", len(st.Layers), len(img.Layers), st.Layers)
	}
	if served, total := servedForLayers(env, img), layerBytes(img); served*20 >= total {
		t.Fatalf("CRI pull fetched %d of %d layer bytes", served, total)
	}
}

// TestCrashRestart: a daemon killed while a container runs on its layers
// leaves dead FUSE mounts (ENOTCONN); the restarted daemon detaches them,
// remounts the layers and serves new containers. (The running container
// itself loses uncached reads: keeping it alive is the fd handoff, not done
// yet.)
func TestCrashRestart(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := testenv.RandomFile("/data/f.bin", 4<<20, 6)
	img := pushLazyImage(t, env, "lazy/busy:1", []testenv.File{f}, "/bin/true")
	image := env.Pull(t, img.Ref, "envsnap")
	ctx := env.Context()

	id := fmt.Sprintf("busy-%d", time.Now().UnixNano())
	c, err := env.Client.NewContainer(ctx, id,
		client.WithSnapshotter("envsnap"),
		client.WithNewSnapshot(id+"-snap", image),
		client.WithNewSpec(oci.WithImageConfig(image), oci.WithProcessArgs("sleep", "300")),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Delete(context.WithoutCancel(ctx), client.WithSnapshotCleanup) })
	task, err := c.NewTask(ctx, cio.NullIO)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { task.Delete(context.WithoutCancel(ctx), client.WithProcessKill) })
	if err := task.Start(ctx); err != nil {
		t.Fatal(err)
	}

	env.Envsnap.Kill()
	env.StartEnvsnap(t)
	// One live mount per layer, none stacked on a dead one.
	if mps := testenv.MountsBelow(filepath.Join(env.EnvsnapRoot, "layers")); len(mps) != len(img.Layers) {
		t.Errorf("mounts after restart %v, want one per layer (%d)", mps, len(img.Layers))
	}
	for _, l := range envsnapStatus(t, env).Layers {
		if !l.Mounted {
			t.Errorf("layer %s not remounted: %s", l.Digest, l.Error)
		}
	}
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Fatalf("new container after restart: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
}
