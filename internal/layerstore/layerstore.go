//go:build linux

// Package layerstore is the data plane behind the snapshotter: it turns the
// labels of a remote snapshot (image ref, manifest digest, layer digest) into
// a lazily fetched FUSE mount of that layer.
//
// Trust chain: the manifest is fetched by the digest containerd resolved and
// verified against it; the layer descriptor in it carries the TOC digest
// (layerfmt.AnnotationTOCDigest), against which the TOC read from the blob's
// tail is verified; the TOC holds the digest of every chunk, verified on
// every fetch. Nothing unverified is ever served. The manifest and the TOC
// are also kept in the node cache, where a restarted daemon finds them
// without the registry (metadata.go); they are verified the same way when
// loaded from there. A layer found through its hint annotations has no
// manifest digest: its TOC digest is the hinted one (from the manifest
// containerd verified, as passed to Prepare), and its repository must be
// one Config.Sources allows.
package layerstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/fdstore"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/lazyfs"
	"github.com/envsnap/envsnap/internal/native"
	"github.com/envsnap/envsnap/internal/peer"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/internal/unpacked"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/snapshotter"
)

// Defaults, all in one place.
const (
	// DefaultReadTimeout bounds one FUSE read.
	DefaultReadTimeout = lazyfs.DefaultReadTimeout
	// manifestCacheEntries bounds the parsed manifests kept in memory: an
	// image's layers arrive as consecutive Prepares, each needing the same
	// manifest, so a handful is enough.
	manifestCacheEntries = 32
	// fuseSuperMagic is the f_type statfs reports for FUSE mounts.
	fuseSuperMagic = 0x65735546
	// checkTimeout bounds the liveness probe of a mount.
	checkTimeout = 5 * time.Second
	// tocPrefetchParallel, tocPrefetchTimeout and tocPrefetchTTL shape the
	// TOC prefetch: containerd prepares an image's layers one after
	// another, each Mount paying a TOC round trip or two; reading every
	// lazy layer's TOC as soon as the manifest is known overlaps them.
	// Unclaimed results are dropped after the TTL.
	tocPrefetchParallel = 8
	tocPrefetchTimeout  = 30 * time.Second
	tocPrefetchTTL      = 2 * time.Minute
	// nativePoll is how often a mounted layer checks whether all its
	// chunks are local, so that its native copy can be built.
	nativePoll = time.Second
	// A layer's native copy is built once the node's lazy layers have
	// served no file-system request for nativeQuiet, or nativeMaxHold
	// after its last chunk arrived, whichever comes first. Idle priority
	// alone did not keep the build off the environments it is for: with
	// every chunk cached before the container started (envsnap-eager),
	// a cold episode's first `go test` on the FUSE lowers took 2.69-3.23
	// s while the copies were built, 1.65-1.88 s with no copies built.
	// The hold keeps the copies for the later environments, which get
	// them as their lowers, without charging the one running now; on a
	// node that is never quiet the copy still comes within the hold.
	nativeQuiet   = 2 * time.Second
	nativeMaxHold = 30 * time.Second
)

