package plan

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/pkg/reference"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/evalgroup"
	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/layerfmt"
)

// Annotations on a composed image's manifest: its provenance.
const (
	// AnnotationPlanName is the plan (task) name.
	AnnotationPlanName = "io.envsnap.plan.name"
	// AnnotationPlanGroups is a JSON list of ProvenanceEntry, lowest first.
	AnnotationPlanGroups = "io.envsnap.plan.groups"
	// AnnotationPlanMutation is the sha256 of the mutation's patch text.
	AnnotationPlanMutation = "io.envsnap.plan.mutation"
	// LabelEvaluatorLayers and LabelEvaluatorDir (image config labels)
	// mark the evaluator-only group of the plan: the positions of its
	// layers counted from the lowest (0), "N-M", and the directory its
	// files live under. The envsnap snapshotter goes by the layer
	// annotation evalgroup.LayerLabel instead; with another snapshotter
	// the client passes these to the envlet shim as the annotations
	// io.envsnap.shim.evaluator-layers and -dir.
	LabelEvaluatorLayers = "io.envsnap.evaluator.layers"
	LabelEvaluatorDir    = "io.envsnap.evaluator.dir"
)

// ProvenanceEntry records one group of a composed image.
type ProvenanceEntry struct {
	Kind   string        `json:"kind"`
	Name   string        `json:"name,omitempty"`
	Ref    string        `json:"ref"`
	Digest digest.Digest `json:"digest"`
	Layers int           `json:"layers"`
}

// Group is a resolved layer group.
type Group struct {
	Ref      string
	Kind     string
	Name     string
	Desc     ocispec.Descriptor // the group's manifest
	Manifest ocispec.Manifest
	Config   ocispec.Image
}

// Blob is content composition creates (the mutation layer).
type Blob struct {
	Desc   ocispec.Descriptor
	DiffID digest.Digest
	Data   []byte
}

// Image is a composed environment image, not yet stored anywhere.
type Image struct {
	Plan          *Plan
	Groups        []*Group
	Manifest      ocispec.Manifest
	ManifestBytes []byte
	Desc          ocispec.Descriptor
	ConfigBytes   []byte
	// LayerGroup maps each manifest layer to its index in Groups; -1 is
	// the mutation layer.
	LayerGroup []int
	Mutation   *Blob
}

// Composer resolves groups (each distinct reference once per Composer) and
// composes plans.
type Composer struct {
	// Hosts says how to reach registries (see internal/registry).
	Hosts docker.RegistryHosts
	// OpenLayer reads files of a group's layer for mutations; nil means
	// plans with mutations are refused.
	OpenLayer LayerOpener
	// Platform selects a manifest from multi-platform groups; default the
	// running platform.
	Platform platforms.MatchComparer

	mu     sync.Mutex
	groups map[string]*groupCall
}

type groupCall struct {
	done chan struct{}
	g    *Group
	err  error
}

// ResolvedGroups is the number of distinct group references resolved.
func (c *Composer) ResolvedGroups() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.groups)
}

