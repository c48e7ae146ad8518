//go:build linux

// Package snapshotter is envsnap's containerd snapshotter: containerd's
// overlay snapshotter plus the remote-snapshot protocol that lets image
// layers in the envsnap lazy format be served from a FUSE mount instead of
// being downloaded and unpacked.
//
// Life cycle of a lazy layer: when the unpacker calls Prepare with the
// remote-snapshot labels (containerd.io/snapshot.ref=<chainID> and the
// cri.image-ref / cri.manifest-digest / cri.layer-digest labels, or else
// the layer's hint annotations, layerfmt.AnnotationHintSource and the
// others, which the unpacker passes for every client), the
// snapshotter asks its FileSystem to mount the layer at
// <root>/layers/<alg>/<hex>/mnt (once per layer digest on the node, however
// many chainIDs contain it), commits a snapshot named <chainID> whose upper
// directory is a symlink to that mount, and answers ErrAlreadyExists so
// containerd skips the download. Overlayfs lowerdirs and bind mounts resolve
// the symlink, so every mount overlay hands out for snapshots above it reads
// the shared FUSE mount. Layers that are not in our format, or that cannot be
// prepared lazily for any reason, take overlay's normal path unchanged.
//
// Native lowers: when the FileSystem also implements NativeLayers and holds
// a complete native copy of a layer (a plain directory tree, what overlay's
// own applier would have unpacked), the mounts handed out for new active
// snapshots and views name that directory instead of the symlink to the
// FUSE mount, so containers started after the layer is fully present read
// it at kernel speed. Overlayfs resolves its lower directories when it
// mounts, so containers already running keep their FUSE lower.
//
// Invariant: a layer mount stays mounted while at least one committed
// snapshot labelled with its digest exists; the snapshot labels are the only
// record, so a restarted daemon rebuilds its mounts from overlay's metadata.
// A layer it cannot mount again is broken until a later try succeeds
// (WithHealInterval); no snapshot over it is handed out meanwhile.
package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/plugins/snapshots/overlay"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/moby/sys/mountinfo"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/diskcap"
	"github.com/envsnap/envsnap/internal/evalgroup"
	"github.com/envsnap/envsnap/layerfmt"
)

// restoreParallel bounds the layers remounted at once on startup.
const restoreParallel = 8

// Labels on a committed lazy snapshot. They live under the
// "containerd.io/snapshot/" prefix on purpose: containerd's metadata store
// inherits and preserves only labels with that prefix (FilterInheritedLabels),
// so an Update that rewrites "labels" through containerd cannot strip them,
// and they are what a restarted daemon uses to remount the layer.
//
// A layer found through the CRI labels has LabelImageRef (the image) and
// LabelManifestDigest; one found through its hint annotations
// (layerfmt.AnnotationHintSource and the others, which containerd's
// unpacker passes for every client) has LabelImageRef (the hinted
// repository), LabelTOCDigest and LabelLayerSize instead, because
// containerd tells a snapshotter no manifest digest.
const (
	LabelLayerDigest    = "containerd.io/snapshot/envsnap.layer-digest"
	LabelImageRef       = "containerd.io/snapshot/envsnap.image-ref"
	LabelManifestDigest = "containerd.io/snapshot/envsnap.manifest-digest"
	LabelTOCDigest      = "containerd.io/snapshot/envsnap.toc-digest"
	LabelLayerSize      = "containerd.io/snapshot/envsnap.layer-size"
)

// internalLabels are the labels only this snapshotter may set. A manifest
// can carry annotations of these names, which containerd's unpacker would
// pass to Prepare: Prepare drops them, or an image could make a normally
// unpacked snapshot look lazy to a restarted daemon.
var internalLabels = []string{LabelLayerDigest, LabelImageRef, LabelManifestDigest, LabelTOCDigest, LabelLayerSize}

// Labels containerd sends with Prepare on the remote-snapshot path
// (pkg/snapshotters in containerd; duplicated to keep the dependency small).
const (
	labelCRIImageRef       = "containerd.io/snapshot/cri.image-ref"
	labelCRIManifestDigest = "containerd.io/snapshot/cri.manifest-digest"
	labelCRILayerDigest    = "containerd.io/snapshot/cri.layer-digest"
)

// FileSystem is the data plane: it makes one image layer readable at a
// mountpoint. The labels carry the image reference, the manifest digest and
// the layer digest (LabelImageRef, LabelManifestDigest, LabelLayerDigest),
// or, for a layer found through its hints, the hinted repository, the
// layer digest, its TOC digest and its size (LabelImageRef,
// LabelLayerDigest, LabelTOCDigest, LabelLayerSize): those are untrusted,
// and Mount must check them (which repositories it may fetch from, the TOC
// against LabelTOCDigest).
// Mount returns an error for layers it cannot serve lazily (errdefs
// ErrNotImplemented for "not in our format"); the snapshotter then unpacks
// them normally.
//
// A Mount made while the snapshotter restores its layers at start-up
// carries a context for which Restoring reports true: containerd's calls
// fail until the snapshotter is up, so such a Mount must not wait for more
// than the layer's metadata (no whole-layer download).
type FileSystem interface {
	Mount(ctx context.Context, mountpoint string, labels map[string]string) error
	// Check reports whether the mount at mountpoint still serves its layer.
	Check(ctx context.Context, mountpoint string, labels map[string]string) error
	Unmount(ctx context.Context, mountpoint string) error
}

// NativeLayers is implemented by a FileSystem that keeps kernel-native
// copies of layers. NativeDir returns the directory of the complete copy
// of layer d, ready to be an overlayfs lower directory. The copy must stay
// in place while NativeInUse reports d: containerd mounts the lower
// directories of a snapshot by the paths Prepare, View and Mounts return,
// at any time while the snapshot exists.
type NativeLayers interface {
	NativeDir(d digest.Digest) (string, bool)
}

// EnvironmentObserver is implemented by a FileSystem that wants to know
// how many environments use each layer it serves: NoteEnvironment is
// called with a layer's mountpoint each time an active snapshot (not an
// unpack's) or a view is prepared over it, before native copies replace
// its lower directories, and once for each such snapshot that exists
// when New restores the layers. The layer store finishes a layer more than one
// environment uses first (fetch.FillPolicy.FreeCPU).
type EnvironmentObserver interface {
	NoteEnvironment(mountpoint string)
}

