package fetch

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

// slotChunk is a chunk whose frame is decoded into a slot.
func slotChunk(i int) (layerfmt.Chunk, digest.Digest) {
	d := digest.FromString(string(rune('a' + i)))
	return layerfmt.Chunk{Digest: d, FrameSize: slotFrame, Size: slotFrame}, d
}

// TestFrameSlotsReused: a frame's slot is written again only after the
// cache dropped the frame and every reader released it, and then it is.
func TestFrameSlotsReused(t *testing.T) {
	f := NewFrameCache(minSlotCache)
	if f.slots == nil {
		t.Fatal("a cache of minSlotCache bytes has no slots (mmap failed?)")
	}
	decoded := func(i int) *frame {
		c, d := slotChunk(i)
		fr := f.buffer(c)
		if fr.slot < 0 {
			t.Fatalf("frame %d: no slot", i)
		}
		fr.adopt(append(fr.b, bytes.Repeat([]byte{byte(i)}, slotFrame)...))
		if fr.slot < 0 {
			t.Fatalf("frame %d: decoded out of its slot", i)
		}
		f.put(d, fr)
		return fr
	}
	first := decoded(0)
	first.release() // the decoder's reference; the cache keeps its own
	_, d0 := slotChunk(0)
	held, ok := f.get(d0)
	if !ok {
		t.Fatal("frame 0 not cached")
	}
	// Evict frame 0 (the cache holds minSlotCache/slotFrame frames) and
	// take every other slot.
	var all []*frame
	for i := 1; ; i++ {
		c, _ := slotChunk(i)
		fr := f.buffer(c)
		if fr.slot < 0 {
			break
		}
		fr.adopt(append(fr.b, bytes.Repeat([]byte{byte(i)}, slotFrame)...))
		all = append(all, fr)
		if i <= int(minSlotCache/slotFrame) {
			_, d := slotChunk(i)
			f.put(d, fr)
		}
	}
	if _, ok := f.get(d0); ok {
		t.Fatal("frame 0 still cached after the cache filled up")
	}
	if len(all) != f.slots.n-1 {
		t.Fatalf("%d slots handed out besides the held frame's, want %d", len(all), f.slots.n-1)
	}
	if !bytes.Equal(held.b, bytes.Repeat([]byte{0}, slotFrame)) {
		t.Fatal("a held frame's slot was written by another frame")
	}
	slot := held.slot
	held.release()
	c, _ := slotChunk(99)
	next := f.buffer(c)
	if next.slot != slot {
		t.Fatalf("after the last release, the next frame got slot %d, want the freed slot %d", next.slot, slot)
	}
	next.release()
	for _, fr := range all {
		fr.release()
	}
}

// TestFrameSlotsOverCommitted: with every slot held, frames go to the Go
// heap, and a frame released more often than held panics.
func TestFrameSlotsOverCommitted(t *testing.T) {
	f := NewFrameCache(minSlotCache)
	var held []*frame
	for i := range f.slots.n {
		c, _ := slotChunk(i)
		held = append(held, f.buffer(c))
	}
	c, _ := slotChunk(f.slots.n)
	if fr := f.buffer(c); fr.slot >= 0 {
		t.Fatalf("slot %d handed out twice", fr.slot)
	}
	for _, fr := range held {
		fr.release()
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a second release did not panic")
		}
	}()
	held[0].release()
}

// TestLayerFramesPinned: readers holding windows of 2 MiB frames while a
// small shared cache evicts and reuses slots under them always see the
// bytes of their chunk, and once every reader released, every slot not
// holding a cached frame is free again.
func TestLayerFramesPinned(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	data := randBytes(r, 20*slotFrame)
	files := []testFile{{"big.bin", data}}
	reg := newFakeRegistry(t)
	blob, toc := testLayer(t, slotFrame, files...)
	desc := reg.addBlob(blob)
	br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
	if err != nil {
		t.Fatal(err)
	}
	frames := NewFrameCache(minSlotCache)
	cache, err := chunkcache.Open(t.TempDir(), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	l := NewLayer(br, toc, cache, WithFill(false), WithSharedFrameCache(frames), WithReadAhead(0))
	defer l.Close()
	idx, _ := toc.Lookup("big.bin")
	cs := toc.Chunks(idx)

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 40 {
				c := cs[r.IntN(len(cs))]
				b, release, err := l.ReadChunk(context.Background(), c)
				if err != nil {
					errs <- err
					return
				}
				time.Sleep(time.Duration(r.IntN(300)) * time.Microsecond)
				if !bytes.Equal(b, data[c.FileOffset:c.FileOffset+c.Size]) {
					errs <- fmt.Errorf("chunk at %d: a held window changed under its reader", c.Offset)
				}
				release()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	l.settle()
	frames.mu.Lock()
	inCache := 0
	for el := frames.lru.Front(); el != nil; el = el.Next() {
		if el.Value.(*frameEntry).frame.slot >= 0 {
			inCache++
		}
	}
	frames.mu.Unlock()
	frames.slots.mu.Lock()
	free, used := len(frames.slots.free), frames.slots.next
	frames.slots.mu.Unlock()
	if inCache == 0 {
		t.Fatal("no frame was decoded into a slot")
	}
	if free+inCache != used {
		t.Fatalf("%d slots handed out, %d free and %d holding cached frames: %d still held after every reader released",
			used, free, inCache, used-free-inCache)
	}
}

// TestFlightReceiveBuffersReused: the buffer a range response was received
// into goes back to the node's Flights when the flight and its readers are
// done, and the next flight receives into it.
func TestFlightReceiveBuffersReused(t *testing.T) {
	fx := newLayerFixture(t, nil, standardFiles(), WithReadAhead(0), WithDecodeAhead(0), WithFill(false))
	cs, want := fx.allChunks(t)
	kept := func() (n int, first *byte) {
		p := &fx.layer.flights.recv
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, l := range p.free {
			for _, b := range l {
				n++
				first = unsafe.SliceData(b)
			}
		}
		return n, first
	}
	var buf *byte
	for i := range 3 {
		got, err := readChunk(fx.layer, cs[i])
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[i]) {
			t.Fatalf("chunk %d: wrong bytes", i)
		}
		fx.layer.settle()
		n, b := kept()
		if n != 1 {
			t.Fatalf("after flight %d: %d receive buffers kept, want 1", i, n)
		}
		if i > 0 && b != buf {
			t.Fatalf("flight %d received into a new buffer, not the one kept", i)
		}
		buf = b
	}
}