// Group resolves ref, once per Composer even under concurrent callers.
func (c *Composer) Group(ctx context.Context, ref string) (*Group, error) {
	c.mu.Lock()
	if c.groups == nil {
		c.groups = map[string]*groupCall{}
	}
	call, ok := c.groups[ref]
	if !ok {
		call = &groupCall{done: make(chan struct{})}
		c.groups[ref] = call
		c.mu.Unlock()
		call.g, call.err = c.resolveGroup(ctx, ref)
		close(call.done)
	} else {
		c.mu.Unlock()
	}
	select {
	case <-call.done:
		return call.g, call.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (c *Composer) resolveGroup(ctx context.Context, ref string) (*Group, error) {
	resolver := docker.NewResolver(docker.ResolverOptions{Hosts: c.Hosts})
	name, desc, err := resolver.Resolve(ctx, ref)
	if err != nil {
		return nil, fmt.Errorf("resolve group %s: %w", ref, err)
	}
	fetcher, err := resolver.Fetcher(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("group %s: %w", ref, err)
	}
	matcher := c.Platform
	if matcher == nil {
		matcher = platforms.Default()
	}
	for images.IsIndexType(desc.MediaType) {
		var idx ocispec.Index
		if err := fetchJSON(ctx, fetcher, desc, &idx); err != nil {
			return nil, fmt.Errorf("group %s: index: %w", ref, err)
		}
		var picked *ocispec.Descriptor
		for i, m := range idx.Manifests {
			if m.Platform != nil && matcher.Match(*m.Platform) && (picked == nil || matcher.Less(*m.Platform, *picked.Platform)) {
				picked = &idx.Manifests[i]
			}
		}
		if picked == nil {
			return nil, fmt.Errorf("group %s: no manifest for this platform: %w", ref, errdefs.ErrNotFound)
		}
		desc = *picked
	}
	g := &Group{Ref: ref, Desc: desc}
	if err := fetchJSON(ctx, fetcher, desc, &g.Manifest); err != nil {
		return nil, fmt.Errorf("group %s: manifest: %w", ref, err)
	}
	if err := fetchJSON(ctx, fetcher, g.Manifest.Config, &g.Config); err != nil {
		return nil, fmt.Errorf("group %s: config: %w", ref, err)
	}
	if len(g.Config.RootFS.DiffIDs) != len(g.Manifest.Layers) {
		return nil, fmt.Errorf("group %s: config lists %d diff ids for %d layers", ref, len(g.Config.RootFS.DiffIDs), len(g.Manifest.Layers))
	}
	g.Kind = g.Manifest.Annotations[group.AnnotationKind]
	g.Name = g.Manifest.Annotations[group.AnnotationName]
	return g, nil
}

// maxMetadataSize bounds manifests, indexes and configs read from a
// registry: they are small, and an unbounded read is a memory hazard.
const maxMetadataSize = 8 << 20

func fetchJSON(ctx context.Context, f remotes.Fetcher, desc ocispec.Descriptor, v any) error {
	if desc.Size > maxMetadataSize {
		return fmt.Errorf("%s is %d bytes, over the %d limit", desc.Digest, desc.Size, maxMetadataSize)
	}
	rc, err := f.Fetch(ctx, desc)
	if err != nil {
		return err
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, desc.Size+1))
	if err != nil {
		return err
	}
	if int64(len(b)) != desc.Size || digest.FromBytes(b) != desc.Digest {
		return fmt.Errorf("content of %s does not match its digest", desc.Digest)
	}
	return json.Unmarshal(b, v)
}

// Compose builds the image for p. Group layers are referenced, never read;
// a mutation reads only the files its patch touches.
func (c *Composer) Compose(ctx context.Context, p *Plan) (*Image, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	img := &Image{Plan: p}
	for _, ref := range p.Groups {
		g, err := c.Group(ctx, ref)
		if err != nil {
			return nil, fmt.Errorf("compose %s: %w", p.Name, err)
		}
		img.Groups = append(img.Groups, g)
	}
	if p.Mutation != nil {
		target, err := mutationGroup(img.Groups, p.Mutation.Group)
		if err != nil {
			return nil, fmt.Errorf("compose %s: %w", p.Name, err)
		}
		if c.OpenLayer == nil {
			return nil, fmt.Errorf("compose %s: mutations need layer access: %w", p.Name, errdefs.ErrNotImplemented)
		}
		if img.Mutation, err = applyMutation(ctx, c.OpenLayer, target, p.Mutation); err != nil {
			return nil, fmt.Errorf("compose %s: %w", p.Name, err)
		}
	}
	if err := img.build(); err != nil {
		return nil, fmt.Errorf("compose %s: %w", p.Name, err)
	}
	return img, nil
}

// evaluatorGroup is the group Plan.Evaluator selects.
func evaluatorGroup(groups []*Group, sel string) (*Group, error) {
	if sel == "" {
		sel = group.KindEvaluator
	}
	for _, g := range groups {
		if g.Ref == sel || g.Kind == sel {
			return g, nil
		}
	}
	return nil, fmt.Errorf("evaluator group %q is not in the plan", sel)
}

func mutationGroup(groups []*Group, sel string) (*Group, error) {
	if sel != "" {
		for _, g := range groups {
			if g.Ref == sel || g.Kind == sel {
				return g, nil
			}
		}
		return nil, fmt.Errorf("mutation group %q is not in the plan", sel)
	}
	for _, g := range groups {
		if g.Kind == group.KindTask {
			return g, nil
		}
	}
	return groups[len(groups)-1], nil
}

// build assembles the manifest and config from the groups, lowest first.
func (img *Image) build() error {
	base := img.Groups[0].Config
	cfg := ocispec.Image{
		Platform: base.Platform,
		RootFS:   ocispec.RootFS{Type: "layers"},
	}
	var envs [][]string
	labels := map[string]string{}
	var provenance []ProvenanceEntry
	var layers []ocispec.Descriptor
	var evaluator *Group
	var evalLayers string
	if ev := img.Plan.Evaluator; ev != nil {
		var err error
		if evaluator, err = evaluatorGroup(img.Groups, ev.Group); err != nil {
			return err
		}
		if len(evaluator.Manifest.Layers) == 0 {
			return fmt.Errorf("evaluator group %s has no layers", evaluator.Ref)
		}
	}
	for gi, g := range img.Groups {
		if g == evaluator {
			evalLayers = fmt.Sprintf("%d-%d", len(layers), len(layers)+len(g.Manifest.Layers)-1)
		}
		gc := g.Config.Config
		envs = append(envs, gc.Env)
		if gc.WorkingDir != "" {
			cfg.Config.WorkingDir = gc.WorkingDir
		}
		if len(gc.Entrypoint) > 0 || len(gc.Cmd) > 0 {
			cfg.Config.Entrypoint, cfg.Config.Cmd = gc.Entrypoint, gc.Cmd
		}
		if gc.User != "" {
			cfg.Config.User = gc.User
		}
		for k, v := range gc.Labels {
			labels[k] = v
		}
		// The group's repository holds every layer of the group: the hints
		// send a snapshotter there, whatever an earlier publication wrote.
		src, err := reference.Parse(g.Ref)
		if err != nil {
			return fmt.Errorf("group %s: %w", g.Ref, err)
		}
		for i, l := range g.Manifest.Layers {
			l.Annotations = layerfmt.WithHints(l.Annotations, src.Locator, l.Digest, l.Size)
			// The group's manifest is shared by every plan of the
			// Composer: change a copy.
			l.Annotations = maps.Clone(l.Annotations)
			delete(l.Annotations, evalgroup.LayerLabel)
			if g == evaluator {
				// The snapshotter keeps the layer out of every container
				// of the image (internal/evalgroup).
				if l.Annotations == nil {
					l.Annotations = map[string]string{}
				}
				l.Annotations[evalgroup.LayerLabel] = path.Clean(img.Plan.Evaluator.Dir)
			}
			layers = append(layers, l)
			img.LayerGroup = append(img.LayerGroup, gi)
			cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, g.Config.RootFS.DiffIDs[i])
		}
		provenance = append(provenance, ProvenanceEntry{Kind: g.Kind, Name: g.Name, Ref: g.Ref, Digest: g.Desc.Digest, Layers: len(g.Manifest.Layers)})
	}
	annotations := map[string]string{}
	if img.Mutation != nil {
		layers = append(layers, img.Mutation.Desc)
		img.LayerGroup = append(img.LayerGroup, -1)
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, img.Mutation.DiffID)
		patch, _ := img.Plan.Mutation.PatchText()
		annotations[AnnotationPlanMutation] = digest.FromBytes(patch).String()
	}
	proc := img.Plan.Process
	envs = append(envs, proc.Env)
	cfg.Config.Env = MergeEnv(envs...)
	if len(proc.Entrypoint) > 0 || len(proc.Cmd) > 0 {
		cfg.Config.Entrypoint, cfg.Config.Cmd = proc.Entrypoint, proc.Cmd
	}
	if proc.WorkingDir != "" {
		cfg.Config.WorkingDir = proc.WorkingDir
	}
	for k, v := range img.Plan.Labels {
		labels[k] = v
	}
	if evaluator != nil {
		// Last: no group or plan label may move the marking.
		labels[LabelEvaluatorLayers] = evalLayers
		labels[LabelEvaluatorDir] = path.Clean(img.Plan.Evaluator.Dir)
	}
	if len(labels) > 0 {
		cfg.Config.Labels = labels
	}
	var err error
	if img.ConfigBytes, err = json.Marshal(cfg); err != nil {
		return err
	}
	pb, err := json.Marshal(provenance)
	if err != nil {
		return err
	}
	annotations[AnnotationPlanGroups] = string(pb)
	if img.Plan.Name != "" {
		annotations[AnnotationPlanName] = img.Plan.Name
	}
	img.Manifest = ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config: ocispec.Descriptor{
			MediaType: ocispec.MediaTypeImageConfig,
			Digest:    digest.FromBytes(img.ConfigBytes),
			Size:      int64(len(img.ConfigBytes)),
		},
		Layers:      layers,
		Annotations: annotations,
	}
	if img.ManifestBytes, err = json.Marshal(img.Manifest); err != nil {
		return err
	}
	img.Desc = ocispec.Descriptor{
		MediaType: ocispec.MediaTypeImageManifest,
		Digest:    digest.FromBytes(img.ManifestBytes),
		Size:      int64(len(img.ManifestBytes)),
	}
	return nil
}

