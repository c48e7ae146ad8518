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
type FrameCache struct {
	mu    sync.Mutex
	max   int64
	size  int64
	lru   *list.List // of *frameEntry, front = most recent
	byDig map[digest.Digest]*list.Element
}

type frameEntry struct {
	d     digest.Digest
	frame []byte
}

// NewFrameCache returns a cache of at most max bytes of decoded frames.
func NewFrameCache(max int64) *FrameCache {
	return &FrameCache{max: max, lru: list.New(), byDig: map[digest.Digest]*list.Element{}}
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
