package fetch

import (
	"context"
	"fmt"
	"sync"

	"github.com/containerd/log"

	"github.com/envsnap/envsnap/layerfmt"
)

// maxSeqFiles bounds the files whose sequential reads a Layer tracks at
// once; past it the table starts again (a reader of many files at once
// is not the one read-ahead windows help).
const maxSeqFiles = 64

// seqRead is the read-ahead state of one file being read sequentially,
// after the kernel's file_ra_state: a window of the file's following
// chunks is fetched asynchronously when the reader reaches the start of
// the previous window, and windows double up to the cap.
type seqRead struct {
	last    int64 // blob offset of the last chunk read
	next    int64 // blob offset the next window starts at
	trigger int64 // a read at or past it issues the next window
	window  int64 // compressed bytes of the next window
}

type seqTable struct {
	mu    sync.Mutex
	files map[int32]*seqRead // by TOC entry
}

// sequential notes a read of span j and, when the reads of its file have
// been sequential up to the trigger, starts fetching the file's next
// window in the background. A miss alone fetches the requested chunk and
// DefaultReadAhead after it (planLocked) and waits for all of it: one
// round trip, verification and cache write per 1-2 MiB of a large file,
// in series with the reader. The windows keep a fetch in flight ahead of
// the reader instead.
func (l *Layer) sequential(j int) {
	if l.o.seqReadAhead <= 0 || l.o.readAhead <= 0 || (l.blob.RangeIgnored() && l.blob.Size() <= l.o.wholeBlobMax) {
		return
	}
	s := l.spans[j]
	t := &l.seq
	t.mu.Lock()
	if t.files == nil || len(t.files) >= maxSeqFiles {
		t.files = map[int32]*seqRead{}
	}
	st := t.files[s.entry]
	// FUSE may deliver a few reads out of order (asynchronous
	// read-ahead requests run in parallel): only a jump resets.
	if st == nil || s.off > st.next+l.o.maxGap || s.off+2*st.window < st.last {
		// A first read, or a jump: what the miss fetches (read-ahead
		// included) is the first window; reaching its end is sequential.
		end := s.off + s.csize + l.o.readAhead
		t.files[s.entry] = &seqRead{last: s.off, next: end, trigger: s.off + l.o.readAhead, window: min(2*l.o.readAhead, l.o.seqReadAhead)}
		t.mu.Unlock()
		return
	}
	st.last = max(st.last, s.off)
	if s.off < st.trigger {
		t.mu.Unlock()
		return
	}
	from, window := st.next, st.window
	idx, end := l.windowAfter(int(s.entry), from, window)
	st.trigger, st.next = from, max(end, from)
	st.window = min(2*window, l.o.seqReadAhead)
	t.mu.Unlock()
	if len(idx) == 0 {
		return
	}
	l.goBackground(func() {
		if err := l.fetchSpans(l.ctx, idx, "read", nil); err != nil && l.ctx.Err() == nil {
			// Readers of these chunks fetch them on demand.
			log.G(context.Background()).WithError(err).WithField("layer", l.label).Debug("sequential read-ahead failed")
		}
	})
}

// windowAfter returns the canonical spans of entry from blob offset from
// on, up to window compressed bytes, and the blob offset where they end.
// fetchSpans skips the ones cached or in flight by the time it runs.
func (l *Layer) windowAfter(entry int, from, window int64) ([]int, int64) {
	n := l.toc.NumChunks(entry)
	var idx []int
	end := from
	for x := range n {
		c := l.toc.Chunk(entry, x)
		if c.Offset < from {
			continue
		}
		if c.Offset+c.CompressedSize-from > window && len(idx) > 0 {
			break
		}
		end = c.Offset + c.CompressedSize
		// Chunks identical to earlier ones are fetched with those.
		if j := l.find(c); j >= 0 && l.canonical(j) == j && (len(idx) == 0 || idx[len(idx)-1] < j) {
			idx = append(idx, j)
		}
	}
	return idx, end
}

// aheadTable is the decode-ahead state of the files being read, by TOC
// entry.
type aheadTable struct {
	mu    sync.Mutex
	files map[int32]*aheadRead
}

type aheadRead struct {
	last  int32 // chunk index of the last chunk read
	ahead int32 // chunks up to it are decoded ahead, or being
}

// errAheadFailed is what readers waiting on a decoding ahead of them see
// when it failed: they try themselves (ReadChunk), with their own
// deadline and their own error.
var errAheadFailed = fmt.Errorf("decoding ahead of the reader failed: %w", context.Canceled)

// decodeAhead notes a read of span j and, when it continues the previous
// read of its file (chunk k after chunk k-1), fetches and decodes the
// file's chunks up to k+decodeAhead in the background into the frame
// cache. A large file mapped and faulted in (an executable's loader)
// reaches the daemon as one FUSE read per frame, one at a time: the rest
// of each frame is stored into the page cache with the reply, so the next
// fault is on the next frame. Each read used to wait for its own request
// and decompression in turn; ahead, the next frames' requests are in
// flight and their decompression runs on the other core while the reader
// copies this one. At most decodeAhead frames past where the reader stops
// are fetched and decoded for nothing.
func (l *Layer) decodeAhead(j int) {
	n := int32(l.o.decodeAhead)
	s := l.spans[j]
	c := l.chunk(j)
	// Frames decoded ahead must not push the ones being read out of the
	// cache.
	if n <= 0 || l.frames.max < int64(n+2)*c.FrameSize {
		return
	}
	t := &l.ahead
	t.mu.Lock()
	if t.files == nil || len(t.files) >= maxSeqFiles {
		t.files = map[int32]*aheadRead{}
	}
	st := t.files[s.entry]
	switch {
	case st == nil:
		t.files[s.entry] = &aheadRead{last: s.k, ahead: s.k}
		t.mu.Unlock()
		return
	case s.k == st.last || (s.k < st.last && s.k >= st.last-n):
		// The same chunk again (the kernel reads a frame in pieces), or
		// a piece of the kernel's readahead arriving late.
		t.mu.Unlock()
		return
	case s.k != st.last+1:
		st.last, st.ahead = s.k, s.k // a jump: not sequential (yet)
		t.mu.Unlock()
		return
	}
	st.last = s.k
	from, to := max(st.ahead, s.k)+1, min(s.k+n, int32(l.toc.NumChunks(int(s.entry)))-1)
	st.ahead = max(st.ahead, to)
	t.mu.Unlock()
	for k := from; k <= to; k++ {
		c := l.toc.Chunk(int(s.entry), int(k))
		if !l.goBackground(func() { l.readAhead(c) }) {
			return
		}
	}
}

// readAhead decodes chunk c's frame into the frame cache unless it is
// there or being decoded.
func (l *Layer) readAhead(c layerfmt.Chunk) {
	fr, dec, mine := l.frames.claim(c.Digest)
	switch {
	case fr != nil:
		fr.release()
		return
	case !mine:
		l.frames.abandon(dec)
		return
	}
	ctx, cancel := context.WithTimeout(l.ctx, l.o.readTimeout)
	defer cancel()
	fr, err := l.readFrame(ctx, c)
	if err != nil {
		if l.ctx.Err() == nil {
			log.G(ctx).WithError(err).WithField("layer", l.label).Debug("decoding ahead failed")
		}
		err = errAheadFailed
	}
	l.frames.finish(c.Digest, dec, fr, err)
	if err == nil {
		fr.release()
	}
}