// PushStats describes what a registry-mode composition sent.
type PushStats struct {
	// LayersLinked counts group layers the target repository already had
	// or obtained by cross-repository mount: no bytes sent.
	LayersLinked int
	// UploadedBytes counts every blob byte sent: config, manifest and the
	// mutation layer, never a group layer.
	UploadedBytes int64
	Duration      time.Duration
}

// Push stores img under target in its registry. Group layers are linked by
// cross-repository mount from their group's repository; a group layer that
// cannot be linked (e.g. another registry) is an error, never a copy.
func (c *Composer) Push(ctx context.Context, img *Image, target string) (PushStats, error) {
	start := time.Now()
	var st PushStats
	spec, err := reference.Parse(target)
	if err != nil {
		return st, fmt.Errorf("push %s: %w", target, err)
	}
	// A pusher per target: see group.Publisher.Hosts.
	pusher, err := group.NewPusher(ctx, c.Hosts, target)
	if err != nil {
		return st, fmt.Errorf("push %s: %w", target, err)
	}
	for i, l := range img.Manifest.Layers {
		gi := img.LayerGroup[i]
		if gi < 0 {
			continue
		}
		src, err := reference.Parse(img.Groups[gi].Ref)
		if err != nil {
			return st, fmt.Errorf("push %s: group %s: %w", target, img.Groups[gi].Ref, err)
		}
		if err := LinkLayer(ctx, pusher, l, spec, src); err != nil {
			return st, fmt.Errorf("push %s: %w", target, err)
		}
		st.LayersLinked++
	}
	blobs := []struct {
		desc ocispec.Descriptor
		data []byte
	}{{img.Manifest.Config, img.ConfigBytes}}
	if img.Mutation != nil {
		blobs = append(blobs, struct {
			desc ocispec.Descriptor
			data []byte
		}{img.Mutation.Desc, img.Mutation.Data})
	}
	blobs = append(blobs, struct {
		desc ocispec.Descriptor
		data []byte
	}{img.Desc, img.ManifestBytes})
	for _, b := range blobs {
		sent, err := group.PushBytes(ctx, pusher, b.desc, b.data)
		if err != nil {
			return st, fmt.Errorf("push %s: %w", target, err)
		}
		if sent {
			st.UploadedBytes += b.desc.Size
		}
	}
	st.Duration = time.Since(start)
	return st, nil
}

// LinkLayer makes layer present in target's repository without sending its
// bytes: containerd's pusher finds it there already (HEAD) or mounts it
// from the source repository named by the distribution-source annotation.
func LinkLayer(ctx context.Context, pusher remotes.Pusher, layer ocispec.Descriptor, target, src reference.Spec) error {
	if src.Hostname() != target.Hostname() {
		return fmt.Errorf("layer %s lives in %s, not in the target registry %s: publish the group there first (composition never copies layers)", layer.Digest, src.Hostname(), target.Hostname())
	}
	// containerd's pusher keys the source by host name without the port.
	host := src.Hostname()
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	desc := layer
	desc.Annotations = map[string]string{
		"containerd.io/distribution.source." + host: strings.TrimPrefix(src.Locator, src.Hostname()+"/"),
	}
	w, err := pusher.Push(ctx, desc)
	if errdefs.IsAlreadyExists(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("link layer %s from %s: %w", layer.Digest, src.Locator, err)
	}
	w.Close()
	return fmt.Errorf("link layer %s: the registry neither has it in the target repository nor mounted it from %s: %w", layer.Digest, src.Locator, errdefs.ErrFailedPrecondition)
}
