//go:build linux

package native

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/idleprio"
	"github.com/envsnap/envsnap/layerfmt"
)

// Defaults, all in one place.
const (
	// maxBuilds bounds the copies built at once: a build reads the chunk
	// cache, decompresses and writes the whole layer, which the node's
	// containers need the CPU and disk for too.
	maxBuilds = 1
	// inUseTTL bounds how often Reclaim asks which copies are in use (a
	// walk of the snapshot metadata and of mountinfo): a full cache calls
	// Reclaim on every Put.
	inUseTTL = time.Second
	// markerVersion changes whenever BuildTree makes a different tree
	// from the same layer, so copies of an older builder are not used.
	markerVersion = 1
	tmpDirName    = "tmp"
)

// Budget is the byte bound the copies share with the chunk cache
// (chunkcache.Cache): Charge fails when n more bytes do not fit even after
// evicting unpinned chunks.
type Budget interface {
	Charge(n int64) error
	Discharge(n int64)
}

// InUse reports the layers whose copies some snapshot may still use: a
// copy handed out as an overlay lower directory is referenced by path
// until no mount and no active snapshot uses it.
type InUse func(ctx context.Context) (map[digest.Digest]bool, error)

// marker is written beside a complete copy, after it is renamed into
// place and synced: a copy without one (a crash mid-build) is never used.
type marker struct {
	Version int           `json:"version"`
	Layer   digest.Digest `json:"layer"`
	Size    int64         `json:"size"`
}

// Stats is a snapshot of the store's counters.
type Stats struct {
	Copies int    `json:"copies"`
	Size   int64  `json:"size"` // bytes charged to the budget
	Builds uint64 `json:"builds"`
	// ProcessBuilds counts the builds that ran in a process of their
	// own (SetBuildCommand), failed ones included.
	ProcessBuilds uint64 `json:"process_builds"`
	Failed        uint64 `json:"failed"` // builds that failed (missing or corrupt chunk, disk)
	Skipped       uint64 `json:"skipped"`
	Reclaimed     uint64 `json:"reclaimed"` // copies dropped to make room
}

type entry struct {
	size     int64
	lastUsed time.Time
}

// Store is the set of native layer copies of a node, under one
// directory: <dir>/<alg>/<hex> is the copy of layer <alg>:<hex>, and
// <dir>/<alg>/<hex>.complete its marker. Safe for concurrent use.
type Store struct {
	dir    string
	budget Budget
	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
	slots  chan struct{}

	mu       sync.Mutex
	command  []string // the helper that builds trees; nil builds them in this process
	copies   map[digest.Digest]*entry
	building map[digest.Digest]bool
	inUse    InUse
	inUseAt  time.Time
	inUseMap map[digest.Digest]bool
	closed   bool

	builds, processBuilds, failed, skipped, reclaimed atomic.Uint64
}

// Open opens the copies under dir, charging each complete one to budget;
// incomplete ones and what a crashed build left are removed.
func Open(ctx context.Context, dir string, budget Budget) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("open native layer store: %w", err)
	}
	tmp := filepath.Join(dir, tmpDirName)
	if err := os.RemoveAll(tmp); err != nil {
		return nil, fmt.Errorf("open native layer store: remove partial builds: %w", err)
	}
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("open native layer store: %w", err)
	}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &Store{
		dir:      dir,
		budget:   budget,
		ctx:      sctx,
		cancel:   cancel,
		slots:    make(chan struct{}, maxBuilds),
		copies:   map[digest.Digest]*entry{},
		building: map[digest.Digest]bool{},
	}
	if err := s.load(ctx); err != nil {
		cancel()
		return nil, err
	}
	return s, nil
}

