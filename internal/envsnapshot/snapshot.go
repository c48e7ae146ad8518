//go:build linux

package envsnapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/beneath"
	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/layerfmt"
)

// Annotations a snapshot image carries.
const (
	// AnnotationBaseLayers (manifest) is how many of the image's layers
	// belong to the original image; the layers above it are snapshot
	// diffs.
	AnnotationBaseLayers = "io.envsnap.snapshot.base-layers"
	// AnnotationParent (manifest) is the manifest digest of the image the
	// snapshotted container ran.
	AnnotationParent = "io.envsnap.snapshot.parent"
	// AnnotationContainer (manifest) is the snapshotted container's ID.
	AnnotationContainer = "io.envsnap.snapshot.container"
	// AnnotationSquashedFrom (manifest) is, on an image made by a
	// background squash, the manifest digest of the unsquashed snapshot
	// it replaced under the same reference.
	AnnotationSquashedFrom = "io.envsnap.snapshot.squashed-from"
	// AnnotationSquashed (layer) counts the snapshot diffs merged into a
	// squashed layer.
	AnnotationSquashed = "io.envsnap.snapshot.squashed"
)

// Defaults of Options.
const (
	DefaultSnapshotter = "envsnap"
	// DefaultMaxDiffSize caps a diff's file data. A running container's
	// diff is read into memory before it is encoded, so the cap also
	// bounds the memory a snapshot takes.
	DefaultMaxDiffSize = 2 << 30
)

// Options configure Take. The zero value uses the defaults.
type Options struct {
	// Hosts says how to reach registries (see internal/registry).
	Hosts docker.RegistryHosts
	// Snapshotter is the only snapshotter whose containers are accepted
	// (DefaultSnapshotter).
	Snapshotter string
	// MaxDiffSize caps the file data of the diff (DefaultMaxDiffSize;
	// negative: no cap).
	MaxDiffSize int64
	// MaxDepth bounds the snapshot layers above the original image
	// (DefaultMaxDepth); see Decide.
	MaxDepth int
	// TempDir holds the encoded layer when it is squashed (it is
	// streamed to the registry otherwise).
	TempDir string
	// UploadChunk is the size of the requests that stream the diff layer
	// to the registry while it is encoded (DefaultUploadChunk). Negative:
	// no streaming; the layer is written to TempDir and uploaded after
	// the encode with containerd's pusher, for a registry that refuses
	// chunked uploads.
	UploadChunk int
	// Platform picks the manifest of a multi-platform image (default the
	// running platform).
	Platform platforms.MatchComparer
	// Log receives progress lines; nil discards them.
	Log io.Writer
}

// Result describes a pushed snapshot.
type Result struct {
	Ref      string
	Manifest ocispec.Descriptor
	// Layer is the pushed diff layer (the squashed one after a squash).
	Layer  ocispec.Descriptor
	DiffID digest.Digest
	Diff   DiffStats
	// Frozen is how long the container's cgroup was frozen (freeze to
	// thaw); 0 for a container that was not running. Copy is the part of
	// it spent reading the writable layer into memory; the rest is
	// freezing and thawing.
	Frozen, Copy time.Duration
	// Precopy is how long the writable layer's files were read into
	// memory before the freeze, while the container ran. FilesCopied
	// counts the regular files read while frozen, FilesReused those kept
	// from the pre-copy instead.
	Precopy                  time.Duration
	FilesCopied, FilesReused int
	// Freezer says how the container was frozen: "cgroup DIR" (directly)
	// or "task pause" (through containerd); empty when it was not.
	Freezer string
	// UploadedBytes counts the blob bytes sent: the layer, the config
	// and the manifest. Base layers are linked, never sent.
	UploadedBytes int64
	LayersLinked  int
	// Depth is the number of snapshot layers above the original image.
	Depth int
	// Squashed is how many earlier snapshot layers were merged into Layer
	// before the push.
	Squashed int
	// Squash is set when the snapshot went one layer over the depth
	// limit: the squash then runs in the background (see Decide); Wait
	// for it before the process exits.
	Squash *Squashing
	// EncodedEarly is set when the layer encoded (and streamed) from the
	// pre-copy while it was read turned out to be the frozen state's
	// diff: nothing was encoded after the thaw, and Encode is the wait
	// for that encode to finish.
	EncodedEarly bool
	// Encode is the time spent writing the diff as an envsnap layer,
	// which is uploaded as it is written (unless it is squashed first or
	// UploadChunk is negative) while the base layers are linked; Push the
	// time after it (and after a squash) until the manifest is pushed:
	// the rest of the upload, the config and the manifest. Duration is
	// the whole snapshot.
	Encode, Push time.Duration
	Duration     time.Duration
}

