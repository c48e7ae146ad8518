package group

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/layerfmt"
)

// SetPrefetch republishes the group at ref with the prefetch lists
// (layerfmt.AnnotationPrefetch values, by layer digest) on the layers they
// name; other layers keep their annotations. Only a new manifest is
// pushed, to the same reference: layers and config are unchanged, and
// environments composed from the group afterwards carry the lists. It
// returns the new manifest and how many layers got a list.
func (p *Publisher) SetPrefetch(ctx context.Context, ref string, lists map[digest.Digest]string) (ocispec.Descriptor, int, error) {
	_, desc, err := docker.NewResolver(docker.ResolverOptions{Hosts: p.Hosts}).Resolve(ctx, ref)
	if err != nil {
		return ocispec.Descriptor{}, 0, fmt.Errorf("set prefetch lists on %s: %w", ref, err)
	}
	if !images.IsManifestType(desc.MediaType) {
		return ocispec.Descriptor{}, 0, fmt.Errorf("set prefetch lists on %s: a %s, not an image manifest: %w", ref, desc.MediaType, errdefs.ErrNotImplemented)
	}
	b, err := fetch.FetchManifest(ctx, p.Hosts, ref, desc.Digest)
	if err != nil {
		return ocispec.Descriptor{}, 0, fmt.Errorf("set prefetch lists on %s: %w", ref, err)
	}
	var mf ocispec.Manifest
	if err := json.Unmarshal(b, &mf); err != nil {
		return ocispec.Descriptor{}, 0, fmt.Errorf("set prefetch lists on %s: decode manifest: %w", ref, err)
	}
	set := 0
	for i, l := range mf.Layers {
		v, ok := lists[l.Digest]
		if !ok || l.Annotations[layerfmt.AnnotationTOCDigest] == "" {
			continue
		}
		a := maps.Clone(l.Annotations)
		a[layerfmt.AnnotationPrefetch] = v
		mf.Layers[i].Annotations = a
		set++
	}
	nb, err := json.Marshal(mf)
	if err != nil {
		return ocispec.Descriptor{}, 0, err
	}
	nd := ocispec.Descriptor{MediaType: desc.MediaType, Digest: digest.FromBytes(nb), Size: int64(len(nb)), Annotations: mf.Annotations}
	if set == 0 || nd.Digest == desc.Digest {
		return desc, set, nil
	}
	pusher, err := NewPusher(ctx, p.Hosts, ref)
	if err != nil {
		return ocispec.Descriptor{}, 0, fmt.Errorf("set prefetch lists on %s: %w", ref, err)
	}
	if _, err := PushBytes(ctx, pusher, nd, nb); err != nil {
		return ocispec.Descriptor{}, 0, fmt.Errorf("set prefetch lists on %s: push manifest: %w", ref, err)
	}
	return nd, set, nil
}
