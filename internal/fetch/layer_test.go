package fetch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

const testChunkSize = 64 << 10

type layerFixture struct {
	reg   *fakeRegistry
	toc   *layerfmt.TOC
	cache *chunkcache.Cache
	layer *Layer
	files map[string][]byte
}

// readChunk is ReadChunk for tests that look at the bytes after the read:
// it returns a copy and releases the frame.
func readChunk(l *Layer, c layerfmt.Chunk) ([]byte, error) {
	b, release, err := l.ReadChunk(context.Background(), c)
	if err != nil {
		return nil, err
	}
	defer release()
	return bytes.Clone(b), nil
}

func newLayerFixture(t *testing.T, cache *chunkcache.Cache, files []testFile, opts ...LayerOption) *layerFixture {
	t.Helper()
	reg := newFakeRegistry(t)
	blob, toc := testLayer(t, testChunkSize, files...)
	desc := reg.addBlob(blob)
	if cache == nil {
		var err error
		if cache, err = chunkcache.Open(t.TempDir(), 1<<30); err != nil {
			t.Fatal(err)
		}
	}
	br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
	if err != nil {
		t.Fatal(err)
	}
	l := NewLayer(br, toc, cache, opts...)
	t.Cleanup(func() { l.Close() })
	fx := &layerFixture{reg: reg, toc: toc, cache: cache, layer: l, files: map[string][]byte{}}
	for _, f := range files {
		fx.files[f.name] = f.data
	}
	return fx
}

// chunksOf returns every chunk of every regular file with the bytes it must
// decode to.
// settle waits for the layer's fetches in progress (nothing else may read
// from it meanwhile): readers are released before their flight caches
// what it fetched.
func (l *Layer) settle() { l.wg.Wait() }

func (fx *layerFixture) chunksOf(t *testing.T, name string) []layerfmt.Chunk {
	t.Helper()
	i, ok := fx.toc.Lookup(name)
	if !ok {
		t.Fatalf("%s not in TOC", name)
	}
	return fx.toc.Chunks(i)
}

func (fx *layerFixture) allChunks(t *testing.T) (cs []layerfmt.Chunk, want [][]byte) {
	for _, name := range []string{"big.bin", "a.txt", "b.txt", "empty", "c.bin"} {
		if _, ok := fx.files[name]; !ok {
			continue
		}
		for _, c := range fx.chunksOf(t, name) {
			cs = append(cs, c)
			want = append(want, fx.files[name][c.FileOffset:c.FileOffset+c.Size])
		}
	}
	return cs, want
}

func (fx *layerFixture) readAll(t *testing.T) {
	t.Helper()
	cs, want := fx.allChunks(t)
	for k, c := range cs {
		got, err := readChunk(fx.layer, c)
		if err != nil {
			t.Fatalf("ReadChunk %d (%s): %v", k, c.Digest, err)
		}
		if !bytes.Equal(got, want[k]) {
			t.Fatalf("ReadChunk %d: wrong bytes", k)
		}
	}
	fx.layer.settle()
}

func TestLayerCoalescing(t *testing.T) {
	files := standardFiles()
	const limited = 128 << 10
	tests := []struct {
		name      string
		opts      []LayerOption
		readAhead int64
		requests  func(frames int) (lo, hi int)
	}{
		// Everything (~790 KiB) is within the default 1 MiB read-ahead of
		// the first chunk: one request serves the whole sequential scan.
		{"default read-ahead", nil, DefaultReadAhead, func(int) (int, int) { return 1, 1 }},
		// A smaller budget: several requests, each within the budget.
		{"128 KiB read-ahead", []LayerOption{WithReadAhead(limited)}, limited, func(n int) (int, int) { return 2, n - 1 }},
		// The evaluator's failure mode: one request per frame.
		{"read-ahead off", []LayerOption{WithReadAhead(0)}, 0, func(n int) (int, int) { return n, n }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkGoroutines(t)
			fx := newLayerFixture(t, nil, files, tt.opts...)
			cs, _ := fx.allChunks(t)
			frames := map[int64]bool{}
			var maxFrame int64
			for _, c := range cs {
				frames[c.Offset] = true
				maxFrame = max(maxFrame, c.CompressedSize)
			}
			fx.readAll(t)
			lo, hi := tt.requests(len(frames))
			if got := fx.reg.requests(); got < lo || got > hi {
				t.Errorf("%d frames read with %d requests, want %d..%d (ranges %v)", len(frames), got, lo, hi, fx.reg.rangeLog())
			}
			for _, r := range fx.reg.rangeLog() {
				var a, z int64
				if _, err := fmt.Sscanf(r, "bytes=%d-%d", &a, &z); err != nil || strings.Contains(r, ",") {
					t.Fatalf("not a single range: %q", r)
				}
				if z-a+1 > tt.readAhead+maxFrame {
					t.Errorf("request %q is larger than the read-ahead budget", r)
				}
			}
			// Everything read is cached: a second pass costs nothing.
			fx.reg.resetCounts()
			fx.readAll(t)
			if n := fx.reg.requests(); n != 0 {
				t.Errorf("second pass sent %d requests", n)
			}
		})
	}
}