func (o *Options) defaults() {
	if o.Snapshotter == "" {
		o.Snapshotter = DefaultSnapshotter
	}
	if o.MaxDiffSize == 0 {
		o.MaxDiffSize = DefaultMaxDiffSize
	}
	if o.MaxDiffSize < 0 {
		o.MaxDiffSize = 0
	}
	if o.MaxDepth < 1 {
		o.MaxDepth = DefaultMaxDepth
	}
	if o.UploadChunk == 0 {
		o.UploadChunk = DefaultUploadChunk
	}
	if o.Platform == nil {
		o.Platform = platforms.Default()
	}
	if o.Log == nil {
		o.Log = io.Discard
	}
}

// source is what a snapshot starts from: the container and its image.
type source struct {
	id        string
	imageRef  string
	upper     string
	desc      ocispec.Descriptor // the image's manifest
	manifest  ocispec.Manifest
	config    ocispec.Image
	base      int // original image layers
	env       []string
	cwd       string
	container client.Container
}

// Take snapshots the files of container id (in ctx's namespace) and pushes
// them to target as an image: the container's image plus one diff layer in
// the envsnap format. A running container's writable layer is pre-copied
// while it runs, then its cgroup is frozen only while the copy is brought
// up to date; it keeps running afterwards. The manifest is pushed last,
// so a failure leaves no image referring to missing blobs. When the
// snapshot goes one layer over o.MaxDepth, Result.Squash reports a squash
// running in the background (see Decide).
func Take(ctx context.Context, c *client.Client, id, target string, o Options) (*Result, error) {
	o.defaults()
	start := time.Now()
	src, err := loadSource(ctx, c, id, o)
	if err != nil {
		return nil, err
	}
	res := &Result{Ref: target}
	// Every read of the writable layer resolves beneath this descriptor
	// (see internal/beneath): the container owns what is in it, and may
	// swap any name for a symlink to a host path while it is read.
	root, err := beneath.OpenRoot(src.upper)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: open writable layer: %w", id, err)
	}
	defer root.Close()
	tmp, err := os.MkdirTemp(o.TempDir, "envsnap-snapshot-")
	if err != nil {
		return nil, err
	}
	keepTmp := false // a background squash takes it over
	defer func() {
		if !keepTmp {
			os.RemoveAll(tmp)
		}
	}()
	parentDiffs := len(src.manifest.Layers) - src.base
	layout := Decide(parentDiffs, o.MaxDepth)
	first := layout
	if layout.Background {
		first = Layout{Keep: layout.Keep}
	}
	// Unless the parent's layers are squashed with it first, the new diff
	// is the pushed layer, streamed to the registry while it is encoded.
	// It goes to disk only for a squash or an unstreamed upload.
	stream := (layout.Squash == 0 || layout.Background) && o.UploadChunk > 0
	diffPath := ""
	if layout.Squash > 0 || !stream {
		diffPath = filepath.Join(tmp, "diff")
	}
	pusher, err := group.NewPusher(ctx, o.Hosts, target)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: push %s: %w", id, target, err)
	}
	// The base layers are linked and the diff layer's upload session is
	// opened while the writable layer is read: both only add blobs (or
	// an upload session the registry expires), which nothing refers to
	// before the manifest.
	var links errgroup.Group
	links.Go(func() error {
		n, err := linkLayers(ctx, pusher, src.manifest.Layers[:src.base+first.Keep], src.imageRef, target)
		res.LayersLinked = n
		return err
	})
	pushFailed := func(err error) error {
		return fmt.Errorf("snapshot %s: %w (the manifest was not pushed: %s is unchanged)", id, err, target)
	}
	var up *blobUpload
	var upErr error
	started := make(chan struct{})
	go func() {
		defer close(started)
		if stream {
			up, upErr = startUpload(ctx, o.Hosts, target, o.UploadChunk)
		}
	}()
	// The layer is encoded and streamed from the pre-copy while its
	// files are still being read, on the bet that the frozen read finds
	// nothing changed; it is kept only if the frozen read gives exactly
	// the same diff, else it is dropped with its upload session and the
	// frozen read is encoded.
	specCtx, cancelSpec := context.WithCancel(ctx)
	defer cancelSpec()
	var (
		speculating bool
		specDone    = make(chan struct{})
		specBlob    *blob
		specStats   DiffStats
		specErr     error
	)
	speculate := func(s *speculation) {
		if !stream {
			return
		}
		speculating = true
		go func() {
			defer close(specDone)
			<-started
			if up == nil {
				return
			}
			specBlob, specStats, specErr = encodeDiff(specCtx, diffPath, up, s.entries, o.MaxDiffSize)
		}()
	}
	dropSpec := func() {
		if speculating {
			cancelSpec()
			<-specDone
			speculating = false
		}
	}
	tree, spec, err := readUpper(ctx, root, src, o, res, speculate)
	<-started
	if err != nil || upErr != nil {
		dropSpec()
		if up != nil {
			up.Abort()
		}
		_ = links.Wait()
		if err != nil {
			return nil, fmt.Errorf("snapshot %s: %w", id, err)
		}
		return nil, pushFailed(fmt.Errorf("push %s: diff layer: %w", target, upErr))
	}
	fmt.Fprintf(o.Log, "captured %s (pre-copy %s; frozen %s, of which reading %s)\n", id, res.Precopy.Round(time.Millisecond), res.Frozen.Round(time.Microsecond), res.Copy.Round(time.Microsecond))
	t := time.Now()
	var diff *blob
	if speculating && spec.holds(tree) {
		<-specDone
		diff, res.Diff, err = specBlob, specStats, specErr
		res.EncodedEarly = true
	} else {
		if speculating {
			dropSpec()
			up.Abort()
			if up, err = startUpload(ctx, o.Hosts, target, o.UploadChunk); err != nil {
				_ = links.Wait()
				return nil, pushFailed(fmt.Errorf("push %s: diff layer: %w", target, err))
			}
		}
		var sink io.Writer
		if up != nil {
			sink = up
		}
		var entries []*upperEntry
		if tree != nil {
			entries = tree.entries
		} else {
			entries, err = scanUpper(ctx, root) // read in place
		}
		if err == nil {
			diff, res.Diff, err = encodeDiff(ctx, diffPath, sink, entries, o.MaxDiffSize)
		}
	}
	if err != nil {
		if up != nil {
			up.Abort()
		}
		_ = links.Wait()
		if up != nil && up.failed() != nil {
			// The encoder stopped because the registry did.
			return nil, pushFailed(fmt.Errorf("push %s: diff layer: %w", target, up.failed()))
		}
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	res.Encode = time.Since(t)

	top := diff
	if layout.Squash > 0 && !layout.Background {
		top, err = squashLayers(ctx, filepath.Join(tmp, "squash"), src, diff, o)
		if err != nil {
			_ = links.Wait()
			return nil, fmt.Errorf("snapshot %s: squash %d layers: %w", id, layout.Squash+1, err)
		}
		top.desc.Annotations[AnnotationSquashed] = strconv.Itoa(layout.Squash + 1)
		res.Squashed = layout.Squash
		fmt.Fprintf(o.Log, "squashed %d snapshot layers into one\n", layout.Squash+1)
	}
	img, err := buildImage(src, first, top)
	if err != nil {
		if up != nil {
			up.Abort()
		}
		_ = links.Wait()
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	res.Layer, res.DiffID, res.Depth = top.desc, top.diffID, first.Keep+1
	t = time.Now()
	// The rest of the layer and the config go up together; the manifest
	// only once every blob it names is there.
	var blobs errgroup.Group
	blobs.Go(func() error {
		if up == nil {
			return img.pushLayer(ctx, pusher, target, top, res)
		}
		if err := up.Commit(top.desc.Digest, top.desc.Size); err != nil {
			return fmt.Errorf("push %s: diff layer: %w", target, err)
		}
		res.UploadedBytes += top.desc.Size
		return nil
	})
	var configSent bool
	blobs.Go(func() (err error) {
		configSent, err = img.pushConfig(ctx, pusher, target)
		return err
	})
	err = errors.Join(links.Wait(), blobs.Wait())
	if configSent {
		res.UploadedBytes += img.manifest.Config.Size
	}
	if err == nil {
		err = img.pushManifest(ctx, pusher, target, res, nil)
	}
	res.Push = time.Since(t)
	if err != nil {
		return nil, pushFailed(err)
	}
	res.Manifest = img.desc
	res.Duration = time.Since(start)
	log.G(ctx).WithField("container", id).WithField("ref", target).WithField("frozen", res.Frozen).
		WithField("uploaded", res.UploadedBytes).Info("pushed environment snapshot")
	if layout.Background {
		keepTmp = true
		res.Squash = startSquash(ctx, src, diff, tmp, target, img.desc, layout, o)
	}
	return res, nil
}

// Squashing is a squash running in the background after a snapshot was
// pushed (see Decide).
type Squashing struct {
	done chan struct{}
	res  *SquashResult
	err  error
}

// SquashResult describes a finished background squash.
type SquashResult struct {
	// Manifest is the squashed image, Ref now points at it.
	Ref      string
	Manifest ocispec.Descriptor
	Layer    ocispec.Descriptor
	// Squashed is how many snapshot layers were merged into Layer.
	Squashed      int
	UploadedBytes int64
	Duration      time.Duration
}

// Wait blocks until the squash has finished or failed. A failed squash
// leaves the snapshot as first pushed (one layer over the limit; the next
// snapshot of it squashes before it pushes).
func (s *Squashing) Wait() (*SquashResult, error) {
	<-s.done
	return s.res, s.err
}

// ErrRefMoved is returned by a background squash that found its
// reference pointing at another manifest than the one it squashes: it
// then pushes no manifest (the squashed blobs stay unreferenced), so a
// newer image under the name is never replaced by an older one.
var ErrRefMoved = errors.New("reference moved since the snapshot")

// startSquash merges the snapshot layers of the image just pushed to
// target as pushed (whose manifest is pushed) into one layer, pushes the
// squashed image's blobs, and re-tags target to it if target still
// points at pushed. It owns tmp (holding the new diff) and removes it.
func startSquash(ctx context.Context, src *source, diff *blob, tmp, target string, pushed ocispec.Descriptor, layout Layout, o Options) *Squashing {
	s := &Squashing{done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer os.RemoveAll(tmp)
		start := time.Now()
		n := layout.Squash + 1
		fail := func(err error) {
			s.err = fmt.Errorf("background squash of %s (%d snapshot layers): %w", target, n, err)
			log.G(ctx).WithError(s.err).Warn("snapshot stays unsquashed")
		}
		top, err := squashLayers(ctx, filepath.Join(tmp, "squash"), src, diff, o)
		if err != nil {
			fail(err)
			return
		}
		top.desc.Annotations[AnnotationSquashed] = strconv.Itoa(n)
		img, err := buildImage(src, Layout{Squash: layout.Squash}, top)
		if err != nil {
			fail(err)
			return
		}
		img.manifest.Annotations[AnnotationSquashedFrom] = pushed.Digest.String()
		if err := img.finish(); err != nil {
			fail(err)
			return
		}
		var tmpRes Result
		resolver := docker.NewResolver(docker.ResolverOptions{Hosts: o.Hosts})
		guard := func(ctx context.Context) error {
			_, now, err := resolver.Resolve(ctx, target)
			if err != nil {
				return fmt.Errorf("resolve %s: %w", target, err)
			}
			if now.Digest != pushed.Digest {
				return fmt.Errorf("%s now points at %s, not at the snapshot %s: %w", target, now.Digest, pushed.Digest, ErrRefMoved)
			}
			return nil
		}
		if err := img.push(ctx, o.Hosts, src.imageRef, target, top, &tmpRes, guard); err != nil {
			fail(err)
			return
		}
		s.res = &SquashResult{Ref: target, Manifest: img.desc, Layer: top.desc, Squashed: n,
			UploadedBytes: tmpRes.UploadedBytes, Duration: time.Since(start)}
		log.G(ctx).WithField("ref", target).WithField("manifest", img.desc.Digest).WithField("layers", n).Info("squashed snapshot layers in the background")
	}()
	return s
}

func loadSource(ctx context.Context, c *client.Client, id string, o Options) (*source, error) {
	ctr, err := c.LoadContainer(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	info, err := ctr.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", id, err)
	}
	if info.Snapshotter != o.Snapshotter {
		return nil, fmt.Errorf("container %s uses the %q snapshotter: only containers on %q can be snapshotted (their writable layer is read from its upper directory and the image's layers are linked lazily): %w",
			id, info.Snapshotter, o.Snapshotter, errdefs.ErrFailedPrecondition)
	}
	if info.SnapshotKey == "" || info.Image == "" {
		return nil, fmt.Errorf("container %s has no snapshot or no image: %w", id, errdefs.ErrFailedPrecondition)
	}
	src := &source{id: id, imageRef: info.Image, container: ctr}
	// The look-ups below are independent round trips to containerd.
	var g errgroup.Group
	g.Go(func() error {
		mounts, err := c.SnapshotService(info.Snapshotter).Mounts(ctx, info.SnapshotKey)
		if err != nil {
			return fmt.Errorf("container %s: mounts of snapshot %s: %w", id, info.SnapshotKey, err)
		}
		if src.upper, err = writableDir(mounts); err != nil {
			return fmt.Errorf("container %s: %w", id, err)
		}
		return nil
	})
	g.Go(func() error {
		img, err := c.ImageService().Get(ctx, info.Image)
		if err != nil {
			return fmt.Errorf("container %s: image %s: %w", id, info.Image, err)
		}
		cs := c.ContentStore()
		if src.desc, err = manifestDesc(ctx, cs, img.Target, o.Platform); err != nil {
			return fmt.Errorf("container %s: image %s: %w", id, info.Image, err)
		}
		if err := readJSON(ctx, cs, src.desc, &src.manifest); err != nil {
			return fmt.Errorf("container %s: manifest of %s: %w", id, info.Image, err)
		}
		if err := readJSON(ctx, cs, src.manifest.Config, &src.config); err != nil {
			return fmt.Errorf("container %s: config of %s: %w", id, info.Image, err)
		}
		if len(src.config.RootFS.DiffIDs) != len(src.manifest.Layers) {
			return fmt.Errorf("container %s: image %s lists %d diff ids for %d layers", id, info.Image, len(src.config.RootFS.DiffIDs), len(src.manifest.Layers))
		}
		return nil
	})
	var sinfo snapshots.Info
	g.Go(func() (err error) {
		if sinfo, err = c.SnapshotService(info.Snapshotter).Stat(ctx, info.SnapshotKey); err != nil {
			return fmt.Errorf("container %s: snapshot %s: %w", id, info.SnapshotKey, err)
		}
		return nil
	})
	var spec *oci.Spec
	g.Go(func() (err error) {
		if spec, err = ctr.Spec(ctx); err != nil {
			return fmt.Errorf("container %s: spec: %w", id, err)
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		return nil, err
	}
	// The diff is only meaningful on the layers the container runs on:
	// if the image name now points at other content, say so.
	if chain := identity.ChainID(src.config.RootFS.DiffIDs).String(); sinfo.Parent != chain {
		return nil, fmt.Errorf("container %s runs on snapshot %s, but image %s now has layers %s (the name was moved since the container was created): %w",
			id, sinfo.Parent, info.Image, chain, errdefs.ErrFailedPrecondition)
	}
	src.base = len(src.manifest.Layers)
	if v, ok := src.manifest.Annotations[AnnotationBaseLayers]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > len(src.manifest.Layers) {
			return nil, fmt.Errorf("container %s: image %s: bad %s annotation %q", id, info.Image, AnnotationBaseLayers, v)
		}
		src.base = n
	}
	src.env, src.cwd = src.config.Config.Env, src.config.Config.WorkingDir
	if spec.Process != nil {
		src.env, src.cwd = spec.Process.Env, spec.Process.Cwd
	}
	return src, nil
}

// manifestDesc resolves an index to the manifest for platform.
func manifestDesc(ctx context.Context, cs content.Store, target ocispec.Descriptor, platform platforms.MatchComparer) (ocispec.Descriptor, error) {
	var found *ocispec.Descriptor
	err := images.Walk(ctx, images.Handlers(images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
		if images.IsManifestType(desc.MediaType) {
			if found == nil && (desc.Platform == nil || platform.Match(*desc.Platform)) {
				d := desc
				found = &d
			}
			return nil, nil
		}
		return nil, nil
	}), images.FilterPlatforms(images.ChildrenHandler(cs), platform)), target)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if found == nil {
		return ocispec.Descriptor{}, fmt.Errorf("no manifest for this platform: %w", errdefs.ErrNotFound)
	}
	return *found, nil
}