// LayerStatus describes one layer mount of this snapshotter.
type LayerStatus struct {
	Digest     digest.Digest `json:"digest"`
	Mountpoint string        `json:"mountpoint"`
	Snapshots  int           `json:"snapshots"` // committed snapshots that use it
	// Refs are the images those snapshots were pulled for, the most recent
	// pull first, each once. A snapshot shared by several images (same
	// chain) counts for the one that pulled it last; after a restart, for
	// the one that created it.
	Refs    []string `json:"refs,omitempty"`
	Mounted bool     `json:"mounted"`
	// Broken: snapshots use the layer but it is not mounted (its restore
	// failed); it is mounted again in the background (WithHealInterval),
	// and containers cannot start on it until then.
	Broken bool   `json:"broken,omitempty"`
	Error  string `json:"error,omitempty"` // last mount failure
}

type config struct {
	overlayOpts     []overlay.Opt
	writableCap     diskcap.Limits
	writableReserve *int
	healInterval    time.Duration
	volatile        bool
}

// Opt configures a Snapshotter.
type Opt func(*config) error

// WithOverlayOpts passes options to the underlying overlay snapshotter.
func WithOverlayOpts(opts ...overlay.Opt) Opt {
	return func(c *config) error {
		c.overlayOpts = append(c.overlayOpts, opts...)
		return nil
	}
}

// WithHealInterval makes the snapshotter try, every d, to mount again the
// layers that snapshots use but that are not mounted (a restore that
// failed: registry unreachable, cache disk full), so they heal without any
// client action. The daemon passes its read timeout: each attempt takes
// at most that long, so a layer heals within twice the read timeout of
// the registry's return. 0 (the default) turns it off; the next Prepare
// or Mounts over the layer still tries.
func WithHealInterval(d time.Duration) Opt {
	return func(c *config) error {
		c.healInterval = d
		return nil
	}
}

// Snapshotter implements snapshots.Snapshotter on top of containerd's overlay
// snapshotter; see the package documentation.
type Snapshotter struct {
	snapshots.Snapshotter // overlay, for everything not overridden below

	root string
	fs   FileSystem
	// writableDefault is the disk cap of container snapshots whose labels
	// name none (WithWritableCap).
	writableDefault diskcap.Limits
	// capPool holds images of writableDefault made ahead (nil: none).
	capPool *diskcap.Pool
	// writableReserve is the percentage of the file system no capped
	// layer takes (WithWritableReserve).
	writableReserve int
	// volatile: container snapshots' uppers are mounted volatile
	// (WithVolatileWritable); bootID is this boot's id, which they record.
	volatile bool
	bootID   []byte

	mu     sync.Mutex
	layers map[digest.Digest]*layer
	useSeq uint64
	closed bool
	// preparing holds the lazy targets a Prepare is making, closed when
	// it is done (lockTarget).
	preparing map[string]chan struct{}

	// kick wakes the heal loop at once (a Stat of a snapshot of a broken
	// layer: an image pull is looking at it); stopHeal ends the loop.
	kick     chan struct{}
	stopHeal context.CancelFunc
	healDone chan struct{}
}

// layer is one shared layer mount. mu serialises mounting and unmounting it;
// refs and users are guarded by Snapshotter.mu.
type layer struct {
	mu         sync.Mutex
	dgst       digest.Digest
	mountpoint string
	refs       int
	mounted    bool
	// up mirrors mounted for readers that must not wait on mu, which a
	// mount of the layer holds for as long as the registry takes.
	up      atomic.Bool
	lastErr error
	// labels are what the layer is mounted (again) with: the lazy labels
	// of its snapshots.
	labels map[string]string
	// users maps each committed snapshot of the layer to the image it was
	// last pulled for, so status names images that still use the layer,
	// not the first one that mounted it.
	users map[string]user
}

type user struct {
	ref string
	seq uint64 // Snapshotter.useSeq when noted: higher is more recent
}

var _ snapshots.Snapshotter = (*Snapshotter)(nil)
var _ snapshots.Cleaner = (*Snapshotter)(nil)

// New opens (or creates) a snapshotter rooted at root and remounts every lazy
// layer recorded in its metadata. Failures to remount are logged, not
// returned: the daemon must come up to serve everything else, and the
// affected layers show up with an error in Layers.
func New(ctx context.Context, root string, fsys FileSystem, opts ...Opt) (*Snapshotter, error) {
	var c config
	for _, o := range opts {
		if err := o(&c); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("create snapshotter root: %w", err)
	}
	if err := os.Chmod(root, 0o700); err != nil {
		return nil, fmt.Errorf("restrict snapshotter root: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(root, "layers"), 0o700); err != nil {
		return nil, fmt.Errorf("create layers dir: %w", err)
	}
	if err := waitMetadataUnlocked(ctx, filepath.Join(root, "metadata.db"), metadataLockWait); err != nil {
		return nil, err
	}
	ov, err := overlay.NewSnapshotter(root, c.overlayOpts...)
	if err != nil {
		return nil, fmt.Errorf("open overlay snapshotter: %w", err)
	}
	s := &Snapshotter{
		Snapshotter: ov,
		root:        root,
		fs:          fsys,
		layers:      make(map[digest.Digest]*layer),

		writableDefault: c.writableCap,
		writableReserve: DefaultWritableReserve,
		volatile:        c.volatile,
	}
	if c.writableReserve != nil {
		s.writableReserve = *c.writableReserve
	}
	if s.writableDefault.Bytes > 0 {
		if err := diskcap.Available(); err != nil {
			// Never silently: without the cap a writer can fill the
			// node's disk before the shim's measurement sees it.
			log.G(ctx).WithError(err).Warn("writable layers get no disk cap on this node; the envlet shim only measures them, and one environment can fill the node's disk")
			s.writableDefault = diskcap.Limits{}
		}
	}
	if s.volatile {
		if s.bootID, err = volatileSupported(root); err != nil {
			log.G(ctx).WithError(err).Warn("writable layers are mounted without overlayfs' volatile option on this node: every copy-up and fsync of a container reaches the disk")
			s.volatile = false
		}
	}
	if err := s.restore(ctx); err != nil {
		ov.Close()
		return nil, err
	}
	if err := s.restoreCaps(ctx); err != nil {
		ov.Close()
		return nil, err
	}
	if err := s.restoreEnvironments(ctx); err != nil {
		ov.Close()
		return nil, err
	}
	if s.writableDefault.Bytes > 0 {
		pool, err := diskcap.NewPool(ctx, filepath.Join(root, capPoolDir), s.writableDefault, capPoolSize, s.defaultCapFits)
		if err != nil {
			// Only slower: every Prepare makes its own image.
			log.G(ctx).WithError(err).Warn("no pool of disk cap images; each container start formats its own")
		}
		s.capPool = pool
	}
	s.kick = make(chan struct{}, 1)
	if c.healInterval > 0 {
		hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		s.stopHeal, s.healDone = cancel, make(chan struct{})
		go s.heal(hctx, c.healInterval)
	}
	return s, nil
}

// heal mounts again, every interval or when kicked, the layers that
// snapshots use but that are not mounted, until ctx is done.
func (s *Snapshotter) heal(ctx context.Context, interval time.Duration) {
	defer close(s.healDone)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.kick:
		}
		for _, l := range s.brokenLayers() {
			l.mu.Lock()
			if l.mounted { // mounted meanwhile (a Prepare, or its first mount)
				l.mu.Unlock()
				continue
			}
			err := s.remountLocked(ctx, l)
			healed := l.mounted
			l.mu.Unlock()
			lg := log.G(ctx).WithField("layer", l.dgst)
			switch {
			case err != nil:
				lg.WithError(err).Debug("broken layer still cannot be mounted")
			case healed:
				lg.Info("broken layer mounted again")
			}
		}
	}
}

