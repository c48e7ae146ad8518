//go:build linux

package layerstore

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/native"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/snapshotter"
)

// TestNativeCopyAfterFill: a mounted layer gets its native copy once the
// background fill has every chunk, with the layer's bytes.
func TestNativeCopyAfterFill(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	lazy, _, _ := testImage(t, r)
	s, cache, copies := newNativeStore(t, Config{})
	mp := t.TempDir()
	if err := s.Mount(t.Context(), mp, lazy); err != nil {
		t.Fatal(err)
	}
	unmountAtCleanup(t, s, mp)
	dir := waitNativeDir(t, s, copies, lazy)
	b, err := os.ReadFile(filepath.Join(dir, "hello.txt"))
	if err != nil || string(b) != "hello, lazy world\n" {
		t.Fatalf("native copy: %q, %v", b, err)
	}
	if st := copies.Stats(); st.Builds != 1 || cache.Stats().Charged != st.Size {
		t.Errorf("stats %+v, cache charged %d", st, cache.Stats().Charged)
	}
}

// TestPassthroughFromNativeCopy: with native copies and no unpacked store
// (the daemon's default), opens through the FUSE mount are handed the
// native copy's file once the copy is complete, and reads then bypass the
// daemon with the file's bytes.
func TestPassthroughFromNativeCopy(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	big := randomBytes(3<<20+123, 3)
	desc, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"dir/big.bin": string(big), "small.txt": "small"}))
	labels := r.addManifest(t, "test/native-backing:1", desc)[0]
	s, _, copies := newNativeStore(t, Config{Passthrough: true, PassthroughMinSize: 64 << 10})
	mp := t.TempDir()
	if err := s.Mount(t.Context(), mp, labels); err != nil {
		t.Fatal(err)
	}
	unmountAtCleanup(t, s, mp)
	s.mu.Lock()
	srv := s.mounts[mp].srv
	s.mu.Unlock()
	if !srv.Passthrough() {
		prereq.Skip(t, prereq.NoFUSEPassthrough, "")
	}

	read := func() {
		t.Helper()
		got, err := os.ReadFile(filepath.Join(mp, "dir/big.bin"))
		if err != nil || !bytes.Equal(got, big) {
			t.Fatalf("read dir/big.bin: %v (equal %v)", err, bytes.Equal(got, big))
		}
	}
	read() // before the copy: the chunk path
	if n := srv.Stats().BackedOpens; n != 0 {
		t.Fatalf("%d passthrough opens before any native copy", n)
	}
	waitNativeDir(t, s, copies, labels)
	// RELEASE reaches the daemon after close returns, and an inode with
	// an open on the chunk path is not switched, so it may take a few
	// opens.
	for i := 0; srv.Stats().BackedOpens == 0; i++ {
		if i == 100 {
			t.Fatalf("no passthrough open of dir/big.bin in 100 opens after its native copy: %+v", srv.Stats())
		}
		read()
		time.Sleep(20 * time.Millisecond)
	}
	before := srv.Stats().BytesRead
	read()
	if after := srv.Stats().BytesRead; after != before {
		t.Errorf("a read of the passthrough file reached the daemon: %d bytes", after-before)
	}
	if got, err := os.ReadFile(filepath.Join(mp, "small.txt")); err != nil || string(got) != "small" {
		t.Fatalf("small.txt: %q, %v", got, err)
	}
}

