package chunkcache

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/mounttest"
	"github.com/envsnap/envsnap/internal/prereq"
)

func blob(seed uint64, n int) ([]byte, digest.Digest) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b, digest.FromBytes(b)
}

func open(t *testing.T, dir string, max int64) *Cache {
	t.Helper()
	c, err := Open(dir, max)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestPutGet(t *testing.T) {
	c := open(t, t.TempDir(), 1<<20)
	b, d := blob(1, 1000)
	if _, ok := c.Get(d); ok {
		t.Fatal("hit on empty cache")
	}
	if err := c.Put(d, b); err != nil {
		t.Fatal(err)
	}
	got, ok := c.Get(d)
	if !ok || !bytes.Equal(got, b) {
		t.Fatalf("Get after Put: ok=%v equal=%v", ok, bytes.Equal(got, b))
	}
	// Putting the same content again stores it once.
	if err := c.Put(d, b); err != nil {
		t.Fatal(err)
	}
	s := c.Stats()
	if s.Entries != 1 || s.Size != 1000 || s.Hits != 1 || s.Misses != 1 {
		t.Fatalf("stats %+v", s)
	}
	// Put refuses content that does not match its name.
	other, _ := blob(2, 10)
	if err := c.Put(d, other); err == nil {
		t.Fatal("Put accepted bytes that do not match the digest")
	}
}

func TestBoundUnderChurn(t *testing.T) {
	const max = 64 << 10
	c := open(t, t.TempDir(), max)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				b, d := blob(uint64(w*1000+i), 1000+(i*37)%4000)
				if err := c.Put(d, b); err != nil {
					t.Error(err)
					return
				}
				if s := c.Stats(); s.Size > max {
					t.Errorf("size %d above bound %d", s.Size, max)
					return
				}
				c.Get(d)
			}
		}()
	}
	wg.Wait()
	s := c.Stats()
	if s.Size > max || s.Evictions == 0 {
		t.Fatalf("after churn: %+v", s)
	}
	// Disk agrees with the index.
	var onDisk int64
	filepath.Walk(c.Dir(), func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			onDisk += fi.Size()
		}
		return nil
	})
	if onDisk != s.Size {
		t.Fatalf("disk holds %d bytes, index says %d", onDisk, s.Size)
	}
}

func TestLRUOrder(t *testing.T) {
	c := open(t, t.TempDir(), 3000)
	b1, d1 := blob(1, 1000)
	b2, d2 := blob(2, 1000)
	b3, d3 := blob(3, 1000)
	b4, d4 := blob(4, 1000)
	for _, p := range []struct {
		b []byte
		d digest.Digest
	}{{b1, d1}, {b2, d2}, {b3, d3}} {
		if err := c.Put(p.d, p.b); err != nil {
			t.Fatal(err)
		}
	}
	c.Get(d1) // d2 is now the least recently used
	if err := c.Put(d4, b4); err != nil {
		t.Fatal(err)
	}
	for d, want := range map[digest.Digest]bool{d1: true, d2: false, d3: true, d4: true} {
		if got := c.Contains(d); got != want {
			t.Errorf("Contains(%s)=%v want %v", d, got, want)
		}
	}
}

func TestPinRespected(t *testing.T) {
	c := open(t, t.TempDir(), 3000)
	b1, d1 := blob(1, 1000)
	b2, d2 := blob(2, 1000)
	c.Pin("layerA", []digest.Digest{d1, d2}) // pinned before they arrive
	for _, p := range []struct {
		b []byte
		d digest.Digest
	}{{b1, d1}, {b2, d2}} {
		if err := c.Put(p.d, p.b); err != nil {
			t.Fatal(err)
		}
	}
	// Churn through unpinned entries: pinned ones survive.
	for i := range 20 {
		b, d := blob(uint64(100+i), 1000)
		if err := c.Put(d, b); err != nil {
			t.Fatal(err)
		}
	}
	if !c.Contains(d1) || !c.Contains(d2) {
		t.Fatal("pinned entry evicted")
	}
	// The bound cannot be met by evicting pinned entries: Put fails with
	// ErrFull instead of exceeding it.
	big, dbig := blob(200, 2000)
	if err := c.Put(dbig, big); !errors.Is(err, ErrFull) {
		t.Fatalf("Put over pinned bound: %v, want ErrFull", err)
	}
	// A second owner pinning d1 keeps it after the first unpins.
	c.Pin("layerB", []digest.Digest{d1})
	c.Unpin("layerA")
	if err := c.Put(dbig, big); err != nil {
		t.Fatalf("Put after unpin: %v", err)
	}
	if !c.Contains(d1) || c.Contains(d2) {
		t.Fatalf("after unpin: d1 %v (want kept), d2 %v (want evicted)", c.Contains(d1), c.Contains(d2))
	}
}