// brokenLayers returns the layers snapshots use that are not mounted.
func (s *Snapshotter) brokenLayers() []*layer {
	s.mu.Lock()
	var used []*layer
	for _, l := range s.layers {
		if l.refs > 0 && !s.closed {
			used = append(used, l)
		}
	}
	s.mu.Unlock()
	var out []*layer
	for _, l := range used {
		if !l.up.Load() {
			out = append(out, l)
		}
	}
	return out
}

// remountLocked mounts l again if snapshots use it and it is not mounted,
// with the labels it was mounted with, bounded like a restore (the
// FileSystem gives a registry round trip the read timeout). l.mu is held.
func (s *Snapshotter) remountLocked(ctx context.Context, l *layer) error {
	s.mu.Lock()
	used, closed := l.refs > 0, s.closed
	s.mu.Unlock()
	if l.mounted || !used || closed {
		return nil
	}
	if l.labels == nil {
		return fmt.Errorf("layer %s: no labels to mount it with", l.dgst)
	}
	return s.mountLocked(context.WithValue(ctx, restoringKey{}, true), l, l.labels)
}

// Stat is overlay's Stat. A Stat of a lazy snapshot whose layer is broken
// (an image pull checking whether the layer is there: containerd's
// unpacker asks nothing else of an image that is present) wakes the heal
// loop, so the pull is what brings the layer back once it can be mounted.
func (s *Snapshotter) Stat(ctx context.Context, key string) (snapshots.Info, error) {
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil {
		return info, err
	}
	if d, perr := digest.Parse(info.Labels[LabelLayerDigest]); perr == nil {
		s.mu.Lock()
		l := s.layers[d]
		used := l != nil && l.refs > 0
		s.mu.Unlock()
		if used && !l.up.Load() {
			select {
			case s.kick <- struct{}{}:
			default:
			}
		}
	}
	return info, nil
}

// ensureLayers mounts again the broken lazy layers of the chain from
// snapshot name down to its base, before overlay is asked for a snapshot
// over them: overlay stats its parent's directory, which is the symlink
// to the layer's mountpoint, and containerd would be told "failed to stat
// parent" with no word of the layer. A layer that still cannot be mounted
// fails the call with the reason (ErrUnavailable).
func (s *Snapshotter) ensureLayers(ctx context.Context, name string) error {
	if len(s.brokenLayers()) == 0 {
		return nil // the common case: no Stat of the chain
	}
	for name != "" {
		info, err := s.Snapshotter.Stat(ctx, name)
		if err != nil {
			return nil //nolint:nilerr // overlay reports a missing parent itself
		}
		if d, err := digest.Parse(info.Labels[LabelLayerDigest]); err == nil && info.Kind == snapshots.KindCommitted {
			s.mu.Lock()
			l := s.layers[d]
			s.mu.Unlock()
			// Mounted layers (the common case) cost no lock: another
			// layer's mount may hold its lock for a registry round trip.
			if l != nil && !l.up.Load() {
				l.mu.Lock()
				if l.labels == nil {
					l.labels = lazyLabels(info.Labels)
				}
				err := s.remountLocked(ctx, l)
				l.mu.Unlock()
				if err != nil {
					return fmt.Errorf("snapshot %s: its lazy layer %s is not mounted: %w: %w", name, d, err, errdefs.ErrUnavailable)
				}
			}
		}
		name = info.Parent
	}
	return nil
}

// metadataLockWait bounds how long New waits for another process to let go
// of the metadata database.
const metadataLockWait = 5 * time.Second

// waitMetadataUnlocked waits until no other process holds the metadata
// database at path, for at most wait or until ctx is done. Overlay opens
// the database without a timeout, and bolt then waits on its file lock
// forever, deaf to the caller's context: a second process on the same root
// would hang there. bolt takes an exclusive flock on the file, so a
// non-blocking one here fails exactly while it is held.
func waitMetadataUnlocked(ctx context.Context, path string, wait time.Duration) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open metadata database %s: %w", path, err)
	}
	defer f.Close()
	deadline := time.Now().Add(wait)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return unix.Flock(int(f.Fd()), unix.LOCK_UN)
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return fmt.Errorf("lock metadata database %s: %w", path, err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("metadata database %s is locked by another process (still after %s): %w", path, wait, errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the metadata database %s: %w", path, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// layerMountpoint avoids ':' (the digest separator) in paths because
// overlayfs uses it to separate lowerdirs.
func (s *Snapshotter) layerMountpoint(d digest.Digest) string {
	return filepath.Join(s.root, "layers", d.Algorithm().String(), d.Encoded(), "mnt")
}

// restore rebuilds the reference counts from the committed lazy snapshots
// and mounts their layers again.
func (s *Snapshotter) restore(ctx context.Context) error {
	labelsOf := make(map[digest.Digest]map[string]string)
	err := s.Snapshotter.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		d, err := digest.Parse(info.Labels[LabelLayerDigest])
		if err != nil || info.Kind != snapshots.KindCommitted {
			return nil //nolint:nilerr // not a lazy snapshot
		}
		s.ref(d)
		s.noteUser(d, info.Name, info.Labels[LabelImageRef])
		if _, ok := labelsOf[d]; !ok {
			labelsOf[d] = lazyLabels(info.Labels)
		}
		return nil
	}, fmt.Sprintf("labels.%q", LabelLayerDigest))
	if err != nil && !errdefs.IsNotFound(err) { // a new store has no bucket yet
		return fmt.Errorf("walk lazy snapshots: %w", err)
	}
	// Each remount costs a manifest and a TOC round trip; a node with
	// hundreds of lazy layers should not pay them one after another.
	var g errgroup.Group
	g.SetLimit(restoreParallel)
	ctx = context.WithValue(ctx, restoringKey{}, true)
	for d, labels := range labelsOf {
		l := s.layers[d]
		g.Go(func() error {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.labels = labels
			if err := s.mountLocked(ctx, l, labels); err != nil {
				log.G(ctx).WithError(err).WithField("layer", d).Error("restore lazy layer mount; the layer is broken until it can be mounted again (retried in the background)")
			}
			return nil
		})
	}
	return g.Wait()
}