func (s *Store) load(ctx context.Context) error {
	algs, err := os.ReadDir(s.dir)
	if err != nil {
		return fmt.Errorf("open native layer store: %w", err)
	}
	for _, a := range algs {
		if !a.IsDir() || a.Name() == tmpDirName {
			continue
		}
		names, err := os.ReadDir(filepath.Join(s.dir, a.Name()))
		if err != nil {
			return fmt.Errorf("open native layer store: %w", err)
		}
		for _, n := range names {
			if !n.IsDir() {
				continue
			}
			d := digest.NewDigestFromEncoded(digest.Algorithm(a.Name()), n.Name())
			m, err := s.readMarker(d)
			if err == nil {
				err = s.budget.Charge(m.Size)
			}
			if err != nil {
				log.G(ctx).WithError(err).WithField("layer", d).Info("dropping native layer copy")
				s.discard(d)
				continue
			}
			s.copies[d] = &entry{size: m.Size, lastUsed: time.Now()}
		}
	}
	return nil
}

func (s *Store) readMarker(d digest.Digest) (marker, error) {
	var m marker
	if err := d.Validate(); err != nil {
		return m, fmt.Errorf("not a layer copy: %w", err)
	}
	b, err := os.ReadFile(s.markerPath(d))
	if err != nil {
		return m, fmt.Errorf("incomplete copy: %w", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("incomplete copy: %w", err)
	}
	if m.Version != markerVersion || m.Layer != d || m.Size <= 0 {
		return m, fmt.Errorf("copy of another builder or layer (marker %+v)", m)
	}
	return m, nil
}

func (s *Store) path(d digest.Digest) string {
	return filepath.Join(s.dir, d.Algorithm().String(), d.Encoded())
}

func (s *Store) markerPath(d digest.Digest) string { return s.path(d) + ".complete" }

// SetInUse installs the oracle Reclaim asks before dropping a copy. Until
// it is set, every copy counts as in use.
func (s *Store) SetInUse(f InUse) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inUse = f
}

// SetBuildCommand has trees built by a process of their own: command is
// the containerd-envsnap binary, to which `native-build` and its
// arguments are appended (BuildFromCache). Builds whose Source names no
// chunk directory or TOC digest, and every build until it is set, run in
// this process.
func (s *Store) SetBuildCommand(command []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.command = command
}

// Source is what a copy is built from: the layer's TOC and its verified
// chunks, and, for a build in a process of its own, the chunk cache
// directory holding both the chunks and the encoded TOC (under
// TOCDigest), which the helper reads and verifies itself.
type Source struct {
	TOC       *layerfmt.TOC
	Chunks    Chunks
	TOCDigest digest.Digest
	ChunkDir  string
}

// Dir returns the directory of the complete copy of layer d, if any.
func (s *Store) Dir(d digest.Digest) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.copies[d]
	if !ok {
		return "", false
	}
	e.lastUsed = time.Now()
	return s.path(d), true
}

// Build makes the copy of layer d from src in the background, at idle
// CPU and I/O priority (idleprio), unless it exists, is being built, a
// build is running already (the caller asks again later), or the budget
// has no room. done, if not nil, is called with the outcome (nil when
// the copy exists).
func (s *Store) Build(d digest.Digest, src Source, done func(error)) {
	if done == nil {
		done = func(error) {}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		done(context.Canceled)
		return
	}
	if s.copies[d] != nil {
		s.mu.Unlock()
		done(nil)
		return
	}
	if s.building[d] {
		s.mu.Unlock()
		done(errBusy)
		return
	}
	select {
	case s.slots <- struct{}{}:
	default:
		s.mu.Unlock()
		s.skipped.Add(1)
		done(errBusy)
		return
	}
	s.building[d] = true
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		err := s.build(d, src)
		<-s.slots
		s.mu.Lock()
		delete(s.building, d)
		s.mu.Unlock()
		done(err)
	}()
}

// errBusy reports a Build not started because another one runs.
var errBusy = errors.New("native layer store busy")

// IsBusy reports whether err is Build's "try again later".
func IsBusy(err error) bool { return errors.Is(err, errBusy) }

