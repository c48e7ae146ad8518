package fetch

import (
	"bytes"
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

// TestFootprintThenPrefetch: a layer records the frames its reads asked
// for, in first-read order; another node (empty cache) given that list
// fetches those frames in a few requests before any read, after which the
// reads of them send nothing, while other frames are still fetched on
// demand.
func TestFootprintThenPrefetch(t *testing.T) {
	checkGoroutines(t)
	files := standardFiles()
	fx := newLayerFixture(t, nil, files, WithReadAhead(0))
	var order []layerfmt.Chunk
	order = append(order, fx.chunksOf(t, "c.bin")...)
	order = append(order, fx.chunksOf(t, "big.bin")[5:]...)
	order = append(order, fx.chunksOf(t, "a.txt")...)
	var want []int
	for _, c := range append(order, order[0]) { // a repeated read adds nothing
		if _, err := readChunk(fx.layer, c); err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(want, c.FrameIndex) {
			want = append(want, c.FrameIndex)
		}
	}
	fp := fx.layer.Footprint()
	var got []int
	for i, e := range fp {
		got = append(got, e.Frame)
		if e.AtMS < 0 || (i > 0 && e.AtMS < fp[i-1].AtMS) {
			t.Errorf("footprint times not in read order: %v", fp)
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("footprint %v, want frames in first-read order %v", fp, want)
	}
	// Through the annotation and back, as the next node gets it.
	frames, err := layerfmt.ParsePrefetch(layerfmt.FormatPrefetch(fp), fx.toc.NumFrames())
	if err != nil {
		t.Fatal(err)
	}

	cache, err := chunkcache.Open(t.TempDir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	fresh := newLayerFixture(t, cache, files, WithReadAhead(0))
	fresh.layer.Prefetch(context.Background(), frames)
	if n := fresh.reg.requests(); n == 0 || n > 3 {
		t.Errorf("prefetch of %d frames took %d requests (ranges %v), want a few coalesced ones", len(frames), n, fresh.reg.rangeLog())
	}
	fresh.reg.resetCounts()
	for _, c := range order {
		got, err := readChunk(fresh.layer, c)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != int(c.Size) {
			t.Fatalf("chunk %s: %d bytes", c.Digest, len(got))
		}
	}
	if n := fresh.reg.requests(); n != 0 {
		t.Errorf("reads of prefetched frames sent %d requests", n)
	}
	if _, err := readChunk(fresh.layer, fx.chunksOf(t, "b.txt")[0]); err != nil {
		t.Fatal(err)
	}
	if n := fresh.reg.requests(); n != 1 {
		t.Errorf("read of a frame not listed sent %d requests, want 1", n)
	}
	// A list naming frames that do not exist is ignored past them.
	fresh.layer.Prefetch(context.Background(), []layerfmt.PrefetchEntry{{Frame: -1}, {Frame: fx.toc.NumFrames() + 3}})
}

// TestWriteFileFromCache: a file is written whole only when every chunk is
// local, and never fetched for it.
func TestWriteFileFromCache(t *testing.T) {
	checkGoroutines(t)
	// Nothing read ahead: the reads below leave exactly one chunk out.
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0), WithDecodeAhead(0))
	idx, _ := fx.toc.Lookup("big.bin")
	if fx.layer.FileLocal(idx) {
		t.Fatal("FileLocal before any read")
	}
	var buf bytes.Buffer
	if err := fx.layer.WriteFile(context.Background(), idx, &buf); err == nil {
		t.Fatal("WriteFile of an uncached file succeeded")
	}
	if n := fx.reg.requests(); n != 0 {
		t.Fatalf("WriteFile sent %d requests", n)
	}
	for _, c := range fx.chunksOf(t, "big.bin")[:7] {
		if _, err := readChunk(fx.layer, c); err != nil {
			t.Fatal(err)
		}
	}
	fx.layer.settle()
	if fx.layer.FileLocal(idx) {
		t.Fatal("FileLocal with one chunk missing")
	}
	fx.readAll(t)
	if !fx.layer.FileLocal(idx) {
		t.Fatal("not FileLocal after reading every chunk")
	}
	buf.Reset()
	if err := fx.layer.WriteFile(context.Background(), idx, &buf); err != nil || !bytes.Equal(buf.Bytes(), fx.files["big.bin"]) {
		t.Fatalf("WriteFile: %v (equal %v)", err, bytes.Equal(buf.Bytes(), fx.files["big.bin"]))
	}
}

// TestPrefetchGateOrder: with every slot taken, waiting requests get the
// next free slot earliest due first, whichever layer they come from; a
// cancelled waiter gives up its place.
func TestPrefetchGateOrder(t *testing.T) {
	g := prefetchGate{limit: DefaultPrefetchPolicy().Inflight}
	ctx := context.Background()
	for range g.limit {
		if err := g.acquire(ctx, time.Time{}); err != nil {
			t.Fatal(err)
		}
	}
	base := time.Now()
	order := make(chan int, 4)
	var wg sync.WaitGroup
	start := func(due int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := g.acquire(ctx, base.Add(time.Duration(due)*time.Millisecond)); err == nil {
				order <- due
			}
		}()
		for {
			g.mu.Lock()
			queued := hasDue(g.waiters, base, due)
			g.mu.Unlock()
			if queued {
				return
			}
			time.Sleep(time.Millisecond)
		}
	}
	cctx, cancel := context.WithCancel(ctx)
	cancelled := make(chan error, 1)
	go func() { cancelled <- g.acquire(cctx, base) }()
	for {
		g.mu.Lock()
		n := len(g.waiters)
		g.mu.Unlock()
		if n == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	start(30)
	start(10)
	start(20)
	cancel()
	if err := <-cancelled; err == nil {
		t.Fatal("a cancelled waiter was granted a slot")
	}
	var got []int
	for range 3 {
		g.release()
		got = append(got, <-order)
	}
	wg.Wait()
	if !slices.Equal(got, []int{10, 20, 30}) {
		t.Errorf("slots granted in order %v, want earliest due first", got)
	}
}

func hasDue(ws gateWaiters, base time.Time, due int) bool {
	for _, w := range ws {
		if w.due.Equal(base.Add(time.Duration(due) * time.Millisecond)) {
			return true
		}
	}
	return false
}
