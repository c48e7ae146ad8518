package groups_test

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"

	"github.com/envsnap/envsnap/tests/testenv"
)

// TestPrefetchFromFootprint: the frames an environment read, recorded by
// the daemon and attached to its groups (`footprints`, `group prefetch`),
// are fetched as soon as the next node mounts the layers of an
// environment composed from them, before the container asks; frames
// nobody read are not.
func TestPrefetchFromFootprint(t *testing.T) {
	// No background fill: every byte fetched is asked for by a read or
	// by the prefetch.
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"))
	f := publishGroups(t, env)
	used := testenv.RandomFile("/opt/data/used.bin", 6<<20, 21)
	unused := testenv.RandomFile("/opt/data/unused.bin", 6<<20, 22)
	dataDir := filepath.Join(f.dir, "data")
	for _, file := range []testenv.File{used, unused} {
		p := filepath.Join(dataDir, filepath.Base(file.Path))
		if err := os.MkdirAll(dataDir, 0o755); err != nil {
			t.Fatal(err)
		}
		out, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, file.Reader()); err != nil {
			t.Fatal(err)
		}
		out.Close()
	}
	data := env.Registry.Host + "/envsnap/data/blobs:1"
	f.cli(t, "group", "publish", "--kind", "data", "--from-dir", dataDir, "--prefix", "/opt/data", "--owner", "0:0", "--mtime", "0", data)
	plan := func(name string) string {
		p := filepath.Join(f.dir, name+".toml")
		body := fmt.Sprintf("name = %q\ngroups = [%q, %q, %q]\n[process]\ncmd = [\"/bin/sh\"]\n", name, f.base, f.harn, data)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const episode = "agent --version && sha256sum /opt/data/used.bin"
	run := func(ref string) {
		t.Helper()
		img := env.Pull(t, ref, "envsnap")
		res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", episode}})
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, used.Digest().Encoded()) {
			t.Fatalf("episode: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
	}

	// First node: run once, record.
	first := env.Registry.Host + "/envsnap/env/first:1"
	f.cli(t, "compose", "--target", first, plan("first"))
	run(first)
	fpPath := filepath.Join(f.dir, "footprints.json")
	bin := testenv.Binary(t, "containerd-envsnap")
	if out, err := exec.Command(bin, "footprints", "--address", env.SnapshotterSocket, "-o", fpPath).CombinedOutput(); err != nil {
		t.Fatalf("footprints: %v\n%s", err, out)
	}
	var fp map[string]string
	if b, err := os.ReadFile(fpPath); err != nil || json.Unmarshal(b, &fp) != nil || len(fp) == 0 {
		t.Fatalf("footprints file: %v %v", err, fp)
	}
	out := f.cli(t, "group", "prefetch", "--footprints", fpPath, f.base, f.harn, data)
	t.Logf("group prefetch:\n%s", out)
	if !strings.Contains(out, "prefetch lists on 1 layers") {
		t.Fatalf("no layer got a list:\n%s", out)
	}

	// A fresh node: the daemon restarts on an empty chunk cache.
	if err := env.Client.ImageService().Delete(env.Context(), first, images.SynchronousDelete()); err != nil {
		t.Fatal(err)
	}
	env.Envsnap.Stop(20 * time.Second)
	if err := os.RemoveAll(filepath.Join(env.EnvsnapRoot, "cache")); err != nil {
		t.Fatal(err)
	}
	env.StartEnvsnap(t)

	second := env.Registry.Host + "/envsnap/env/second:1"
	f.cli(t, "compose", "--target", second, plan("second"))
	env.Registry.ResetCounters()
	img := env.Pull(t, second, "envsnap")
	// The pull mounted the layers; the prefetch runs without a reader.
	deadline := time.Now().Add(30 * time.Second)
	for env.Registry.BlobBytesServed() < used.Size {
		if time.Now().After(deadline) {
			t.Fatalf("only %d bytes fetched 30s after the pull, want the %d of used.bin", env.Registry.BlobBytesServed(), used.Size)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Let the other layers' lists finish: a request in flight when the
	// counters are reset would count against the episode. A request may
	// wait until shortly before its recorded time (fetch.PrefetchPolicy.Lead).
	for stable, last := time.Now(), int64(-1); time.Since(stable) < 2*time.Second; time.Sleep(100 * time.Millisecond) {
		if n := env.Registry.BlobBytesServed(); n != last {
			stable, last = time.Now(), n
		}
		if time.Now().After(deadline) {
			t.Fatal("prefetch still fetching 30s after the pull")
		}
	}
	prefetched := env.Registry.BlobBytesServed()
	if prefetched > used.Size+unused.Size/2 {
		t.Errorf("prefetch fetched %d bytes: more than the files read (used.bin is %d)", prefetched, used.Size)
	}
	env.Registry.ResetCounters()
	res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", episode}})
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, used.Digest().Encoded()) {
		t.Fatalf("episode on the second node: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	if n := env.Registry.BlobBytesServed(); n > used.Size/20 {
		t.Errorf("the episode fetched %d bytes after the prefetch, want < 5%% of the %d it reads", n, used.Size)
	}
	t.Logf("prefetched %d bytes at mount; the episode then fetched %d", prefetched, env.Registry.BlobBytesServed())
}