func TestLayerSingleflight(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles())
	fx.reg.latency = 100 * time.Millisecond
	big := fx.chunksOf(t, "big.bin")
	want := fx.files["big.bin"]
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Half ask for chunk 0, half for chunk 3, which chunk 0's
			// read-ahead covers: still one request.
			c := big[0]
			if g%2 == 1 {
				c = big[3]
			}
			got, err := readChunk(fx.layer, c)
			if err != nil {
				t.Error(err)
				return
			}
			if !bytes.Equal(got, want[c.FileOffset:c.FileOffset+c.Size]) {
				t.Error("wrong bytes")
			}
		}()
		if g == 0 {
			// The others arrive while the first reader's fetch is on the
			// wire (the registry holds it for 100 ms).
			for fx.reg.requests() == 0 {
				time.Sleep(time.Millisecond)
			}
		}
	}
	wg.Wait()
	if n := fx.reg.requests(); n != 1 {
		t.Fatalf("16 concurrent reads sent %d requests, want 1", n)
	}
}

func TestLayerCorruptChunk(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0))
	c := fx.chunksOf(t, "b.txt")[0]
	fx.reg.setFaults(faultCorrupt)
	for range 2 {
		got, err := readChunk(fx.layer, c)
		if !errors.Is(err, layerfmt.ErrDigestMismatch) || got != nil {
			t.Fatalf("corrupt chunk: got %d bytes, err %v; want ErrDigestMismatch and no bytes", len(got), err)
		}
		if !strings.Contains(err.Error(), c.Digest.String()) {
			t.Errorf("error does not name the digest: %v", err)
		}
		if fx.cache.Contains(c.Digest) {
			t.Fatal("corrupt chunk cached")
		}
	}
	if n := fx.reg.requests(); n != 2 {
		t.Errorf("%d requests: a mismatch must not be retried behind the reader's back", n)
	}
}

// TestLayerCorruptReadAhead: a corrupt chunk among read-ahead chunks does not
// fail the chunk asked for, and is not cached.
func TestLayerCorruptReadAhead(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles())
	cs, want := fx.allChunks(t)
	fx.reg.setFaults(faultNone, faultCorrupt) // flips one byte in the middle of the range
	got, err := readChunk(fx.layer, cs[0])
	if err != nil || !bytes.Equal(got, want[0]) {
		t.Fatalf("requested chunk: %v", err)
	}
	fx.layer.settle() // the reader is released before the read-ahead is cached
	var missing []int
	for k, c := range cs {
		if !fx.cache.Contains(c.Digest) {
			missing = append(missing, k)
		}
	}
	if len(missing) != 1 {
		t.Fatalf("chunks not cached after a range with one corrupt chunk: %v, want exactly one", missing)
	}
	// The registry is healthy again: the next read fetches a good copy.
	got, err = readChunk(fx.layer, cs[missing[0]])
	if err != nil || !bytes.Equal(got, want[missing[0]]) {
		t.Fatalf("refetch after mismatch: %v", err)
	}
}

func TestLayerDeadline(t *testing.T) {
	tests := []struct {
		name    string
		latency time.Duration
		always  fault
		reason  string
	}{
		{"slow registry", 3 * time.Second, faultNone, "deadline exceeded"},
		{"registry down", 0, fault503, "503"},
		{"connection resets", 0, faultReset, "reset"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkGoroutines(t)
			// No read-ahead: a response cut short must not hold the whole
			// chunk asked for, which would be served (verified) before
			// the cut.
			fx := newLayerFixture(t, nil, standardFiles(), WithReadTimeout(400*time.Millisecond), WithReadAhead(0))
			fx.reg.latency = tt.latency
			fx.reg.setFaults(tt.always)
			c := fx.chunksOf(t, "a.txt")[0]
			got, err := readChunk(fx.layer, c)
			if err == nil || got != nil {
				t.Fatal("read served past its deadline")
			}
			if !strings.Contains(err.Error(), tt.reason) || !strings.Contains(err.Error(), c.Digest.String()) {
				t.Fatalf("error %q should name the chunk and the reason %q", err, tt.reason)
			}
			if err := fx.layer.Close(); err != nil {
				t.Fatal(err)
			}
			// A closed layer fails reads instead of hanging.
			if _, err := readChunk(fx.layer, c); err == nil {
				t.Fatal("read on closed layer succeeded")
			}
		})
	}
}