type restoringKey struct{}

// Restoring reports whether ctx is that of a Mount the snapshotter makes
// while restoring its layers at start-up (see FileSystem).
func Restoring(ctx context.Context) bool {
	v, _ := ctx.Value(restoringKey{}).(bool)
	return v
}

// ref returns the layer for d with its reference count incremented.
func (s *Snapshotter) ref(d digest.Digest) *layer {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.layers[d]
	if !ok {
		l = &layer{dgst: d, mountpoint: s.layerMountpoint(d)}
		s.layers[d] = l
	}
	l.refs++
	return l
}

// noteUser records that the committed snapshot name of layer d was (last)
// pulled for image ref.
func (s *Snapshotter) noteUser(d digest.Digest, name, ref string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.layers[d]
	if !ok || ref == "" {
		return
	}
	if l.users == nil {
		l.users = make(map[string]user)
	}
	s.useSeq++
	l.users[name] = user{ref: ref, seq: s.useSeq}
}

// dropUser forgets the removed snapshot name of layer d.
func (s *Snapshotter) dropUser(d digest.Digest, name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l, ok := s.layers[d]; ok {
		delete(l.users, name)
	}
}

// refsLocked lists the images of l's users, most recent first, each once.
// s.mu is held.
func refsLocked(l *layer) []string {
	us := make([]user, 0, len(l.users))
	for _, u := range l.users {
		us = append(us, u)
	}
	sort.Slice(us, func(i, j int) bool { return us[i].seq > us[j].seq })
	var refs []string
	seen := make(map[string]bool, len(us))
	for _, u := range us {
		if !seen[u.ref] {
			seen[u.ref] = true
			refs = append(refs, u.ref)
		}
	}
	return refs
}

// unref drops one reference to d and unmounts the layer when none is left.
// The layer stays in the map while it is unmounted, so a concurrent ref of
// the same digest waits on l.mu and remounts it instead of mounting a second
// time on the same mountpoint.
func (s *Snapshotter) unref(ctx context.Context, d digest.Digest) {
	s.mu.Lock()
	l, ok := s.layers[d]
	if !ok {
		s.mu.Unlock()
		return
	}
	l.refs--
	last := l.refs <= 0
	s.mu.Unlock()
	if !last {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	s.mu.Lock()
	revived := l.refs > 0
	s.mu.Unlock()
	if revived {
		return
	}
	s.unmountLocked(ctx, l)
	s.mu.Lock()
	// A layer that failed to unmount stays listed (with its error) so
	// Layers shows it and Close retries.
	if l.refs <= 0 && !l.mounted && s.layers[d] == l {
		delete(s.layers, d)
	}
	s.mu.Unlock()
}

// mountLocked mounts l unless it is mounted and passes Check. l.mu is held.
func (s *Snapshotter) mountLocked(ctx context.Context, l *layer, labels map[string]string) error {
	if l.mounted {
		err := s.fs.Check(ctx, l.mountpoint, labels)
		if err == nil {
			return nil
		}
		log.G(ctx).WithError(err).WithField("layer", l.dgst).Warn("lazy layer mount failed its check; remounting")
		s.unmountLocked(ctx, l)
	}
	// The FileSystem may already serve this mountpoint: a mount it took
	// over from the previous daemon, with containers still reading it.
	// Detaching that would break them.
	if err := s.fs.Check(ctx, l.mountpoint, labels); err == nil {
		l.mounted, l.lastErr = true, nil
		l.up.Store(true)
		return nil
	}
	if stale(l.mountpoint) {
		// Left by a previous daemon that could not unmount it because a
		// container still used it; its FUSE connection died with that
		// daemon. Detach it: those containers keep their (broken) view,
		// new ones get the new mount.
		log.G(ctx).WithField("layer", l.dgst).Warn("detaching stale layer mount left by a previous daemon")
		if err := unix.Unmount(l.mountpoint, unix.MNT_DETACH); err != nil {
			l.lastErr = err
			return fmt.Errorf("detach stale mount %s: %w", l.mountpoint, err)
		}
	}
	if err := os.MkdirAll(l.mountpoint, 0o755); err != nil {
		l.lastErr = err
		return fmt.Errorf("create mountpoint: %w", err)
	}
	if err := s.fs.Mount(ctx, l.mountpoint, labels); err != nil {
		l.lastErr = err
		// No mountpoint, no silent empty layer: the symlinks of snapshots
		// using it dangle, so mounting them fails loudly until a later
		// Prepare of the layer mounts it again.
		os.Remove(l.mountpoint)
		return fmt.Errorf("mount layer %s: %w", l.dgst, err)
	}
	l.mounted, l.lastErr, l.labels = true, nil, labels
	l.up.Store(true)
	return nil
}

func (s *Snapshotter) unmountLocked(ctx context.Context, l *layer) {
	if !l.mounted {
		return
	}
	if err := s.fs.Unmount(ctx, l.mountpoint); err != nil {
		log.G(ctx).WithError(err).WithField("layer", l.dgst).Error("unmount lazy layer")
		l.lastErr = err
		return
	}
	l.mounted = false
	l.up.Store(false)
	// Best effort: the directory tree is ours and empty once unmounted.
	if err := os.Remove(l.mountpoint); err == nil {
		os.Remove(filepath.Dir(l.mountpoint))
	}
}

// Prepare creates an active snapshot, or, on the remote-snapshot path,
// commits a lazy snapshot named after the chainID and reports
// ErrAlreadyExists. The mounts of an active snapshot name the native
// copies of its lazy layers where they are ready, and, unless it is an
// unpack's, leave out evaluator layers (holdBackEvaluator) and have
// their writable directories on a file system of their disk cap, if any
// (WithWritableCap).
func (s *Snapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	if unpacking(opts) {
		mounts, err := s.prepare(ctx, key, parent, opts...)
		if err != nil {
			return nil, err
		}
		return s.nativeMounts(ctx, mounts), nil
	}
	dcap, opts, err := s.writableCap(ctx, opts)
	if err != nil {
		return nil, err
	}
	mounts, err := s.prepare(ctx, key, parent, opts...)
	if err != nil {
		return nil, err
	}
	if dcap.Bytes > 0 {
		if err := s.capWritable(ctx, key, mounts, dcap); err != nil {
			return nil, err
		}
	}
	s.noteEnvironment(mounts)
	mounts = s.nativeMounts(ctx, mounts)
	mounts, err = s.volatileMounts(ctx, key, mounts)
	if err == nil {
		mounts, err = s.holdBackEvaluator(ctx, parent, mounts)
	}
	if err != nil {
		if rerr := s.remove(ctx, key); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("key", key).Warn("remove snapshot whose mounts could not be made")
		}
		return nil, fmt.Errorf("prepare %s: %w", key, err)
	}
	return mounts, nil
}

