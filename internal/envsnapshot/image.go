package envsnapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/pkg/reference"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/internal/plan"
)

// snapshotImage is a snapshot's manifest and config, not yet pushed.
type snapshotImage struct {
	manifest    ocispec.Manifest
	desc        ocispec.Descriptor
	manifestRaw []byte
	configRaw   []byte
	// linked are the layers that already live in the source repository.
	linked []ocispec.Descriptor
}

// buildImage is the source image with layout.Keep of its snapshot layers
// and top above them. The config keeps everything of the source's but the
// layer list, the history of dropped layers, and the process environment
// and working directory, which come from the container.
func buildImage(src *source, layout Layout, top *blob) (*snapshotImage, error) {
	keep := src.base + layout.Keep
	img := &snapshotImage{linked: append([]ocispec.Descriptor(nil), src.manifest.Layers[:keep]...)}

	cfg := src.config
	cfg.RootFS.DiffIDs = append(append([]digest.Digest(nil), src.config.RootFS.DiffIDs[:keep]...), top.diffID)
	cfg.Config.Env, cfg.Config.WorkingDir = src.env, src.cwd
	now := time.Now().UTC()
	cfg.Created = &now
	// History is optional, but when present its non-empty entries must
	// match the layers one to one.
	if h, ok := trimHistory(src.config.History, keep); ok {
		comment := "envsnap snapshot of container " + src.id
		if layout.Squash > 0 {
			comment += fmt.Sprintf(" (%d snapshot layers squashed)", layout.Squash+1)
		}
		cfg.History = append(h, ocispec.History{Created: &now, CreatedBy: "containerd-envsnap env snapshot", Comment: comment})
	} else {
		cfg.History = nil
	}
	var err error
	if img.configRaw, err = json.Marshal(cfg); err != nil {
		return nil, err
	}
	annotations := map[string]string{}
	for k, v := range src.manifest.Annotations {
		annotations[k] = v
	}
	annotations[AnnotationBaseLayers] = strconv.Itoa(src.base)
	annotations[AnnotationParent] = src.desc.Digest.String()
	annotations[AnnotationContainer] = src.id
	img.manifest = ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config: ocispec.Descriptor{
			MediaType: ocispec.MediaTypeImageConfig,
			Digest:    digest.FromBytes(img.configRaw),
			Size:      int64(len(img.configRaw)),
		},
		Layers:      append(append([]ocispec.Descriptor(nil), img.linked...), top.desc),
		Annotations: annotations,
	}
	if err := img.finish(); err != nil {
		return nil, err
	}
	return img, nil
}

// finish encodes the manifest (again, after a change) and its descriptor.
func (img *snapshotImage) finish() error {
	var err error
	if img.manifestRaw, err = json.Marshal(img.manifest); err != nil {
		return err
	}
	img.desc = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(img.manifestRaw), Size: int64(len(img.manifestRaw))}
	return nil
}

// trimHistory keeps the history entries of the first layers layers; ok
// is false when the history does not describe the layers (it is then
// dropped rather than left contradicting them).
func trimHistory(h []ocispec.History, layers int) ([]ocispec.History, bool) {
	if len(h) == 0 {
		return nil, false
	}
	var out []ocispec.History
	n := 0
	for _, e := range h {
		if !e.EmptyLayer {
			if n == layers {
				break
			}
			n++
		}
		out = append(out, e)
	}
	return out, n == layers
}

// push links the kept layers into target's repository from the source
// image's repository, uploads the new layer, then the config, and the
// manifest last; guard, if set, runs just before the manifest push and
// stops it with its error.
func (img *snapshotImage) push(ctx context.Context, hosts docker.RegistryHosts, srcRef, target string, top *blob, res *Result, guard func(context.Context) error) error {
	pusher, err := group.NewPusher(ctx, hosts, target)
	if err != nil {
		return fmt.Errorf("push %s: %w", target, err)
	}
	if res.LayersLinked, err = linkLayers(ctx, pusher, img.linked, srcRef, target); err != nil {
		return err
	}
	if err := img.pushLayer(ctx, pusher, target, top, res); err != nil {
		return err
	}
	sent, err := img.pushConfig(ctx, pusher, target)
	if err != nil {
		return err
	}
	if sent {
		res.UploadedBytes += img.manifest.Config.Size
	}
	return img.pushManifest(ctx, pusher, target, res, guard)
}

// linkLayers links layers into target's repository from srcRef's (a HEAD,
// or a cross-repository mount: no byte is sent) and returns how many it
// linked.
func linkLayers(ctx context.Context, pusher remotes.Pusher, layers []ocispec.Descriptor, srcRef, target string) (int, error) {
	dst, err := reference.Parse(target)
	if err != nil {
		return 0, fmt.Errorf("target %s: %w", target, err)
	}
	src, err := reference.Parse(srcRef)
	if err != nil {
		return 0, fmt.Errorf("image %s is not a registry reference, so its layers cannot be linked: %w", srcRef, err)
	}
	for i, l := range layers {
		if err := plan.LinkLayer(ctx, pusher, l, dst, src); err != nil {
			return i, fmt.Errorf("push %s: %w", target, err)
		}
	}
	return len(layers), nil
}

// pushLayer uploads the layer top from its file.
func (img *snapshotImage) pushLayer(ctx context.Context, pusher remotes.Pusher, target string, top *blob, res *Result) error {
	f, err := os.Open(top.path)
	if err != nil {
		return err
	}
	defer f.Close()
	sent, err := group.PushReader(ctx, pusher, top.desc, f)
	if err != nil {
		return fmt.Errorf("push %s: diff layer: %w", target, err)
	}
	if sent {
		res.UploadedBytes += top.desc.Size
	}
	return nil
}

// pushConfig uploads the config; it reports whether bytes were sent.
func (img *snapshotImage) pushConfig(ctx context.Context, pusher remotes.Pusher, target string) (bool, error) {
	sent, err := group.PushBytes(ctx, pusher, img.manifest.Config, img.configRaw)
	if err != nil {
		return false, fmt.Errorf("push %s: config: %w", target, err)
	}
	return sent, nil
}

// manifestCommitTimeout bounds the manifest's push once it has started.
const manifestCommitTimeout = 30 * time.Second

// pushManifest pushes the manifest, which makes the image visible under
// target; guard, if set, runs just before and stops it with its error.
//
// The push is the commit point and is not cut off half way by ctx: a
// request the registry has taken may have moved the tag even though its
// answer never arrived, and a caller told "not pushed" would be wrong
// (a SIGTERM during the request did that). A ctx ended before it starts
// stops it; once started it runs to its answer, within
// manifestCommitTimeout.
func (img *snapshotImage) pushManifest(ctx context.Context, pusher remotes.Pusher, target string, res *Result, guard func(context.Context) error) error {
	if guard != nil {
		if err := guard(ctx); err != nil {
			return fmt.Errorf("push %s: %w", target, err)
		}
	}
	if err := context.Cause(ctx); err != nil {
		return fmt.Errorf("push %s: manifest: %w", target, err)
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), manifestCommitTimeout)
	defer cancel()
	sent, err := group.PushBytes(cctx, pusher, img.desc, img.manifestRaw)
	if err != nil {
		return fmt.Errorf("push %s: manifest: %w", target, err)
	}
	if sent {
		res.UploadedBytes += img.desc.Size
	}
	return nil
}
