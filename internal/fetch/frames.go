package fetch

import (
	"container/list"
	"sync"

	"github.com/opencontainers/go-digest"
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
type FrameCache struct {
	mu       sync.Mutex
	max      int64
	size     int64
	lru      *list.List // of *frameEntry, front = most recent
	byDig    map[digest.Digest]*list.Element
	decoding map[digest.Digest]*decoding
}

// decoding is a frame one reader is producing; the others wait for done.
type decoding struct {
	done  chan struct{}
	frame []byte
	err   error
}

type frameEntry struct {
	d     digest.Digest
	frame []byte
}

// NewFrameCache returns a cache of at most max bytes of decoded frames.
func NewFrameCache(max int64) *FrameCache {
	return &FrameCache{max: max, lru: list.New(), byDig: map[digest.Digest]*list.Element{}, decoding: map[digest.Digest]*decoding{}}
}

// claim returns the decoded frame d when it is cached. Otherwise it returns
// the decoding of d in progress, to wait for (mine false), or a new one
// that the caller must complete with finish (mine true).
func (f *FrameCache) claim(d digest.Digest) (frame []byte, dec *decoding, mine bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if el, ok := f.byDig[d]; ok {
		f.lru.MoveToFront(el)
		return el.Value.(*frameEntry).frame, nil, false
	}
	if dec, ok := f.decoding[d]; ok {
		return nil, dec, false
	}
	dec = &decoding{done: make(chan struct{})}
	f.decoding[d] = dec
	return nil, dec, true
}

// finish completes a decoding claimed with claim: a frame is kept (when it
// fits) and handed to the waiters, an error is handed to them.
func (f *FrameCache) finish(d digest.Digest, dec *decoding, frame []byte, err error) {
	if err == nil {
		f.put(d, frame)
	}
	f.mu.Lock()
	delete(f.decoding, d)
	f.mu.Unlock()
	dec.frame, dec.err = frame, err
	close(dec.done)
}

// get returns the decoded frame d. Callers must not modify it.
func (f *FrameCache) get(d digest.Digest) ([]byte, bool) {
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
	return el.Value.(*frameEntry).frame, true
}

func (f *FrameCache) put(d digest.Digest, frame []byte) {
	n := int64(len(frame))
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
		f.size -= int64(len(e.frame))
	}
	f.byDig[d] = f.lru.PushFront(&frameEntry{d, frame})
	f.size += n
}