// Config configures a Store.
type Config struct {
	// Hosts resolves registries; required. See registry.ConfigureHosts.
	Hosts docker.RegistryHosts
	// Cache is the node chunk cache; required.
	Cache *chunkcache.Cache
	// Fill fetches every chunk of a layer in the background once mounted.
	Fill bool
	// FillDelay postpones the background fill after a mount. The fill
	// yields to foreground work by itself (fetch.StartFill), so zero is a
	// good value; a delay still helps a node whose container starts spend
	// long stretches without reading.
	FillDelay time.Duration
	// FillPolicy says when the fill yields to the node's foreground work
	// (zero: fetch.DefaultFillPolicy).
	FillPolicy fetch.FillPolicy
	// PrefetchPolicy shapes the fetches of prefetch lists (zero:
	// fetch.DefaultPrefetchPolicy).
	PrefetchPolicy fetch.PrefetchPolicy
	// Eager turns on-demand fetching off: Mount returns only once every
	// chunk of the layer is in the node cache (the benchmark's "download
	// everything, then mount" baseline, and a choice for nodes whose
	// registry link is better used in bulk).
	Eager bool
	// ReadTimeout bounds one FUSE read (DefaultReadTimeout when zero).
	ReadTimeout time.Duration
	// Registerer receives per-layer FUSE metrics; may be nil.
	Registerer prometheus.Registerer
	// FetchMetrics records registry and cache traffic; may be nil.
	FetchMetrics *fetch.Metrics
	// Peers, when set, is the cluster tier every layer fetches through
	// (fetch.WithPeers); PeerSource serves the other members.
	Peers *peer.Client
	// FrameCache, when set, holds the decoded frames of every layer of
	// the node (fetch.WithSharedFrameCache); without it each layer keeps
	// a few MiB of its own.
	FrameCache *fetch.FrameCache
	// Passthrough hands the kernel local copies of files of at least
	// PassthroughMinSize bytes to read directly (FUSE passthrough): a
	// cached read then costs what a read of a local file does. Below the
	// size a copy saves little beyond what the page cache already does
	// for an immutable layer. The copies are the files of the layer's
	// native copy (Native) once it is complete, and, with Unpacked set,
	// decompressed copies of single files whose chunks are all in the
	// node cache before that.
	Passthrough        bool
	PassthroughMinSize int64
	Unpacked           *unpacked.Store
	// Native, when set, builds a kernel-native copy of every mounted
	// layer once all its chunks are in the node cache; the snapshotter
	// hands it to new containers instead of the FUSE mount (NativeDir).
	Native *native.Store
	// LazyMinSize: a new layer whose blob is smaller than this is not
	// served lazily; Mount declines it (errdefs.ErrNotImplemented) and
	// containerd downloads and unpacks it as overlayfs would. Fetching a
	// layer that small costs about the round trip its first lazy read
	// would pay anyway, while a FUSE lower costs every container that
	// has it a round trip to this process for the first lookup of every
	// path: overlayfs looks a name up in each lower above the one that
	// holds it, so a small layer high in the stack (a task's patch, an
	// evaluator) stands in front of the whole image. Zero serves every
	// layer lazily. Layers mounted before (restores, takeovers) are
	// served as they were.
	LazyMinSize int64
	// Sources decides which repositories layer hints may send the store
	// to (layers named by snapshotter.LabelTOCDigest rather than a
	// manifest digest). The zero value allows none.
	Sources registry.SourcePolicy
	// Keeper, when set, holds a duplicate of every mount's FUSE
	// descriptor so the mounts survive a restart of this process (see
	// Restore). May be nil: mounts then die with the process.
	Keeper *fdstore.Client
}

// Store implements snapshotter.FileSystem.
type Store struct {
	cfg Config

	mu        sync.Mutex
	mounts    map[string]*mounted // by mountpoint
	manifests map[digest.Digest]manifestEntry
	mfOrder   []digest.Digest
	tocs      map[digest.Digest]*tocFetch // prefetched, by layer digest
	tocSem    chan struct{}
	// flights is shared by every layer of the node: a frame present in
	// several layers (same digest) is fetched once when they miss it at
	// the same time, and every layer's background fill yields to the
	// foreground reads of all of them.
	flights *fetch.Flights
}

// manifestEntry is a manifest recalled in memory, with its verified bytes
// (kept in the node cache with every mount of one of its layers).
type manifestEntry struct {
	mf  *ocispec.Manifest
	raw []byte
}

// tocFetch is one layer's TOC being read ahead of its Mount.
type tocFetch struct {
	done    chan struct{}
	started time.Time
	blob    *fetch.BlobReader
	toc     *layerfmt.TOC
	raw     []byte // the encoded TOC
	err     error
}

type mounted struct {
	ref    string
	desc   ocispec.Descriptor
	layer  *fetch.Layer
	srv    *lazyfs.Server
	cancel context.CancelFunc // stops the background fill
	native atomic.Value       // NativeState of the layer's copy, while buildNative runs
}

// NativeState is where the native copy of a mounted layer stands (Config.Native).
type NativeState string

const (
	NativeWaitChunks NativeState = "waiting for chunks" // not every chunk is in the node cache yet
	NativeWaitQuiet  NativeState = "waiting for quiet"  // environments are reading lazy layers (nativeQuiet)
	NativeQueued     NativeState = "queued"             // other copies are being built
	NativeBuilding   NativeState = "building"
	NativeReady      NativeState = "ready"   // new containers get it as their lower
	NativeFailed     NativeState = "failed"  // new containers keep the FUSE mount (the daemon's log says why)
	NativeStopped    NativeState = "stopped" // the layer is unmounted or the daemon stops
)

var (
	_ snapshotter.FileSystem   = (*Store)(nil)
	_ snapshotter.NativeLayers = (*Store)(nil)

	_ snapshotter.EnvironmentObserver = (*Store)(nil)
)