// View is overlay's View with native lowers (see Prepare).
func (s *Snapshotter) View(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	if err := s.ensureLayers(ctx, parent); err != nil {
		return nil, err
	}
	mounts, err := s.Snapshotter.View(ctx, key, parent, opts...)
	if err != nil {
		return nil, err
	}
	s.noteEnvironment(mounts)
	return s.nativeMounts(ctx, mounts), nil
}

// Mounts is overlay's Mounts with native lowers and, for an active
// snapshot that is not an unpack's, without evaluator layers (see
// Prepare).
func (s *Snapshotter) Mounts(ctx context.Context, key string) ([]mount.Mount, error) {
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil {
		return nil, err
	}
	if err := s.ensureLayers(ctx, info.Parent); err != nil {
		return nil, err
	}
	mounts, err := s.Snapshotter.Mounts(ctx, key)
	if err != nil {
		return nil, err
	}
	mounts = s.nativeMounts(ctx, mounts)
	if info.Kind != snapshots.KindActive || info.Labels[snapshots.LabelSnapshotRef] != "" {
		return mounts, nil
	}
	if isCapped(info) {
		// Never hand out the directories the cap's file system covers.
		upper, err := upperDir(mounts)
		if err != nil {
			return nil, err
		}
		if mounted, err := diskcap.Mounted(filepath.Dir(upper)); err != nil || !mounted {
			return nil, fmt.Errorf("snapshot %s: its disk cap's file system is not mounted (%v): %w", key, err, errdefs.ErrFailedPrecondition)
		}
	}
	if mounts, err = s.volatileMounts(ctx, key, mounts); err != nil {
		return nil, err
	}
	return s.holdBackEvaluator(ctx, info.Parent, mounts)
}

func (s *Snapshotter) prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	var base snapshots.Info
	for _, o := range opts {
		if err := o(&base); err != nil {
			return nil, err
		}
	}
	if dropInternalLabels(base.Labels) {
		opts = append(slices.Clone(opts), dropInternal)
	}
	if err := s.ensureLayers(ctx, parent); err != nil {
		return nil, err
	}
	target := base.Labels[snapshots.LabelSnapshotRef]
	labels, ok := remoteLabels(ctx, base.Labels)
	if target == "" || !ok {
		return s.Snapshotter.Prepare(ctx, key, parent, opts...)
	}
	unlock, err := s.lockTarget(ctx, target)
	if err != nil {
		return nil, err
	}
	defer unlock()
	// Another namespace (or an earlier pull, or the Prepare this one
	// waited for) already made this layer lazily.
	if info, err := s.Snapshotter.Stat(ctx, target); err == nil {
		if info.Kind == snapshots.KindCommitted && info.Parent == parent {
			if d, err := digest.Parse(info.Labels[LabelLayerDigest]); err == nil {
				s.noteUser(d, target, labels[LabelImageRef])
			}
			// A pull of an image whose layer is broken mounts it again
			// (or the next snapshot over it says why not).
			if err := s.ensureLayers(ctx, target); err != nil {
				log.G(ctx).WithError(err).Warn("pull of a broken lazy layer")
			}
			return nil, fmt.Errorf("target snapshot %q: %w", target, errdefs.ErrAlreadyExists)
		}
	}
	mounts, err := s.Snapshotter.Prepare(ctx, key, parent, opts...)
	if err != nil {
		return nil, err
	}
	lg := log.G(ctx).WithField("key", key).WithField("layer", labels[LabelLayerDigest]).WithField("ref", labels[LabelImageRef])
	err = s.prepareLazy(ctx, key, target, parent, mounts, base.Labels, labels)
	switch {
	case err == nil:
		lg.Debug("serving layer lazily")
		return nil, fmt.Errorf("target snapshot %q: %w", target, errdefs.ErrAlreadyExists)
	case errors.Is(err, errdefs.ErrAlreadyExists):
		return nil, err
	case errdefs.IsNotImplemented(err):
		lg.WithError(err).Debug("layer is not lazy; unpacking it normally")
	default:
		lg.WithError(err).Warn("cannot serve layer lazily; unpacking it normally")
	}
	// The active snapshot may be gone if the failure came after Commit
	// raced with another Prepare of the same chainID; make a fresh one.
	if _, serr := s.Snapshotter.Stat(ctx, key); serr != nil {
		return s.Snapshotter.Prepare(ctx, key, parent, opts...)
	}
	return mounts, nil
}

// lockTarget makes the Prepares of one lazy target wait for each other.
// Environments started together pull images sharing their base layers:
// each Prepare of a shared layer used to create an active snapshot, mount
// or join the layer, lose the race to Commit and remove its snapshot
// again: three write transactions of overlay's metadata store (two of
// them committed, with their fsyncs), each behind its single writer lock.
// Waiting instead, the others find the target committed and write
// nothing.
func (s *Snapshotter) lockTarget(ctx context.Context, target string) (func(), error) {
	for {
		s.mu.Lock()
		busy, ok := s.preparing[target]
		if !ok {
			if s.preparing == nil {
				s.preparing = map[string]chan struct{}{}
			}
			done := make(chan struct{})
			s.preparing[target] = done
			s.mu.Unlock()
			return func() {
				s.mu.Lock()
				delete(s.preparing, target)
				s.mu.Unlock()
				close(done)
			}, nil
		}
		s.mu.Unlock()
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for another prepare of %s: %w", target, ctx.Err())
		}
	}
}

