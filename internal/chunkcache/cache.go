// Package chunkcache is the node-wide, on-disk cache of compressed layer
// chunks, shared by every lazy layer mounted on the node.
//
// Entries are content addressed by the digest of the bytes they hold, so a
// chunk that occurs in several layers (or several times in one layer) is
// stored once. The main invariant: Get never returns bytes that do not match
// the digest asked for. Files are written to a temporary name and renamed into
// place, and Get verifies the content on every read, so a torn write after a
// crash, a bit flip or a file edited by hand is dropped and reported as a miss
// instead of being served.
//
// The cache is bounded: Put evicts least recently used entries that are not
// pinned. The bound may be shared with a tenant (the native layer copies),
// whose bytes are charged to it (Charge) and which is asked to give room
// back before any chunk is evicted (SetTenant). Layers pin the chunks they consist of while they are mounted, so a
// fully filled layer keeps working without the network. When nothing can be
// evicted, or the file system is full, Put fails with ErrFull and callers serve
// the bytes without caching them; later Puts try again, so the cache recovers
// by itself once space returns.
//
// The index is rebuilt from the directory on Open, so the cache survives
// daemon restarts; last-use order is approximated by file modification times,
// which Get refreshes at most once per touchInterval.
package chunkcache

import (
	"container/list"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// ErrFull is returned by Put when the entry cannot be stored: the size bound
// is reached and every remaining entry is pinned, the entry alone is larger
// than the bound, or the file system has no space left.
var ErrFull = errors.New("chunk cache full")

const (
	tmpDirName = "tmp"
	// touchInterval bounds how often a hit rewrites a file's mtime: the LRU
	// order only needs to survive a restart approximately, and a utimes
	// syscall per read of a hot chunk would be wasted work.
	touchInterval = time.Minute
)

// Stats is a snapshot of the cache counters.
type Stats struct {
	Size      int64 // bytes of chunk data on disk
	MaxBytes  int64
	Entries   int
	Pinned    int // entries currently pinned by at least one owner
	Hits      uint64
	Misses    uint64
	Evictions uint64
	Corrupt   uint64 // entries dropped because their content did not match
	PutErrors uint64 // Puts that failed (full, ENOSPC, I/O errors)
	Charged   int64  // bytes of the tenant counted against MaxBytes
}

// Tenant shares the cache's bound (Charge). When a Put needs room, the
// cache first asks the tenant to free want bytes, and evicts chunks only
// for what Reclaim could not free. Reclaim is called without the cache's
// lock held, and gives its bytes back through Discharge.
type Tenant interface {
	Reclaim(want int64) (freed int64)
}

type entry struct {
	d       digest.Digest
	size    int64
	touched time.Time
	elem    *list.Element
}

// Cache is safe for concurrent use by multiple goroutines. Several processes
// must not share one directory.
type Cache struct {
	dir      string
	maxBytes int64

	mu       sync.Mutex
	entries  map[digest.Digest]*entry
	lru      *list.List // front: most recently used
	size     int64      // committed entries
	reserved int64      // bytes of Puts in progress
	charged  int64      // the tenant's bytes
	tenant   Tenant
	pins     map[digest.Digest]int
	owners   map[string][]digest.Digest
	stats    Stats

	prefetchSlots chan struct{}
}

// Open opens (creating if needed) the cache rooted at dir, bounded to
// maxBytes of chunk data. Leftover temporary files of an interrupted Put are
// removed, and the index is rebuilt from the files present. If the directory
// already holds more than maxBytes (the bound was lowered), the oldest entries
// are evicted.
func Open(dir string, maxBytes int64) (*Cache, error) {
	if maxBytes <= 0 {
		return nil, fmt.Errorf("open chunk cache %s: max size must be positive, got %d", dir, maxBytes)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("open chunk cache: %w", err)
	}
	tmp := filepath.Join(dir, tmpDirName)
	if err := os.RemoveAll(tmp); err != nil {
		return nil, fmt.Errorf("open chunk cache: clean temporary files: %w", err)
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("open chunk cache: %w", err)
	}
	c := &Cache{
		dir:      dir,
		maxBytes: maxBytes,
		entries:  map[digest.Digest]*entry{},
		lru:      list.New(),
		pins:     map[digest.Digest]int{},
		owners:   map[string][]digest.Digest{},

		prefetchSlots: make(chan struct{}, maxPrefetch),
	}
	if err := c.load(); err != nil {
		return nil, fmt.Errorf("open chunk cache %s: %w", dir, err)
	}
	c.mu.Lock()
	c.evictLocked(0)
	c.mu.Unlock()
	return c, nil
}

// load walks <dir>/<algorithm>/<xx>/<encoded> and indexes every file whose
// name is a valid digest. Content is not verified here (that would read the
// whole cache at start-up); Get verifies lazily.
func (c *Cache) load() error {
	var found []*entry
	err := filepath.WalkDir(c.dir, func(path string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if de.IsDir() {
			if path != c.dir && de.Name() == tmpDirName && filepath.Dir(path) == c.dir {
				return filepath.SkipDir
			}
			return nil
		}
		rel, err := filepath.Rel(c.dir, path)
		if err != nil {
			return err
		}
		parts := strings.Split(filepath.ToSlash(rel), "/")
		if len(parts) != 3 {
			return nil
		}
		d := digest.NewDigestFromEncoded(digest.Algorithm(parts[0]), parts[2])
		if d.Validate() != nil || len(parts[2]) < 2 || parts[1] != parts[2][:2] {
			return nil
		}
		info, err := de.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		found = append(found, &entry{d: d, size: info.Size(), touched: info.ModTime()})
		return nil
	})
	if err != nil {
		return fmt.Errorf("rebuild index: %w", err)
	}
	// Oldest first, so that pushing each to the front leaves the most
	// recently used at the front.
	sort.Slice(found, func(i, j int) bool { return found[i].touched.Before(found[j].touched) })
	for _, e := range found {
		e.elem = c.lru.PushFront(e)
		c.entries[e.d] = e
		c.size += e.size
	}
	return nil
}

func (c *Cache) path(d digest.Digest) string { return entryPath(c.dir, d) }

func entryPath(dir string, d digest.Digest) string {
	enc := d.Encoded()
	return filepath.Join(dir, d.Algorithm().String(), enc[:2], enc)
}

// Reader reads the entries of a cache that another process has open: a
// helper the daemon starts (the native layer builder) reads chunks it
// was told are there. Get verifies as Cache.Get does; it neither keeps
// an index nor touches or removes a file: the owner does.
type Reader struct{ dir string }

// NewReader returns a Reader of the cache rooted at dir.
func NewReader(dir string) Reader { return Reader{dir: dir} }

// Get returns the bytes stored under d, or false when there are none
// or they do not match d.
func (r Reader) Get(d digest.Digest) ([]byte, bool) {
	if d.Validate() != nil {
		return nil, false
	}
	b, err := os.ReadFile(entryPath(r.dir, d))
	if err != nil || d.Algorithm().FromBytes(b) != d {
		return nil, false
	}
	return b, true
}

// Contains reports whether d is indexed, without reading or verifying it.
func (c *Cache) Contains(d digest.Digest) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.entries[d]
	return ok
}

