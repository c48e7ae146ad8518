package fetch

import (
	"container/list"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/layerfmt"
)

// FrameCache keeps the most recently decoded frames in memory, by digest.
// Small files share frames (layerfmt packs them up to the chunk size), and
// FUSE reads a big file in 128 KiB requests, so without it every request
// would verify and decompress a whole frame again: 8 decompressions of the
// same 1 MiB frame to read one 1 MiB file. Frames are content addressed,
// so one cache can serve every layer of a node (WithSharedFrameCache).
//
// It also holds the frames being decoded (claim, finish): the kernel sends
// the 1 MiB halves of a 2 MiB frame as two concurrent readahead requests,
// and environments starting together read the same frames at the same
// moment; each of them used to read the compressed frame from the node
// cache, hash it and decompress it again while the first was still at it.
//
// A cache of at least minSlotCache bytes decodes frames of 1-2 MiB into
// slots of memory it reuses (frameSlots) instead of the Go heap, so every
// frame handed out is pinned: its reader releases it when done, and a slot
// is reused only once the cache has dropped its frame and no reader holds
// it.
type FrameCache struct {
	mu       sync.Mutex
	max      int64
	size     int64
	lru      *list.List // of *frameEntry, front = most recent
	byDig    map[digest.Digest]*list.Element
	decoding map[digest.Digest]*decoding
	slots    *frameSlots // nil: every frame on the Go heap
}

// minSlotCache is the smallest cache given slots: the per-layer caches
// (DefaultFrameCache) hold two frames, not worth a mapping each.
const minSlotCache = 16 << 20

// frame is a decoded frame and the references to it: the cache's while it
// is cached, and one per reader holding it.
type frame struct {
	b     []byte
	refs  atomic.Int32
	slot  int // -1: on the Go heap
	slots *frameSlots
}

// release drops one reference; the last one frees the frame's slot.
func (f *frame) release() {
	switch n := f.refs.Add(-1); {
	case n < 0:
		panic("fetch: decoded frame released more often than it was held")
	case n == 0 && f.slot >= 0:
		f.slots.put(f.slot)
	}
}

// adopt makes out, what decoding into f.b returned, the frame's bytes.
// The decoder appends into the buffer it was given when the frame fits,
// which FrameBufferSize guarantees; if it ever did not, the slot is freed
// and the frame lives on the Go heap.
func (f *frame) adopt(out []byte) {
	if f.slot >= 0 && (len(out) == 0 || unsafe.SliceData(out) != unsafe.SliceData(f.b)) {
		f.slots.put(f.slot)
		f.slot = -1
	}
	f.b = out
}

// decoding is a frame one reader is producing; the others wait for done.
type decoding struct {
	done chan struct{}
	// waiters is how many readers wait for the frame, each of which is
	// given a reference to it; finished says they were. Both are guarded
	// by FrameCache.mu.
	waiters  int32
	finished bool
	frame    *frame
	err      error
}

type frameEntry struct {
	d     digest.Digest
	frame *frame
}

// NewFrameCache returns a cache of at most max bytes of decoded frames.
func NewFrameCache(max int64) *FrameCache {
	f := &FrameCache{max: max, lru: list.New(), byDig: map[digest.Digest]*list.Element{}, decoding: map[digest.Digest]*decoding{}}
	if max >= minSlotCache {
		if s := newFrameSlots(max); s != nil {
			f.slots = s
			// Every frame in a slot holds s, so s is collected only when
			// no frame is held any more, by the cache or a reader.
			runtime.AddCleanup(s, func(mem []byte) { unmap(mem) }, s.mem)
		}
	}
	return f
}

// buffer returns a frame to decode c's frame into (frame.adopt), held once
// by the caller.
func (f *FrameCache) buffer(c layerfmt.Chunk) *frame {
	fr := &frame{slot: -1}
	fr.refs.Store(1)
	if f.slots != nil && c.FrameSize >= minSlotFrame && c.FrameSize <= slotFrame {
		if b, slot, ok := f.slots.get(int(layerfmt.FrameBufferSize(c))); ok {
			fr.b, fr.slot, fr.slots = b[:0], slot, f.slots
		}
	}
	return fr
}

// claim returns the decoded frame d, held for the caller, when it is
// cached. Otherwise it returns the decoding of d in progress, to wait for
// (mine false; see wait), or a new one that the caller must complete with
// finish (mine true).
func (f *FrameCache) claim(d digest.Digest) (fr *frame, dec *decoding, mine bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if el, ok := f.byDig[d]; ok {
		f.lru.MoveToFront(el)
		fr := el.Value.(*frameEntry).frame
		fr.refs.Add(1)
		return fr, nil, false
	}
	if dec, ok := f.decoding[d]; ok {
		dec.waiters++
		return nil, dec, false
	}
	dec = &decoding{done: make(chan struct{})}
	f.decoding[d] = dec
	return nil, dec, true
}

// abandon is what a waiter of dec that stops waiting calls: the frame it
// would have been given is not held for it, or is released.
func (f *FrameCache) abandon(dec *decoding) {
	f.mu.Lock()
	if !dec.finished {
		dec.waiters--
		f.mu.Unlock()
		return
	}
	f.mu.Unlock()
	<-dec.done
	if dec.err == nil {
		dec.frame.release()
	}
}

// finish completes a decoding claimed with claim: a frame is kept (when it
// fits) and handed to the waiters, each holding it once; an error is handed
// to them. The caller's own reference to fr is its own to release.
func (f *FrameCache) finish(d digest.Digest, dec *decoding, fr *frame, err error) {
	if err == nil {
		f.put(d, fr)
	}
	f.mu.Lock()
	delete(f.decoding, d)
	dec.finished = true
	if err == nil {
		fr.refs.Add(dec.waiters)
	}
	f.mu.Unlock()
	dec.frame, dec.err = fr, err
	close(dec.done)
}

// get returns the decoded frame d, held for the caller. Callers must not
// modify it.
func (f *FrameCache) get(d digest.Digest) (*frame, bool) {
	if f.max <= 0 {
		return nil, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	el, ok := f.byDig[d]
	if !ok {
		return nil, false
	}
	f.lru.MoveToFront(el)
	fr := el.Value.(*frameEntry).frame
	fr.refs.Add(1)
	return fr, true
}

func (f *FrameCache) put(d digest.Digest, fr *frame) {
	n := int64(len(fr.b))
	if n > f.max {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.byDig[d]; ok {
		return
	}
	for f.size+n > f.max {
		el := f.lru.Back()
		e := el.Value.(*frameEntry)
		f.lru.Remove(el)
		delete(f.byDig, e.d)
		f.size -= int64(len(e.frame.b))
		e.frame.release()
	}
	fr.refs.Add(1)
	f.byDig[d] = f.lru.PushFront(&frameEntry{d, fr})
	f.size += n
}