// New returns a Store.
func New(cfg Config) (*Store, error) {
	if cfg.Hosts == nil || cfg.Cache == nil {
		return nil, errors.New("layerstore: Hosts and Cache are required")
	}
	if cfg.ReadTimeout <= 0 {
		cfg.ReadTimeout = DefaultReadTimeout
	}
	if cfg.FillPolicy == (fetch.FillPolicy{}) {
		cfg.FillPolicy = fetch.DefaultFillPolicy()
	}
	if cfg.PrefetchPolicy == (fetch.PrefetchPolicy{}) {
		cfg.PrefetchPolicy = fetch.DefaultPrefetchPolicy()
	}

	return &Store{
		cfg:       cfg,
		mounts:    make(map[string]*mounted),
		manifests: make(map[digest.Digest]manifestEntry),
		tocs:      make(map[digest.Digest]*tocFetch),
		tocSem:    make(chan struct{}, tocPrefetchParallel),
		flights:   fetch.NewFlights(fetch.WithFillPolicy(cfg.FillPolicy), fetch.WithPrefetchPolicy(cfg.PrefetchPolicy)),
	}, nil
}

// PeerSource is what the node serves to its peers: frames of the layers it
// has open.
func (s *Store) PeerSource() peer.Source { return s.flights }

// Mount makes the layer named by labels readable at mountpoint. Layers
// without our TOC annotation fail with errdefs.ErrNotImplemented.
func (s *Store) Mount(ctx context.Context, mountpoint string, labels map[string]string) error {
	s.mu.Lock()
	_, busy := s.mounts[mountpoint]
	s.mu.Unlock()
	if busy {
		return fmt.Errorf("mount layer %s at %s: %w", labels[snapshotter.LabelLayerDigest], mountpoint, errdefs.ErrAlreadyExists)
	}
	restoring := snapshotter.Restoring(ctx)
	o, err := s.open(ctx, labels, restoring, !restoring)
	if err != nil {
		return err
	}
	m, err := s.serve(ctx, mountpoint, o, nil)
	if err != nil {
		return err
	}
	s.keep(ctx, mountpoint, labels, m.srv)
	return nil
}

// opened is a layer whose metadata is known and verified, ready to be
// served.
type opened struct {
	ref       string
	manifest  digest.Digest
	desc      ocispec.Descriptor
	tocDigest digest.Digest
	blob      *fetch.BlobReader
	toc       *layerfmt.TOC
	// The verified bytes of the manifest (nil for a hinted layer, which
	// has none) and of the encoded TOC, kept in the node cache while the
	// layer is mounted (keepMetadata).
	manifestRaw, tocRaw []byte
}

// open finds the layer named by labels: its descriptor in the manifest and
// its TOC, from memory, the node cache or the registry, in that order.
// With bounded, a registry round trip may take no longer than one read
// may: a restore or a takeover holds containers (their requests wait in
// the kernel) or containerd (the socket is not up yet) meanwhile.
//
// A fresh open is for a new mount: a layer below Config.LazyMinSize fails
// it with errdefs.ErrNotImplemented before its TOC is read.
func (s *Store) open(ctx context.Context, labels map[string]string, bounded, fresh bool) (*opened, error) {
	ref := labels[snapshotter.LabelImageRef]
	ldgst, err := digest.Parse(labels[snapshotter.LabelLayerDigest])
	if err != nil {
		return nil, fmt.Errorf("layer digest label: %w", err)
	}
	if bounded {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.cfg.ReadTimeout)
		defer cancel()
	}

	var (
		desc  ocispec.Descriptor
		mdgst digest.Digest
		mraw  []byte
	)
	if _, hinted := labels[snapshotter.LabelTOCDigest]; hinted {
		desc, err = s.hintedLayer(ref, ldgst, labels)
	} else {
		desc, mdgst, mraw, err = s.manifestLayer(ctx, ref, ldgst, labels)
	}
	if err != nil {
		return nil, err
	}
	tocDigest, err := digest.Parse(desc.Annotations[layerfmt.AnnotationTOCDigest])
	if err != nil {
		return nil, fmt.Errorf("layer %s has no valid %s annotation: %w: %w", ldgst, layerfmt.AnnotationTOCDigest, layerfmt.ErrNotLayer, errdefs.ErrNotImplemented)
	}
	if fresh && s.tooSmall(desc) {
		log.G(ctx).WithField("layer", ldgst).WithField("bytes", desc.Size).Info("layer below lazy_min_size: containerd unpacks it")
		return nil, fmt.Errorf("layer %s has %d bytes, below lazy_min_size (%d): %w", ldgst, desc.Size, s.cfg.LazyMinSize, errdefs.ErrNotImplemented)
	}

	blob, toc, traw, err := s.claimTOC(ctx, ldgst)
	if err != nil || toc == nil {
		if err != nil {
			log.G(ctx).WithError(err).WithField("layer", ldgst).Debug("prefetched TOC failed; reading it again")
		}
		if blob, toc, traw, err = s.readTOC(ctx, ref, desc, tocDigest); err != nil {
			return nil, err
		}
	}
	return &opened{ref: ref, manifest: mdgst, desc: desc, tocDigest: tocDigest, blob: blob, toc: toc, manifestRaw: mraw, tocRaw: traw}, nil
}

