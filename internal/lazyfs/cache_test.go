package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/layerfmt"
)

// TestPageCacheKeptAcrossOpens: with FOPEN_KEEP_CACHE a second open (as by
// another container sharing the mount) reads from the page cache, so the
// chunk source is not asked again. Without it the kernel drops the file's
// pages on every open.
func TestPageCacheKeptAcrossOpens(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, src, _ := f.mount(t)
	p := filepath.Join(mnt, "data/big")
	first, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	n := src.calls.Load()
	if n == 0 {
		t.Fatal("first read did not reach the chunk source")
	}
	for range 3 {
		again, err := os.ReadFile(p)
		if err != nil || !bytes.Equal(again, first) {
			t.Fatalf("re-read: %v", err)
		}
	}
	if extra := src.calls.Load() - n; extra != 0 {
		t.Errorf("re-opening a cached file issued %d more ReadChunk calls, want 0", extra)
	}
}

// BenchmarkWarmRead compares reads of a file whose pages are cached on the
// FUSE mount with the same file on a plain directory (both warm), in one
// run: the ratio is what FUSE costs once data is local.
func BenchmarkWarmRead(b *testing.B) {
	requireFUSE(b)
	const size = 64 << 20
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(5, 6))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	plainDir := b.TempDir()
	plain := filepath.Join(plainDir, "file")
	if err := os.WriteFile(plain, data, 0o644); err != nil {
		b.Fatal(err)
	}
	blob, toc := convert(b, bytes.NewReader(buildTar(b, []tarFile{{hdr: hdr('0', "file", 0o644), data: data}})))
	mnt, _ := mountLayer(b, toc, newBlobSource(bytes.NewReader(blob)))
	lazy := filepath.Join(mnt, "file")
	for _, p := range []string{plain, lazy} {
		// Warm the page cache.
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, data) {
			b.Fatalf("warm %s: %v", p, err)
		}
	}

	type result struct{ plain, lazy float64 } // MB/s
	results := map[string]*result{}
	for _, mode := range []struct {
		name string
		read func(f *os.File, buf []byte, i int) error
		bs   int
	}{
		{"seq-1MiB", func(f *os.File, buf []byte, i int) error {
			_, err := f.ReadAt(buf, int64(i*len(buf))%size)
			return err
		}, 1 << 20},
		{"rand-4KiB", func(f *os.File, buf []byte, i int) error {
			_, err := f.ReadAt(buf, int64(rand.IntN(size/4096))*4096)
			return err
		}, 4096},
	} {
		results[mode.name] = &result{}
		for _, target := range []struct {
			name string
			path string
			out  *float64
		}{{"plain", plain, &results[mode.name].plain}, {"fuse", lazy, &results[mode.name].lazy}} {
			b.Run(mode.name+"/"+target.name, func(b *testing.B) {
				f, err := os.Open(target.path)
				if err != nil {
					b.Fatal(err)
				}
				defer f.Close()
				buf := make([]byte, mode.bs)
				b.SetBytes(int64(mode.bs))
				b.ResetTimer()
				start := time.Now()
				for i := 0; b.Loop(); i++ {
					if err := mode.read(f, buf, i); err != nil {
						b.Fatal(err)
					}
				}
				*target.out = float64(b.N) * float64(mode.bs) / time.Since(start).Seconds() / 1e6
			})
		}
	}
	for name, r := range results {
		if r.plain > 0 && r.lazy > 0 {
			fmt.Printf("warm %-10s plain %9.0f MB/s  fuse %9.0f MB/s  fuse/plain %.2f\n", name, r.plain, r.lazy, r.lazy/r.plain)
		}
	}
}

// BenchmarkColdSequentialRead reads a file whose pages are not cached, with
// the kernel's default FUSE readahead (128 KiB) and with the 1 MiB window
// Mount sets, against a source that costs a round trip per call (the
// fetcher's cached-frame path still costs a copy and a lookup; a remote
// chunk costs a network round trip).
func BenchmarkColdSequentialRead(b *testing.B) {
	requireFUSE(b)
	const size = 32 << 20
	data := make([]byte, size)
	r := rand.New(rand.NewPCG(7, 8))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	blob, toc := convert(b, bytes.NewReader(buildTar(b, []tarFile{{hdr: hdr('0', "file", 0o644), data: data}})))
	src := newBlobSource(bytes.NewReader(blob))
	mnt, srv := mountLayer(b, toc, &delayedSource{src, 200 * time.Microsecond})
	var st unix.Stat_t
	if err := unix.Stat(mnt, &st); err != nil {
		b.Fatal(err)
	}
	for _, ra := range []int{128 << 10, maxRequest} {
		b.Run(fmt.Sprintf("readahead-%dKiB", ra>>10), func(b *testing.B) {
			if err := setReadahead(st.Dev, ra); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(size)
			before := srv.Stats().Ops["read"].Count
			buf := make([]byte, 128<<10)
			for b.Loop() {
				f, err := os.Open(filepath.Join(mnt, "file"))
				if err != nil {
					b.Fatal(err)
				}
				// Drop the cached pages so every iteration is cold.
				if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
					b.Fatal(err)
				}
				for off := int64(0); off < size; off += int64(len(buf)) {
					if _, err := f.ReadAt(buf, off); err != nil {
						b.Fatal(err)
					}
				}
				f.Close()
			}
			b.ReportMetric(float64(srv.Stats().Ops["read"].Count-before)/float64(b.N), "fuse-reads/op")
		})
	}
}

