package fetch

import (
	"bytes"
	"context"
	"slices"
	"testing"

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
		if _, err := fx.layer.ReadChunk(context.Background(), c); err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(want, c.FrameIndex) {
			want = append(want, c.FrameIndex)
		}
	}
	fp := fx.layer.Footprint()
	if !slices.Equal(fp, want) {
		t.Fatalf("footprint %v, want frames in first-read order %v", fp, want)
	}
	// Through the annotation and back, as the next node gets it.
	frames, err := layerfmt.ParseFrameList(layerfmt.FormatFrameList(fp), fx.toc.NumFrames())
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
		got, err := fresh.layer.ReadChunk(context.Background(), c)
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
	if _, err := fresh.layer.ReadChunk(context.Background(), fx.chunksOf(t, "b.txt")[0]); err != nil {
		t.Fatal(err)
	}
	if n := fresh.reg.requests(); n != 1 {
		t.Errorf("read of a frame not listed sent %d requests, want 1", n)
	}
	// A list naming frames that do not exist is ignored past them.
	fresh.layer.Prefetch(context.Background(), []int{-1, fx.toc.NumFrames() + 3})
}

// TestWriteFileFromCache: a file is written whole only when every chunk is
// local, and never fetched for it.
func TestWriteFileFromCache(t *testing.T) {
	checkGoroutines(t)
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0))
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
		if _, err := fx.layer.ReadChunk(context.Background(), c); err != nil {
			t.Fatal(err)
		}
	}
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