func TestLayerFill(t *testing.T) {
	checkGoroutines(t)
	reg := prometheus.NewPedanticRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	fx := newLayerFixture(t, nil, standardFiles(), WithFillBatch(128<<10, 2), WithMetrics(m))
	cached, total := fx.layer.Progress()
	if cached != 0 || total == 0 {
		t.Fatalf("fresh layer progress %d/%d", cached, total)
	}
	fx.layer.StartFill(context.Background())
	waitFilled(t, fx.layer)
	if n := fx.reg.requests(); n < 2 {
		t.Errorf("fill of %d bytes in 128 KiB batches took %d requests", total, n)
	}
	label := fx.layer.label
	if v := testutil.ToFloat64(m.fillCached.WithLabelValues(label)); v != float64(total) {
		t.Errorf("fill gauge %v, want %d", v, total)
	}
	if v := testutil.ToFloat64(m.registryBytes.WithLabelValues(label)); v < float64(total) {
		t.Errorf("registry bytes %v < layer bytes %d", v, total)
	}

	// After the fill, reads never touch the network (which is now down).
	fx.reg.resetCounts()
	fx.reg.setFaults(fault503)
	fx.readAll(t)
	if n := fx.reg.requests(); n != 0 {
		t.Fatalf("reads after fill sent %d requests", n)
	}
	if v := testutil.ToFloat64(m.cacheBytes.WithLabelValues(label)); v == 0 {
		t.Error("cache bytes not counted")
	}
	// Reads of a filled layer never waited; one that misses does.
	if n, _ := readWaits(t, reg); n != 0 {
		t.Errorf("%d read waits counted for a layer the fill completed first", n)
	}
	other := newLayerFixture(t, nil, standardFiles(), WithMetrics(m), WithFill(false), WithReadAhead(0))
	other.reg.setLatency(50 * time.Millisecond)
	if _, err := readChunk(other.layer, other.chunksOf(t, "b.txt")[0]); err != nil {
		t.Fatal(err)
	}
	if n, sum := readWaits(t, reg); n != 1 || sum < 0.05 {
		t.Errorf("read waits after one miss on a 50 ms registry: %d, %.3fs in all; want 1, >= 0.05s", n, sum)
	}
}

// readWaits returns the count and sum of envsnap_fetch_read_wait_seconds.
func readWaits(t *testing.T, reg prometheus.Gatherer) (uint64, float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "envsnap_fetch_read_wait_seconds" {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	t.Fatal("envsnap_fetch_read_wait_seconds is not registered")
	return 0, 0
}

func waitFilled(t *testing.T, l *Layer) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		cached, total := l.Progress()
		if cached == total {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("fill incomplete: %d of %d bytes", cached, total)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestLayerFillStops(t *testing.T) {
	t.Run("close", func(t *testing.T) {
		checkGoroutines(t)
		// 16 KiB/s: the fill would take most of a minute.
		fx := newLayerFixture(t, nil, standardFiles(), WithFillBatch(64<<10, 2), WithFillRate(16<<10))
		fx.layer.StartFill(context.Background())
		time.Sleep(50 * time.Millisecond)
		if err := fx.layer.Close(); err != nil {
			t.Fatal(err)
		}
		cached, total := fx.layer.Progress()
		if cached >= total {
			t.Fatalf("rate-limited fill finished %d/%d before Close", cached, total)
		}
	})
	t.Run("context", func(t *testing.T) {
		checkGoroutines(t)
		fx := newLayerFixture(t, nil, standardFiles(), WithFillBatch(64<<10, 1), WithFillRate(16<<10))
		ctx, cancel := context.WithCancel(context.Background())
		fx.layer.StartFill(ctx)
		time.Sleep(50 * time.Millisecond)
		cancel()
		// The fill is gone: goroutine check at cleanup, and foreground
		// reads still work.
		fx.readAll(t)
	})
	t.Run("disabled", func(t *testing.T) {
		checkGoroutines(t)
		fx := newLayerFixture(t, nil, standardFiles(), WithFill(false))
		fx.layer.StartFill(context.Background())
		time.Sleep(50 * time.Millisecond)
		if n := fx.reg.requests(); n != 0 {
			t.Fatalf("disabled fill sent %d requests", n)
		}
	})
}

func TestLayerRangeIgnored(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0))
	fx.reg.noRange = true
	cs, want := fx.allChunks(t)
	// The registry sends the whole blob for the first miss: the small
	// blob's every chunk is kept from that one response.
	got, err := readChunk(fx.layer, cs[5])
	if err != nil || !bytes.Equal(got, want[5]) {
		t.Fatalf("first read: %v", err)
	}
	// The rest is cached right after the reader is released.
	waitFilled(t, fx.layer)
	fx.readAll(t)
	if n := fx.reg.requests(); n != 1 {
		t.Fatalf("%d requests, want 1", n)
	}
}