func readJSON(ctx context.Context, cs content.Provider, desc ocispec.Descriptor, v any) error {
	b, err := content.ReadBlob(ctx, cs, desc)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// writableDir finds the writable directory in an active snapshot's
// mounts as containerd's overlay-based snapshotters hand them out: the
// upperdir option of an overlay mount, or the source of a read-write bind
// mount when the snapshot has no parent.
func writableDir(mounts []mount.Mount) (string, error) {
	if len(mounts) != 1 {
		return "", fmt.Errorf("snapshot has %d mounts, want one overlay or bind mount: %w", len(mounts), errdefs.ErrNotImplemented)
	}
	m := mounts[0]
	switch m.Type {
	case "bind":
		return m.Source, nil
	case "overlay":
		for _, opt := range m.Options {
			if v, ok := strings.CutPrefix(opt, "upperdir="); ok {
				return v, nil
			}
		}
		return "", fmt.Errorf("overlay mount without upperdir: the snapshot is not writable: %w", errdefs.ErrFailedPrecondition)
	}
	return "", fmt.Errorf("%s mount: no upper directory to read: %w", m.Type, errdefs.ErrNotImplemented)
}

// readUpper reads the container's writable layer into memory,
// consistently, and records the freeze in res. The upper directory of a
// running task is first pre-copied while the task runs; then its cgroup
// is frozen, the files that changed, or may have, since the pre-copy are
// read again along with everything that is not a regular file, and the
// cgroup is thawed, also when anything failed. A container without a
// running task is read in place as the diff is written: it returns nil.
//
// speculate, if set, is handed the pre-copy as soon as its walk is done,
// its reads still running (see speculation); the speculation is returned
// with the frozen read, for the caller to check.
func readUpper(ctx context.Context, root *beneath.Dir, src *source, o Options, res *Result, speculate func(*speculation)) (tree *captured, spec *speculation, err error) {
	task, err := src.container.Task(ctx, nil)
	if errdefs.IsNotFound(err) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("task: %w", err)
	}
	status, err := task.Status(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("task status: %w", err)
	}
	if status.Status != client.Running && status.Status != client.Paused {
		// Created (never started) or stopped: nothing writes.
		return nil, nil, nil
	}
	read := func(pre *precopied, dirty *mapped) (*captured, error) {
		t := time.Now()
		tree, err := capture(ctx, root, pre, dirty, o.MaxDiffSize)
		res.Copy = time.Since(t)
		if tree != nil {
			res.FilesCopied, res.FilesReused = tree.Copied, tree.Reused
		}
		return tree, err
	}
	if status.Status == client.Paused {
		// Frozen by someone else, who also decides when it thaws.
		tree, err := read(nil, nil)
		return tree, nil, err
	}
	t := time.Now()
	spec, err = startPrecopy(ctx, root, o.MaxDiffSize)
	var pre *precopied
	if err == nil {
		if speculate != nil {
			speculate(spec)
		}
		pre, err = spec.wait()
	}
	res.Precopy = time.Since(t)
	if errors.Is(err, ErrDiffTooLarge) {
		return nil, spec, err
	}
	if cerr := ctx.Err(); cerr != nil {
		// Cancelled: nothing is frozen yet, and nothing will be.
		return nil, spec, fmt.Errorf("pre-copy of the writable layer: %w", cerr)
	}
	if err != nil {
		log.G(ctx).WithError(err).Warn("pre-copy of the writable layer failed; reading all of it while frozen")
		pre = nil
	}
	t0 := time.Now()
	fz, err := freeze(ctx, task, res)
	if err != nil {
		return nil, spec, err
	}
	tree, serr := func() (*captured, error) {
		pids, err := fz.pids()
		if err != nil {
			return nil, fmt.Errorf("processes of the frozen task: %w", err)
		}
		dirty, err := mappedShared(pids)
		if err != nil {
			return nil, fmt.Errorf("shared mappings of the frozen task: %w", err)
		}
		return read(pre, dirty)
	}()
	rerr := fz.thaw()
	res.Frozen = time.Since(t0)
	if rerr != nil {
		return nil, spec, rerr
	}
	if serr != nil {
		return nil, spec, serr
	}
	return tree, spec, nil
}

