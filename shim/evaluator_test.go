//go:build linux

package shim

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/containerd/containerd/api/types"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/evalgroup"
)

// TestSnapshotterRecordWins: when the snapshotter held the evaluator
// back (its record beside the upper directory), the shim mounts the
// recorded layers and leaves the rootfs alone, whatever the spec's
// annotations say: their positions count layers the rootfs no longer has.
func TestSnapshotterRecordWins(t *testing.T) {
	snap := t.TempDir()
	upper := filepath.Join(snap, "fs")
	if err := os.Mkdir(upper, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := evalgroup.Write(upper, evalgroup.Record{Dir: "/opt/evaluator", Lowers: []string{"/l/eval"}}); err != nil {
		t.Fatal(err)
	}
	opts := []string{"workdir=" + filepath.Join(snap, "work"), "upperdir=" + upper, "lowerdir=/l/task:/l/base"}
	rootfs := []*types.Mount{{Type: "overlay", Source: "overlay", Options: slices.Clone(opts)}}
	s := &specs.Spec{Annotations: map[string]string{AnnEvaluatorLayers: "0", AnnEvaluatorDir: "/elsewhere"}}
	e, err := holdBackEvaluator(s, rootfs, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.unmount() })
	if !slices.Equal(rootfs[0].Options, opts) {
		t.Errorf("rootfs options changed to %v", rootfs[0].Options)
	}
	if !slices.Equal(e.lowers, []string{"/l/eval"}) || e.dir != "/opt/evaluator" {
		t.Errorf("evaluator %v at %s, want the record's", e.lowers, e.dir)
	}
	if n := len(s.Mounts); n != 1 || s.Mounts[0].Destination != "/opt/evaluator" {
		t.Errorf("spec mounts %+v, want the stage at /opt/evaluator", s.Mounts)
	}
}

func TestSplitLowers(t *testing.T) {
	// overlay order: topmost first; positions count from the lowest.
	lowers := []string{"/l/mutation", "/l/eval2", "/l/eval1", "/l/task", "/l/base"}
	for _, tc := range []struct {
		v          string
		held, rest []string
		wantErr    bool
	}{
		{"2-3", []string{"/l/eval2", "/l/eval1"}, []string{"/l/mutation", "/l/task", "/l/base"}, false},
		{"4", []string{"/l/mutation"}, []string{"/l/eval2", "/l/eval1", "/l/task", "/l/base"}, false},
		{"0", []string{"/l/base"}, []string{"/l/mutation", "/l/eval2", "/l/eval1", "/l/task"}, false},
		{"5", nil, nil, true},
		{"0-4", nil, nil, true},
		{"3-2", nil, nil, true},
		{"-1", nil, nil, true},
		{"x", nil, nil, true},
		{"", nil, nil, true},
	} {
		lo, hi, err := parseLayerRange(tc.v)
		var held, rest []string
		if err == nil {
			held, rest, err = splitLowers(lowers, lo, hi)
		}
		if (err != nil) != tc.wantErr || !slices.Equal(held, tc.held) || !slices.Equal(rest, tc.rest) {
			t.Errorf("%q: held %v rest %v err %v", tc.v, held, rest, err)
		}
	}
}

func FuzzParseLayerRange(f *testing.F) {
	for _, s := range []string{"2", "2-3", "0-0", "-", "9999999999999999999", "1-", "-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		lo, hi, err := parseLayerRange(v)
		if err == nil && (lo < 0 || hi < lo) {
			t.Fatalf("%q parsed to %d-%d", v, lo, hi)
		}
	})
}