func (s *Store) build(d digest.Digest, src Source) (retErr error) {
	size := TreeSize(src.TOC)
	if err := s.budget.Charge(size); err != nil {
		s.skipped.Add(1)
		return fmt.Errorf("build native copy of layer %s (%d bytes): %w", d, size, err)
	}
	start := time.Now()
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, tmpDirName), d.Encoded()+"-")
	if err == nil {
		err = os.Remove(tmp) // BuildTree creates it
	}
	defer func() {
		if retErr != nil {
			s.budget.Discharge(size)
			s.failed.Add(1)
			if tmp != "" {
				os.RemoveAll(tmp)
			}
		}
	}()
	if err != nil {
		return fmt.Errorf("build native copy of layer %s: %w", d, err)
	}
	if err := s.buildTree(tmp, src); err != nil {
		return fmt.Errorf("build native copy of layer %s: %w", d, err)
	}
	if err := os.MkdirAll(filepath.Dir(s.path(d)), 0o700); err != nil {
		return fmt.Errorf("build native copy of layer %s: %w", d, err)
	}
	// A stale tree without a marker may sit at the final name (a crash
	// between rename and marker in this very run is impossible, but one
	// in an earlier run whose load failed to remove it is not).
	os.Remove(s.markerPath(d))
	if err := os.RemoveAll(s.path(d)); err != nil {
		return fmt.Errorf("build native copy of layer %s: remove stale tree: %w", d, err)
	}
	if err := os.Rename(tmp, s.path(d)); err != nil {
		return fmt.Errorf("build native copy of layer %s: %w", d, err)
	}
	tmp = s.path(d) // removed on a failure below
	if err := syncfs(s.dir); err != nil {
		return fmt.Errorf("build native copy of layer %s: sync: %w", d, err)
	}
	if err := writeMarker(s.markerPath(d), marker{Version: markerVersion, Layer: d, Size: size}); err != nil {
		return fmt.Errorf("build native copy of layer %s: %w", d, err)
	}
	s.mu.Lock()
	s.copies[d] = &entry{size: size, lastUsed: time.Now()}
	s.mu.Unlock()
	s.builds.Add(1)
	log.G(s.ctx).WithField("layer", d).WithField("bytes", size).WithField("took", time.Since(start)).Info("built native layer copy")
	return nil
}