// serve serves the opened layer at mountpoint: a new FUSE mount, or, with
// takeover, the live connection of a predecessor (lazyfs.WithTakeover:
// lazyfs owns takeover.FD from this call on, also when it fails).
func (s *Store) serve(ctx context.Context, mountpoint string, o *opened, takeover *lazyfs.Handover) (_ *mounted, retErr error) {
	ref, desc, toc, ldgst := o.ref, o.desc, o.toc, o.desc.Digest
	// The metadata first, so a mount never exists without it. A takeover
	// serves anyway: its containers are waiting on the connection, and
	// giving it up would fail them.
	defer func() {
		if retErr != nil {
			s.cfg.Cache.Unpin(metaPinOwner(mountpoint))
		}
	}()
	if err := s.keepMetadata(mountpoint, o); err != nil {
		if takeover == nil {
			return nil, fmt.Errorf("mount layer %s at %s: %w", ldgst, mountpoint, err)
		}
		log.G(ctx).WithError(err).WithField("layer", ldgst).Error("taking over the layer mount without its metadata in the node cache; the next restart will need the registry for it")
	}
	layerOpts := []fetch.LayerOption{
		fetch.WithFill(s.cfg.Fill || s.cfg.Eager),
		// Eager mounts wait for their fill: nothing to yield to.
		fetch.WithFillYield(!s.cfg.Eager),
		fetch.WithFlights(s.flights),
		fetch.WithReadTimeout(s.cfg.ReadTimeout),
		fetch.WithMetrics(s.cfg.FetchMetrics),
	}
	if s.cfg.Peers != nil {
		layerOpts = append(layerOpts, fetch.WithPeers(s.cfg.Peers))
	}
	if s.cfg.FrameCache != nil {
		layerOpts = append(layerOpts, fetch.WithSharedFrameCache(s.cfg.FrameCache))
	}
	layer := fetch.NewLayer(o.blob, toc, s.cfg.Cache, layerOpts...)
	defer func() {
		if retErr != nil {
			layer.Close()
		}
	}()
	// A restore at start-up must not hold the daemon's socket back for
	// whole-layer downloads (containerd fails its calls meanwhile): it
	// mounts at once and fills in the background below.
	restoring := snapshotter.Restoring(ctx)
	if s.cfg.Eager && takeover == nil && !restoring {
		if err := s.fetchAll(ctx, layer, ldgst); err != nil {
			return nil, err
		}
	} else if v := desc.Annotations[layerfmt.AnnotationPrefetch]; v != "" && takeover == nil {
		// Started before the FUSE mount: the container needs these
		// frames within a second, and the mount and container set-up
		// are time the link can use. The layer's Close stops it.
		if frames, err := layerfmt.ParsePrefetch(v, toc.NumFrames()); err != nil {
			log.G(ctx).WithError(err).WithField("layer", ldgst).Warn("ignoring the layer's prefetch list")
		} else if len(frames) > 0 {
			go layer.Prefetch(context.WithoutCancel(ctx), frames)
		}
	}
	opts := []lazyfs.Option{
		lazyfs.WithReadTimeout(s.cfg.ReadTimeout),
		lazyfs.WithFSName(ldgst.String()),
	}
	if s.cfg.Registerer != nil {
		opts = append(opts, lazyfs.WithMetrics(s.cfg.Registerer, ldgst.String()))
	}
	if takeover != nil {
		opts = append(opts, lazyfs.WithTakeover(*takeover))
	}
	// Beside the mountpoint, so a successor finds it (Restore).
	state := filepath.Join(filepath.Dir(mountpoint), "passthrough")
	// A taken-over mount whose predecessor switched files to passthrough
	// keeps backing with passthrough now off: the kernel refuses a page
	// cache open of an inode while a passthrough open of it lives, so
	// the successor must go on handing out the same copies.
	if s.cfg.Passthrough || (takeover != nil && nonEmpty(state)) {
		b := &backing{layer: layer, toc: toc, minSize: s.cfg.PassthroughMinSize, files: s.cfg.Unpacked}
		if s.cfg.Native != nil {
			b.native = func() (string, bool) { return s.cfg.Native.Dir(ldgst) }
		}
		opts = append(opts, lazyfs.WithBacking(b, state))
	}
	// The mount outlives the Prepare that created it: log with the
	// daemon's fields, not the request's cancellation.
	srv, err := lazyfs.Mount(context.WithoutCancel(ctx), mountpoint, toc, layer, opts...)
	if err != nil {
		return nil, fmt.Errorf("mount layer %s at %s: %w", ldgst, mountpoint, err)
	}
	fillCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	m := &mounted{ref: ref, desc: desc, layer: layer, srv: srv, cancel: cancel}
	switch {
	case s.cfg.Fill && !s.cfg.Eager:
		timer := time.AfterFunc(s.cfg.FillDelay, func() { layer.StartFill(fillCtx) })
		m.cancel = func() { timer.Stop(); cancel() }
	case s.cfg.Eager && (restoring || takeover != nil):
		layer.StartFill(fillCtx)
	}
	if s.cfg.Native != nil {
		m.native.Store(NativeWaitChunks)
		go s.buildNative(fillCtx, ldgst, m, native.Source{TOC: toc, Chunks: s.cfg.Cache, TOCDigest: o.tocDigest, ChunkDir: s.cfg.Cache.Dir()})
	}

	s.mu.Lock()
	s.mounts[mountpoint] = m
	s.mu.Unlock()
	log.G(ctx).WithField("layer", ldgst).WithField("ref", ref).WithField("entries", toc.Len()).WithField("fill", s.cfg.Fill).WithField("takeover", takeover != nil).Info("mounted lazy layer")
	return m, nil
}