type delayedSource struct {
	ChunkSource
	delay time.Duration
}

func (d *delayedSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	time.Sleep(d.delay)
	return d.ChunkSource.ReadChunk(ctx, c)
}

// TestDirectoryListingCached: FOPEN_CACHE_DIR lets the kernel answer a
// second listing of a directory without asking the daemon.
func TestDirectoryListingCached(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, _, srv := f.mount(t)
	first, err := os.ReadDir(filepath.Join(mnt, "bin"))
	if err != nil {
		t.Fatal(err)
	}
	n := srv.Stats().Ops["readdir"].Count
	if n == 0 {
		t.Fatal("listing did not reach the daemon")
	}
	for range 3 {
		again, err := os.ReadDir(filepath.Join(mnt, "bin"))
		if err != nil || len(again) != len(first) {
			t.Fatalf("second listing: %d entries, %v", len(again), err)
		}
	}
	if extra := srv.Stats().Ops["readdir"].Count - n; extra != 0 {
		t.Errorf("relisting a directory produced %d more READDIRs, want 0", extra)
	}
}

// TestRestOfChunkStored: a small read of a big chunk leaves the rest of
// the chunk in the page cache (FUSE_NOTIFY_STORE), so the following small
// reads of that chunk reach neither the daemon nor the chunk source.
func TestRestOfChunkStored(t *testing.T) {
	requireFUSE(t)
	const chunk = 1 << 20
	data := make([]byte, 2*chunk)
	r := rand.New(rand.NewPCG(7, 8))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	blob, toc := convert(t, bytes.NewReader(buildTar(t, []tarFile{{hdr: hdr(tar.TypeReg, "big", 0o644), data: data}})), layerfmt.WithChunkSize(chunk))
	src := newBlobSource(bytes.NewReader(blob))
	mnt, _ := mountLayer(t, toc, src)
	f, err := os.Open(filepath.Join(mnt, "big"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Random reads: no readahead, so the kernel asks for what we read.
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	if _, err := f.ReadAt(buf, chunk+128<<10); err != nil {
		t.Fatal(err)
	}
	calls := src.calls.Load()
	// The store is asynchronous: wait until the kernel holds the chunk.
	m, err := unix.Mmap(int(f.Fd()), chunk, chunk, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, chunk/4096)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
			t.Fatal(e)
		}
		resident := 0
		for _, v := range vec {
			resident += int(v & 1)
		}
		if resident == len(vec) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d pages of the chunk resident after one read of it", resident, len(vec))
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, off := range []int64{chunk, chunk + 512<<10, 2*chunk - int64(len(buf))} {
		if _, err := f.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, data[off:off+int64(len(buf))]) {
			t.Fatalf("wrong bytes at %d", off)
		}
	}
	if extra := src.calls.Load() - calls; extra != 0 {
		t.Errorf("%d more ReadChunk calls for reads of a chunk already decoded", extra)
	}
}

// observedSource counts NoteActivity calls.
type observedSource struct {
	*blobSource
	ops atomic.Int64
}

func (s *observedSource) NoteActivity() { s.ops.Add(1) }

// TestActivityObserved: a source implementing ActivityObserver hears of
// metadata operations too, not only reads.
func TestActivityObserved(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	src := &observedSource{blobSource: newBlobSource(bytes.NewReader(f.blob))}
	mnt, _ := mountLayer(t, f.toc, src)
	before := src.ops.Load()
	if _, err := os.Stat(filepath.Join(mnt, "etc/passwd")); err != nil {
		t.Fatal(err)
	}
	if src.ops.Load() == before {
		t.Fatal("a lookup was not reported to the ActivityObserver")
	}
	if src.calls.Load() != 0 {
		t.Fatal("a stat read file data")
	}
}
