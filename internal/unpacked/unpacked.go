// Package unpacked keeps whole, decompressed copies of files of lazy layers
// on local disk, so the FUSE file system can hand them to the kernel (FUSE
// passthrough, Linux 6.9+) and reads of a file that is fully local never
// reach the daemon.
//
// A lazy layer's bytes live in the node chunk cache as compressed, verified
// frames; serving a read from there costs the daemon a chunk file read, a
// decompression and a FUSE round trip per request, which is what kept
// cached reads below overlayfs's speed (docs/snapshotter.md). A copy here
// is built once from those verified chunks and then read by the kernel
// like any file on the node's disk. The daemon keeps this store only
// without native lowers: with them, a layer's native copy holds the same
// files (internal/layerstore).
//
// Invariant: a copy is only ever built from chunks the chunk source
// verified, under a name derived from the digests of those chunks, and it is
// renamed into place only once complete. Copies are not verified again when
// opened, so the store starts empty on every Open: a copy left by an earlier
// process (torn by a crash, edited by hand) is never served. Rebuilding
// costs one decompression of chunks still in the chunk cache.
//
// The store is bounded: a build evicts least recently opened copies. A copy
// evicted while the kernel reads it stays readable (the kernel holds the
// file) and disappears with its last user.
package unpacked

import (
	"container/list"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/layerfmt"
)

// maxBuilds bounds the copies built at once: a build reads the chunk cache,
// decompresses and writes, all of which the workload needs too. A request
// beyond it is dropped; the next open of the file asks again.
const maxBuilds = 2

// Stats is a snapshot of the store's counters.
type Stats struct {
	Size     int64 // bytes of complete copies on disk
	MaxBytes int64
	Entries  int
	Hits     uint64 // Get calls that found a copy
	Builds   uint64 // copies completed
	Failed   uint64 // builds that failed (chunk missing, disk full, ...)
	Evicted  uint64
}

type entry struct {
	key  digest.Digest
	size int64
	elem *list.Element
}

// Store is safe for concurrent use. Several processes must not share one
// directory.
type Store struct {
	dir      string
	maxBytes int64
	ctx      context.Context // cancelled by Close
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	slots    chan struct{}

	mu       sync.Mutex
	entries  map[digest.Digest]*entry
	building map[digest.Digest]bool
	lru      *list.List // front: most recently opened
	size     int64      // complete copies
	reserved int64      // builds in progress
	closed   bool

	hits, builds, failed, evicted atomic.Uint64
}

// Open empties dir (see the package comment) and returns a store of at most
// maxBytes of copies in it.
func Open(dir string, maxBytes int64) (*Store, error) {
	if maxBytes <= 0 {
		return nil, fmt.Errorf("open unpacked file store %s: max size must be positive, got %d", dir, maxBytes)
	}
	// Copies of an earlier run are moved aside and deleted in the
	// background: a daemon restarting under running containers should
	// not wait for thousands of unlinks before it serves.
	stale, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".stale-")
	if err != nil {
		return nil, fmt.Errorf("open unpacked file store: %w", err)
	}
	if err := os.Rename(dir, filepath.Join(stale, "copies")); err != nil && !errors.Is(err, os.ErrNotExist) {
		os.Remove(stale)
		return nil, fmt.Errorf("open unpacked file store: move copies of an earlier run aside: %w", err)
	}
	leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), filepath.Base(dir)+".stale-*"))
	go func() {
		for _, d := range leftovers { // this run's, and any a crash left
			if err := os.RemoveAll(d); err != nil {
				log.L.WithError(err).WithField("dir", d).Warn("remove unpacked copies of an earlier run")
			}
		}
	}()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("open unpacked file store: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Store{
		dir:      dir,
		maxBytes: maxBytes,
		ctx:      ctx,
		cancel:   cancel,
		slots:    make(chan struct{}, maxBuilds),
		entries:  map[digest.Digest]*entry{},
		building: map[digest.Digest]bool{},
		lru:      list.New(),
	}, nil
}

// Key names the content of regular file idx of toc: a digest over its size
// and the chunks that hold it (each chunk is identified by its frame's
// digest and its place in the frame). Identical files in different layers
// converted alike share a key, and so one copy.
func Key(toc *layerfmt.TOC, idx int) digest.Digest {
	d := digest.Canonical.Digester()
	h := d.Hash()
	var b [8]byte
	put := func(v int64) {
		binary.LittleEndian.PutUint64(b[:], uint64(v))
		h.Write(b[:])
	}
	h.Write([]byte("envsnap unpacked file v1\x00"))
	put(toc.Size(idx))
	for k := range toc.NumChunks(idx) {
		c := toc.Chunk(idx, k)
		h.Write([]byte(c.Digest))
		put(c.FrameOffset)
		put(c.FileOffset)
		put(c.Size)
	}
	return d.Digest()
}