// Get returns the bytes stored under d. The content is verified against d; a
// file that does not match is removed and reported as a miss.
func (c *Cache) Get(d digest.Digest) ([]byte, bool) {
	if d.Validate() != nil {
		return nil, false
	}
	c.mu.Lock()
	e, ok := c.entries[d]
	if !ok {
		c.stats.Misses++
		c.mu.Unlock()
		return nil, false
	}
	c.lru.MoveToFront(e.elem)
	touch := time.Since(e.touched) > touchInterval
	if touch {
		e.touched = time.Now()
	}
	c.mu.Unlock()

	b, err := os.ReadFile(c.path(d))
	if err == nil && d.Algorithm().FromBytes(b) == d {
		c.mu.Lock()
		c.stats.Hits++
		c.mu.Unlock()
		if touch {
			now := time.Now()
			// Best effort: only the restart order depends on it.
			_ = os.Chtimes(c.path(d), now, now)
		}
		return b, true
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	c.stats.Misses++
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		// Wrong content or unreadable: never serve it, drop it so the next
		// Put stores a good copy.
		c.stats.Corrupt++
	}
	if cur, ok := c.entries[d]; ok && cur == e {
		c.removeLocked(e)
	}
	return nil, false
}

// maxPrefetch bounds the Prefetch goroutines in flight; past it a
// prefetch is dropped (it is only a hint).
const maxPrefetch = 4

