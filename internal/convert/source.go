package convert

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/registry"
)

var errAlreadyExists = errdefs.ErrAlreadyExists

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// sourceInfo remembers where a registry source lives, for blob mounts.
type sourceInfo struct {
	host, repo string
}

// children lists what a descriptor refers to, leaving out index entries
// that will not be converted (other platforms, attestations), so that they
// are not fetched either.
func children(store content.Provider, matcher platforms.MatchComparer) images.HandlerFunc {
	ch := images.ChildrenHandler(store)
	return func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
		descs, err := ch(ctx, desc)
		if err != nil || !images.IsIndexType(desc.MediaType) {
			return descs, err
		}
		var out []ocispec.Descriptor
		for _, d := range descs {
			if d.Annotations["vnd.docker.reference.type"] == "attestation-manifest" ||
				matcher != nil && d.Platform != nil && !matcher.Match(*d.Platform) {
				continue
			}
			out = append(out, d)
		}
		return out, nil
	}
}

// load stages the image at src in store and returns its root descriptor.
func load(ctx context.Context, store content.Store, src Location, o Options, matcher platforms.MatchComparer) (ocispec.Descriptor, sourceInfo, error) {
	ro := o.Registry
	switch src.Kind {
	case Containerd:
		addr, ns := o.ContainerdAddress, o.ContainerdNamespace
		if addr == "" {
			addr = "/run/containerd/containerd.sock"
		}
		if ns == "" {
			ns = namespaces.Default
		}
		cl, err := client.New(addr)
		if err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, fmt.Errorf("connect to containerd at %s: %w", addr, err)
		}
		defer cl.Close()
		ctx := namespaces.WithNamespace(ctx, ns)
		img, err := cl.ImageService().Get(ctx, src.Ref)
		if err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, fmt.Errorf("image %s in namespace %s: %w", src.Ref, ns, err)
		}
		provider := cl.ContentStore()
		copyIn := images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
			return nil, copyFromProvider(ctx, store, provider, desc)
		})
		// containerd usually holds one platform of an index: skip entries
		// whose manifests it does not have.
		present := func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
			descs, err := children(store, matcher)(ctx, desc)
			if err != nil || !images.IsIndexType(desc.MediaType) {
				return descs, err
			}
			var out []ocispec.Descriptor
			for _, d := range descs {
				if _, err := provider.Info(ctx, d.Digest); err == nil {
					out = append(out, d)
				}
			}
			return out, nil
		}
		h := images.Handlers(copyIn, images.HandlerFunc(present))
		if err := images.Dispatch(ctx, h, nil, img.Target); err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, err
		}
		return img.Target, sourceInfo{}, nil
	case Registry:
		resolver, err := registry.NewResolver(ctx, ro)
		if err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, err
		}
		name, root, err := resolver.Resolve(ctx, src.Ref)
		if err != nil {
			return root, sourceInfo{}, fmt.Errorf("resolve: %w", err)
		}
		fetcher, err := resolver.Fetcher(ctx, name)
		if err != nil {
			return root, sourceInfo{}, err
		}
		h := images.Handlers(remotes.FetchHandler(store, fetcher), children(store, matcher))
		if err := images.Dispatch(ctx, h, nil, root); err != nil {
			return root, sourceInfo{}, fmt.Errorf("fetch: %w", err)
		}
		host, repo, err := hostAndRepo(src.Ref)
		return root, sourceInfo{host: host, repo: repo}, err
	case Layout:
		var idx ocispec.Index
		b, err := os.ReadFile(filepath.Join(src.Path, ocispec.ImageIndexFile))
		if err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, err
		}
		if err := jsonUnmarshal(b, &idx); err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, fmt.Errorf("%s: %w", ocispec.ImageIndexFile, err)
		}
		copyIn := images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
			return nil, copyFromLayout(ctx, store, src.Path, desc)
		})
		h := images.Handlers(copyIn, children(store, matcher))
		if err := images.Dispatch(ctx, h, nil, idx.Manifests...); err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, err
		}
		root, err := layoutRoot(ctx, store, idx)
		return root, sourceInfo{}, err
	case Archive:
		f, err := os.Open(src.Path)
		if err != nil {
			return ocispec.Descriptor{}, sourceInfo{}, err
		}
		defer f.Close()
		desc, err := archive.ImportIndex(ctx, store, f)
		if err != nil {
			return desc, sourceInfo{}, fmt.Errorf("import: %w", err)
		}
		var idx ocispec.Index
		if err := readJSON(ctx, store, desc, &idx); err != nil {
			return desc, sourceInfo{}, err
		}
		root, err := layoutRoot(ctx, store, idx)
		return root, sourceInfo{}, err
	}
	return ocispec.Descriptor{}, sourceInfo{}, fmt.Errorf("unknown source kind %d", src.Kind)
}

// layoutRoot picks the image of a layout's index.json: its only entry, or
// an index of all of them.
func layoutRoot(ctx context.Context, store content.Store, idx ocispec.Index) (ocispec.Descriptor, error) {
	switch len(idx.Manifests) {
	case 0:
		return ocispec.Descriptor{}, errors.New("layout index has no images")
	case 1:
		return idx.Manifests[0], nil
	}
	idx.MediaType, idx.SchemaVersion = ocispec.MediaTypeImageIndex, 2
	c := &converter{store: store}
	return c.writeJSON(ctx, ocispec.Descriptor{}, ocispec.MediaTypeImageIndex, idx)
}

func blobPath(dir string, desc ocispec.Descriptor) (string, error) {
	if err := desc.Digest.Validate(); err != nil {
		return "", err
	}
	return filepath.Join(dir, ocispec.ImageBlobsDir, desc.Digest.Algorithm().String(), desc.Digest.Encoded()), nil
}

func copyFromProvider(ctx context.Context, store content.Store, p content.Provider, desc ocispec.Descriptor) error {
	if _, err := store.Info(ctx, desc.Digest); err == nil {
		return nil
	}
	ra, err := p.ReaderAt(ctx, desc)
	if err != nil {
		return fmt.Errorf("read %s: %w", desc.Digest, err)
	}
	defer ra.Close()
	if err := content.WriteBlob(ctx, store, "import-"+desc.Digest.Encoded(), io.NewSectionReader(ra, 0, desc.Size), desc); err != nil && !errdefs.IsAlreadyExists(err) {
		return fmt.Errorf("import %s: %w", desc.Digest, err)
	}
	return nil
}

func copyFromLayout(ctx context.Context, store content.Store, dir string, desc ocispec.Descriptor) error {
	if _, err := store.Info(ctx, desc.Digest); err == nil {
		return nil
	}
	p, err := blobPath(dir, desc)
	if err != nil {
		return err
	}
	f, err := os.Open(p)
	if err != nil {
		return fmt.Errorf("layout blob %s: %w", desc.Digest, err)
	}
	defer f.Close()
	if err := content.WriteBlob(ctx, store, "import-"+desc.Digest.Encoded(), f, desc); err != nil && !errdefs.IsAlreadyExists(err) {
		return fmt.Errorf("import layout blob %s: %w", desc.Digest, err)
	}
	return nil
}