// frozen is a task frozen by freeze.
type frozen struct {
	thaw func() error
	// pids lists the task's processes (all of them stopped).
	pids func() ([]int, error)
}

// freeze stops every process of a running task. It freezes the task's
// cgroup directly (v1 freezer or v2 cgroup.freeze, waiting until the
// kernel reports it frozen): the same state containerd's task Pause
// reaches through the shim and a runc process, in milliseconds instead of
// the 0.3-1 s that round trip took on a loaded node. A task whose cgroup
// cannot be found from its process (a runtime that keeps it elsewhere,
// such as a VM) is paused through containerd instead. thaw runs even when
// ctx is cancelled: a container must never stay frozen because its
// snapshot failed.
func freeze(ctx context.Context, task client.Task, res *Result) (*frozen, error) {
	fz, ferr := cgroupfs.FreezerOf(int(task.Pid()))
	if ferr == nil {
		if err := fz.Freeze(); err != nil {
			return nil, err
		}
		res.Freezer = "cgroup " + fz.Dir()
		return &frozen{thaw: fz.Thaw, pids: fz.Pids}, nil
	}
	log.G(ctx).WithError(ferr).WithField("pid", task.Pid()).Warn("no cgroup freezer for the task's process; pausing it through containerd")
	if err := task.Pause(ctx); err != nil {
		return nil, fmt.Errorf("freeze (pause task): %w", err)
	}
	res.Freezer = "task pause"
	nctx := context.WithoutCancel(ctx)
	return &frozen{
		thaw: func() error {
			rctx, cancel := context.WithTimeout(nctx, 30*time.Second)
			defer cancel()
			if err := task.Resume(rctx); err != nil {
				return fmt.Errorf("thaw (resume task): %w", err)
			}
			return nil
		},
		pids: func() ([]int, error) {
			ps, err := task.Pids(nctx)
			var out []int
			for _, p := range ps {
				out = append(out, int(p.Pid))
			}
			return out, err
		},
	}, nil
}