func (s *Store) path(key digest.Digest) string {
	return filepath.Join(s.dir, key.Encoded())
}

// Get opens the copy named key read-only, or reports that there is none.
func (s *Store) Get(key digest.Digest) (*os.File, bool) {
	s.mu.Lock()
	e, ok := s.entries[key]
	if ok {
		s.lru.MoveToFront(e.elem)
	}
	s.mu.Unlock()
	if !ok {
		return nil, false
	}
	f, err := os.Open(s.path(key))
	if err != nil {
		// Removed behind our back: forget it, a later open rebuilds it.
		s.mu.Lock()
		if cur, ok := s.entries[key]; ok && cur == e {
			s.removeLocked(e)
		}
		s.mu.Unlock()
		return nil, false
	}
	s.hits.Add(1)
	return f, true
}

// Build makes the copy named key, size bytes long, in the background from
// what write writes, unless it exists, is being built, the store is busy
// with other builds, or it cannot fit. write must write exactly the file's
// bytes, each verified, and honour ctx (cancelled by Close).
func (s *Store) Build(key digest.Digest, size int64, write func(ctx context.Context, w io.Writer) error) {
	if size > s.maxBytes || size < 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.building[key] || s.entries[key] != nil {
		return
	}
	select {
	case s.slots <- struct{}{}:
	default:
		return
	}
	if !s.makeRoomLocked(size) {
		<-s.slots
		return
	}
	s.building[key] = true
	s.reserved += size
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() { <-s.slots }()
		err := s.build(key, size, write)
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.building, key)
		s.reserved -= size
		if err != nil {
			s.failed.Add(1)
			if !errors.Is(err, context.Canceled) {
				log.G(s.ctx).WithError(err).WithField("key", key).Warn("unpacked copy not built; reads stay on the chunk path")
			}
			return
		}
		e := &entry{key: key, size: size}
		e.elem = s.lru.PushFront(e)
		s.entries[key] = e
		s.size += size
		s.builds.Add(1)
	}()
}

func (s *Store) build(key digest.Digest, size int64, write func(context.Context, io.Writer) error) (retErr error) {
	tmp, err := os.CreateTemp(s.dir, ".build-*")
	if err != nil {
		return fmt.Errorf("build unpacked copy %s: %w", key, err)
	}
	defer func() {
		tmp.Close()
		if retErr != nil {
			os.Remove(tmp.Name())
		}
	}()
	w := &limitedWriter{w: tmp, left: size}
	if err := write(s.ctx, w); err != nil {
		return fmt.Errorf("build unpacked copy %s: %w", key, err)
	}
	if w.left != 0 {
		return fmt.Errorf("build unpacked copy %s: got %d of %d bytes", key, size-w.left, size)
	}
	if err := tmp.Chmod(0o400); err != nil {
		return fmt.Errorf("build unpacked copy %s: %w", key, err)
	}
	if err := os.Rename(tmp.Name(), s.path(key)); err != nil {
		return fmt.Errorf("build unpacked copy %s: %w", key, err)
	}
	return nil
}

// limitedWriter refuses to write more than the file's size: a writer that
// produced more would otherwise leave a copy of the wrong length.
type limitedWriter struct {
	w    io.Writer
	left int64
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.left {
		return 0, fmt.Errorf("write past the file's end (%d bytes left, %d written)", l.left, len(p))
	}
	n, err := l.w.Write(p)
	l.left -= int64(n)
	return n, err
}

// makeRoomLocked evicts least recently opened copies until n more bytes fit.
func (s *Store) makeRoomLocked(n int64) bool {
	for s.size+s.reserved+n > s.maxBytes {
		back := s.lru.Back()
		if back == nil {
			return false
		}
		s.removeLocked(back.Value.(*entry))
		s.evicted.Add(1)
	}
	return true
}

func (s *Store) removeLocked(e *entry) {
	s.lru.Remove(e.elem)
	delete(s.entries, e.key)
	s.size -= e.size
	// An open descriptor (ours or the kernel's) keeps the bytes readable.
	if err := os.Remove(s.path(e.key)); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.G(s.ctx).WithError(err).WithField("key", e.key).Warn("remove unpacked copy")
	}
}

// Wait blocks until the builds in progress have finished (tests).
func (s *Store) Wait() { s.wg.Wait() }

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Stats{
		Size:     s.size,
		MaxBytes: s.maxBytes,
		Entries:  len(s.entries),
		Hits:     s.hits.Load(),
		Builds:   s.builds.Load(),
		Failed:   s.failed.Load(),
		Evicted:  s.evicted.Load(),
	}
}

// Close cancels the builds in progress and waits for them. Copies stay on
// disk for readers that hold them; the next Open removes them.
func (s *Store) Close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
}