// prepareLazy turns the freshly prepared active snapshot key into the
// committed lazy snapshot target. On error the active snapshot key is left
// as overlay created it (an empty upper directory), ready for a normal
// unpack, unless the error is ErrAlreadyExists.
func (s *Snapshotter) prepareLazy(ctx context.Context, key, target, parent string, mounts []mount.Mount, prepLabels, labels map[string]string) (retErr error) {
	d, err := digest.Parse(labels[LabelLayerDigest])
	if err != nil {
		return fmt.Errorf("layer digest label: %w: %w", err, errdefs.ErrNotImplemented)
	}
	upper, err := upperDir(mounts)
	if err != nil {
		return err
	}
	l := s.ref(d)
	refHeld := true
	defer func() {
		if refHeld {
			s.unref(ctx, d)
		}
	}()
	l.mu.Lock()
	err = s.mountLocked(ctx, l, labels)
	l.mu.Unlock()
	if err != nil {
		return err
	}

	// Swap the empty upper directory for a symlink to the layer mount before
	// Commit, so no snapshot ever sees the empty directory. Overlay's Commit
	// measures usage with a Walk that does not follow the symlink.
	if err := os.Remove(upper); err != nil {
		return fmt.Errorf("replace upper dir of %s: %w", key, err)
	}
	if err := os.Symlink(l.mountpoint, upper); err != nil {
		if merr := os.Mkdir(upper, 0o755); merr != nil {
			log.G(ctx).WithError(merr).WithField("path", upper).Error("restore upper dir")
		}
		return fmt.Errorf("link upper dir of %s to layer mount: %w", key, err)
	}
	restoreUpper := func() {
		if err := os.Remove(upper); err == nil {
			if err := os.Mkdir(upper, 0o755); err != nil {
				log.G(ctx).WithError(err).WithField("path", upper).Error("restore upper dir")
			}
		}
	}

	commitLabels := make(map[string]string, len(prepLabels)+len(labels))
	for k, v := range prepLabels {
		commitLabels[k] = v
	}
	for k, v := range labels {
		commitLabels[k] = v
	}
	if err := s.Snapshotter.Commit(ctx, target, key, snapshots.WithLabels(commitLabels)); err != nil {
		restoreUpper()
		if !errdefs.IsAlreadyExists(err) {
			return fmt.Errorf("commit lazy snapshot %s: %w", target, err)
		}
		// Lost a race with another Prepare for the same chainID (or the name
		// is taken by another namespace's chain). Hand over to the winner if
		// it has our parent.
		if info, serr := s.Snapshotter.Stat(ctx, target); serr == nil && info.Parent == parent {
			if rerr := s.Snapshotter.Remove(ctx, key); rerr != nil {
				log.G(ctx).WithError(rerr).WithField("key", key).Warn("remove abandoned active snapshot")
			}
			return fmt.Errorf("target snapshot %q: %w", target, errdefs.ErrAlreadyExists)
		}
		// Not %w: ErrAlreadyExists would tell containerd the layer is done.
		return fmt.Errorf("commit lazy snapshot %s: name taken by another chain: %v", target, err)
	}
	refHeld = false // now owned by the committed snapshot
	s.noteUser(d, target, labels[LabelImageRef])
	return nil
}

// nativeMounts replaces, in overlay's mounts, every lower directory that is
// a lazy layer's symlink to its FUSE mount by the layer's native copy, when
// one is ready.
func (s *Snapshotter) nativeMounts(ctx context.Context, mounts []mount.Mount) []mount.Mount {
	nl, ok := s.fs.(NativeLayers)
	if !ok {
		return mounts
	}
	native := func(p string) string {
		d, ok := s.lazyLower(p)
		if !ok {
			return p
		}
		if dir, ok := nl.NativeDir(d); ok {
			log.G(ctx).WithField("layer", d).Debug("native lower")
			return dir
		}
		return p
	}
	for i, m := range mounts {
		switch m.Type {
		case "bind":
			mounts[i].Source = native(m.Source)
		case "overlay":
			opts := slices.Clone(m.Options)
			for k, o := range opts {
				v, ok := strings.CutPrefix(o, "lowerdir=")
				if !ok {
					continue
				}
				dirs := strings.Split(v, ":")
				for j, dir := range dirs {
					dirs[j] = native(dir)
				}
				opts[k] = "lowerdir=" + strings.Join(dirs, ":")
				if !fitsOnePage(opts, dirs) {
					// Native paths are longer than overlay's
					// snapshots/<id>/fs: an image with very many
					// layers keeps its FUSE lowers rather than fail
					// to mount.
					log.G(ctx).WithField("layers", len(dirs)).Info("lower directories too long for one mount call; keeping the FUSE lowers")
					opts = m.Options
				}
			}
			mounts[i].Options = opts
		}
	}
	return mounts
}

// mountDataMax is what containerd's mount.All lets an overlay's options
// take, after it has shortened the lower directories to paths relative to
// their common parent (core/mount: one page, less a 512-byte reserve).
const mountDataMax = 4096 - 512

// fitsOnePage reports whether overlay options opts, whose lower
// directories are dirs, fit in mountDataMax once containerd has made the
// lower directories relative to their common parent, as it does for long
// options.
func fitsOnePage(opts, dirs []string) bool {
	size := len(opts) - 1
	for _, o := range opts {
		size += len(o)
	}
	if size < mountDataMax {
		return true
	}
	common := dirs[0]
	for _, d := range dirs[1:] {
		for !strings.HasPrefix(d, common) {
			common = common[:len(common)-1]
		}
	}
	common = filepath.Dir(common)
	if common == "/" || common == "." {
		return false
	}
	shorter := len(dirs) * (len(common) + 1)
	return size-shorter < mountDataMax
}

// lazyLower returns the lazy layer whose FUSE mount lower directory p
// links to; a directory of its own is not a lazy layer.
func (s *Snapshotter) lazyLower(p string) (digest.Digest, bool) {
	target, err := os.Readlink(p)
	if err != nil {
		return "", false
	}
	return s.layerOfMountpoint(target)
}

// noteEnvironment tells an EnvironmentObserver FileSystem about the lazy
// layers of an environment's mounts (Prepare, View).
func (s *Snapshotter) noteEnvironment(mounts []mount.Mount) {
	obs, ok := s.fs.(EnvironmentObserver)
	if !ok {
		return
	}
	for _, m := range mounts {
		var dirs []string
		switch m.Type {
		case "bind":
			dirs = []string{m.Source}
		case "overlay":
			for _, o := range m.Options {
				if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
					dirs = strings.Split(v, ":")
				}
			}
		}
		for _, dir := range dirs {
			if d, ok := s.lazyLower(dir); ok {
				obs.NoteEnvironment(s.layerMountpoint(d))
			}
		}
	}
}

// restoreEnvironments tells an EnvironmentObserver FileSystem, once the
// layers are mounted again, about the environments that outlived the
// previous daemon: the counts lived in its memory, and without them a
// layer every running container shares would be filled and copied as if
// one environment used it.
func (s *Snapshotter) restoreEnvironments(ctx context.Context) error {
	if _, ok := s.fs.(EnvironmentObserver); !ok {
		return nil
	}
	var keys []string
	err := s.Snapshotter.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		if (info.Kind == snapshots.KindActive || info.Kind == snapshots.KindView) && info.Labels[snapshots.LabelSnapshotRef] == "" {
			keys = append(keys, info.Name)
		}
		return nil
	})
	if err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("walk environments' snapshots: %w", err)
	}
	for _, key := range keys {
		mounts, err := s.Snapshotter.Mounts(ctx, key)
		if err != nil {
			// Removed since the walk, or broken: it is no environment to count.
			log.G(ctx).WithError(err).WithField("key", key).Warn("environment not counted for its layers after restart")
			continue
		}
		s.noteEnvironment(mounts)
	}
	return nil
}