// buildNative has the native copy of the layer built once all its chunks
// are in the node cache (a finished fill, or a warm cache), in the
// background at idle priority (native.Store.Build): never on a
// container's start path, and never waiting for an idle core. It gives up when the
// layer is unmounted (ctx) or the build fails; a later mount tries again.
func (s *Store) buildNative(ctx context.Context, d digest.Digest, m *mounted, src native.Source) {
	tick := time.NewTicker(nativePoll)
	defer tick.Stop()
	var whole time.Time // when the last chunk was first seen cached
	for {
		if _, ok := s.cfg.Native.Dir(d); ok {
			m.native.Store(NativeReady)
			return
		}
		cached, total := m.layer.Progress()
		if cached >= total && whole.IsZero() {
			whole = time.Now()
		}
		if cached >= total && !nativeHeld(time.Now(), s.flights.LastActivity(), whole) {
			m.native.Store(NativeBuilding)
			if !s.cfg.Cache.Contains(src.TOCDigest) {
				// A takeover serves without its metadata kept
				// (serve): a build process could not read the TOC.
				src.TOCDigest, src.ChunkDir = "", ""
			}
			done := make(chan error, 1)
			s.cfg.Native.Build(d, src, func(err error) { done <- err })
			err := <-done
			switch {
			case err == nil:
				m.native.Store(NativeReady)
				return
			case errors.Is(err, context.Canceled):
				// The daemon is stopping: the next one builds it.
				m.native.Store(NativeStopped)
				log.G(ctx).WithError(err).WithField("layer", d).Debug("native copy of the layer not built")
				return
			case !native.IsBusy(err):
				// A corrupt or evicted chunk, a full budget or disk:
				// containers keep the FUSE mount, which refetches
				// what it cannot verify.
				m.native.Store(NativeFailed)
				log.G(ctx).WithError(err).WithField("layer", d).Warn("no native copy of the layer; new containers keep reading it through FUSE")
				return
			}
			m.native.Store(NativeQueued)
		} else if cached >= total {
			m.native.Store(NativeWaitQuiet)
		}
		select {
		case <-ctx.Done():
			m.native.Store(NativeStopped)
			return
		case <-tick.C:
		}
	}
}

// nativeHeld reports whether, at now, a native copy whose layer has been
// whole since whole still waits: the node's lazy layers served a request
// less than nativeQuiet ago (lastOp), and the hold has not reached
// nativeMaxHold.
func nativeHeld(now, lastOp, whole time.Time) bool {
	return now.Sub(lastOp) < nativeQuiet && now.Sub(whole) < nativeMaxHold
}

