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
// of the link in DESIGN.md), once without read-ahead and once with the
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