// TestLayerRangeIgnoredLargeBlob: above the whole-blob limit, windows are
// read out of full-blob responses and only they are kept.
func TestLayerRangeIgnoredLargeBlob(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0), func(o *layerOptions) { o.wholeBlobMax = 1000 })
	fx.reg.noRange = true
	fx.readAll(t)
	cs, _ := fx.allChunks(t)
	frames := map[int64]bool{}
	for _, c := range cs {
		frames[c.Offset] = true
	}
	if n := fx.reg.requests(); n != len(frames) {
		t.Fatalf("%d requests for %d frames", n, len(frames))
	}
}

// TestSharedChunksAcrossLayers: identical files in two layers are stored once
// and fetched once.
func TestSharedChunksAcrossLayers(t *testing.T) {
	checkGoroutines(t)
	cache, err := chunkcache.Open(t.TempDir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(21, 22))
	shared := testFile{"c.bin", randBytes(r, 150000)}
	a := newLayerFixture(t, cache, []testFile{{"a.txt", randBytes(r, 5000)}, shared})
	b := newLayerFixture(t, cache, []testFile{{"b.txt", randBytes(r, 7000)}, shared})
	for _, c := range a.chunksOf(t, "c.bin") {
		if _, err := readChunk(a.layer, c); err != nil {
			t.Fatal(err)
		}
	}
	a.layer.settle()
	entries := cache.Stats().Entries
	for _, c := range b.chunksOf(t, "c.bin") {
		got, err := readChunk(b.layer, c)
		if err != nil || !bytes.Equal(got, shared.data[c.FileOffset:c.FileOffset+c.Size]) {
			t.Fatalf("layer b: %v", err)
		}
	}
	if n := b.reg.requests(); n != 0 {
		t.Fatalf("layer b fetched %d times chunks layer a already cached", n)
	}
	if cache.Stats().Entries != entries {
		t.Fatal("shared chunks stored twice")
	}
}

func TestLayerCacheFull(t *testing.T) {
	checkGoroutines(t)
	cache, err := chunkcache.Open(t.TempDir(), 1000) // smaller than any chunk
	if err != nil {
		t.Fatal(err)
	}
	fx := newLayerFixture(t, cache, standardFiles(), WithFillBatch(64<<10, 1))
	fx.readAll(t)
	if s := cache.Stats(); s.Entries != 0 || s.PutErrors == 0 {
		t.Fatalf("cache stats %+v", s)
	}
	if cached, _ := fx.layer.Progress(); cached != 0 {
		t.Fatalf("progress counts %d uncached bytes", cached)
	}
	// The fill stops instead of downloading a layer it cannot keep.
	fx.reg.resetCounts()
	fx.layer.StartFill(context.Background())
	for fx.reg.requests() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	// ~13 batches of 64 KiB; the first Put failing with ErrFull ends it.
	if n := fx.reg.requests(); n != 1 {
		t.Fatalf("fill into a full cache sent %d requests, want 1", n)
	}
}

