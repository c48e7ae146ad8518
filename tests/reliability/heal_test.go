package reliability_test

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/tests/testenv"
)

// cutRegistry makes the harness registry unreachable while down is set:
// every connection is reset before an answer, as a dead link does.
func cutRegistry(env *testenv.Env, down *atomic.Bool) {
	env.Registry.Intercept(func(w http.ResponseWriter, r *http.Request) bool {
		if !down.Load() {
			return false
		}
		resetConnection(w)
		return true
	})
}

// resetConnection closes the client's connection with a TCP reset.
func resetConnection(w http.ResponseWriter) {
	if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
		if tc, ok := conn.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		conn.Close()
	}
}

// fillCompletely writes p until its file system has no byte left.
func fillCompletely(t *testing.T, p string) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for _, n := range []int{64 << 10, 4 << 10, 512, 1} {
		for {
			if _, err := f.Write(buf[:n]); err != nil {
				break
			}
		}
	}
}

// TestFullCacheDiskThenOutage: the node cache's file system is full when
// an image is first pulled, and the daemon is later killed and restarted
// under a running container while the registry is unreachable. A layer is
// served lazily only with its manifest and TOC kept in the node cache, so
// here it is unpacked by containerd instead, and the restart breaks
// nothing: the container lists the root and the layer's directory and
// reads its file across it. (The layers used to be mounted without their
// metadata; the restart then aborted them, and `ls /` and `ls /data` in
// the container failed with ENOTCONN.)
func TestFullCacheDiskThenOutage(t *testing.T) {
	fsDir := smallFS(t, 8<<20)
	cacheDir := filepath.Join(fsDir, "cache")
	cfg := daemonConfig(t, fmt.Sprintf("cache_dir = %q\ncache_size = \"1GiB\"\n", cacheDir))
	env := testenv.New(t, testenv.WithEnvsnap("--config", cfg, "--fill=false", "--read-timeout=3s"))
	var down atomic.Bool
	cutRegistry(env, &down)
	f := testenv.RandomFile("/data/a.bin", 2<<20, 61)
	img := pushLazy(t, env, "rel/fulldisk:1", []testenv.File{f})
	fillCompletely(t, filepath.Join(fsDir, "filler"))
	image := env.Pull(t, img.Ref, "envsnap")
	if !env.Envsnap.LogContains("in the node cache, which a restart serves the mount from") {
		t.Errorf("no layer mount was refused for want of room for its metadata (the test proves nothing):\n%s", env.Envsnap.LogTail(30))
	}

	signals := t.TempDir()
	rc := startContainer(t, env, image, signals, "/bin/sh", "-c", `sha256sum /data/a.bin
echo ready
while [ ! -e /signal/1 ]; do sleep 0.05; done
if ls / >/dev/null && ls /data >/dev/null; then echo ls-ok; else echo ls-failed; fi
if sha256sum /data/a.bin; then echo read-ok; else echo read-failed; fi
echo finished`)
	t.Cleanup(func() {
		if t.Failed() {
			env.Envsnap.Kill()
		}
	})
	rc.waitOutput(t, "ready", time.Minute)

	env.Envsnap.Kill()
	down.Store(true)
	if _, err := env.Env.StartEnvsnap(); err != nil {
		t.Fatalf("restart during the outage: %v", err)
	}
	if err := os.WriteFile(filepath.Join(signals, "1"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	rc.waitOutput(t, "finished", hangBound)
	out := rc.out.String()
	for _, want := range []string{"ls-ok", "read-ok"} {
		if !strings.Contains(out, want) {
			t.Errorf("container output lacks %q after the restart: stdout %q stderr %q", want, out, rc.errOut)
		}
	}
	if n := strings.Count(out, f.Digest().Encoded()); n != 2 {
		t.Errorf("sha256 of %s printed %d times, want 2: %q", f.Path, n, out)
	}
	// A new container during the outage as well.
	res, err := env.Env.Run(env.Context(), image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	if err != nil || res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Errorf("new container during the outage: %v, exit %d, stdout %q stderr %q", err, res.ExitCode, res.Stdout, res.Stderr)
	}
}

// brokenLayer stops the daemon (no container runs, so it unmounts every
// layer), corrupts the TOC it kept of the image's data layer and restarts
// it with the registry unreachable: the restore of that layer fails. It
// returns the broken layer's digest.
func brokenLayer(t *testing.T, env *testenv.Env, img lazyImage, down *atomic.Bool) string {
	t.Helper()
	data := img.Results[len(img.Results)-1].Digest
	env.Envsnap.Stop(30 * time.Second)
	corruptKeptTOC(t, env, img, filepath.Join(env.EnvsnapRoot, "layers", data.Algorithm().String(), data.Encoded(), "mnt"))
	down.Store(true)
	if _, err := env.Env.StartEnvsnap(); err != nil {
		t.Fatalf("restart during the outage: %v", err)
	}
	var broken *daemon.LayerStatus
	for _, l := range envsnapStatus(t, env).Layers {
		if l.Digest == data {
			broken = &l
		}
	}
	if broken == nil || broken.Mounted || !broken.Broken || broken.Error == "" {
		t.Fatalf("status of layer %s after its restore failed: %+v, want broken with the reason", data, broken)
	}
	out, err := env.EnvsnapCLI("status", "--address", env.SnapshotterSocket)
	if err != nil || !strings.Contains(out, data.Encoded()[:12]) || !strings.Contains(out, "broken: ") {
		t.Errorf("containerd-envsnap status does not show layer %s broken with its reason: %v\n%s", data, err, out)
	}
	return data.String()
}

// healImage is an image whose data layer TestBrokenLayerHeals* break.
func healImage(t *testing.T) (*testenv.Env, lazyImage, testenv.File, *atomic.Bool) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false", "--read-timeout=3s"))
	down := &atomic.Bool{}
	cutRegistry(env, down)
	f := testenv.RandomFile("/data/b.bin", 2<<20, 62)
	img := pushLazy(t, env, "rel/heal:1", []testenv.File{f})
	image := env.Pull(t, img.Ref, "envsnap")
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Fatalf("read before the outage: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	return env, img, f, down
}

// TestBrokenLayerHeals: a layer whose restore failed (kept TOC corrupt,
// registry unreachable) is shown broken with the reason; a container over
// it fails with that reason, not with overlay's "failed to stat parent";
// once the registry is back the daemon mounts the layer again by itself
// (no pull, no client call), and containers read the right bytes.
// (The layer used to stay broken until a pull of an image that was not
// present, or `rmi` and a new pull.)
func TestBrokenLayerHeals(t *testing.T) {
	env, img, f, down := healImage(t)
	layer := brokenLayer(t, env, img, down)
	image, err := env.Client.GetImage(env.Context(), img.Ref)
	if err != nil {
		t.Fatal(err)
	}
	_, err = env.Env.Run(env.Context(), image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"true"}})
	if err == nil || !strings.Contains(err.Error(), layer) || strings.Contains(err.Error(), "failed to stat parent") {
		t.Errorf("container over the broken layer: %v, want an error naming layer %s", err, layer)
	}

	down.Store(false)
	back := time.Now()
	for {
		if l := layerStatus(t, env, layer); l.Mounted {
			break
		}
		if time.Since(back) > hangBound {
			t.Fatalf("layer %s not mounted again %s after the registry came back: %+v", layer, hangBound, layerStatus(t, env, layer))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("layer mounted again %s after the registry came back (read timeout 3s)", time.Since(back).Round(10*time.Millisecond))
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Errorf("read after the layer healed: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
}

// TestRepullAfterFailedRestore: with the registry back, a pull of the
// image that is still present, then a container, work at once: the pull
// wakes the daemon's remount of the broken layer, and the container's
// snapshot mounts it if it is not mounted yet. (`ctr images pull`,
// `nerdctl pull` and the Go client used to leave it broken: a present
// image makes no Prepare, and containers failed with "failed to stat
// parent".)
func TestRepullAfterFailedRestore(t *testing.T) {
	env, img, f, down := healImage(t)
	brokenLayer(t, env, img, down)
	down.Store(false)
	image := env.Pull(t, img.Ref, "envsnap")
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Errorf("read after the re-pull: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
}

func layerStatus(t *testing.T, env *testenv.Env, layer string) daemon.LayerStatus {
	t.Helper()
	for _, l := range envsnapStatus(t, env).Layers {
		if l.Digest.String() == layer {
			return l
		}
	}
	t.Fatalf("layer %s not in the status", layer)
	return daemon.LayerStatus{}
}
