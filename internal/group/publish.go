// Package group publishes layer groups: independently versioned environment
// components (base, task, harness, evaluator, or any name) stored in a
// registry as ordinary OCI images whose layers are in the envsnap lazy
// format, annotated with the group's kind, and whose config carries the
// group's environment contributions.
//
// Publishing is deterministic: the same content gives the same layer digest,
// so republishing unchanged content finds every layer already in the
// registry and uploads no layer bytes.
package group

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/containerd/containerd/v2/pkg/reference"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/layerfmt"
)

// Annotations on a group's manifest.
const (
	// AnnotationKind is the group's kind: base, task, harness, evaluator or
	// any other name.
	AnnotationKind = "io.envsnap.group.kind"
	// AnnotationName is the group's name, e.g. "claude-code".
	AnnotationName = "io.envsnap.group.name"
)

// Well-known kinds. Any other non-empty name is allowed.
const (
	KindBase      = "base"
	KindTask      = "task"
	KindHarness   = "harness"
	KindEvaluator = "evaluator"
)

// Meta is what a group contributes besides its files.
type Meta struct {
	Kind string
	Name string
	// Env entries ("K=V"). When environments are composed, PATH-like
	// entries are merged (see plan.MergeEnv); others override lower groups.
	Env        []string
	WorkingDir string
	Labels     map[string]string
	// Platform defaults to linux and the running architecture.
	Platform *ocispec.Platform
}

// TarSource writes one layer's uncompressed tar stream to w.
type TarSource func(ctx context.Context, w io.Writer) error

// DirSource is a layer made from a directory tree.
func DirSource(dir string, o DirOptions) TarSource {
	return func(ctx context.Context, w io.Writer) error { return WriteDirTar(ctx, w, dir, o) }
}

// TarFileSource is a layer made from a tar file, plain or compressed with
// gzip or zstd.
func TarFileSource(path string) TarSource {
	return func(ctx context.Context, w io.Writer) error {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		r, err := compression.DecompressStream(f)
		if err != nil {
			return fmt.Errorf("decompress %s: %w", path, err)
		}
		defer r.Close()
		_, err = io.Copy(w, r)
		return err
	}
}

// Result describes a published group.
type Result struct {
	Ref      string
	Manifest ocispec.Descriptor
	Config   ocispec.Descriptor
	Layers   []ocispec.Descriptor
	// UploadedLayers and UploadedBytes count layer blobs that were not in
	// the registry yet; SkippedLayers the ones that were.
	UploadedLayers, SkippedLayers int
	UploadedBytes                 int64
	Duration                      time.Duration
}

// Publisher converts layers to the envsnap format and pushes groups.
type Publisher struct {
	// Hosts says how to reach registries (see internal/registry). Every
	// Publish gets a pusher of its own: containerd's resolver remembers
	// pushed content by digest alone, so a pusher shared across
	// repositories would skip content the second repository still needs.
	Hosts docker.RegistryHosts
	// TempDir holds converted blobs until they are pushed; "" is the
	// system default.
	TempDir string
	// Progress, when set, receives one line per layer.
	Progress io.Writer
}

// Layer is a layer already in the envsnap format, ready to push.
type Layer struct {
	Desc   ocispec.Descriptor // with the layerfmt annotations
	DiffID digest.Digest
	// Open returns the blob's bytes.
	Open func() (io.ReadCloser, error)
}

// Publish converts each source to an envsnap layer and pushes the group to
// ref (e.g. "registry.example/envsnap/harness/claude-code:2.0").
func (p *Publisher) Publish(ctx context.Context, ref string, sources []TarSource, meta Meta) (*Result, error) {
	if len(sources) == 0 {
		return nil, fmt.Errorf("publish %s: a group needs at least one layer: %w", ref, errdefs.ErrInvalidArgument)
	}
	tmp, err := os.MkdirTemp(p.TempDir, "envsnap-group-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	layers := make([]Layer, len(sources))
	for i, src := range sources {
		if layers[i], err = convertSource(ctx, tmp, i, src); err != nil {
			return nil, fmt.Errorf("publish %s: layer %d: %w", ref, i, err)
		}
	}
	return p.PublishLayers(ctx, ref, layers, meta)
}

// convertSource converts src into a blob file below dir.
func convertSource(ctx context.Context, dir string, i int, src TarSource) (Layer, error) {
	path := filepath.Join(dir, fmt.Sprintf("layer-%d", i))
	f, err := os.Create(path)
	if err != nil {
		return Layer{}, err
	}
	defer f.Close()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(src(ctx, pw)) }()
	wr, err := layerfmt.Convert(ctx, f, pr)
	pr.CloseWithError(err)
	if err != nil {
		return Layer{}, fmt.Errorf("convert: %w", err)
	}
	if err := f.Close(); err != nil {
		return Layer{}, err
	}
	return Layer{
		Desc:   ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: wr.Digest, Size: wr.Size, Annotations: wr.Annotations()},
		DiffID: wr.DiffID,
		Open:   func() (io.ReadCloser, error) { return os.Open(path) },
	}, nil
}