func TestLayerRestartKeepsCache(t *testing.T) {
	checkGoroutines(t)
	dir := t.TempDir()
	cache, err := chunkcache.Open(dir, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	fx := newLayerFixture(t, cache, standardFiles())
	fx.layer.StartFill(context.Background())
	waitFilled(t, fx.layer)
	fx.layer.Close()

	// A daemon restart: new cache index from disk, new layer.
	cache2, err := chunkcache.Open(dir, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	l2 := NewLayer(fx.layer.blob, fx.toc, cache2)
	defer l2.Close()
	if cached, total := l2.Progress(); cached != total {
		t.Fatalf("after restart %d of %d bytes cached", cached, total)
	}
	fx.reg.resetCounts()
	fx.layer = l2
	fx.readAll(t)
	if n := fx.reg.requests(); n != 0 {
		t.Fatalf("%d requests after restart with a full cache", n)
	}
}

// TestLayerFrameCache: chunks sharing a frame are decoded once, and a caller
// appending to a returned slice (a window of the shared frame) cannot
// change what the next reader gets.
func TestLayerFrameCache(t *testing.T) {
	checkGoroutines(t)
	r := rand.New(rand.NewPCG(51, 52))
	files := []testFile{{"a", randBytes(r, 1000)}, {"b", randBytes(r, 2000)}, {"c", randBytes(r, 3000)}}
	fx := newLayerFixture(t, nil, files)
	var cs []layerfmt.Chunk
	for _, f := range files {
		cs = append(cs, fx.chunksOf(t, f.name)...)
	}
	if cs[0].Offset != cs[2].Offset {
		t.Fatalf("small files not packed into one frame: offsets %d, %d", cs[0].Offset, cs[2].Offset)
	}
	for round := range 2 {
		for k, c := range cs {
			got, err := readChunk(fx.layer, c)
			if err != nil || !bytes.Equal(got, files[k].data) {
				t.Fatalf("round %d file %s: %v", round, files[k].name, err)
			}
			_ = append(got, make([]byte, 4096)...)
		}
	}
	if s := fx.cache.Stats(); s.Hits != 0 {
		t.Errorf("%d cache reads for chunks of a frame already decoded", s.Hits)
	}
	if n := fx.reg.requests(); n != 1 {
		t.Errorf("%d requests for one frame", n)
	}
}

// TestLayerStreamedFlight: a reader is released when its chunk has arrived,
// while the read-ahead behind it is still on the way, and the read-ahead is
// cached once it arrives.
func TestLayerStreamedFlight(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithReadTimeout(20*time.Second))
	cs, want := fx.allChunks(t)
	fx.reg.setFaults(faultNone, faultStall)
	got, err := readChunk(fx.layer, cs[0])
	if err != nil || !bytes.Equal(got, want[0]) {
		t.Fatalf("first chunk while the rest of its response is held back: %v", err)
	}
	if fx.cache.Contains(cs[len(cs)-1].Digest) {
		t.Fatal("last chunk cached before it was sent")
	}
	fx.reg.unstall()
	fx.layer.settle()
	fx.reg.resetCounts()
	fx.readAll(t)
	if n := fx.reg.requests(); n != 0 {
		t.Errorf("%d requests after the streamed response ended, want 0 (all of it cached)", n)
	}
}

// TestLayerConcurrentDecode: readers of one frame arriving together read
// it from the node cache and decompress it once; the others wait for that
// decoding (FrameCache.claim) and get the same bytes.
func TestLayerConcurrentDecode(t *testing.T) {
	checkGoroutines(t)
	r := rand.New(rand.NewPCG(53, 54))
	files := []testFile{{"big.bin", randBytes(r, 3*testChunkSize)}}
	fx := newLayerFixture(t, nil, files, WithFill(false))
	fx.readAll(t) // the node cache now holds every frame
	l := NewLayer(fx.layer.blob, fx.toc, fx.cache, WithFill(false))
	defer l.Close()
	cs, want := fx.allChunks(t)
	before := fx.cache.Stats().Hits
	const readers = 16
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, readers)
	for i := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			k := i % len(cs)
			got, err := readChunk(l, cs[k])
			if err == nil && !bytes.Equal(got, want[k]) {
				err = fmt.Errorf("chunk %d: wrong bytes", k)
			}
			errs <- err
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if hits := fx.cache.Stats().Hits - before; hits != uint64(len(cs)) {
		t.Errorf("%d node-cache reads for %d frames read by %d readers at once, want one per frame", hits, len(cs), readers)
	}
}

