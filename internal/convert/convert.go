// Package convert rewrites OCI images so that every layer is in the envsnap
// lazy layer format (layerfmt): it reads an image from a registry, an OCI
// layout directory or an OCI archive, converts each tar, tar+gzip or
// tar+zstd layer, rewrites configs (rootfs.diff_ids), manifests (layer
// descriptors with layerfmt annotations) and indexes (every selected
// platform), and writes the result to a registry, a layout or an archive.
//
// Everything is staged in a private containerd content store under a
// temporary directory, so the source is read once and partial results never
// reach the destination: the destination is written only after every layer
// converted.
package convert

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/log"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/layerfmt"
)

// Options configure a conversion.
type Options struct {
	// Platforms selects the platforms of multi-platform images to keep
	// ("linux/amd64", ...); empty keeps every platform.
	Platforms []string
	// Registry configures registry access for registry sources and
	// destinations.
	Registry registry.Options
	// LayerOptions are passed to layerfmt.Convert.
	LayerOptions []layerfmt.WriteOption
	// Progress, when set, receives one event per layer as it finishes.
	Progress func(LayerEvent)
	// TempDir holds the staging content store (default os.TempDir()).
	TempDir string
	// Parallel bounds concurrent layer conversions (default 2).
	Parallel int
	// ContainerdAddress and ContainerdNamespace locate a containerd
	// source (defaults /run/containerd/containerd.sock and "default").
	ContainerdAddress, ContainerdNamespace string
	// HintSource is the repository ("host/path") written into the hint
	// annotations of every layer in the format (layerfmt.WithHints): where
	// a snapshotter can fetch the blobs when the puller tells it nothing.
	// A registry destination's repository by default; no hints for a
	// layout or archive destination unless set.
	HintSource string
}

// LayerEvent reports one finished layer.
type LayerEvent struct {
	Source, Result ocispec.Descriptor
	// Passed is set when the layer was not converted: it already was in
	// the layer format, or it is not a tar layer (attestations, ...).
	Passed   bool
	Duration time.Duration
}

// Summary describes a finished conversion.
type Summary struct {
	Root      ocispec.Descriptor // the converted image's index or manifest
	Manifests int                // image manifests written
	Layers    int                // distinct layers in the output
	Converted int                // layers converted (the rest passed through)
	BytesIn   int64              // source size of the distinct layers
	BytesOut  int64              // output size of the distinct layers
	// Dropped counts index entries left out: other platforms, and
	// attestation manifests, whose subjects are the old manifests.
	Dropped  int
	Duration time.Duration
}

// Run converts the image at src and writes it to dst.
func Run(ctx context.Context, src, dst Location, o Options) (*Summary, error) {
	start := time.Now()
	if dst.Kind == Containerd {
		return nil, errors.New("a containerd image store can only be a source")
	}
	if o.Parallel <= 0 {
		o.Parallel = 2
	}
	if o.HintSource == "" && dst.Kind == Registry {
		host, repo, err := hostAndRepo(dst.Ref)
		if err != nil {
			return nil, fmt.Errorf("destination %s: %w", dst, err)
		}
		o.HintSource = host + "/" + repo
	}
	tmp, err := os.MkdirTemp(o.TempDir, "envsnap-convert-")
	if err != nil {
		return nil, fmt.Errorf("create staging directory: %w", err)
	}
	defer os.RemoveAll(tmp)
	store, err := local.NewStore(tmp)
	if err != nil {
		return nil, fmt.Errorf("open staging content store: %w", err)
	}
	var matcher platforms.MatchComparer
	if len(o.Platforms) > 0 {
		ps, err := platforms.ParseAll(o.Platforms)
		if err != nil {
			return nil, fmt.Errorf("parse platforms: %w", err)
		}
		matcher = platforms.Any(ps...)
	}
	c := &converter{store: store, opts: o, matcher: matcher, layers: map[digest.Digest]*layerResult{}}

	root, srcInfo, err := load(ctx, store, src, o, matcher)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", src, err)
	}
	out, err := c.convert(ctx, root)
	if err != nil {
		return nil, fmt.Errorf("convert %s: %w", src, err)
	}
	if err := write(ctx, store, out, dst, o.Registry, srcInfo, c.passedThrough()); err != nil {
		return nil, fmt.Errorf("write %s: %w", dst, err)
	}
	s := &Summary{Root: out, Manifests: c.manifests, Dropped: c.dropped, Duration: time.Since(start)}
	for _, l := range c.layers {
		s.Layers++
		if !l.passed {
			s.Converted++
		}
		s.BytesIn += l.src.Size
		s.BytesOut += l.desc.Size
	}
	return s, nil
}

type converter struct {
	store   content.Store
	opts    Options
	matcher platforms.MatchComparer

	mu        sync.Mutex
	layers    map[digest.Digest]*layerResult // by source layer digest
	manifests int
	dropped   int
}