// NoteEnvironment tells the layer served at mountpoint that one more
// environment was prepared over it (snapshotter.EnvironmentObserver,
// fetch.Layer.NoteEnvironment).
func (s *Store) NoteEnvironment(mountpoint string) {
	s.mu.Lock()
	m := s.mounts[mountpoint]
	s.mu.Unlock()
	if m != nil {
		m.layer.NoteEnvironment()
	}
}

// NativeDir returns the directory of the complete native copy of layer d
// (snapshotter.NativeLayers).
func (s *Store) NativeDir(d digest.Digest) (string, bool) {
	if s.cfg.Native == nil {
		return "", false
	}
	return s.cfg.Native.Dir(d)
}

// manifestLayer is the descriptor of layer ldgst in the manifest the
// labels name (the CRI labels' path): the manifest is verified against its
// digest, so the TOC digest is the manifest's.
func (s *Store) manifestLayer(ctx context.Context, ref string, ldgst digest.Digest, labels map[string]string) (ocispec.Descriptor, digest.Digest, []byte, error) {
	mdgst, err := digest.Parse(labels[snapshotter.LabelManifestDigest])
	if err != nil {
		return ocispec.Descriptor{}, "", nil, fmt.Errorf("manifest digest label: %w", err)
	}
	me, err := s.manifest(ctx, ref, mdgst)
	if err != nil {
		return ocispec.Descriptor{}, "", nil, err
	}
	desc, ok := findLayer(me.mf, ldgst)
	if !ok {
		return ocispec.Descriptor{}, "", nil, fmt.Errorf("layer %s not in manifest %s of %s: %w", ldgst, mdgst, ref, errdefs.ErrNotFound)
	}
	return desc, mdgst, me.raw, nil
}

// hintedLayer is the descriptor the hint annotations of a layer describe
// (snapshotter.LabelTOCDigest and LabelLayerSize; ref is the hinted
// repository). Hints are the image's word alone: the repository must be
// one Config.Sources allows (the daemon's credentials go there), and the
// TOC read from the blob must match the hinted TOC digest, which then
// vouches for every chunk, as the manifest's annotation does on the CRI
// labels' path. A refused hint fails the mount; the snapshotter then
// unpacks the layer normally.
func (s *Store) hintedLayer(ref string, ldgst digest.Digest, labels map[string]string) (ocispec.Descriptor, error) {
	if err := s.cfg.Sources.Check(ref); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("layer %s: refusing its hint: %w: %w", ldgst, err, errdefs.ErrPermissionDenied)
	}
	toc, err := digest.Parse(labels[snapshotter.LabelTOCDigest])
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("layer %s: TOC digest label: %w", ldgst, err)
	}
	size, err := strconv.ParseInt(labels[snapshotter.LabelLayerSize], 10, 64)
	if err != nil || size <= 0 {
		return ocispec.Descriptor{}, fmt.Errorf("layer %s: size label %q: %w", ldgst, labels[snapshotter.LabelLayerSize], errdefs.ErrInvalidArgument)
	}
	return ocispec.Descriptor{
		MediaType:   layerfmt.MediaTypeLayer,
		Digest:      ldgst,
		Size:        size,
		Annotations: map[string]string{layerfmt.AnnotationTOCDigest: toc.String()},
	}, nil
}

// fetchAll fills layer completely before it is mounted (Config.Eager). A
// fill that makes no progress for the read timeout fails the mount, and
// the snapshotter falls back to containerd's own download.
func (s *Store) fetchAll(ctx context.Context, layer *fetch.Layer, ldgst digest.Digest) error {
	stall := s.cfg.ReadTimeout
	if stall <= 0 {
		stall = DefaultReadTimeout
	}
	start := time.Now()
	layer.StartFill(context.WithoutCancel(ctx))
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	last, progressed := int64(-1), time.Now()
	for {
		cached, total := layer.Progress()
		if cached >= total {
			log.G(ctx).WithField("layer", ldgst).WithField("bytes", total).WithField("took", time.Since(start)).Debug("fetched whole layer before mounting")
			return nil
		}
		if cached != last {
			last, progressed = cached, time.Now()
		} else if time.Since(progressed) > stall {
			return fmt.Errorf("fetch layer %s before mounting: no progress for %s at %d of %d bytes", ldgst, stall, cached, total)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("fetch layer %s before mounting: %w", ldgst, ctx.Err())
		case <-tick.C:
		}
	}
}