// TestFillSmallLayerAtMiss: once its fill has started, a layer no larger
// than SmallLayer is fetched whole at its first miss, although every hold
// of the fill applies, so its later reads are served from the node cache;
// a larger one keeps fetching what is read, one miss at a time.
func TestFillSmallLayerAtMiss(t *testing.T) {
	for _, tc := range []struct {
		name  string
		small int64
		whole bool
	}{
		{"small", 1 << 20, true},
		{"larger than SmallLayer", 64 << 10, false},
		{"off", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkGoroutines(t)
			p := DefaultFillPolicy()
			// The fill itself would wait an hour: a mount just happened.
			p.AfterMount, p.MaxPause, p.SmallLayer = time.Hour, time.Hour, tc.small
			// No read-ahead: on demand, every frame is a request.
			fx := newLayerFixture(t, nil, standardFiles(), WithFlights(NewFlights(WithFillPolicy(p))), WithReadAhead(0))
			fx.layer.StartFill(context.Background())
			cs, want := fx.allChunks(t)
			if got, err := readChunk(fx.layer, cs[0]); err != nil || !bytes.Equal(got, want[0]) {
				t.Fatalf("first read: %v", err)
			}
			if !tc.whole {
				time.Sleep(100 * time.Millisecond)
				if cached, total := fx.layer.Progress(); cached == total {
					t.Fatalf("the whole layer (%d bytes) was fetched at the first miss, SmallLayer %d", total, tc.small)
				}
				if n := fx.reg.requests(); n != 1 {
					t.Fatalf("%d requests after one read with the fill held", n)
				}
				return
			}
			waitFilled(t, fx.layer)
			for i, c := range cs {
				if got, err := readChunk(fx.layer, c); err != nil || !bytes.Equal(got, want[i]) {
					t.Fatalf("read %d: %v", i, err)
				}
			}
			// The reader's frame, and the rest in at most two ranges
			// (before and after it).
			if n := fx.reg.requests(); n > 3 {
				t.Fatalf("%d requests for %d frames of a small layer, want at most 3", n, len(cs))
			}
		})
	}
}

// TestLayerFillRangeIgnored: against a registry that ignores Range, the fill
// takes the whole (small) blob in one response instead of one full-blob
// response per batch.
func TestLayerFillRangeIgnored(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithFillBatch(64<<10, 1))
	fx.reg.noRange = true
	fx.layer.StartFill(context.Background())
	waitFilled(t, fx.layer)
	// The first batch discovers it, the second takes the rest.
	if n := fx.reg.requests(); n > 2 {
		t.Fatalf("fill against a Range-ignoring registry took %d full-blob responses", n)
	}
}

// TestLayerFillYieldsToForeground: while a foreground read waits on the
// network, the fill sends nothing; it resumes once the read is served.
func TestLayerFillYieldsToForeground(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithFillBatch(64<<10, 1))
	fx.reg.latency = 500 * time.Millisecond
	cs, want := fx.allChunks(t)
	last := len(cs) - 1 // nothing follows it: its read fetches only its frame
	done := make(chan error, 1)
	go func() {
		got, err := readChunk(fx.layer, cs[last])
		if err == nil && !bytes.Equal(got, want[last]) {
			err = errors.New("wrong bytes")
		}
		done <- err
	}()
	for fx.reg.requests() == 0 {
		time.Sleep(time.Millisecond)
	}
	fx.layer.StartFill(context.Background())
	time.Sleep(150 * time.Millisecond) // well inside the 500 ms the read waits
	if n := fx.reg.requests(); n != 1 {
		t.Fatalf("%d requests while a foreground read was waiting; the fill must wait", n)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	fx.reg.setLatency(0)
	waitFilled(t, fx.layer)
}