// TestOpenNativeFileStaysInside: a name that resolves through a symlink,
// even one inside the copy, or to something other than a regular file of
// the expected size, gets no backing file.
func TestOpenNativeFileStaysInside(t *testing.T) {
	dir := t.TempDir()
	outside := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(outside, []byte("0123456789"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "d", "f"), []byte("0123456789"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, l := range []struct{ name, target string }{{"out", filepath.Dir(outside)}, {"in", "d"}, {"file", "d/f"}} {
		if err := os.Symlink(l.target, filepath.Join(dir, l.name)); err != nil {
			t.Fatal(err)
		}
	}
	if f := openNativeFile(dir, "d/f", 10); f == nil {
		t.Fatal("no file for d/f")
	} else {
		f.Close()
	}
	for _, c := range []struct {
		name string
		size int64
	}{{"out/secret", 10}, {"in/f", 10}, {"file", 10}, {"d/f", 9}, {"d", 10}, {"../secret", 10}, {"missing", 10}} {
		if f := openNativeFile(dir, c.name, c.size); f != nil {
			f.Close()
			t.Errorf("openNativeFile(%q, %d) opened %s", c.name, c.size, f.Name())
		}
	}
}

// TestNativeCopyOnBusyNode: on a node whose other processes keep its
// cores busy but for short gaps (as a build or a test does), the native
// copy of a layer one environment uses is built at idle priority in those
// gaps: it is ready within a bound set by the same layer's copy on the
// node without them, instead of waiting for a core to stay idle for a
// second, which such a node never has (the daemon's hold before it ran
// its background work at idle priority left NATIVE at "waiting for CPU"
// for minutes).
func TestNativeCopyOnBusyNode(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	layer := func(seed uint64) map[string]string {
		files := map[string]string{}
		for i := range 64 {
			files[fmt.Sprintf("d%d/f%d.bin", i%8, i)] = string(randomBytes(64<<10, seed+uint64(i)))
		}
		desc, _ := r.addLazyLayer(t, tarOf(t, files))
		return r.addManifest(t, fmt.Sprintf("test/busy-%d:1", seed), desc)[0]
	}
	// From the mount (one environment on the layer) to its native copy.
	ready := func(s *Store, copies *native.Store, labels map[string]string, limit time.Duration) time.Duration {
		t.Helper()
		mp := t.TempDir()
		start := time.Now()
		if err := s.Mount(t.Context(), mp, labels); err != nil {
			t.Fatal(err)
		}
		unmountAtCleanup(t, s, mp)
		s.NoteEnvironment(mp)
		d := digest.Digest(labels[snapshotter.LabelLayerDigest])
		for ; ; time.Sleep(20 * time.Millisecond) {
			if _, ok := s.NativeDir(d); ok {
				return time.Since(start)
			}
			if time.Since(start) > limit {
				t.Fatalf("no native copy %v after the mount: %+v, %+v", limit, s.Status()[mp], copies.Stats())
			}
		}
	}
	s, _, copies := newNativeStore(t, Config{})
	idle := ready(s, copies, layer(100), 5*time.Minute)

	// Busy processes, one per core, each spinning ~20 ms and sleeping
	// 5 ms: the node's cores are 80% busy with them.
	ctx, cancel := context.WithCancel(context.Background())
	var burners []*exec.Cmd
	t.Cleanup(func() {
		cancel()
		for _, c := range burners {
			c.Wait()
		}
	})
	for range runtime.NumCPU() {
		cmd := exec.CommandContext(ctx, "sh", "-c", `while :; do i=0; while [ $i -lt 6000 ]; do i=$((i+1)); done; sleep 0.005; done`)
		if err := cmd.Start(); err != nil {
			t.Fatalf("start a busy process: %v", err)
		}
		burners = append(burners, cmd)
	}
	// On an idle node the copy is ready in about a second here; the
	// floor covers the scheduler's slices for an idle-priority thread
	// on a machine that other work loads too.
	bound := max(20*idle, 30*time.Second)
	t.Logf("native copy ready %v after the mount on an idle node; bound on a busy one %v", idle, bound)
	busy := ready(s, copies, layer(200), bound)
	t.Logf("native copy ready %v after the mount on a busy node (%.1fx)", busy, float64(busy)/float64(idle))
}

// TestNativeCopyWaitsForQuiet: a layer whose chunks are all cached gets
// no native copy while the node's lazy layers serve file-system requests
// (its state says why), and gets it once they have been quiet.
func TestNativeCopyWaitsForQuiet(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	lazy, _, _ := testImage(t, r)
	s, _, copies := newNativeStore(t, Config{})
	mp := t.TempDir()
	if err := s.Mount(t.Context(), mp, lazy); err != nil {
		t.Fatal(err)
	}
	unmountAtCleanup(t, s, mp)
	s.mu.Lock()
	m := s.mounts[mp]
	s.mu.Unlock()
	d := digest.Digest(lazy[snapshotter.LabelLayerDigest])
	// Requests keep coming (as lazyfs notes them) until the layer has
	// been whole for a few of the store's looks.
	deadline := time.Now().Add(time.Minute)
	var whole time.Time
	waited := false
	for whole.IsZero() || time.Since(whole) < 3*nativePoll {
		if time.Now().After(deadline) {
			t.Fatalf("the layer's fill did not complete within a minute: %+v", s.Status()[mp])
		}
		m.layer.NoteActivity()
		if cached, total := m.layer.Progress(); cached >= total && whole.IsZero() {
			whole = time.Now()
		}
		if _, ok := s.NativeDir(d); ok {
			t.Fatalf("native copy built while the layers served requests (%v after the layer was whole)", time.Since(whole))
		}
		if m.native.Load() == NativeWaitQuiet {
			waited = true
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !waited {
		t.Errorf("the layer's native state never said %q while requests came", NativeWaitQuiet)
	}
	waitNativeDir(t, s, copies, lazy)
}

// TestNativeHeld: a whole layer's copy waits while requests came less
// than nativeQuiet ago, never beyond nativeMaxHold after the layer was
// whole, and not at all on a node whose layers served nothing.
func TestNativeHeld(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		name          string
		lastOp, whole time.Time
		held          bool
	}{
		{"requests just now", now.Add(-time.Millisecond), now.Add(-time.Second), true},
		{"quiet long enough", now.Add(-nativeQuiet), now.Add(-time.Second), false},
		{"never a request", time.Time{}, now, false},
		{"busy, hold used up", now, now.Add(-nativeMaxHold), false},
		{"busy, hold nearly used up", now, now.Add(-nativeMaxHold + time.Millisecond), true},
	} {
		if got := nativeHeld(now, c.lastOp, c.whole); got != c.held {
			t.Errorf("%s: held %v, want %v", c.name, got, c.held)
		}
	}
}

// waitNativeDir waits for the native copy of the layer labels name and
// returns its directory.
func waitNativeDir(t *testing.T, s *Store, copies *native.Store, labels map[string]string) string {
	t.Helper()
	d := digest.Digest(labels[snapshotter.LabelLayerDigest])
	deadline := time.Now().Add(30 * time.Second)
	for {
		if dir, ok := s.NativeDir(d); ok {
			return dir
		}
		if time.Now().After(deadline) {
			t.Fatalf("no native copy 30 s after the mount: %+v", copies.Stats())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// newNativeStore returns a store with cfg, background fill, a node cache
// and native copies sharing its budget, as the daemon sets them up.
func newNativeStore(t *testing.T, cfg Config) (*Store, *chunkcache.Cache, *native.Store) {
	return newNativeStoreSized(t, cfg, 256<<20)
}

// newNativeStoreSized is newNativeStore with a node cache of cacheBytes.
func newNativeStoreSized(t *testing.T, cfg Config, cacheBytes int64) (*Store, *chunkcache.Cache, *native.Store) {
	cache, err := chunkcache.Open(t.TempDir(), cacheBytes)
	if err != nil {
		t.Fatal(err)
	}
	copies, err := native.Open(context.Background(), t.TempDir(), cache)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(copies.Close)
	cache.SetTenant(copies)
	cfg.Hosts = registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true})
	cfg.Cache, cfg.Fill, cfg.Native = cache, true, copies
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, cache, copies
}

// randomBytes returns n incompressible bytes, the same for the same seed.
func randomBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	rng := rand.New(rand.NewPCG(seed, seed+1))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// TestFillPolicyConfigured: the store's fill follows Config.FillPolicy. A
// policy that holds the fill for an hour after a mount keeps every chunk
// of a mounted, unread layer on the registry.
func TestFillPolicyConfigured(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	desc, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"a.bin": string(randomBytes(1<<20, 5))}))
	labels := r.addManifest(t, "test/held:1", desc)[0]
	held := fetch.DefaultFillPolicy()
	held.AfterMount, held.MaxPause = time.Hour, time.Hour
	s, _, _ := newNativeStore(t, Config{FillPolicy: held})
	mp := t.TempDir()
	if err := s.Mount(t.Context(), mp, labels); err != nil {
		t.Fatal(err)
	}
	unmountAtCleanup(t, s, mp)
	// Three times the default AfterMount: the default policy would have
	// filled the layer by then.
	time.Sleep(3 * fetch.DefaultFillPolicy().AfterMount)
	if st := s.Status()[mp]; st.CachedBytes != 0 {
		t.Fatalf("fill ran against a policy holding it for an hour: %+v", st)
	}
}