func TestRestartPersistence(t *testing.T) {
	dir := t.TempDir()
	c := open(t, dir, 1<<20)
	var ds []digest.Digest
	for i := range 10 {
		b, d := blob(uint64(i), 500+i)
		if err := c.Put(d, b); err != nil {
			t.Fatal(err)
		}
		ds = append(ds, d)
	}
	want := c.Stats().Size
	// A Put interrupted by a crash leaves a temporary file behind.
	if err := os.WriteFile(filepath.Join(dir, tmpDirName, "put-123"), []byte("partial"), 0o600); err != nil {
		t.Fatal(err)
	}

	c2 := open(t, dir, 1<<20)
	if s := c2.Stats(); s.Entries != 10 || s.Size != want {
		t.Fatalf("after reopen: %+v, want 10 entries %d bytes", s, want)
	}
	for _, d := range ds {
		if _, ok := c2.Get(d); !ok {
			t.Fatalf("lost %s across restart", d)
		}
	}
	if left, _ := os.ReadDir(filepath.Join(dir, tmpDirName)); len(left) != 0 {
		t.Fatalf("temporary files not cleaned: %v", left)
	}

	// Reopening with a lower bound trims to it.
	c3 := open(t, dir, 2000)
	if s := c3.Stats(); s.Size > 2000 || s.Entries == 0 {
		t.Fatalf("reopen with lower bound: %+v", s)
	}
}

func TestCorruptFileDropped(t *testing.T) {
	tests := []struct {
		name    string
		corrupt func(path string) error
	}{
		{"bit flip", func(p string) error {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			b[len(b)/2] ^= 1
			return os.WriteFile(p, b, 0o600)
		}},
		{"truncated", func(p string) error { return os.Truncate(p, 10) }},
		{"removed behind our back", os.Remove},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := open(t, t.TempDir(), 1<<20)
			b, d := blob(7, 4096)
			if err := c.Put(d, b); err != nil {
				t.Fatal(err)
			}
			if err := tt.corrupt(c.path(d)); err != nil {
				t.Fatal(err)
			}
			if got, ok := c.Get(d); ok {
				t.Fatalf("served %d bytes of a damaged entry", len(got))
			}
			if c.Contains(d) || c.Stats().Size != 0 {
				t.Fatalf("damaged entry still indexed: %+v", c.Stats())
			}
			if _, err := os.Stat(c.path(d)); !os.IsNotExist(err) {
				t.Fatalf("damaged file still on disk: %v", err)
			}
			// A fresh Put repairs it.
			if err := c.Put(d, b); err != nil {
				t.Fatal(err)
			}
			if got, ok := c.Get(d); !ok || !bytes.Equal(got, b) {
				t.Fatal("not repaired by Put")
			}
		})
	}
}

// TestReader: another process's view of the cache serves what the
// owner stored, verified, and leaves a damaged entry to the owner.
func TestReader(t *testing.T) {
	dir := t.TempDir()
	c := open(t, dir, 1<<20)
	b, d := blob(9, 4096)
	r := NewReader(dir)
	if _, ok := r.Get(d); ok {
		t.Fatal("hit before Put")
	}
	if err := c.Put(d, b); err != nil {
		t.Fatal(err)
	}
	if got, ok := r.Get(d); !ok || !bytes.Equal(got, b) {
		t.Fatalf("Get after the owner's Put: ok=%v equal=%v", ok, bytes.Equal(got, b))
	}
	if _, ok := r.Get("sha256:nothex"); ok {
		t.Fatal("hit for an invalid digest")
	}
	flipped := bytes.Clone(b)
	flipped[100] ^= 1
	if err := os.WriteFile(c.path(d), flipped, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, ok := r.Get(d); ok {
		t.Fatal("served a damaged entry")
	}
	if _, err := os.Stat(c.path(d)); err != nil {
		t.Fatalf("the reader removed the owner's file: %v", err)
	}
}

// TestENOSPC runs the cache on a 2 MiB tmpfs with a bound far above it: Put
// must fail with ErrFull (callers then serve uncached), never corrupt the
// index, and work again once space returns.
func TestENOSPC(t *testing.T) {
	prereq.RequireRoot(t) // to mount a tmpfs
	mounttest.NoLeaks(t)
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", dir).CombinedOutput(); err != nil {
		prereq.Missing(t, "mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, out)
		}
	})
	c := open(t, dir, 1<<30)
	var pinned []digest.Digest
	var stored []digest.Digest
	full := false
	for i := 0; i < 64 && !full; i++ {
		b, d := blob(uint64(i), 128<<10)
		pinned = append(pinned, d)
		c.Pin("mounted", pinned)
		err := c.Put(d, b)
		switch {
		case err == nil:
			stored = append(stored, d)
		case errors.Is(err, ErrFull):
			full = true
		default:
			t.Fatalf("Put %d: %v (want nil or ErrFull)", i, err)
		}
	}
	if !full {
		t.Fatal("2 MiB tmpfs never filled")
	}
	s := c.Stats()
	if s.Entries != len(stored) || s.PutErrors == 0 {
		t.Fatalf("index after ENOSPC: %+v, stored %d", s, len(stored))
	}
	for _, d := range stored {
		if _, ok := c.Get(d); !ok {
			t.Fatalf("entry %s lost after ENOSPC", d)
		}
	}
	if left, _ := os.ReadDir(filepath.Join(dir, tmpDirName)); len(left) != 0 {
		t.Fatalf("temporary files left after ENOSPC: %d", len(left))
	}
	// Space returns when the layer is unmounted: the next Put evicts our own
	// unpinned entries on ENOSPC and succeeds.
	c.Unpin("mounted")
	b, d := blob(1000, 128<<10)
	if err := c.Put(d, b); err != nil {
		t.Fatalf("Put after space returned: %v", err)
	}
	if got, ok := c.Get(d); !ok || !bytes.Equal(got, b) {
		t.Fatal("Get after recovery")
	}
}