// TestSharedFlights: two layers holding the same file, read at the same
// moment, fetch its frames once when they share Flights (and twice when they
// do not: what the option buys).
func TestSharedFlights(t *testing.T) {
	r := rand.New(rand.NewPCG(61, 62))
	shared := testFile{"c.bin", randBytes(r, 150000)}
	filesA := []testFile{{"a.txt", randBytes(r, 5000)}, shared}
	filesB := []testFile{{"b.txt", randBytes(r, 7000)}, shared}
	for _, tt := range []struct {
		name  string
		share bool
		want  int
	}{{"shared", true, 1}, {"separate", false, 2}} {
		t.Run(tt.name, func(t *testing.T) {
			checkGoroutines(t)
			cache, err := chunkcache.Open(t.TempDir(), 1<<30)
			if err != nil {
				t.Fatal(err)
			}
			var opts []LayerOption
			if tt.share {
				opts = append(opts, WithFlights(NewFlights()))
			}
			a := newLayerFixture(t, cache, filesA, opts...)
			b := newLayerFixture(t, cache, filesB, opts...)
			a.reg.setLatency(300 * time.Millisecond)
			b.reg.setLatency(300 * time.Millisecond)
			ca, cb := a.chunksOf(t, "c.bin")[0], b.chunksOf(t, "c.bin")[0]
			if ca.Digest != cb.Digest {
				t.Fatal("identical files produced different frames")
			}
			errs := make(chan error, 1)
			go func() {
				_, err := readChunk(a.layer, ca)
				errs <- err
			}()
			for a.reg.requests() == 0 {
				time.Sleep(time.Millisecond)
			}
			got, err := readChunk(b.layer, cb)
			if err != nil || !bytes.Equal(got, shared.data[cb.FileOffset:cb.FileOffset+cb.Size]) {
				t.Fatalf("layer b: %v", err)
			}
			if err := <-errs; err != nil {
				t.Fatalf("layer a: %v", err)
			}
			if n := a.reg.requests() + b.reg.requests(); n != tt.want {
				t.Fatalf("%d requests for one frame read by two layers, want %d", n, tt.want)
			}
			a.layer.settle()
			b.layer.settle()
			if cached, _ := b.layer.Progress(); cached == 0 {
				t.Error("layer b's progress ignores the frame layer a fetched for it")
			}
		})
	}
}

// TestLayerCorruptCacheFile: a cached frame altered on disk is caught by the
// one verification a cache hit gets (chunkcache.Get), refetched and served
// correctly, never decoded as is.
func TestLayerCorruptCacheFile(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0), WithFrameCache(0))
	c := fx.chunksOf(t, "b.txt")[0]
	want := fx.files["b.txt"][c.FileOffset : c.FileOffset+c.Size]
	if _, err := readChunk(fx.layer, c); err != nil {
		t.Fatal(err)
	}
	fx.layer.settle()
	enc := c.Digest.Encoded()
	p := filepath.Join(fx.cache.Dir(), c.Digest.Algorithm().String(), enc[:2], enc)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0xff
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	fx.reg.resetCounts()
	got, err := readChunk(fx.layer, c)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read after corrupting the cache file: err %v, equal %v", err, bytes.Equal(got, want))
	}
	if s := fx.cache.Stats(); s.Corrupt != 1 {
		t.Errorf("cache counted %d corrupt entries, want 1", s.Corrupt)
	}
	if n := fx.reg.requests(); n != 1 {
		t.Errorf("%d requests to replace the corrupt frame, want 1", n)
	}
}

// TestFillYieldsNodeWide: a foreground read of one layer waiting on the
// network holds back the fill of another layer sharing the Flights.
func TestFillYieldsNodeWide(t *testing.T) {
	checkGoroutines(t)
	cache, err := chunkcache.Open(t.TempDir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	flights := NewFlights()
	a := newLayerFixture(t, cache, standardFiles(), WithFlights(flights), WithReadAhead(0))
	r := rand.New(rand.NewPCG(71, 72))
	b := newLayerFixture(t, cache, []testFile{{"other.bin", randBytes(r, 300000)}}, WithFlights(flights), WithFillBatch(64<<10, 1))
	mounted := time.Now()
	a.reg.setLatency(3 * time.Second)
	c := a.chunksOf(t, "b.txt")[0]
	done := make(chan error, 1)
	go func() {
		_, err := readChunk(a.layer, c)
		done <- err
	}()
	for a.reg.requests() == 0 {
		time.Sleep(time.Millisecond)
	}
	b.layer.StartFill(context.Background())
	time.Sleep(DefaultFillPolicy().AfterMount - time.Since(mounted) + 200*time.Millisecond) // past the mounts' quiet period, inside the read's wait
	if n := b.reg.requests(); n != 0 {
		t.Fatalf("layer b's fill sent %d requests while layer a's read waited on the network", n)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFilled(t, b.layer)
}

// TestFillStatusJSON: an operator sees why a fill is held
// (containerd-envsnap status), and a fill that holds nothing shows no
// reason.
func TestFillStatusJSON(t *testing.T) {
	checkGoroutines(t)
	p := DefaultFillPolicy()
	p.AfterMount, p.MaxPause = time.Hour, time.Hour
	f := newLayerFixture(t, nil, standardFiles(), WithFlights(NewFlights(WithFillPolicy(p))))
	if st := f.layer.FillStatus(); st.State != FillPending {
		t.Errorf("fill status before StartFill %+v, want pending", st)
	}
	f.layer.StartFill(context.Background())
	var st FillStatus
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if st = f.layer.FillStatus(); st.State == FillHeld {
			break
		}
	}
	if st.State != FillHeld || st.Hold != HoldMount {
		t.Fatalf("fill status after a mount %+v, want held for the mount", st)
	}
	b, err := json.Marshal(st)
	if err != nil || !strings.Contains(string(b), `"state":"held","hold":"mount"`) {
		t.Errorf("fill status as JSON %s, %v", b, err)
	}
	var back FillStatus
	if err := json.Unmarshal(b, &back); err != nil || back.State != st.State || back.Hold != st.Hold || !back.Since.Equal(st.Since) {
		t.Errorf("fill status back from JSON %+v, %v; want %+v", back, err, st)
	}
	b, _ = json.Marshal(FillStatus{State: FillComplete, Since: time.Now()})
	if strings.Contains(string(b), "hold") {
		t.Errorf("a fill that holds nothing shows a reason: %s", b)
	}
	if err := json.Unmarshal([]byte(`{"state":"napping"}`), &back); err == nil {
		t.Errorf("an unknown fill state was accepted")
	}
	if err := json.Unmarshal([]byte(`{"state":"held","hold":"cpu"}`), &back); err == nil {
		t.Errorf("the hold for idle cores, which no fill has any more, was accepted")
	}
}

// idleThreads returns the threads of this process that run SCHED_IDLE.
func idleThreads(t *testing.T) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	var idle []int
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		a, err := unix.SchedGetAttr(tid, 0)
		if err != nil {
			continue // ended meanwhile
		}
		if a.Policy == unix.SCHED_IDLE {
			idle = append(idle, tid)
		}
	}
	return idle
}