// manifest recalls the manifest dgst of ref from memory or the node cache,
// or fetches it; verified by digest either way.
func (s *Store) manifest(ctx context.Context, ref string, dgst digest.Digest) (manifestEntry, error) {
	s.mu.Lock()
	me, ok := s.manifests[dgst]
	s.mu.Unlock()
	if ok {
		return me, nil
	}
	b, ok := s.cachedManifest(dgst)
	if !ok {
		var err error
		if b, err = fetch.FetchManifest(ctx, s.cfg.Hosts, ref, dgst); err != nil {
			return manifestEntry{}, fmt.Errorf("fetch manifest %s of %s: %w", dgst, ref, err)
		}
		s.keepManifest(ctx, dgst, b)
	}
	mf := new(ocispec.Manifest)
	if err := json.Unmarshal(b, mf); err != nil {
		return manifestEntry{}, fmt.Errorf("decode manifest %s of %s: %w", dgst, ref, err)
	}
	if !images.IsManifestType(mf.MediaType) && mf.MediaType != "" {
		return manifestEntry{}, fmt.Errorf("%s of %s is a %s, not an image manifest: %w", dgst, ref, mf.MediaType, errdefs.ErrNotImplemented)
	}
	me = manifestEntry{mf: mf, raw: b}
	s.prefetchTOCs(ctx, ref, mf)
	s.mu.Lock()
	if _, ok := s.manifests[dgst]; !ok {
		s.manifests[dgst] = me
		s.mfOrder = append(s.mfOrder, dgst)
		if len(s.mfOrder) > manifestCacheEntries {
			delete(s.manifests, s.mfOrder[0])
			s.mfOrder = s.mfOrder[1:]
		}
	}
	s.mu.Unlock()
	return me, nil
}

// readTOC returns the TOC of desc, verified against tocDigest: from the
// node cache, or read from the registry (and then kept in the cache).
func (s *Store) readTOC(ctx context.Context, ref string, desc ocispec.Descriptor, tocDigest digest.Digest) (*fetch.BlobReader, *layerfmt.TOC, []byte, error) {
	blob, err := fetch.NewBlobReader(s.cfg.Hosts, ref, desc, fetch.WithRequestMetrics(s.cfg.FetchMetrics))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("open blob %s of %s: %w", desc.Digest, ref, err)
	}
	if toc, raw := s.cachedTOC(ctx, desc, tocDigest); toc != nil {
		return blob, toc, raw, nil
	}
	tail := &tailRecorder{ra: blob.ReaderAt(ctx)}
	toc, err := layerfmt.ReadTOC(ctx, tail, desc.Size, tocDigest)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("read TOC of layer %s: %w", desc.Digest, err)
	}
	raw := s.keepTOC(ctx, desc, tocDigest, tail)
	return blob, toc, raw, nil
}

// prefetchTOCs starts reading the TOC of every lazy layer of mf that is not
// mounted or being read already, and drops stale unclaimed results.
func (s *Store) prefetchTOCs(ctx context.Context, ref string, mf *ocispec.Manifest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for d, f := range s.tocs {
		if now.Sub(f.started) > tocPrefetchTTL {
			delete(s.tocs, d)
		}
	}
	mountedDigests := make(map[digest.Digest]bool, len(s.mounts))
	for _, m := range s.mounts {
		mountedDigests[m.desc.Digest] = true
	}
	for _, desc := range mf.Layers {
		tocDigest, err := digest.Parse(desc.Annotations[layerfmt.AnnotationTOCDigest])
		if err != nil || mountedDigests[desc.Digest] || s.tocs[desc.Digest] != nil || s.tooSmall(desc) {
			continue
		}
		f := &tocFetch{done: make(chan struct{}), started: now}
		s.tocs[desc.Digest] = f
		go func() {
			defer close(f.done)
			s.tocSem <- struct{}{}
			defer func() { <-s.tocSem }()
			fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), tocPrefetchTimeout)
			defer cancel()
			f.blob, f.toc, f.raw, f.err = s.readTOC(fctx, ref, desc, tocDigest)
		}()
	}
}

// tooSmall reports whether a new mount of the layer desc is declined for
// its size (Config.LazyMinSize).
func (s *Store) tooSmall(desc ocispec.Descriptor) bool {
	return desc.Size < s.cfg.LazyMinSize
}

// claimTOC returns (and forgets) the prefetched TOC of layer d: nil, nil,
// nil when none was prefetched.
func (s *Store) claimTOC(ctx context.Context, d digest.Digest) (*fetch.BlobReader, *layerfmt.TOC, []byte, error) {
	s.mu.Lock()
	f := s.tocs[d]
	delete(s.tocs, d)
	s.mu.Unlock()
	if f == nil {
		return nil, nil, nil, nil
	}
	select {
	case <-f.done:
		return f.blob, f.toc, f.raw, f.err
	case <-ctx.Done():
		return nil, nil, nil, ctx.Err()
	}
}