type layerResult struct {
	once   sync.Once
	src    ocispec.Descriptor
	desc   ocispec.Descriptor
	diffID digest.Digest // "" when the config's diff_id stays
	passed bool
	err    error
}

func (c *converter) passedThrough() map[digest.Digest]bool {
	out := map[digest.Digest]bool{}
	for _, l := range c.layers {
		if l.passed {
			out[l.desc.Digest] = true
		}
	}
	return out
}

// convert returns the converted form of desc (an index, a manifest, or
// anything else, which is kept).
func (c *converter) convert(ctx context.Context, desc ocispec.Descriptor) (ocispec.Descriptor, error) {
	switch {
	case images.IsIndexType(desc.MediaType):
		return c.convertIndex(ctx, desc)
	case images.IsManifestType(desc.MediaType):
		return c.convertManifest(ctx, desc)
	}
	return desc, nil
}

func (c *converter) convertIndex(ctx context.Context, desc ocispec.Descriptor) (ocispec.Descriptor, error) {
	var idx ocispec.Index
	if err := readJSON(ctx, c.store, desc, &idx); err != nil {
		return desc, err
	}
	var kept []ocispec.Descriptor
	for _, m := range idx.Manifests {
		// Entries not staged were left out on purpose (other platforms,
		// attestations, platforms a containerd source never pulled).
		if _, err := c.store.Info(ctx, m.Digest); err != nil {
			c.mu.Lock()
			c.dropped++
			c.mu.Unlock()
			continue
		}
		if m.Annotations["vnd.docker.reference.type"] == "attestation-manifest" ||
			c.matcher != nil && m.Platform != nil && !c.matcher.Match(*m.Platform) {
			c.mu.Lock()
			c.dropped++
			c.mu.Unlock()
			continue
		}
		kept = append(kept, m)
	}
	if len(kept) == 0 {
		return desc, fmt.Errorf("index %s has no manifest for the selected platforms", desc.Digest)
	}
	for k, m := range kept {
		out, err := c.convert(ctx, m)
		if err != nil {
			return desc, err
		}
		kept[k] = out
	}
	idx.MediaType = ocispec.MediaTypeImageIndex
	idx.SchemaVersion = 2
	idx.Manifests = kept
	return c.writeJSON(ctx, desc, ocispec.MediaTypeImageIndex, idx)
}

func (c *converter) convertManifest(ctx context.Context, desc ocispec.Descriptor) (ocispec.Descriptor, error) {
	var m ocispec.Manifest
	if err := readJSON(ctx, c.store, desc, &m); err != nil {
		return desc, err
	}
	results := make([]*layerResult, len(m.Layers))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(c.opts.Parallel)
	for k, l := range m.Layers {
		c.mu.Lock()
		r, ok := c.layers[l.Digest]
		if !ok {
			r = &layerResult{src: l}
			c.layers[l.Digest] = r
		}
		c.mu.Unlock()
		results[k] = r
		g.Go(func() error {
			r.once.Do(func() { c.convertLayer(gctx, r) })
			return r.err
		})
	}
	if err := g.Wait(); err != nil {
		return desc, err
	}
	changed := false
	for k, r := range results {
		m.Layers[k] = r.desc
		if isOurs(r.desc) {
			m.Layers[k].Annotations = layerfmt.WithHints(r.desc.Annotations, c.opts.HintSource, r.desc.Digest, r.desc.Size)
		}
		changed = changed || r.diffID != ""
	}
	if changed {
		cfg, err := c.rewriteConfig(ctx, m.Config, results)
		if err != nil {
			return desc, err
		}
		m.Config = cfg
	}
	m.MediaType = ocispec.MediaTypeImageManifest
	m.SchemaVersion = 2
	c.mu.Lock()
	c.manifests++
	c.mu.Unlock()
	return c.writeJSON(ctx, desc, ocispec.MediaTypeImageManifest, m)
}

// rewriteConfig replaces the diff_ids of converted layers, keeping every
// other field of the config byte-for-byte as decoded JSON.
func (c *converter) rewriteConfig(ctx context.Context, desc ocispec.Descriptor, layers []*layerResult) (ocispec.Descriptor, error) {
	if desc.MediaType != ocispec.MediaTypeImageConfig && desc.MediaType != images.MediaTypeDockerSchema2Config {
		return desc, fmt.Errorf("converted layers of a manifest whose config is %s, not an image config", desc.MediaType)
	}
	var cfg map[string]json.RawMessage
	if err := readJSON(ctx, c.store, desc, &cfg); err != nil {
		return desc, err
	}
	var rootfs ocispec.RootFS
	if err := json.Unmarshal(cfg["rootfs"], &rootfs); err != nil {
		return desc, fmt.Errorf("config %s rootfs: %w", desc.Digest, err)
	}
	if len(rootfs.DiffIDs) != len(layers) {
		return desc, fmt.Errorf("config %s has %d diff_ids for %d layers", desc.Digest, len(rootfs.DiffIDs), len(layers))
	}
	for k, l := range layers {
		if l.diffID != "" {
			rootfs.DiffIDs[k] = l.diffID
		}
	}
	b, err := json.Marshal(rootfs)
	if err != nil {
		return desc, err
	}
	cfg["rootfs"] = b
	return c.writeJSON(ctx, desc, ocispec.MediaTypeImageConfig, cfg)
}

