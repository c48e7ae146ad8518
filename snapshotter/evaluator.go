//go:build linux

package snapshotter

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"

	"github.com/envsnap/envsnap/internal/evalgroup"
)

// unpacking reports whether Prepare options are those of a layer unpack:
// containerd's unpacker (and compose's local mode) name the chainID the
// snapshot is committed to.
func unpacking(opts []snapshots.Opt) bool {
	var info snapshots.Info
	for _, o := range opts {
		if err := o(&info); err != nil {
			return false
		}
	}
	return info.Labels[snapshots.LabelSnapshotRef] != ""
}

// holdBackEvaluator takes the layers of an evaluator-only group
// (evalgroup.LayerLabel on their committed snapshots) out of the overlay
// mount of an active snapshot whose parent is parent, and records them
// beside its upper directory for the envlet shim, so the container sees
// them only if its runtime mounts them for the evaluator. The snapshot's
// mounts are the only way into a container's root file system for every
// client (CRI, nerdctl, ctr), so none of them has to pass anything.
// Unpacks keep every layer: a layer applied above the evaluator must see
// it to write its whiteouts. A marking that cannot be honoured fails,
// rather than show the layers.
func (s *Snapshotter) holdBackEvaluator(ctx context.Context, parent string, mounts []mount.Mount) ([]mount.Mount, error) {
	if parent == "" {
		return mounts, nil
	}
	var marked []int // positions from the topmost parent (0)
	dir := ""
	n := 0
	for name := parent; name != ""; n++ {
		info, err := s.Snapshotter.Stat(ctx, name)
		if err != nil {
			return nil, fmt.Errorf("stat parent snapshot %s: %w", name, err)
		}
		if v, ok := info.Labels[evalgroup.LayerLabel]; ok {
			d, err := evalgroup.CheckDir(v)
			if err != nil {
				return nil, fmt.Errorf("snapshot %s: label %s: %w", name, evalgroup.LayerLabel, err)
			}
			if dir != "" && d != dir {
				return nil, fmt.Errorf("evaluator layers name two directories, %s and %s", dir, d)
			}
			dir = d
			marked = append(marked, n)
		}
		name = info.Parent
	}
	if len(marked) == 0 {
		return mounts, nil
	}
	if len(mounts) != 1 || mounts[0].Type != "overlay" {
		return nil, fmt.Errorf("hold back evaluator layers: want one overlay mount, got %d mounts", len(mounts))
	}
	m := mounts[0]
	opts := slices.Clone(m.Options)
	li := slices.IndexFunc(opts, func(o string) bool { return strings.HasPrefix(o, "lowerdir=") })
	if li < 0 {
		return nil, fmt.Errorf("hold back evaluator layers: the overlay mount has no lowerdir")
	}
	lowers := strings.Split(strings.TrimPrefix(opts[li], "lowerdir="), ":")
	if len(lowers) != n {
		return nil, fmt.Errorf("hold back evaluator layers: %d lower directories for %d parent snapshots", len(lowers), n)
	}
	var held, rest []string
	for i, l := range lowers {
		if slices.Contains(marked, i) {
			held = append(held, l)
		} else {
			rest = append(rest, l)
		}
	}
	if len(rest) == 0 {
		return nil, fmt.Errorf("hold back evaluator layers: the image has no other layer")
	}
	upper, err := upperDir(mounts)
	if err != nil {
		return nil, fmt.Errorf("hold back evaluator layers: %w", err)
	}
	if err := evalgroup.Write(upper, evalgroup.Record{Dir: dir, Lowers: held}); err != nil {
		return nil, err
	}
	opts[li] = "lowerdir=" + strings.Join(rest, ":")
	m.Options = opts
	return []mount.Mount{m}, nil
}