func findLayer(mf *ocispec.Manifest, d digest.Digest) (ocispec.Descriptor, bool) {
	for _, l := range mf.Layers {
		if l.Digest == d {
			return l, true
		}
	}
	return ocispec.Descriptor{}, false
}

// Check reports whether mountpoint is still a live FUSE mount of ours. A
// mount whose server died answers statfs with ENOTCONN; one whose server
// hangs would block the caller forever, so the probe is bounded by
// checkTimeout (the probing goroutine is then left behind, blocked in the
// kernel, which is the lesser evil).
func (s *Store) Check(ctx context.Context, mountpoint string, labels map[string]string) error {
	s.mu.Lock()
	_, ok := s.mounts[mountpoint]
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("no layer mounted at %s: %w", mountpoint, errdefs.ErrNotFound)
	}
	done := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		if err := unix.Statfs(mountpoint, &st); err != nil {
			done <- fmt.Errorf("statfs %s: %w", mountpoint, err)
			return
		}
		if st.Type != fuseSuperMagic {
			done <- fmt.Errorf("%s is not a FUSE mount (f_type %#x)", mountpoint, st.Type)
			return
		}
		done <- nil
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(checkTimeout):
		return fmt.Errorf("statfs %s: no answer within %s", mountpoint, checkTimeout)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Unmount stops the layer's background fill and unmounts it. It fails (and
// keeps the layer) while the mount is busy.
func (s *Store) Unmount(ctx context.Context, mountpoint string) error {
	s.mu.Lock()
	m, ok := s.mounts[mountpoint]
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("no layer mounted at %s: %w", mountpoint, errdefs.ErrNotFound)
	}
	if err := m.srv.Unmount(); err != nil {
		return fmt.Errorf("unmount layer %s: %w", m.desc.Digest, err)
	}
	m.cancel()
	s.cfg.Cache.Unpin(metaPinOwner(mountpoint))
	// Overlay mounts keep private references to their lower layers, so
	// the FUSE connection may go on serving a container after Unmount:
	// the chunk source stays open until the kernel lets go (Wait).
	go func() {
		m.srv.Wait()
		m.layer.Close()
	}()
	s.forget(ctx, mountpoint)
	s.mu.Lock()
	delete(s.mounts, mountpoint)
	s.mu.Unlock()
	return nil
}

// LayerStatus describes one mounted layer.
type LayerStatus struct {
	Mountpoint string
	Digest     digest.Digest
	BlobSize   int64
	// CachedBytes of TotalBytes (compressed bytes of the layer's chunks)
	// are in the node cache.
	CachedBytes, TotalBytes int64
	// Environments prepared over the layer since it was mounted
	// (NoteEnvironment; after a restart, those whose snapshots still
	// exist). Shown in status; the fill and the native copy do not
	// depend on it.
	Environments int
	// Fill is what the layer's background fill is doing.
	Fill fetch.FillStatus
	// Native is where the layer's native copy stands; empty without
	// native copies (Config.Native).
	Native NativeState
}

// Footprints returns, for every mounted layer, the frames its readers
// have asked for in the order of their first read, with its time
// (fetch.Layer.Footprint): what a workload needs of each layer and when,
// for layerfmt.AnnotationPrefetch.
func (s *Store) Footprints() map[digest.Digest][]layerfmt.PrefetchEntry {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[digest.Digest][]layerfmt.PrefetchEntry, len(s.mounts))
	for _, m := range s.mounts {
		if fp := m.layer.Footprint(); len(fp) > 0 {
			out[m.desc.Digest] = fp
		}
	}
	return out
}

// Status reports every mounted layer, keyed by mountpoint.
func (s *Store) Status() map[string]LayerStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]LayerStatus, len(s.mounts))
	for mp, m := range s.mounts {
		ls := LayerStatus{Mountpoint: mp, Digest: m.desc.Digest, BlobSize: m.desc.Size}
		ls.CachedBytes, ls.TotalBytes = m.layer.Progress()
		ls.Environments = m.layer.Environments()
		ls.Fill = m.layer.FillStatus()
		if s.cfg.Native != nil {
			ls.Native, _ = m.native.Load().(NativeState)
			if _, ok := s.cfg.Native.Dir(m.desc.Digest); ok {
				// Built for another mount of the layer, or before it.
				ls.Native = NativeReady
			}
		}
		out[mp] = ls
	}
	return out
}

// nonEmpty reports whether the file at p exists and holds something.
func nonEmpty(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Size() > 0
}