// isOurs reports whether a layer is already in the layer format.
func isOurs(desc ocispec.Descriptor) bool {
	return desc.MediaType == layerfmt.MediaTypeLayer && desc.Annotations[layerfmt.AnnotationTOCDigest] != ""
}

func (c *converter) convertLayer(ctx context.Context, r *layerResult) {
	start := time.Now()
	defer func() {
		if r.err == nil && c.opts.Progress != nil {
			c.opts.Progress(LayerEvent{Source: r.src, Result: r.desc, Passed: r.passed, Duration: time.Since(start)})
		}
	}()
	src := r.src
	if isOurs(src) {
		// Check the TOC is what the annotation says before vouching for
		// the layer again.
		ra, err := c.store.ReaderAt(ctx, src)
		if err != nil {
			r.err = fmt.Errorf("open layer %s: %w", src.Digest, err)
			return
		}
		defer ra.Close()
		if _, err := layerfmt.ReadTOC(ctx, ra, ra.Size(), digest.Digest(src.Annotations[layerfmt.AnnotationTOCDigest])); err != nil {
			r.err = fmt.Errorf("layer %s claims the layer format: %w", src.Digest, err)
			return
		}
		r.desc, r.passed = src, true
		return
	}
	if !images.IsLayerType(src.MediaType) {
		r.desc, r.passed = src, true
		return
	}
	if _, err := images.DiffCompression(ctx, src.MediaType); err != nil {
		r.err = fmt.Errorf("layer %s: %w", src.Digest, err)
		return
	}
	ra, err := c.store.ReaderAt(ctx, src)
	if err != nil {
		r.err = fmt.Errorf("open layer %s: %w", src.Digest, err)
		return
	}
	defer ra.Close()
	tarStream, err := compression.DecompressStream(io.NewSectionReader(ra, 0, ra.Size()))
	if err != nil {
		r.err = fmt.Errorf("decompress layer %s: %w", src.Digest, err)
		return
	}
	defer tarStream.Close()

	ref := "convert-" + src.Digest.Encoded()
	w, err := content.OpenWriter(ctx, c.store, content.WithRef(ref))
	if err != nil {
		r.err = fmt.Errorf("stage layer %s: %w", src.Digest, err)
		return
	}
	defer w.Close()
	res, err := layerfmt.Convert(ctx, w, tarStream, c.opts.LayerOptions...)
	if err != nil {
		r.err = fmt.Errorf("convert layer %s: %w", src.Digest, err)
		return
	}
	if err := w.Commit(ctx, res.Size, res.Digest); err != nil && !errors.Is(err, errAlreadyExists) {
		r.err = fmt.Errorf("stage layer %s: %w", src.Digest, err)
		return
	}
	ann := maps.Clone(src.Annotations)
	if ann == nil {
		ann = map[string]string{}
	}
	maps.Copy(ann, res.Annotations())
	r.desc = ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: res.Digest, Size: res.Size, Annotations: ann}
	r.diffID = res.DiffID
	log.G(ctx).WithFields(log.Fields{"layer": src.Digest, "result": res.Digest, "entries": res.Entries,
		"in": src.Size, "out": res.Size}).Debug("converted layer")
}

func readJSON(ctx context.Context, p content.Provider, desc ocispec.Descriptor, v any) error {
	b, err := content.ReadBlob(ctx, p, desc)
	if err != nil {
		return fmt.Errorf("read %s %s: %w", desc.MediaType, desc.Digest, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decode %s %s: %w", desc.MediaType, desc.Digest, err)
	}
	return nil
}

// writeJSON stores v and returns old with the new media type, digest and
// size (keeping its platform and annotations).
func (c *converter) writeJSON(ctx context.Context, old ocispec.Descriptor, mediaType string, v any) (ocispec.Descriptor, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return old, err
	}
	d := old
	d.MediaType, d.Digest, d.Size = mediaType, digest.FromBytes(b), int64(len(b))
	if err := content.WriteBlob(ctx, c.store, "convert-"+d.Digest.Encoded(), bytesReader(b), d); err != nil {
		return old, fmt.Errorf("store %s: %w", mediaType, err)
	}
	return d, nil
}
