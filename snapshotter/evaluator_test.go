//go:build linux

package snapshotter

import (
	"slices"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"

	"github.com/envsnap/envsnap/internal/evalgroup"
)

// TestEvaluatorLayersHeldBack: the layers marked evaluator-only, lazy or
// unpacked, are missing from the mounts of a container's snapshot, from
// Prepare and from Mounts alike, and recorded beside its upper
// directory; unpacks still see every layer; a label update cannot drop
// the marking; a marking that cannot be honoured fails Prepare and
// leaves no snapshot.
func TestEvaluatorLayersHeldBack(t *testing.T) {
	s, _ := newTestSnapshotter(t, newFakeFS())
	ctx := testContext(t)
	mark := func(dir string) snapshots.Opt {
		return snapshots.WithLabels(map[string]string{evalgroup.LayerLabel: dir})
	}
	// c1 lazy, c2 lazy and marked, c3 unpacked and marked, c4 unpacked.
	prepareLazy(t, s, "c1", "", layerDigest(1))
	if _, err := s.Prepare(ctx, "extract-c2", "c1", remoteOpts("c2", layerDigest(2)), mark("/opt/evaluator")); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("lazy marked layer: %v", err)
	}
	unpack := func(chainID, parent string, opts ...snapshots.Opt) {
		t.Helper()
		key := "extract-" + chainID
		opts = append(opts, snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: chainID}))
		if _, err := s.Prepare(ctx, key, parent, opts...); err != nil {
			t.Fatalf("unpack %s: %v", chainID, err)
		}
		if err := s.Commit(ctx, chainID, key, opts...); err != nil {
			t.Fatalf("commit %s: %v", chainID, err)
		}
	}
	unpack("c3", "c2", mark("/opt/evaluator/"))
	unpack("c4", "c3")

	// An unpack above sees the whole chain: c4, c3, c2, c1.
	all, err := s.Prepare(ctx, "extract-c5", "c4", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "c5"}))
	if err != nil {
		t.Fatal(err)
	}
	full := lowerdirs(t, all[0].Options)
	if len(full) != 4 {
		t.Fatalf("unpack mounts have %d lowers, want 4: %v", len(full), full)
	}

	ms, err := s.Prepare(ctx, "rootfs", "c4")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{full[0], full[3]}
	if got := lowerdirs(t, ms[0].Options); !slices.Equal(got, want) {
		t.Errorf("container lowers %v, want %v (c4, c1)", got, want)
	}
	upper, err := upperDir(ms)
	if err != nil {
		t.Fatal(err)
	}
	rec, ok, err := evalgroup.Read(upper)
	if err != nil || !ok {
		t.Fatalf("no record beside %s: %v", upper, err)
	}
	if rec.Dir != "/opt/evaluator" || !slices.Equal(rec.Lowers, full[1:3]) {
		t.Errorf("record %+v, want /opt/evaluator with %v (c3, c2)", rec, full[1:3])
	}
	again, err := s.Mounts(ctx, "rootfs")
	if err != nil {
		t.Fatal(err)
	}
	if got := lowerdirs(t, again[0].Options); !slices.Equal(got, want) {
		t.Errorf("Mounts lowers %v, want %v", got, want)
	}

	// Replacing every label keeps the marking.
	if _, err := s.Update(ctx, snapshots.Info{Name: "c3", Labels: map[string]string{"x": "y"}}, "labels"); err != nil {
		t.Fatal(err)
	}
	if info, err := s.Stat(ctx, "c3"); err != nil || info.Labels[evalgroup.LayerLabel] != "/opt/evaluator/" {
		t.Errorf("after a label update c3 has labels %v (%v)", info.Labels, err)
	}

	// Two directories, and a chain that is all evaluator: refused.
	unpack("d1", "c4", mark("/other"))
	prepareLazy(t, s, "e1", "", layerDigest(9))
	if _, err := s.Update(ctx, snapshots.Info{Name: "e1", Labels: map[string]string{evalgroup.LayerLabel: "/opt/evaluator"}}, "labels."+evalgroup.LayerLabel); err != nil {
		t.Fatal(err)
	}
	for _, parent := range []string{"d1", "e1"} {
		if _, err := s.Prepare(ctx, "bad-"+parent, parent); err == nil {
			t.Errorf("Prepare above %s succeeded", parent)
		}
		if _, err := s.Stat(ctx, "bad-"+parent); !errdefs.IsNotFound(err) {
			t.Errorf("failed Prepare above %s left its snapshot: %v", parent, err)
		}
	}
}
