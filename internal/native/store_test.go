//go:build linux

package native

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

func buildNow(t *testing.T, s *Store, d digest.Digest, src Source) error {
	t.Helper()
	done := make(chan error, 1)
	s.Build(d, src, func(err error) { done <- err })
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
	if err := buildNow(t, s, d, Source{TOC: toc, Chunks: cache}); err != nil {
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
	if err := buildNow(t, s, a, Source{TOC: toc, Chunks: cache}); err != nil {
		t.Fatalf("build a: %v", err)
	}
	if err := buildNow(t, s, b, Source{TOC: toc, Chunks: cache}); err == nil {
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
	s.Build(digest.FromString("layer"), Source{TOC: toc, Chunks: chunks}, func(err error) { done <- err })
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

// TestMain runs the test binary as the build process when a Store with
// a build command starts it (TestBuildProcess), as containerd-envsnap's
// native-build subcommand does.
func TestMain(m *testing.M) {
	if len(os.Args) == 7 && os.Args[1] == "native-build" && os.Args[2] == "--chunks" && os.Args[4] == "--toc" {
		if err := BuildFromCache(context.Background(), os.Args[6], os.Args[3], digest.Digest(os.Args[5])); err != nil {
			fmt.Fprintf(os.Stderr, "native-build: %v\n", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestBuildProcess: with a build command the tree is built by a process
// of its own from the chunk cache's directory, the same tree as in
// process; what that process cannot read or verify fails the build with
// its reason.
func TestBuildProcess(t *testing.T) {
	requireRoot(t)
	blob, toc, cache := cachedLayer(t, buildTar(t, allKinds()))
	tocOff, tocSize, err := layerfmt.TOCRange(blob[len(blob)-layerfmt.FooterSize:], int64(len(blob)))
	if err != nil {
		t.Fatal(err)
	}
	encoded := blob[tocOff : tocOff+tocSize]
	tocDigest := digest.FromBytes(encoded)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	open := func() *Store {
		s, err := Open(context.Background(), t.TempDir(), cache)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Close)
		s.SetBuildCommand([]string{self})
		return s
	}
	src := Source{TOC: toc, Chunks: cache, TOCDigest: tocDigest, ChunkDir: cache.Dir()}
	d := digest.FromString("layer")

	// The encoded TOC is not in the cache yet: only the process reads it.
	s := open()
	err = buildNow(t, s, d, src)
	if err == nil || !strings.Contains(err.Error(), "build process") || !strings.Contains(err.Error(), tocDigest.String()) {
		t.Fatalf("build without the TOC in the cache: %v; want the build process's error naming the TOC", err)
	}
	if _, ok := s.Dir(d); ok {
		t.Fatal("a copy after a failed build")
	}

	if err := cache.Put(tocDigest, encoded); err != nil {
		t.Fatal(err)
	}
	if err := buildNow(t, s, d, src); err != nil {
		t.Fatalf("build: %v", err)
	}
	got, ok := s.Dir(d)
	if !ok {
		t.Fatal("no copy after a successful build")
	}
	if st := s.Stats(); st.Builds != 1 || st.ProcessBuilds != 2 {
		t.Fatalf("stats %+v, want 1 build, 2 in a process", st)
	}
	want := filepath.Join(t.TempDir(), "tree")
	if err := BuildTree(context.Background(), want, toc, cache); err != nil {
		t.Fatal(err)
	}
	w, g := describe(t, want), describe(t, got)
	if len(w) < 50 || !maps.Equal(w, g) {
		t.Fatalf("the process built a different tree:\n got  %v\n want %v", g, w)
	}

	// A chunk damaged on disk: the process refuses it.
	damageChunk(t, cache, toc.Frame(toc.NumFrames()/2).Digest)
	s = open()
	if err := buildNow(t, s, d, src); err == nil || !strings.Contains(err.Error(), ErrChunkMissing.Error()) {
		t.Fatalf("build over a damaged chunk: %v; want %q", err, ErrChunkMissing)
	}
}
