package lazyfs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/log"
	"github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/layerfmt"
)

// maxParallelChunks bounds the concurrent ReadChunk calls of one FUSE read.
// A read is at most maxRequest bytes, so with the default 1 MiB chunks it
// touches one or two chunks; small chunk sizes are where this matters.
const maxParallelChunks = 8

var errTimeout = errors.New("read timeout expired")

// failLogInterval bounds read-failure logging per mount: when a registry
// is down every container reading the layer fails every read, and one
// line per failure would bury everything else. Every failure is counted
// in Stats/metrics regardless.
const failLogInterval = time.Second

// logLimiter lets one event through per interval and counts the rest.
type logLimiter struct {
	mu         sync.Mutex
	last       time.Time
	suppressed int
}

// allow reports whether to log now, and how many events were dropped
// since the last one logged.
func (r *logLimiter) allow(now time.Time) (int, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.last.IsZero() && now.Sub(r.last) < failLogInterval {
		r.suppressed++
		return 0, false
	}
	n := r.suppressed
	r.last, r.suppressed = now, 0
	return n, true
}

// read fills dest with the bytes of regular file idx at off. It returns the
// number of bytes (short only at EOF) or EIO; it never returns bytes it has
// not received from the chunk source for exactly the chunk that holds them.
// spill, when not nil, receives the bytes of those chunks outside the read
// (at their file offsets), which the source had to produce anyway, with
// the release of the chunk, which it must call when it is done with them.
func (l *layer) read(dest []byte, off int64, idx int, spill spillFunc) (int, syscall.Errno) {
	if off < 0 {
		return 0, syscall.EINVAL
	}
	size := l.toc.Size(idx)
	if off >= size || len(dest) == 0 {
		return 0, 0
	}
	end := min(off+int64(len(dest)), size)

	chunks, err := l.covering(idx, off, end)
	if err == nil {
		err = l.fetchInto(dest, off, end, chunks, spill)
	}
	if err != nil {
		l.stats.readErrors.Add(1)
		if errors.Is(err, errTimeout) {
			l.stats.readTimeouts.Add(1)
		}
		if suppressed, ok := l.failLog.allow(time.Now()); ok {
			log.G(l.ctx).WithError(err).WithFields(log.Fields{
				"path":       l.toc.Name(idx),
				"offset":     off,
				"length":     end - off,
				"suppressed": suppressed,
			}).Error("lazyfs: read failed, returning EIO")
		}
		return 0, syscall.EIO
	}
	return int(end - off), 0
}

// covering returns the chunks of file idx that hold [off, end), checking
// that they tile the range without gaps: a TOC that does not cover a byte
// yields an error, never zeros.
func (l *layer) covering(idx int, off, end int64) ([]layerfmt.Chunk, error) {
	first := l.toc.ChunkAt(idx, off)
	if first < 0 {
		return nil, fmt.Errorf("no chunk holds offset %d of %d-byte file", off, l.toc.Size(idx))
	}
	n := l.toc.NumChunks(idx)
	var out []layerfmt.Chunk
	for k, pos := first, off; pos < end; k++ {
		if k >= n {
			return nil, fmt.Errorf("chunks of file end before offset %d", pos)
		}
		c := l.toc.Chunk(idx, k)
		if c.Size <= 0 || c.FileOffset > pos || c.FileOffset+c.Size <= pos {
			return nil, fmt.Errorf("chunk %d (file offset %d size %d) does not continue at offset %d", k, c.FileOffset, c.Size, pos)
		}
		out = append(out, c)
		pos = c.FileOffset + c.Size
	}
	return out, nil
}

// spilled are bytes of a file at off that a read did not ask for.
type spilled struct {
	off int64
	b   []byte
}

// spillFunc takes the parts of a chunk outside a read and the chunk's
// release.
type spillFunc func(parts []spilled, release func())