// blob is an encoded envsnap layer in a local file.
type blob struct {
	path   string
	desc   ocispec.Descriptor
	diffID digest.Digest
	toc    digest.Digest
}

// encodeLayer converts the tar written by write into an envsnap layer,
// written to the file at path (none when path is empty) and to sink (if
// set) as it is produced.
func encodeLayer(ctx context.Context, path string, sink io.Writer, write func(io.Writer) error) (*blob, error) {
	var outs []io.Writer
	var f *os.File
	if path != "" {
		var err error
		if f, err = os.Create(path); err != nil {
			return nil, err
		}
		defer f.Close()
		outs = append(outs, f)
	}
	if sink != nil {
		outs = append(outs, sink)
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(write(pw)) }()
	wr, err := layerfmt.Convert(ctx, io.MultiWriter(outs...), pr)
	pr.CloseWithError(err)
	if err != nil {
		return nil, fmt.Errorf("encode layer: %w", err)
	}
	if f != nil {
		if err := f.Close(); err != nil {
			return nil, err
		}
	}
	return &blob{
		path:   path,
		desc:   ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: wr.Digest, Size: wr.Size, Annotations: wr.Annotations()},
		diffID: wr.DiffID,
		toc:    wr.TOCDigest,
	}, nil
}

// encodeDiff encodes entries as an envsnap layer, written to the file at
// path (none when path is empty) and to sink (if set) as it is produced.
func encodeDiff(ctx context.Context, path string, sink io.Writer, entries []*upperEntry, maxData int64) (*blob, DiffStats, error) {
	var outs []io.Writer
	var f *os.File
	if path != "" {
		var err error
		if f, err = os.Create(path); err != nil {
			return nil, DiffStats{}, err
		}
		defer f.Close()
		outs = append(outs, f)
	}
	if sink != nil {
		outs = append(outs, sink)
	}
	x, err := layerfmt.NewWriter(io.MultiWriter(outs...))
	if err != nil {
		return nil, DiffStats{}, fmt.Errorf("encode layer: %w", err)
	}
	defer x.Abort()
	st, err := writeDiff(ctx, x, entries, maxData)
	if err != nil {
		return nil, st, err
	}
	wr, err := x.Close()
	if err != nil {
		return nil, st, fmt.Errorf("encode layer: %w", err)
	}
	if f != nil {
		if err := f.Close(); err != nil {
			return nil, st, err
		}
	}
	return &blob{
		path:   path,
		desc:   ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: wr.Digest, Size: wr.Size, Annotations: wr.Annotations()},
		diffID: wr.DiffID,
		toc:    wr.TOCDigest,
	}, st, nil
}