// layerOfMountpoint is the inverse of layerMountpoint.
func (s *Snapshotter) layerOfMountpoint(p string) (digest.Digest, bool) {
	rel, err := filepath.Rel(filepath.Join(s.root, "layers"), p)
	if err != nil {
		return "", false
	}
	parts := strings.Split(rel, string(filepath.Separator))
	if len(parts) != 3 || parts[2] != "mnt" {
		return "", false
	}
	d := digest.NewDigestFromEncoded(digest.Algorithm(parts[0]), parts[1])
	if d.Validate() != nil {
		return "", false
	}
	return d, true
}

// NativeInUse reports the lazy layers whose native copies may be in use:
// those in the parent chain of an active snapshot or a view (containerd
// may mount it by the paths it was given at any time), and those an
// overlay mount on the node has as a lower directory. The FileSystem must
// not remove these copies (see NativeLayers).
func (s *Snapshotter) NativeInUse(ctx context.Context) (map[digest.Digest]bool, error) {
	infos := map[string]snapshots.Info{}
	err := s.Snapshotter.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		infos[info.Name] = info
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("walk snapshots: %w", err)
	}
	used := map[digest.Digest]bool{}
	lazy := map[digest.Digest]bool{}
	for _, info := range infos {
		if d, err := digest.Parse(info.Labels[LabelLayerDigest]); err == nil && info.Kind == snapshots.KindCommitted {
			lazy[d] = true
		}
		if info.Kind == snapshots.KindCommitted {
			continue
		}
		for p, n := info.Parent, 0; p != "" && n <= len(infos); n++ {
			pi, ok := infos[p]
			if !ok {
				break
			}
			if d, err := digest.Parse(pi.Labels[LabelLayerDigest]); err == nil {
				used[d] = true
			}
			p = pi.Parent
		}
	}
	nl, ok := s.fs.(NativeLayers)
	if !ok {
		return used, nil
	}
	byDir := map[string]digest.Digest{}
	for d := range lazy {
		if dir, ok := nl.NativeDir(d); ok {
			byDir[dir] = d
		}
	}
	infosM, err := containerMounts(mountinfo.FSTypeFilter("overlay"))
	if err != nil {
		return nil, err
	}
	for _, m := range infosM {
		for _, opt := range strings.Split(m.VFSOptions, ",") {
			k, v, _ := strings.Cut(opt, "=")
			if k != "lowerdir" && k != "lowerdir+" {
				continue
			}
			for _, dir := range strings.Split(v, ":") {
				if d, ok := byDir[dir]; ok {
					used[d] = true
				}
			}
		}
	}
	return used, nil
}

// remoteLabels extracts what the data plane needs from Prepare's labels; ok
// is false unless they name a layer to serve lazily. Two sources, in this
// order: the CRI labels a client adds (all three of them), and the hint
// annotations of the layer's descriptor, which containerd's unpacker
// passes whichever client pulls. Hints are untrusted: the FileSystem
// checks them (which hosts, and every byte against the hinted TOC
// digest). Malformed hints are logged and ignored.
func remoteLabels(ctx context.Context, in map[string]string) (map[string]string, bool) {
	ref, mfst, layer := in[labelCRIImageRef], in[labelCRIManifestDigest], in[labelCRILayerDigest]
	if ref != "" && mfst != "" && layer != "" {
		return map[string]string{
			LabelImageRef:       ref,
			LabelManifestDigest: mfst,
			LabelLayerDigest:    layer,
		}, true
	}
	h, ok, err := layerfmt.ParseHints(in)
	if err != nil {
		log.G(ctx).WithError(err).WithField("chainID", in[snapshots.LabelSnapshotRef]).Warn("ignoring the layer's hint annotations; unpacking it normally")
		return nil, false
	}
	if !ok {
		return nil, false
	}
	return map[string]string{
		LabelImageRef:    h.Source,
		LabelLayerDigest: h.Layer.String(),
		LabelTOCDigest:   h.TOC.String(),
		LabelLayerSize:   strconv.FormatInt(h.Size, 10),
	}, true
}

// lazyLabels is the subset of a lazy snapshot's labels that names its
// layer (either source of remoteLabels).
func lazyLabels(in map[string]string) map[string]string {
	out := make(map[string]string, len(internalLabels))
	for _, k := range internalLabels {
		if v, ok := in[k]; ok {
			out[k] = v
		}
	}
	return out
}

// dropInternalLabels deletes internalLabels from labels and reports
// whether there were any.
func dropInternalLabels(labels map[string]string) bool {
	found := false
	for _, k := range internalLabels {
		if _, ok := labels[k]; ok {
			delete(labels, k)
			found = true
		}
	}
	return found
}

// upperDir finds the writable directory of a freshly prepared active
// snapshot in overlay's mounts: the bind source without a parent, the
// upperdir option with one.
func upperDir(mounts []mount.Mount) (string, error) {
	if len(mounts) != 1 {
		return "", fmt.Errorf("unexpected %d mounts from overlay", len(mounts))
	}
	m := mounts[0]
	switch m.Type {
	case "bind":
		return m.Source, nil
	case "overlay":
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "upperdir="); ok {
				return v, nil
			}
		}
	}
	return "", fmt.Errorf("no upper directory in %s mount from overlay", m.Type)
}

// Update keeps the envsnap labels of a lazy snapshot even when a caller
// replaces all labels: without them the layer could not be remounted after
// a restart nor unmounted on Remove.
func (s *Snapshotter) Update(ctx context.Context, info snapshots.Info, fieldpaths ...string) (snapshots.Info, error) {
	replacesLabels := len(fieldpaths) == 0
	for _, p := range fieldpaths {
		if p == "labels" || strings.HasPrefix(p, "labels.containerd.io/snapshot/envsnap.") {
			replacesLabels = true
		}
	}
	if replacesLabels {
		cur, err := s.Snapshotter.Stat(ctx, info.Name)
		if err != nil {
			return snapshots.Info{}, err
		}
		if _, lazy := cur.Labels[LabelLayerDigest]; lazy {
			if info.Labels == nil {
				info.Labels = make(map[string]string)
			}
			for k, v := range lazyLabels(cur.Labels) {
				info.Labels[k] = v
			}
		}
		// The evaluator marking is the only record that a layer must stay
		// out of containers: no label update drops it.
		if v, ok := cur.Labels[evalgroup.LayerLabel]; ok {
			if info.Labels == nil {
				info.Labels = make(map[string]string)
			}
			info.Labels[evalgroup.LayerLabel] = v
		}
	}
	return s.Snapshotter.Update(ctx, info, fieldpaths...)
}