// Prefetch asks the kernel to start reading the files of the cached
// entries among ds (readahead), without waiting: a sequential reader's next
// Gets then find them in memory instead of reading 1 MiB files from disk
// one at a time. Best effort: unknown digests are skipped, errors ignored.
func (c *Cache) Prefetch(ds []digest.Digest) {
	c.mu.Lock()
	paths := make([]string, 0, len(ds))
	for _, d := range ds {
		if _, ok := c.entries[d]; ok {
			paths = append(paths, c.path(d))
		}
	}
	c.mu.Unlock()
	if len(paths) == 0 {
		return
	}
	select {
	case c.prefetchSlots <- struct{}{}:
	default:
		return
	}
	go func() {
		defer func() { <-c.prefetchSlots }()
		for _, p := range paths {
			f, err := os.Open(p)
			if err != nil {
				continue
			}
			_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_WILLNEED)
			f.Close()
		}
	}()
}

// Put stores b under d. b must hash to d (Put verifies it: the cache never
// holds bytes that do not match their name). Storing an existing digest only
// marks it as used. Put returns an error wrapping ErrFull when the entry does
// not fit; the caller keeps serving b without caching it.
func (c *Cache) Put(d digest.Digest, b []byte) error {
	if err := d.Validate(); err != nil {
		return fmt.Errorf("cache put %s: %w", d, err)
	}
	if got := d.Algorithm().FromBytes(b); got != d {
		return fmt.Errorf("cache put %s: content has digest %s", d, got)
	}
	return c.put(d, b)
}

// PutVerified is Put for bytes the caller has just hashed to d itself (the
// fetcher checks every frame on arrival): hashing them again here was a
// third of the CPU a background fill spent per byte. Passing bytes that do
// not match d breaks the cache's invariant; Get would still catch them.
func (c *Cache) PutVerified(d digest.Digest, b []byte) error {
	if err := d.Validate(); err != nil {
		return fmt.Errorf("cache put %s: %w", d, err)
	}
	return c.put(d, b)
}