func TestCollector(t *testing.T) {
	c := open(t, t.TempDir(), 1<<20)
	b, d := blob(1, 100)
	_ = c.Put(d, b)
	c.Get(d)
	c.Get(digest.FromString("absent"))
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c.Collector()); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]float64{
		"envsnap_chunkcache_hits_total":   1,
		"envsnap_chunkcache_misses_total": 1,
		"envsnap_chunkcache_size_bytes":   100,
	} {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
			found = true
			m := mf.GetMetric()[0]
			got := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			if got != want {
				t.Errorf("%s = %v, want %v", name, got, want)
			}
		}
		if !found {
			t.Errorf("%s not exported", name)
		}
	}
	if n := testutil.CollectAndCount(c.Collector()); n != 9 {
		t.Errorf("collector exports %d metrics, want 9", n)
	}
}

func FuzzOpenIndex(f *testing.F) {
	// Open must tolerate any file name under the cache directory (foreign
	// files, half-written names) without indexing junk.
	f.Add("sha256/ab/abcd")
	f.Add("sha256/" + digest.FromString("x").Encoded()[:2] + "/" + digest.FromString("x").Encoded())
	f.Fuzz(func(t *testing.T, name string) {
		dir := t.TempDir()
		p := filepath.Join(dir, filepath.FromSlash(name))
		if rel, err := filepath.Rel(dir, p); err != nil || rel == "." || filepath.IsAbs(rel) || len(rel) > 200 || rel[0] == '.' {
			return
		}
		if os.MkdirAll(filepath.Dir(p), 0o700) != nil || os.WriteFile(p, []byte("x"), 0o600) != nil {
			return
		}
		c, err := Open(dir, 1<<20)
		if err != nil {
			return
		}
		for d := range c.entries {
			if d.Validate() != nil {
				t.Fatalf("indexed invalid digest %q", d)
			}
			if _, ok := c.Get(d); ok && d != digest.FromString("x") {
				t.Fatal(fmt.Sprintf("served unverifiable entry %s", d))
			}
		}
	})
}

// TestPutVerified stores like Put; Get still verifies what it reads back,
// so bytes wrongly vouched for are never served.
func TestPutVerified(t *testing.T) {
	c := open(t, t.TempDir(), 1<<20)
	b, d := blob(1, 1000)
	if err := c.PutVerified(d, b); err != nil {
		t.Fatal(err)
	}
	if got, ok := c.Get(d); !ok || !bytes.Equal(got, b) {
		t.Fatalf("Get after PutVerified: ok=%v", ok)
	}
	_, od := blob(2, 10)
	if err := c.PutVerified(od, b); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Get(od); ok {
		t.Fatal("Get served bytes that do not match their digest")
	}
	if s := c.Stats(); s.Corrupt != 1 {
		t.Fatalf("stats %+v, want one corrupt entry", s)
	}
}

// resident returns how many pages of the file at p are in the page cache.
func resident(t *testing.T, p string) (in, total int) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatal(e)
	}
	for _, v := range vec {
		in += int(v & 1)
	}
	return in, len(vec)
}

// TestPrefetch: Prefetch brings an entry's file back into the page cache
// without a Get.
func TestPrefetch(t *testing.T) {
	c := open(t, t.TempDir(), 8<<20)
	b, d := blob(3, 1<<20)
	if err := c.Put(d, b); err != nil {
		t.Fatal(err)
	}
	p := c.path(d)
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	f.Close()
	if in, _ := resident(t, p); in != 0 {
		prereq.Skip(t, prereq.PageCacheKept, "%d pages kept", in)
	}
	c.Prefetch([]digest.Digest{d, digest.FromString("not cached")})
	deadline := time.Now().Add(5 * time.Second)
	for {
		in, total := resident(t, p)
		if in == total {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d pages resident after Prefetch", in, total)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s := c.Stats(); s.Hits != 0 || s.Misses != 0 {
		t.Errorf("Prefetch counted as Get: %+v", s)
	}
}