// TestFillRunsIdle: a fill batch is received, verified and cached on a
// thread at idle priority, whatever the node's CPU load: the fill never
// waits for an idle core, and an environment's threads come first. A
// foreground read of a chunk the batch carries boosts it to the daemon's
// priority: the read does not wait at idle priority.
func TestFillRunsIdle(t *testing.T) {
	checkGoroutines(t)
	// A lowered thread ends just after its job (earlier tests' fills).
	for deadline := time.Now().Add(10 * time.Second); len(idleThreads(t)) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("threads %v idle before the fill", idleThreads(t))
		}
	}
	p := DefaultFillPolicy()
	p.AfterMount, p.Startup = 0, 0
	f := newLayerFixture(t, nil, standardFiles(), WithFlights(NewFlights(WithFillPolicy(p))), WithFillBatch(DefaultFillBatch, 1))
	f.reg.setLatency(2 * time.Second)
	f.layer.StartFill(context.Background())
	for f.reg.requests() == 0 {
		time.Sleep(time.Millisecond)
	}
	var idle []int
	for deadline := time.Now().Add(10 * time.Second); len(idle) == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		idle = idleThreads(t)
	}
	if len(idle) != 1 {
		t.Fatalf("%d threads idle while the fill's batch is in flight, want 1", len(idle))
	}
	read := make(chan error, 1)
	go func() {
		_, err := readChunk(f.layer, f.chunksOf(t, "big.bin")[0])
		read <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); len(idle) > 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		idle = idleThreads(t)
	}
	if len(idle) != 0 {
		t.Fatalf("thread %v still idle with a read waiting on its batch", idle)
	}
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	if n := f.reg.requests(); n != 1 {
		t.Errorf("%d requests, want the fill's alone (the read joins it)", n)
	}
	waitFilled(t, f.layer)
}

// TestFillStatusWithoutFill: a layer without background fill says so
// until a read caches its last chunk.
func TestFillStatusWithoutFill(t *testing.T) {
	checkGoroutines(t)
	cache, err := chunkcache.Open(t.TempDir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	f := newLayerFixture(t, cache, []testFile{{"one.txt", []byte("one small file")}}, WithFill(false))
	f.layer.StartFill(context.Background())
	if st := f.layer.FillStatus(); st.State != FillOff {
		t.Errorf("fill status %+v, want off", st)
	}
	for _, c := range f.chunksOf(t, "one.txt") {
		if _, err := readChunk(f.layer, c); err != nil {
			t.Fatal(err)
		}
	}
	// A fetched chunk reaches the cache after its readers have it.
	waitFilled(t, f.layer)
	if st := f.layer.FillStatus(); st.State != FillComplete {
		t.Errorf("fill status with every chunk read %+v, want complete", st)
	}
}
