package fetch

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/chunkcache"
)

// BenchmarkSequentialScan reads every chunk of a layer of many small files in
// blob order through a registry that adds 20 ms per request (the round trip
// of the benchmark link, docs/benchmarks.md), once without read-ahead and once with the
// default, and reports the speed-up and the request counts side by side.
func BenchmarkSequentialScan(b *testing.B) {
	r := rand.New(rand.NewPCG(41, 42))
	var files []testFile
	for i := range 300 {
		// ~50 kB files, the size of the evaluator's serial reads, that
		// compress about like source code.
		files = append(files, testFile{fmt.Sprintf("f%03d", i), wordBytes(r, 40000+r.IntN(20000))})
	}
	blob, toc := testLayer(b, 1<<20, files...)

	scan := func(b *testing.B, opts ...LayerOption) (time.Duration, int) {
		reg := newFakeRegistry(b)
		desc := reg.addBlob(blob)
		reg.latency = 20 * time.Millisecond
		cache, err := chunkcache.Open(b.TempDir(), 1<<30)
		if err != nil {
			b.Fatal(err)
		}
		br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc)
		if err != nil {
			b.Fatal(err)
		}
		l := NewLayer(br, toc, cache, opts...)
		defer l.Close()
		start := time.Now()
		for _, f := range files {
			i, _ := toc.Lookup(f.name)
			for _, c := range toc.Chunks(i) {
				if _, err := l.ReadChunk(context.Background(), c); err != nil {
					b.Fatal(err)
				}
			}
		}
		return time.Since(start), reg.requests()
	}
	var off, on time.Duration
	var reqOff, reqOn int
	for b.Loop() {
		d, n := scan(b, WithReadAhead(0))
		off, reqOff = off+d, n
		d, n = scan(b)
		on, reqOn = on+d, n
	}
	b.ReportMetric(float64(off)/float64(on), "speedup")
	b.ReportMetric(float64(reqOff), "requests-no-readahead")
	b.ReportMetric(float64(reqOn), "requests-readahead")
}

// wordBytes is text from a small vocabulary: compresses ~3-4x with zstd.
func wordBytes(r *rand.Rand, n int) []byte {
	words := []string{"func", "return", "err", "nil", "if", "for", "range", "ctx", "context", "string", "int64", "package", "import", "type", "struct", "{", "}", "(", ")", "\n\t", ":=", "=", "fmt.Errorf", "len", "append"}
	var b []byte
	for len(b) < n {
		b = append(b, words[r.IntN(len(words))]...)
		b = append(b, ' ')
		if r.IntN(12) == 0 {
			b = append(b, fmt.Sprintf("v%d", r.IntN(100000))...)
		}
	}
	return b[:n]
}

// BenchmarkFill measures the background fill of a 32 MiB layer through a
// registry adding 20 ms per request against one plain GET of the whole blob
// through the same registry (the floor: one round trip, one stream), and
// reports fill time / floor.
func BenchmarkFill(b *testing.B) {
	r := rand.New(rand.NewPCG(43, 44))
	var files []testFile
	for i := range 32 {
		files = append(files, testFile{fmt.Sprintf("f%02d", i), wordBytes(r, 1<<20)})
	}
	blob, toc := testLayer(b, 1<<20, files...)
	reg := newFakeRegistry(b)
	desc := reg.addBlob(blob)
	reg.setLatency(20 * time.Millisecond)

	var fill, floor time.Duration
	var requests int
	for b.Loop() {
		start := time.Now()
		br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := br.ReadRange(context.Background(), 0, desc.Size); err != nil {
			b.Fatal(err)
		}
		floor += time.Since(start)

		cache, err := chunkcache.Open(b.TempDir(), 1<<30)
		if err != nil {
			b.Fatal(err)
		}
		// The raw fill speed: nothing runs in the foreground here, and
		// the yield policy (FillPolicy) would only add its
		// waits.
		l := NewLayer(br, toc, cache, WithFillYield(false))
		reg.resetCounts()
		start = time.Now()
		l.StartFill(context.Background())
		for {
			if c, t := l.Progress(); c == t {
				break
			}
			time.Sleep(time.Millisecond)
		}
		fill += time.Since(start)
		requests = reg.requests()
		l.Close()
	}
	b.ReportMetric(float64(fill)/float64(floor), "fill/single-GET")
	b.ReportMetric(float64(requests), "fill-requests")
	b.ReportMetric(float64(len(blob))/(1<<20), "blob-MiB")
}