// fetchInto reads chunks (concurrently when there are several) and copies
// the window [off, end) of the file into dest, all within one read timeout.
func (l *layer) fetchInto(dest []byte, off, end int64, chunks []layerfmt.Chunk, spill spillFunc) error {
	ctx, cancel := context.WithTimeout(l.ctx, l.opts.readTimeout)
	defer cancel()

	// place copies c's part of the read into dest and hands the rest,
	// and the duty to release c, to spill.
	place := func(c layerfmt.Chunk, data []byte, release func()) {
		lo := max(off, c.FileOffset)
		hi := min(end, c.FileOffset+c.Size)
		copy(dest[lo-off:hi-off], data[lo-c.FileOffset:hi-c.FileOffset])
		var parts []spilled
		if spill != nil && lo > c.FileOffset {
			parts = append(parts, spilled{c.FileOffset, data[:lo-c.FileOffset]})
		}
		if spill != nil && hi < c.FileOffset+c.Size {
			parts = append(parts, spilled{hi, data[hi-c.FileOffset:]})
		}
		if len(parts) == 0 {
			release()
			return
		}
		spill(parts, release)
	}
	if len(chunks) == 1 {
		data, release, err := l.fetch(ctx, chunks[0])
		if err != nil {
			return err
		}
		place(chunks[0], data, release)
		return nil
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(maxParallelChunks)
	for _, c := range chunks {
		g.Go(func() error {
			data, release, err := l.fetch(gctx, c)
			if err != nil {
				return err
			}
			// Chunks write disjoint windows of dest.
			place(c, data, release)
			return nil
		})
	}
	return g.Wait()
}

// fetch calls the chunk source and checks what it returned has the size
// the TOC promises. The source runs in its own goroutine so that a source
// that ignores ctx still cannot hold the reader past the timeout; its late
// result is released unread. The caller must call release after a
// successful fetch.
func (l *layer) fetch(ctx context.Context, c layerfmt.Chunk) (data []byte, release func(), err error) {
	type result struct {
		data    []byte
		release func()
		err     error
	}
	// Unbuffered: after the reader gives up (abandoned), the result can
	// only go to the release below, never into a channel nobody reads.
	ch := make(chan result)
	abandoned := make(chan struct{})
	l.stats.chunkReads.Add(1)
	go func() {
		defer func() {
			// A panicking source must not take the daemon (and every
			// container using its mounts) down.
			if r := recover(); r != nil {
				select {
				case ch <- result{err: fmt.Errorf("chunk source panicked: %v", r)}:
				case <-abandoned:
				}
			}
		}()
		data, release, err := l.src.ReadChunk(ctx, c)
		if err == nil && release == nil {
			release = func() {}
		}
		select {
		case ch <- result{data, release, err}:
		case <-abandoned:
			if err == nil {
				release()
			}
		}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, nil, fmt.Errorf("read chunk %s at blob offset %d: %w", c.Digest, c.Offset, r.err)
		}
		if int64(len(r.data)) != c.Size {
			r.release()
			return nil, nil, fmt.Errorf("read chunk %s at blob offset %d: got %d bytes, TOC says %d", c.Digest, c.Offset, len(r.data), c.Size)
		}
		l.stats.chunkBytes.Add(uint64(len(r.data)))
		return r.data, r.release, nil
	case <-ctx.Done():
		close(abandoned) // the source's result, if it comes, is released unread
		err := ctx.Err()
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("%w after %s", errTimeout, l.opts.readTimeout)
		}
		return nil, nil, fmt.Errorf("read chunk %s at blob offset %d: %w", c.Digest, c.Offset, err)
	}
}

// pageSize is the unit of the kernel page cache: only whole pages can be
// stored into it.
const pageSize = 4096

// maxCacheStores bounds the page-cache stores in flight per mount; past it
// a spill is dropped (it is only an optimisation).
const maxCacheStores = 8

// cacheStorer pushes the parts of decoded chunks a read did not ask for
// into the kernel page cache (FUSE_NOTIFY_STORE). A random 128 KiB reader
// of a file with 1 MiB chunks otherwise makes the daemon read, verify and
// decompress the same chunk up to 8 times; with the store, the kernel
// serves the other 7 reads itself. The bytes are the chunk source's
// verified output, and the layer is immutable, so the stored pages are as
// good as pages the kernel read.
type cacheStorer struct {
	slots chan struct{}
}

func newCacheStorer() *cacheStorer {
	return &cacheStorer{slots: make(chan struct{}, maxCacheStores)}
}

// store hands parts (file bytes at their offsets) to the kernel
// asynchronously, then calls release: the store waits for any page of the
// range the kernel holds locked, and pages of the read being answered stay
// locked until its reply is written, after the caller returns.
func (s *cacheStorer) store(ino *fs.Inode, parts []spilled, fileSize int64, release func()) {
	var whole []spilled
	for _, p := range parts {
		off, b := p.off, p.b
		// Whole pages only, except the file's last page.
		if r := off % pageSize; r != 0 {
			skip := pageSize - r
			if int64(len(b)) <= skip {
				continue
			}
			off, b = off+skip, b[skip:]
		}
		if end := off + int64(len(b)); end < fileSize {
			b = b[:len(b)-int(end%pageSize)]
		}
		if len(b) > 0 {
			whole = append(whole, spilled{off, b})
		}
	}
	if len(whole) == 0 {
		release()
		return
	}
	select {
	case s.slots <- struct{}{}:
	default:
		release()
		return
	}
	go func() {
		defer func() {
			release()
			<-s.slots
		}()
		for _, p := range whole {
			// Errors are harmless: the kernel reads the pages on demand.
			_ = ino.WriteCache(p.off, p.b)
		}
	}()
}