// squashLayers merges the parent's snapshot layers (read from the
// registry, lazily: TOCs and the chunks of files that survive) and the new
// diff into one layer.
func squashLayers(ctx context.Context, path string, src *source, diff *blob, o Options) (*blob, error) {
	var readers []*layerfmt.Reader
	for _, l := range src.manifest.Layers[src.base:] {
		toc := digest.Digest(l.Annotations[layerfmt.AnnotationTOCDigest])
		if toc == "" {
			return nil, fmt.Errorf("snapshot layer %s is not in the envsnap format: %w", l.Digest, layerfmt.ErrNotLayer)
		}
		br, err := fetch.NewBlobReader(o.Hosts, src.imageRef, l)
		if err != nil {
			return nil, err
		}
		r, err := layerfmt.NewReader(br.ReaderAt(ctx), l.Size, toc)
		if err != nil {
			return nil, fmt.Errorf("open snapshot layer %s: %w", l.Digest, err)
		}
		readers = append(readers, r)
	}
	f, err := os.Open(diff.path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	top, err := layerfmt.NewReader(f, diff.desc.Size, diff.toc)
	if err != nil {
		return nil, fmt.Errorf("open new diff: %w", err)
	}
	readers = append(readers, top)
	below, err := readBelow(ctx, o.Hosts, src.imageRef, src.manifest.Layers[:src.base])
	if err != nil {
		return nil, err
	}
	return encodeLayer(ctx, path, nil, func(w io.Writer) error { return Squash(ctx, w, below, readers) })
}
