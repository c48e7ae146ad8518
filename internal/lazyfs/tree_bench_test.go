package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"

	"github.com/envsnap/envsnap/layerfmt"
)

// wideTOC builds a TOC of n empty files spread over n/100 directories.
func wideTOC(b *testing.B, n int) *layerfmt.TOC {
	b.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for d := 0; d < n/100; d++ {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("d%04d/", d), Mode: 0o755}); err != nil {
			b.Fatal(err)
		}
		for f := 0; f < 99; f++ {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("d%04d/file-with-a-typical-name-%03d.go", d, f), Mode: 0o644}); err != nil {
				b.Fatal(err)
			}
		}
	}
	tw.Close()
	_, toc := convert(b, &buf)
	return toc
}

// eagerRoot builds the whole inode tree when the file system starts, the
// alternative to lazyfs's Lookup-driven tree. It exists only to measure
// what that would cost.
type eagerRoot struct{ node }

func (r *eagerRoot) OnAdd(ctx context.Context) {
	t := r.l.toc
	inodes := make([]*fs.Inode, t.Len())
	inodes[0] = &r.Inode
	for i := 1; i < t.Len(); i++ { // breadth-first: parents come first
		c, name, ok := r.l.resolveChild(t.Parent(i), i)
		if !ok {
			continue
		}
		parent := inodes[t.Parent(i)]
		if parent == nil {
			continue
		}
		ch := parent.NewPersistentInode(ctx, r.l.newNode(c), fs.StableAttr{Mode: c.mode, Ino: ino(c.idx)})
		parent.AddChild(name, ch, true)
		inodes[i] = ch
	}
}

// BenchmarkTreeBuild compares the start-up time and retained heap of the
// lazy tree (what Mount does) with building every inode up front, for a
// 100k-entry layer. Run with -benchtime=3x; it prints a table.
func BenchmarkTreeBuild(b *testing.B) {
	const entries = 100_000
	toc := wideTOC(b, entries)
	src := newBlobSource(bytes.NewReader(nil))
	type result struct {
		dur  time.Duration
		heap uint64
	}
	measure := func(build func() any) result {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		keep := build()
		d := time.Since(start)
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(keep)
		return result{d, after.HeapAlloc - min(before.HeapAlloc, after.HeapAlloc)}
	}
	var lazy, eager result
	for b.Loop() {
		lazy = measure(func() any {
			root, err := NewRoot(toc, src)
			if err != nil {
				b.Fatal(err)
			}
			return fs.NewNodeFS(root, fsOptions(defaultOptions()))
		})
		eager = measure(func() any {
			l, err := newLayer(context.Background(), toc, src, defaultOptions())
			if err != nil {
				b.Fatal(err)
			}
			return fs.NewNodeFS(&eagerRoot{node{l: l}}, fsOptions(defaultOptions()))
		})
	}
	b.ReportMetric(float64(lazy.dur.Microseconds())/1e3, "lazy-ms")
	b.ReportMetric(float64(eager.dur.Microseconds())/1e3, "eager-ms")
	b.ReportMetric(float64(lazy.heap)/(1<<20), "lazy-MiB")
	b.ReportMetric(float64(eager.heap)/(1<<20), "eager-MiB")
	fmt.Printf("%d entries: lazy %s %.1f MiB, eager %s %.1f MiB\n", toc.Len(), lazy.dur.Round(time.Millisecond), float64(lazy.heap)/(1<<20), eager.dur.Round(time.Millisecond), float64(eager.heap)/(1<<20))
}
