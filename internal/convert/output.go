package convert

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/images/archive"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/semaphore"

	"github.com/envsnap/envsnap/internal/registry"
)

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// distributionSourcePrefix is the annotation containerd's docker pusher
// reads to try a cross-repository blob mount before uploading.
const distributionSourcePrefix = "containerd.io/distribution.source."

// write sends the image rooted at root to dst. passed holds the digests of
// blobs taken unchanged from the source, which a push into the source's
// registry mounts instead of uploading.
func write(ctx context.Context, store content.Store, root ocispec.Descriptor, dst Location, ro registry.Options, src sourceInfo, passed map[digest.Digest]bool) error {
	switch dst.Kind {
	case Registry:
		resolver, err := registry.NewResolver(ctx, ro)
		if err != nil {
			return err
		}
		pusher, err := resolver.Pusher(ctx, dst.Ref)
		if err != nil {
			return err
		}
		dstHost, _, err := hostAndRepo(dst.Ref)
		if err != nil {
			return err
		}
		wrapper := func(h images.Handler) images.Handler {
			return images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
				if src.host != "" && src.host == dstHost && passed[desc.Digest] {
					d := desc
					d.Annotations = map[string]string{}
					for k, v := range desc.Annotations {
						d.Annotations[k] = v
					}
					// containerd keys the source by host name without
					// the port (url.Hostname in its pusher).
					d.Annotations[distributionSourcePrefix+hostname(src.host)] = src.repo
					desc = d
				}
				return h.Handle(ctx, desc)
			})
		}
		// The pusher checks each blob with HEAD first and skips those the
		// registry has.
		return remotes.PushContent(ctx, pusher, root, store, semaphore.NewWeighted(3), nil, wrapper)
	case Archive:
		f, err := os.Create(dst.Path)
		if err != nil {
			return err
		}
		opts := []archive.ExportOpt{archive.WithAllPlatforms()}
		if dst.Ref != "" {
			opts = append(opts, archive.WithManifest(root, dst.Ref))
		} else {
			opts = append(opts, archive.WithManifest(root))
		}
		if err := archive.Export(ctx, store, f, opts...); err != nil {
			f.Close()
			return err
		}
		return f.Close()
	case Layout:
		return writeLayout(ctx, store, root, dst)
	}
	return fmt.Errorf("unknown destination kind %d", dst.Kind)
}

// writeLayout writes an OCI image layout directory whose index.json names
// only the converted image. Blobs already present are kept.
func writeLayout(ctx context.Context, store content.Store, root ocispec.Descriptor, dst Location) error {
	copyOut := images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
		p, err := blobPath(dst.Path, desc)
		if err != nil {
			return nil, err
		}
		if st, err := os.Stat(p); err == nil && st.Size() == desc.Size {
			return nil, nil
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return nil, err
		}
		ra, err := store.ReaderAt(ctx, desc)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", desc.Digest, err)
		}
		defer ra.Close()
		tmp, err := os.CreateTemp(filepath.Dir(p), ".tmp-")
		if err != nil {
			return nil, err
		}
		defer os.Remove(tmp.Name())
		if _, err := io.Copy(tmp, io.NewSectionReader(ra, 0, desc.Size)); err != nil {
			tmp.Close()
			return nil, fmt.Errorf("write %s: %w", desc.Digest, err)
		}
		if err := tmp.Close(); err != nil {
			return nil, err
		}
		return nil, os.Rename(tmp.Name(), p)
	})
	if err := images.Walk(ctx, images.Handlers(copyOut, images.ChildrenHandler(store)), root); err != nil {
		return err
	}
	layout, _ := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
	if err := os.WriteFile(filepath.Join(dst.Path, ocispec.ImageLayoutFile), layout, 0o644); err != nil {
		return err
	}
	entry := root
	if dst.Ref != "" {
		entry.Annotations = map[string]string{ocispec.AnnotationRefName: dst.Ref}
		for k, v := range root.Annotations {
			entry.Annotations[k] = v
		}
	}
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{entry}}
	idx.SchemaVersion = 2
	b, err := json.MarshalIndent(idx, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dst.Path, ocispec.ImageIndexFile), b, 0o644)
}

func hostname(host string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		return h
	}
	return host
}
