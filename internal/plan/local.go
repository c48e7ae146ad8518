package plan

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Labels the remote-snapshot protocol uses to tell a snapshotter where a
// layer lives (the same ones CRI and snapshotters.AppendInfoHandlerWrapper
// set on a pull).
const (
	labelImageRef       = "containerd.io/snapshot/cri.image-ref"
	labelManifestDigest = "containerd.io/snapshot/cri.manifest-digest"
	labelLayerDigest    = "containerd.io/snapshot/cri.layer-digest"
)

// WriteLocal stores img in containerd as image name without any registry
// write: config, manifest and the mutation layer go into containerd's
// content store, and every group layer is prepared in snapshotter (which
// must serve it lazily: each layer is described to it by its group's
// reference and manifest, where its bytes live). The image is then ready
// to run with that snapshotter.
func WriteLocal(ctx context.Context, c *client.Client, img *Image, name, snapshotter string) error {
	ctx, done, err := c.WithLease(ctx, leases.WithExpiration(time.Hour))
	if err != nil {
		return fmt.Errorf("local compose %s: lease: %w", name, err)
	}
	defer done(ctx)

	cs := c.ContentStore()
	if img.Mutation != nil {
		if err := writeContent(ctx, cs, img.Mutation.Desc, img.Mutation.Data, nil); err != nil {
			return fmt.Errorf("local compose %s: mutation layer: %w", name, err)
		}
	}
	if err := writeContent(ctx, cs, img.Manifest.Config, img.ConfigBytes, nil); err != nil {
		return fmt.Errorf("local compose %s: config: %w", name, err)
	}
	// GC references: containerd keeps what a manifest's labels point to.
	gcLabels := map[string]string{"containerd.io/gc.ref.content.config": img.Manifest.Config.Digest.String()}
	for i, l := range img.Manifest.Layers {
		gcLabels["containerd.io/gc.ref.content.l."+strconv.Itoa(i)] = l.Digest.String()
	}
	if err := writeContent(ctx, cs, img.Desc, img.ManifestBytes, gcLabels); err != nil {
		return fmt.Errorf("local compose %s: manifest: %w", name, err)
	}
	top, err := unpackLocal(ctx, c, img, snapshotter)
	if err != nil {
		return fmt.Errorf("local compose %s: %w", name, err)
	}
	// The same label containerd's unpacker sets, so GC keeps the snapshots
	// as long as the image exists.
	info := content.Info{Digest: img.Manifest.Config.Digest, Labels: map[string]string{
		"containerd.io/gc.ref.snapshot." + snapshotter: top.String(),
	}}
	if _, err := cs.Update(ctx, info, "labels.containerd.io/gc.ref.snapshot."+snapshotter); err != nil {
		return fmt.Errorf("local compose %s: label config: %w", name, err)
	}
	is := c.ImageService()
	record := images.Image{Name: name, Target: img.Desc}
	if _, err := is.Create(ctx, record); err != nil {
		if !errdefs.IsAlreadyExists(err) {
			return fmt.Errorf("local compose %s: create image: %w", name, err)
		}
		if _, err := is.Update(ctx, record, "target"); err != nil {
			return fmt.Errorf("local compose %s: update image: %w", name, err)
		}
	}
	return nil
}

// unpackLocal creates the snapshot chain for img, as containerd's unpacker
// does on a pull: group layers through the remote-snapshot protocol (the
// snapshotter answers AlreadyExists once it serves the layer lazily), the
// mutation layer through the diff service. It returns the top chain ID.
func unpackLocal(ctx context.Context, c *client.Client, img *Image, snapshotter string) (digest.Digest, error) {
	var cfg ocispec.Image
	if err := json.Unmarshal(img.ConfigBytes, &cfg); err != nil {
		return "", err
	}
	sn := c.SnapshotService(snapshotter)
	var chain []digest.Digest
	for i, layer := range img.Manifest.Layers {
		diffID := cfg.RootFS.DiffIDs[i]
		parent := identity.ChainID(chain)
		chain = append(chain, diffID)
		chainID := identity.ChainID(chain).String()
		if _, err := sn.Stat(ctx, chainID); err == nil {
			continue
		} else if !errdefs.IsNotFound(err) {
			return "", fmt.Errorf("stat snapshot %s: %w", chainID, err)
		}
		labels := map[string]string{snapshots.LabelSnapshotRef: chainID}
		for k, v := range snapshots.FilterInheritedLabels(layer.Annotations) {
			labels[k] = v
		}
		gi := img.LayerGroup[i]
		if gi >= 0 {
			g := img.Groups[gi]
			labels[labelImageRef] = g.Ref
			labels[labelManifestDigest] = g.Desc.Digest.String()
			labels[labelLayerDigest] = layer.Digest.String()
		}
		key := fmt.Sprintf("envsnap-compose %d %s", time.Now().UnixNano(), chainID)
		mounts, err := sn.Prepare(ctx, key, parentString(parent, i), snapshots.WithLabels(labels))
		if errdefs.IsAlreadyExists(err) {
			if _, err := sn.Stat(ctx, chainID); err != nil {
				return "", fmt.Errorf("layer %d (%s): snapshotter said it exists but %s is missing: %w", i, layer.Digest, chainID, err)
			}
			continue
		}
		if err != nil {
			return "", fmt.Errorf("prepare layer %d (%s): %w", i, layer.Digest, err)
		}
		if gi >= 0 {
			_ = sn.Remove(ctx, key)
			return "", fmt.Errorf("layer %d (%s) of group %s: snapshotter %s did not serve it lazily, and local composition never downloads layers (pull the image instead): %w",
				i, layer.Digest, img.Groups[gi].Ref, snapshotter, errdefs.ErrFailedPrecondition)
		}
		if err := applyAndCommit(ctx, c, sn, img.Mutation.Desc, mounts, key, chainID, diffID); err != nil {
			_ = sn.Remove(ctx, key)
			return "", fmt.Errorf("layer %d (mutation): %w", i, err)
		}
	}
	return identity.ChainID(chain), nil
}

func parentString(parent digest.Digest, i int) string {
	if i == 0 {
		return ""
	}
	return parent.String()
}

func applyAndCommit(ctx context.Context, c *client.Client, sn snapshots.Snapshotter, desc ocispec.Descriptor, mounts []mount.Mount, key, chainID string, diffID digest.Digest) error {
	applied, err := c.DiffService().Apply(ctx, desc, mounts)
	if err != nil {
		return fmt.Errorf("apply: %w", err)
	}
	if applied.Digest != diffID {
		return fmt.Errorf("applied diff %s, want %s", applied.Digest, diffID)
	}
	if err := sn.Commit(ctx, chainID, key); err != nil && !errdefs.IsAlreadyExists(err) {
		return fmt.Errorf("commit %s: %w", chainID, err)
	}
	return nil
}

func writeContent(ctx context.Context, cs content.Store, desc ocispec.Descriptor, data []byte, labels map[string]string) error {
	var opts []content.Opt
	if labels != nil {
		opts = append(opts, content.WithLabels(labels))
	}
	err := content.WriteBlob(ctx, cs, "envsnap-compose-"+desc.Digest.String(), bytes.NewReader(data), desc, opts...)
	if err != nil && !errdefs.IsAlreadyExists(err) {
		return err
	}
	if labels != nil && errdefs.IsAlreadyExists(err) {
		fields := make([]string, 0, len(labels))
		for k := range labels {
			fields = append(fields, "labels."+k)
		}
		_, err = cs.Update(ctx, content.Info{Digest: desc.Digest, Labels: labels}, fields...)
		return err
	}
	return nil
}
