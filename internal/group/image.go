package group

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/convert"
)

// ImageLayers turns an existing image into group layers: src is anything
// `containerd-envsnap convert` reads (oci-layout:DIR, oci-archive:FILE -
// what `buildctl --output type=oci` writes -, containerd:NAME, or a
// registry reference). The image is converted once, for the running
// platform, into an OCI layout below dir; the returned layers read from
// it. The image's config is returned so its Env and WorkingDir can serve
// as the group's contributions.
// o carries registry access and the containerd socket for containerd:
// sources; its platform and temporary directory are set here.
func ImageLayers(ctx context.Context, src string, o convert.Options, dir string) ([]Layer, ocispec.ImageConfig, error) {
	loc, err := convert.ParseLocation(src)
	if err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	out := filepath.Join(dir, "layout")
	o.Platforms, o.TempDir = []string{platforms.DefaultString()}, dir
	if _, err := convert.Run(ctx, loc, convert.Location{Kind: convert.Layout, Path: out}, o); err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	blob := func(d digest.Digest) string { return filepath.Join(out, "blobs", d.Algorithm().String(), d.Encoded()) }
	readJSON := func(d digest.Digest, v any) error {
		b, err := os.ReadFile(blob(d))
		if err != nil {
			return err
		}
		if digest.FromBytes(b) != d {
			return fmt.Errorf("%s: content does not match its digest", d)
		}
		return json.Unmarshal(b, v)
	}
	var idx ocispec.Index
	b, err := os.ReadFile(filepath.Join(out, "index.json"))
	if err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	if err := json.Unmarshal(b, &idx); err != nil || len(idx.Manifests) == 0 {
		return nil, ocispec.ImageConfig{}, fmt.Errorf("converted layout of %s has no image (%v)", src, err)
	}
	desc := idx.Manifests[0]
	for images.IsIndexType(desc.MediaType) {
		var sub ocispec.Index
		if err := readJSON(desc.Digest, &sub); err != nil {
			return nil, ocispec.ImageConfig{}, err
		}
		if len(sub.Manifests) == 0 {
			return nil, ocispec.ImageConfig{}, fmt.Errorf("%s: no manifest for %s", src, platforms.DefaultString())
		}
		desc = sub.Manifests[0]
	}
	var m ocispec.Manifest
	if err := readJSON(desc.Digest, &m); err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	var cfg ocispec.Image
	if err := readJSON(m.Config.Digest, &cfg); err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	if len(cfg.RootFS.DiffIDs) != len(m.Layers) {
		return nil, ocispec.ImageConfig{}, fmt.Errorf("%s: %d diff ids for %d layers", src, len(cfg.RootFS.DiffIDs), len(m.Layers))
	}
	layers := make([]Layer, len(m.Layers))
	for i, l := range m.Layers {
		path := blob(l.Digest)
		layers[i] = Layer{Desc: l, DiffID: cfg.RootFS.DiffIDs[i], Open: func() (io.ReadCloser, error) { return os.Open(path) }}
	}
	return layers, cfg.Config, nil
}