// Commit is overlay's, without internalLabels: containerd's unpacker
// passes a layer's annotations to Commit as it does to Prepare.
// A snapshot with a disk cap first has its files copied off the cap's
// file system, which goes (commitCapped): committing costs a copy of
// the layer, as BuildKit's steps on this snapshotter do.
func (s *Snapshotter) Commit(ctx context.Context, name, key string, opts ...snapshots.Opt) error {
	if !unpacking(opts) {
		if info, err := s.Snapshotter.Stat(ctx, key); err == nil && isCapped(info) {
			if err := s.commitCapped(ctx, info); err != nil {
				return fmt.Errorf("commit %s: %w", key, err)
			}
		}
	}
	return s.Snapshotter.Commit(ctx, name, key, append(slices.Clone(opts), dropInternal)...)
}

// dropInternal is a snapshots.Opt dropping internalLabels.
func dropInternal(info *snapshots.Info) error {
	dropInternalLabels(info.Labels)
	return nil
}

// Remove removes a snapshot and unmounts its layer when it was the last
// snapshot using it.
func (s *Snapshotter) Remove(ctx context.Context, key string) error {
	info, err := s.Snapshotter.Stat(ctx, key)
	if err != nil {
		return err
	}
	if isCapped(info) {
		if err := s.uncapWritable(ctx, key); err != nil {
			return err
		}
	}
	if err := s.Snapshotter.Remove(ctx, key); err != nil {
		return err
	}
	if d, err := digest.Parse(info.Labels[LabelLayerDigest]); err == nil && info.Kind == snapshots.KindCommitted {
		s.dropUser(d, key)
		s.unref(ctx, d)
	}
	return nil
}

// remove removes an active snapshot this Prepare made, with its disk cap.
func (s *Snapshotter) remove(ctx context.Context, key string) error {
	if info, err := s.Snapshotter.Stat(ctx, key); err == nil && isCapped(info) {
		if err := s.uncapWritable(ctx, key); err != nil {
			return err
		}
	}
	return s.Snapshotter.Remove(ctx, key)
}

// Cleanup removes disk resources of removed snapshots (overlay's Cleanup).
func (s *Snapshotter) Cleanup(ctx context.Context) error {
	c, ok := s.Snapshotter.(snapshots.Cleaner)
	if !ok {
		return nil
	}
	return c.Cleanup(ctx)
}

// Layers reports the layer mounts, sorted by nothing in particular.
func (s *Snapshotter) Layers() []LayerStatus {
	s.mu.Lock()
	ls := make([]*layer, 0, len(s.layers))
	refs := make([]int, 0, len(s.layers))
	images := make([][]string, 0, len(s.layers))
	for _, l := range s.layers {
		ls = append(ls, l)
		refs = append(refs, l.refs)
		images = append(images, refsLocked(l))
	}
	s.mu.Unlock()
	out := make([]LayerStatus, len(ls))
	for i, l := range ls {
		l.mu.Lock()
		out[i] = LayerStatus{Digest: l.dgst, Mountpoint: l.mountpoint, Snapshots: refs[i], Refs: images[i], Mounted: l.mounted, Broken: refs[i] > 0 && !l.mounted}
		if l.lastErr != nil {
			out[i].Error = l.lastErr.Error()
		}
		l.mu.Unlock()
	}
	return out
}

// Close unmounts every layer mount no other mount uses (see layersInUse)
// and closes the metadata store. Layers in a container's rootfs stay
// mounted for it (a restarted daemon takes them over, see
// layerstore.Restore). Close is idempotent.
func (s *Snapshotter) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	stopHeal, healDone := s.stopHeal, s.healDone
	ls := make([]*layer, 0, len(s.layers))
	for _, l := range s.layers {
		ls = append(ls, l)
	}
	s.mu.Unlock()
	if stopHeal != nil {
		stopHeal()
		<-healDone
	}
	ctx := context.Background()
	inUse := s.layersInUse(ctx)
	for _, l := range ls {
		if inUse[l.dgst] {
			// Overlayfs holds private clones of its lower mounts, so
			// unmounting would succeed under a running container
			// and its FUSE connection would die with this process.
			// Left mounted, the connection is kept alive by the
			// descriptor keeper (if any) for the next daemon.
			log.G(ctx).WithField("layer", l.dgst).Info("leaving layer mounted: a container's rootfs uses it")
			continue
		}
		l.mu.Lock()
		s.unmountLocked(ctx, l)
		l.mu.Unlock()
	}
	if s.capPool != nil {
		if err := s.capPool.Close(); err != nil {
			log.G(ctx).WithError(err).Warn("close the pool of disk cap images")
		}
	}
	return s.Snapshotter.Close()
}

// layersInUse returns the lazy layers some other mount uses: an overlay
// (a container's rootfs) with the layer's snapshot directory, which is a
// symlink to the layer mount, among its lower directories, or a bind mount
// of the layer (a single-layer view), in this mount namespace or the
// host's (containerMounts). Mounts are what count, not snapshot
// metadata: containerd removes deleted snapshots from the backend only at
// its next garbage collection. If mountinfo cannot be read, every layer
// counts as used: leaving a mount behind is recoverable, breaking a
// running container is not.
func (s *Snapshotter) layersInUse(ctx context.Context) map[digest.Digest]bool {
	used := map[digest.Digest]bool{}
	byMountpoint := map[string]digest.Digest{}
	s.mu.Lock()
	for d, l := range s.layers {
		byMountpoint[l.mountpoint] = d
	}
	s.mu.Unlock()
	infos, err := containerMounts(nil)
	if err != nil {
		log.G(ctx).WithError(err).Warn("read mountinfo to find layers in use; leaving every layer mounted")
		for _, d := range byMountpoint {
			used[d] = true
		}
		return used
	}
	byDev := map[[2]int]digest.Digest{}
	for _, m := range infos {
		if d, ok := byMountpoint[m.Mountpoint]; ok {
			byDev[[2]int{m.Major, m.Minor}] = d
		}
	}
	for _, m := range infos {
		if d, ok := byDev[[2]int{m.Major, m.Minor}]; ok && byMountpoint[m.Mountpoint] != d {
			used[d] = true
		}
		if m.FSType != "overlay" {
			continue
		}
		for _, opt := range strings.Split(m.VFSOptions, ",") {
			k, v, _ := strings.Cut(opt, "=")
			if k != "lowerdir" && k != "lowerdir+" && k != "datadir+" {
				continue
			}
			for _, dir := range strings.Split(v, ":") {
				target := dir
				if t, err := os.Readlink(dir); err == nil {
					target = t
				}
				if d, ok := byMountpoint[target]; ok {
					used[d] = true
				}
			}
		}
	}
	return used
}

// stale reports whether something is mounted at p that this process did not
// mount: a dead FUSE mount answers stat with ENOTCONN; a live one has
// another device than its parent directory.
func stale(p string) bool {
	var st, parent unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		return errors.Is(err, unix.ENOTCONN)
	}
	if err := unix.Stat(filepath.Dir(p), &parent); err != nil {
		return false
	}
	return st.Dev != parent.Dev
}
