package fetch

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
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
				if _, err := readChunk(l, c); err != nil {
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

// BenchmarkDecodeAhead reads spans of a large file chunk by chunk, as the
// loader's page faults on a mapped executable reach the daemon (one read
// per frame, each after the previous one is answered), with decoding
// ahead off and on, alternating, and reports the time ratio and the
// compressed bytes fetched side by side. ENVSNAP_BENCH_LATENCY adds a
// delay per registry request (default none: the unshaped case).
func BenchmarkDecodeAhead(b *testing.B) {
	r := rand.New(rand.NewPCG(43, 44))
	// Compresses about as well as machine code (~2x): 4 KiB blocks of
	// random bytes and of text.
	data := make([]byte, 0, 64<<20)
	for len(data) < cap(data) {
		if r.IntN(2) == 0 {
			data = append(data, randBytes(r, 4096)...)
		} else {
			data = append(data, wordBytes(r, 4096)...)
		}
	}
	blob, toc := testLayer(b, 2<<20, testFile{"agent", data})
	spans := []struct{ off, n int64 }{{0, 14 << 20}, {24 << 20, 8 << 20}, {40 << 20, 12 << 20}}
	latency, _ := time.ParseDuration(os.Getenv("ENVSNAP_BENCH_LATENCY"))

	read := func(b *testing.B, ahead int) (time.Duration, int64) {
		reg := newFakeRegistry(b)
		desc := reg.addBlob(blob)
		reg.latency = latency
		cache, err := chunkcache.Open(b.TempDir(), 1<<30)
		if err != nil {
			b.Fatal(err)
		}
		br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc)
		if err != nil {
			b.Fatal(err)
		}
		l := NewLayer(br, toc, cache, WithFill(false), WithDecodeAhead(ahead), WithSharedFrameCache(NewFrameCache(128<<20)))
		defer l.Close()
		i, _ := toc.Lookup("agent")
		start := time.Now()
		for _, s := range spans {
			for k := toc.ChunkAt(i, s.off); k <= toc.ChunkAt(i, s.off+s.n-1); k++ {
				c := toc.Chunk(i, k)
				got, err := readChunk(l, c)
				if err != nil || !bytes.Equal(got, data[c.FileOffset:c.FileOffset+c.Size]) {
					b.Fatalf("chunk %d: %v", k, err)
				}
			}
		}
		d := time.Since(start)
		l.settle()
		var fetched int64
		for _, rg := range reg.rangeLog() {
			var first, last int64
			if _, err := fmt.Sscanf(rg, "bytes=%d-%d", &first, &last); err == nil {
				fetched += last - first + 1
			}
		}
		return d, fetched
	}
	var off, on time.Duration
	var bytesOff, bytesOn int64
	round := 0
	for b.Loop() {
		// Alternate which goes first: the machine's load drifts.
		order := []int{0, DefaultDecodeAhead}
		if round%2 == 1 {
			order = []int{DefaultDecodeAhead, 0}
		}
		round++
		for _, ahead := range order {
			d, n := read(b, ahead)
			if ahead == 0 {
				off, bytesOff = off+d, n
			} else {
				on, bytesOn = on+d, n
			}
		}
	}
	b.Logf("%d rounds: off %.3fs, on %.3fs per round; fetched %.1f MiB off, %.1f MiB on",
		round, off.Seconds()/float64(round), on.Seconds()/float64(round), float64(bytesOff)/(1<<20), float64(bytesOn)/(1<<20))
	b.ReportMetric(on.Seconds()/off.Seconds(), "on/off")
	b.ReportMetric(float64(bytesOn)/float64(bytesOff), "bytes-on/off")
}