// PublishLayers pushes a group made of layers that are already in the
// envsnap format. Layers the registry has are not uploaded again.
func (p *Publisher) PublishLayers(ctx context.Context, ref string, layers []Layer, meta Meta) (*Result, error) {
	if meta.Kind == "" {
		return nil, fmt.Errorf("publish %s: group kind is required: %w", ref, errdefs.ErrInvalidArgument)
	}
	if len(layers) == 0 {
		return nil, fmt.Errorf("publish %s: a group needs at least one layer: %w", ref, errdefs.ErrInvalidArgument)
	}
	start := time.Now()
	pusher, err := NewPusher(ctx, p.Hosts, ref)
	if err != nil {
		return nil, fmt.Errorf("publish %s: %w", ref, err)
	}
	res := &Result{Ref: ref}
	// Every layer is pushed to ref's repository, so that is where the
	// hints send a snapshotter.
	spec, err := reference.Parse(ref)
	if err != nil {
		return nil, fmt.Errorf("publish %s: %w", ref, err)
	}
	var diffIDs []digest.Digest
	for i, l := range layers {
		if l.Desc.Annotations[layerfmt.AnnotationTOCDigest] == "" {
			return nil, fmt.Errorf("publish %s: layer %d (%s): %w", ref, i, l.Desc.Digest, layerfmt.ErrNotLayer)
		}
		uploaded, err := pushLayer(ctx, pusher, l)
		if err != nil {
			return nil, fmt.Errorf("publish %s: layer %d: %w", ref, i, err)
		}
		if uploaded {
			res.UploadedLayers++
			res.UploadedBytes += l.Desc.Size
		} else {
			res.SkippedLayers++
		}
		if p.Progress != nil {
			state := "exists"
			if uploaded {
				state = "uploaded"
			}
			fmt.Fprintf(p.Progress, "layer %d: %s %d bytes (%s)\n", i, l.Desc.Digest, l.Desc.Size, state)
		}
		desc := l.Desc
		desc.Annotations = layerfmt.WithHints(desc.Annotations, spec.Locator, desc.Digest, desc.Size)
		res.Layers = append(res.Layers, desc)
		diffIDs = append(diffIDs, l.DiffID)
	}
	platform := ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH}
	if meta.Platform != nil {
		platform = *meta.Platform
	}
	cfg := ocispec.Image{
		Platform: platform,
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: diffIDs},
		Config: ocispec.ImageConfig{
			Env:        meta.Env,
			WorkingDir: meta.WorkingDir,
			Labels:     meta.Labels,
		},
	}
	cfgBytes, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	res.Config = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cfgBytes), Size: int64(len(cfgBytes))}
	annotations := map[string]string{AnnotationKind: meta.Kind}
	if meta.Name != "" {
		annotations[AnnotationName] = meta.Name
	}
	manifest := ocispec.Manifest{
		Versioned:   specs.Versioned{SchemaVersion: 2},
		MediaType:   ocispec.MediaTypeImageManifest,
		Config:      res.Config,
		Layers:      res.Layers,
		Annotations: annotations,
	}
	mb, err := json.Marshal(manifest)
	if err != nil {
		return nil, err
	}
	res.Manifest = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(mb), Size: int64(len(mb)), Annotations: annotations}
	if _, err := PushBytes(ctx, pusher, res.Config, cfgBytes); err != nil {
		return nil, fmt.Errorf("publish %s: config: %w", ref, err)
	}
	if _, err := PushBytes(ctx, pusher, res.Manifest, mb); err != nil {
		return nil, fmt.Errorf("publish %s: manifest: %w", ref, err)
	}
	res.Duration = time.Since(start)
	log.G(ctx).WithField("ref", ref).WithField("manifest", res.Manifest.Digest).
		WithField("uploaded", res.UploadedLayers).WithField("skipped", res.SkippedLayers).Info("published group")
	return res, nil
}

// pushLayer pushes l unless the registry already has it.
func pushLayer(ctx context.Context, pusher remotes.Pusher, l Layer) (bool, error) {
	rc, err := l.Open()
	if err != nil {
		return false, err
	}
	defer rc.Close()
	return PushReader(ctx, pusher, l.Desc, rc)
}

// NewPusher returns a pusher for ref with a fresh push tracker.
func NewPusher(ctx context.Context, hosts docker.RegistryHosts, ref string) (remotes.Pusher, error) {
	return docker.NewResolver(docker.ResolverOptions{Hosts: hosts}).Pusher(ctx, ref)
}

// PushBytes pushes b as desc; it reports whether bytes were sent (false
// when the registry already had the content).
func PushBytes(ctx context.Context, pusher remotes.Pusher, desc ocispec.Descriptor, b []byte) (bool, error) {
	return PushReader(ctx, pusher, desc, bytes.NewReader(b))
}

// PushReader pushes desc from r unless the registry already has it, which
// containerd's pusher finds out with a HEAD request (or a cross-repository
// mount when desc carries a containerd.io/distribution.source annotation).
func PushReader(ctx context.Context, pusher remotes.Pusher, desc ocispec.Descriptor, r io.Reader) (bool, error) {
	w, err := pusher.Push(ctx, desc)
	if err != nil {
		if errdefs.IsAlreadyExists(err) {
			return false, nil
		}
		return false, fmt.Errorf("push %s: %w", desc.Digest, err)
	}
	defer w.Close()
	if _, err := io.Copy(w, r); err != nil {
		return false, fmt.Errorf("upload %s: %w", desc.Digest, err)
	}
	if err := w.Commit(ctx, desc.Size, desc.Digest); err != nil && !errdefs.IsAlreadyExists(err) {
		return false, fmt.Errorf("commit %s: %w", desc.Digest, err)
	}
	return true, nil
}