func (c *Cache) put(d digest.Digest, b []byte) error {
	n := int64(len(b))

	c.mu.Lock()
	if e, ok := c.entries[d]; ok {
		c.lru.MoveToFront(e.elem)
		c.mu.Unlock()
		return nil
	}
	if over := c.size + c.reserved + c.charged + n - c.maxBytes; over > 0 && c.tenant != nil {
		t := c.tenant
		c.mu.Unlock()
		t.Reclaim(over)
		c.mu.Lock()
	}
	if !c.evictLocked(n) {
		c.stats.PutErrors++
		c.mu.Unlock()
		return fmt.Errorf("cache put %s (%d bytes, %d/%d used): %w", d, n, c.size, c.maxBytes, ErrFull)
	}
	c.reserved += n
	c.mu.Unlock()

	err := c.write(d, b)
	if err != nil && errors.Is(err, syscall.ENOSPC) {
		// The file system is smaller than the bound (or shared): give back
		// space of our own unpinned entries and try once more.
		c.mu.Lock()
		freed := c.evictBytesLocked(n)
		c.mu.Unlock()
		if freed > 0 {
			err = c.write(d, b)
		}
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	c.reserved -= n
	if err != nil {
		c.stats.PutErrors++
		if errors.Is(err, syscall.ENOSPC) {
			return fmt.Errorf("cache put %s: %w: %w", d, ErrFull, err)
		}
		return fmt.Errorf("cache put %s: %w", d, err)
	}
	if e, ok := c.entries[d]; ok {
		// A concurrent Put of the same digest won; same bytes, same file.
		c.lru.MoveToFront(e.elem)
		return nil
	}
	e := &entry{d: d, size: n, touched: time.Now()}
	e.elem = c.lru.PushFront(e)
	c.entries[d] = e
	c.size += n
	return nil
}

func (c *Cache) write(d digest.Digest, b []byte) error {
	final := c.path(d)
	if err := os.MkdirAll(filepath.Dir(final), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Join(c.dir, tmpDirName), "put-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(b)
	// No fsync: a torn file after a crash is caught by the verification in
	// Get, and syncing every chunk would cost more than refetching the few
	// chunks a crash can lose.
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}

// evictLocked makes room for n more bytes within the bound, evicting unpinned
// entries from the least recently used end. It reports whether n fits.
func (c *Cache) evictLocked(n int64) bool {
	if n > c.maxBytes {
		return false
	}
	over := c.size + c.reserved + c.charged + n - c.maxBytes
	if over <= 0 {
		return true
	}
	return c.evictBytesLocked(over) >= over
}

// SetTenant makes t the cache's tenant (see Tenant).
func (c *Cache) SetTenant(t Tenant) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tenant = t
}

// Charge counts n bytes of the tenant against the bound, evicting
// unpinned chunks if they do not fit otherwise. It fails with ErrFull,
// charging nothing, when they cannot fit.
func (c *Cache) Charge(n int64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n < 0 {
		return fmt.Errorf("charge %d bytes: negative", n)
	}
	if !c.evictLocked(n) {
		return fmt.Errorf("charge %d bytes (%d chunks, %d charged, bound %d): %w", n, c.size, c.charged, c.maxBytes, ErrFull)
	}
	c.charged += n
	return nil
}

// Discharge gives back n bytes charged before.
func (c *Cache) Discharge(n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.charged = max(0, c.charged-n)
}

// evictBytesLocked evicts unpinned entries, oldest first, until at least want
// bytes are freed or none are left; it returns the bytes freed.
func (c *Cache) evictBytesLocked(want int64) int64 {
	var freed int64
	for el := c.lru.Back(); el != nil && freed < want; {
		prev := el.Prev()
		e := el.Value.(*entry)
		if c.pins[e.d] == 0 {
			c.removeLocked(e)
			c.stats.Evictions++
			freed += e.size
		}
		el = prev
	}
	return freed
}

func (c *Cache) removeLocked(e *entry) {
	c.lru.Remove(e.elem)
	delete(c.entries, e.d)
	c.size -= e.size
	// A reader that already opened the file keeps its descriptor; removal
	// only unlinks the name.
	_ = os.Remove(c.path(e.d))
}

// Pin protects ds from eviction until Unpin(owner). Digests need not be
// cached yet: they are protected once they arrive. Pinning again with the
// same owner replaces its set.
func (c *Cache) Pin(owner string, ds []digest.Digest) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.unpinLocked(owner)
	set := make([]digest.Digest, 0, len(ds))
	seen := make(map[digest.Digest]struct{}, len(ds))
	for _, d := range ds {
		if _, dup := seen[d]; dup {
			continue
		}
		seen[d] = struct{}{}
		set = append(set, d)
		c.pins[d]++
	}
	c.owners[owner] = set
}

// Unpin releases the pins taken by owner.
func (c *Cache) Unpin(owner string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.unpinLocked(owner)
}

func (c *Cache) unpinLocked(owner string) {
	for _, d := range c.owners[owner] {
		if c.pins[d]--; c.pins[d] <= 0 {
			delete(c.pins, d)
		}
	}
	delete(c.owners, owner)
}

// Stats returns a snapshot of the counters.
func (c *Cache) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.stats
	s.Size = c.size
	s.MaxBytes = c.maxBytes
	s.Charged = c.charged
	s.Entries = len(c.entries)
	for d := range c.pins {
		if _, ok := c.entries[d]; ok {
			s.Pinned++
		}
	}
	return s
}

// Dir returns the cache's root directory.
func (c *Cache) Dir() string { return c.dir }
