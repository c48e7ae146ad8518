//go:build linux

package native

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

func buildNow(t *testing.T, s *Store, d digest.Digest, toc *layerfmt.TOC, chunks Chunks) error {
	t.Helper()
	done := make(chan error, 1)
	s.Build(d, toc, chunks, func(err error) { done <- err })
	return <-done
}

// TestStoreRestart: a complete copy is found again by a new Store (and
// charged to the budget); a tree a crash left without its marker is not,
// and is removed.
func TestStoreRestart(t *testing.T) {
	requireRoot(t)
	_, toc, cache := cachedLayer(t, buildTar(t, allKinds()))
	dir := t.TempDir()
	ctx := context.Background()
	d := digest.FromString("layer one")
	s, err := Open(ctx, dir, cache)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Dir(d); ok {
		t.Fatal("copy ready before any build")
	}
	if err := buildNow(t, s, d, toc, cache); err != nil {
		t.Fatalf("build: %v", err)
	}
	p, ok := s.Dir(d)
	if !ok {
		t.Fatal("no copy after a successful build")
	}
	if b, err := os.ReadFile(filepath.Join(p, "opaque/kept")); err != nil || string(b) != "kept" {
		t.Fatalf("opaque/kept: %q, %v", b, err)
	}
	if got := cache.Stats().Charged; got != TreeSize(toc) {
		t.Errorf("charged %d, want %d", got, TreeSize(toc))
	}
	s.Close()

	// A build that died between rename and marker.
	torn := digest.FromString("torn layer")
	tornDir := filepath.Join(dir, torn.Algorithm().String(), torn.Encoded())
	if err := os.MkdirAll(filepath.Join(tornDir, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	cache2, err := chunkcache.Open(cache.Dir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := Open(ctx, dir, cache2)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if p2, ok := s2.Dir(d); !ok || p2 != p {
		t.Errorf("after restart: copy %q, %v; want %q", p2, ok, p)
	}
	if _, ok := s2.Dir(torn); ok {
		t.Error("a copy without marker is used")
	}
	s2.Wait()
	if _, err := os.Stat(tornDir); !os.IsNotExist(err) {
		t.Errorf("torn copy still on disk: %v", err)
	}
	if got := cache2.Stats().Charged; got != TreeSize(toc) {
		t.Errorf("after restart charged %d, want %d", got, TreeSize(toc))
	}
}

// TestStoreBudget: copies and chunks share one bound. A Put that does not
// fit drops a copy nobody uses before it evicts a chunk; a copy in use is
// never dropped; a copy that does not fit is not built.
func TestStoreBudget(t *testing.T) {
	requireRoot(t)
	_, toc, src := cachedLayer(t, buildTar(t, allKinds()))
	size := TreeSize(toc)
	var chunkBytes int64
	for k := range toc.NumFrames() {
		chunkBytes += toc.Frame(k).CompressedSize
	}
	// Room for the chunks and one copy, with a little to spare.
	cache, err := chunkcache.Open(t.TempDir(), chunkBytes+size+size/4)
	if err != nil {
		t.Fatal(err)
	}
	for k := range toc.NumFrames() {
		f := toc.Frame(k)
		b, _ := src.Get(f.Digest)
		if err := cache.Put(f.Digest, b); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	s, err := Open(ctx, t.TempDir(), cache)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	cache.SetTenant(s)
	used := map[digest.Digest]bool{}
	s.SetInUse(func(context.Context) (map[digest.Digest]bool, error) { return used, nil })

	a, b := digest.FromString("layer a"), digest.FromString("layer b")
	if err := buildNow(t, s, a, toc, cache); err != nil {
		t.Fatalf("build a: %v", err)
	}
	if err := buildNow(t, s, b, toc, cache); err == nil {
		t.Fatal("a second copy was built beyond the bound")
	}
	if _, ok := s.Dir(b); ok {
		t.Fatal("copy b ready although its build failed")
	}
	used[a] = true
	s.mu.Lock()
	s.inUseMap = nil // the test changed the answer; do not wait for the TTL
	s.mu.Unlock()
	// No room for this Put without evicting: a is in use, so chunks go.
	filler := make([]byte, size/4+chunkBytes/2)
	fd := digest.FromBytes(filler)
	if err := cache.Put(fd, filler); err != nil {
		t.Fatalf("put: %v", err)
	}
	if _, ok := s.Dir(a); !ok {
		t.Fatal("copy in use was dropped")
	}
	if cache.Stats().Evictions == 0 {
		t.Fatal("no chunk evicted although the copy is in use")
	}

	delete(used, a)
	s.mu.Lock()
	s.inUseMap = nil
	s.mu.Unlock()
	evictions := cache.Stats().Evictions
	filler2 := make([]byte, size/2)
	if err := cache.Put(digest.FromBytes(filler2), filler2); err != nil {
		t.Fatalf("put: %v", err)
	}
	if _, ok := s.Dir(a); ok {
		t.Fatal("copy nobody uses kept while a Put needed room")
	}
	if got := cache.Stats().Evictions; got != evictions {
		t.Errorf("%d chunks evicted although dropping the copy made room", got-evictions)
	}
	if st := s.Stats(); st.Reclaimed != 1 || st.Copies != 0 {
		t.Errorf("stats %+v", st)
	}
	if got := cache.Stats().Charged; got != 0 {
		t.Errorf("charged %d after the copy was dropped", got)
	}
}

// pausingChunks reads chunks from a cache; its first Get reports the
// thread asking on asked and waits for resume.
type pausingChunks struct {
	*chunkcache.Cache
	once   sync.Once
	asked  chan int
	resume chan struct{}
}

func (c *pausingChunks) Get(d digest.Digest) ([]byte, bool) {
	c.once.Do(func() {
		c.asked <- unix.Gettid()
		<-c.resume
	})
	return c.Cache.Get(d)
}

// TestBuildRunsIdle: a copy is decoded and written at idle CPU and I/O
// priority (SCHED_IDLE, I/O class idle), not at the priority of the
// environments whose CPU and disk it would take. The build's thread is
// looked at from outside a few times, as its floor turns
// (idleprio.FloorFor every FloorEvery) run it at the daemon's priority.
func TestBuildRunsIdle(t *testing.T) {
	requireRoot(t)
	_, toc, cache := cachedLayer(t, buildTar(t, allKinds()))
	s, err := Open(context.Background(), t.TempDir(), cache)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	chunks := &pausingChunks{Cache: cache, asked: make(chan int), resume: make(chan struct{})}
	done := make(chan error, 1)
	s.Build(digest.FromString("layer"), toc, chunks, func(err error) { done <- err })
	tid := <-chunks.asked
	const ioClassIdle = 3
	var sched, io bool
	for range 10 {
		if a, err := unix.SchedGetAttr(tid, 0); err == nil && a.Policy == unix.SCHED_IDLE {
			sched = true
		}
		if p, _, e := unix.Syscall(unix.SYS_IOPRIO_GET, 1, uintptr(tid), 0); e == 0 && int(p)>>13 == ioClassIdle {
			io = true
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(chunks.resume)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !sched || !io {
		t.Fatalf("the build's thread ran SCHED_IDLE: %v, at I/O class idle: %v; want both", sched, io)
	}
}