// buildTree writes the tree of src into dir at idle CPU and I/O
// priority: decompressing and writing a whole layer takes seconds of CPU
// and disk that the node's environments come first for; at idle priority
// it takes what they leave, however busy the node, instead of waiting
// for a core to be idle. With a build command it runs in a process of
// its own: a lowered thread of the daemon that the kernel does not run
// would hold up every stop-the-world phase of the daemon's garbage
// collector, and every file-system request the daemon serves with it,
// until the thread next ran (idleprio.RunProcess).
func (s *Store) buildTree(dir string, src Source) error {
	s.mu.Lock()
	command := s.command
	s.mu.Unlock()
	if len(command) == 0 || src.TOCDigest == "" || src.ChunkDir == "" {
		var err error
		idleprio.Run(func() { err = BuildTree(s.ctx, dir, src.TOC, src.Chunks) })
		return err
	}
	args := append(slices.Clip(command[1:]), "native-build", "--chunks", src.ChunkDir, "--toc", src.TOCDigest.String(), dir)
	cmd := exec.CommandContext(s.ctx, command[0], args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	s.processBuilds.Add(1)
	if err := idleprio.RunProcess(cmd); err != nil {
		if ctxErr := s.ctx.Err(); ctxErr != nil {
			return ctxErr
		}
		return fmt.Errorf("build process: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// BuildFromCache is the build process's side of buildTree: it writes
// the tree of the layer whose encoded TOC is stored under tocDigest in
// the chunk cache at chunkDir into dir, from that cache's chunks. It
// trusts nothing it is handed: the TOC and every chunk are verified
// against their digests as they are read.
func BuildFromCache(ctx context.Context, dir, chunkDir string, tocDigest digest.Digest) error {
	chunks := chunkcache.NewReader(chunkDir)
	b, ok := chunks.Get(tocDigest)
	if !ok {
		return fmt.Errorf("TOC %s: %w", tocDigest, ErrChunkMissing)
	}
	toc, err := layerfmt.DecodeTOC(b, tocDigest)
	if err != nil {
		return fmt.Errorf("TOC %s: %w", tocDigest, err)
	}
	return BuildTree(ctx, dir, toc, chunks)
}

// syncfs flushes the file system holding dir: the marker promises a
// complete tree, also after a power loss.
func syncfs(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.Syncfs(int(f.Fd()))
}

func writeMarker(p string, m marker) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	tmp := p + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if serr := f.Sync(); err == nil {
		err = serr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

// TreeSize is the disk a copy of toc is charged: every regular file
// rounded up to blocks, a block per directory.
func TreeSize(toc *layerfmt.TOC) int64 {
	var n int64
	for i := range toc.Len() {
		switch toc.Type(i) {
		case layerfmt.TypeDir:
			n += blockSize
		case layerfmt.TypeReg:
			n += blockSize * max(1, (toc.Size(i)+blockSize-1)/blockSize)
		}
	}
	return n
}

// Reclaim drops copies no snapshot uses, least recently handed out first,
// until want bytes are freed or none is left (chunkcache.Tenant: the
// chunk cache asks before it evicts chunks). It returns the bytes freed.
func (s *Store) Reclaim(want int64) int64 {
	used, at := s.used()
	s.mu.Lock()
	defer s.mu.Unlock()
	type cand struct {
		d digest.Digest
		e *entry
	}
	var cands []cand
	for d, e := range s.copies {
		// A copy handed out after the oracle looked may belong to a
		// snapshot it has not seen.
		if used != nil && !used[d] && e.lastUsed.Before(at) {
			cands = append(cands, cand{d, e})
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].e.lastUsed.Before(cands[j].e.lastUsed) })
	var freed int64
	for _, c := range cands {
		if freed >= want {
			break
		}
		delete(s.copies, c.d)
		s.discard(c.d)
		s.budget.Discharge(c.e.size)
		s.reclaimed.Add(1)
		freed += c.e.size
		log.G(s.ctx).WithField("layer", c.d).WithField("bytes", c.e.size).Info("dropped native layer copy to make room")
	}
	return freed
}

// used asks the oracle which copies are in use, at most once per
// inUseTTL, without holding s.mu (the oracle may call Dir). nil means no
// answer: every copy then counts as in use, since a copy dropped under a
// running container's overlay is worse than a full cache.
func (s *Store) used() (map[digest.Digest]bool, time.Time) {
	s.mu.Lock()
	f, cached, at, n := s.inUse, s.inUseMap, s.inUseAt, len(s.copies)
	s.mu.Unlock()
	if f == nil || n == 0 {
		return nil, at
	}
	if cached != nil && time.Since(at) < inUseTTL {
		return cached, at
	}
	at = time.Now()
	used, err := f(s.ctx)
	if err != nil {
		log.G(s.ctx).WithError(err).Warn("cannot tell which native layer copies are in use; keeping them all")
		return nil, at
	}
	s.mu.Lock()
	s.inUseMap, s.inUseAt = used, at
	s.mu.Unlock()
	return used, at
}

// discard removes the marker of d's copy (from then on it is not used,
// also after a crash), moves the tree aside and deletes it in the
// background.
func (s *Store) discard(d digest.Digest) {
	os.Remove(s.markerPath(d))
	aside, err := os.MkdirTemp(filepath.Join(s.dir, tmpDirName), "drop-")
	if err == nil {
		err = os.Rename(s.path(d), filepath.Join(aside, "tree"))
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		log.G(s.ctx).WithError(err).WithField("layer", d).Warn("move native layer copy aside")
		aside = s.path(d)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := os.RemoveAll(aside); err != nil {
			log.G(s.ctx).WithError(err).WithField("layer", d).Warn("remove native layer copy")
		}
	}()
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{
		Copies:        len(s.copies),
		Builds:        s.builds.Load(),
		ProcessBuilds: s.processBuilds.Load(),
		Failed:        s.failed.Load(),
		Skipped:       s.skipped.Load(),
		Reclaimed:     s.reclaimed.Load(),
	}
	for _, e := range s.copies {
		st.Size += e.size
	}
	return st
}

// Wait blocks until builds and removals in progress are done (tests).
func (s *Store) Wait() { s.wg.Wait() }

// Close cancels builds in progress and waits for them. Complete copies
// stay for the next Open.
func (s *Store) Close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
}
