package shim_test

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/ksm"
	"github.com/envsnap/envsnap/internal/prereq"
)

// TestMemoryMerge: with [shim] memory-merge the envlet shim marks itself
// mergeable before it starts containers, so a container's process is
// marked (whole-process KSM merging) without anything in its image or
// command; a container of the runc shim on the same node is not. Whether
// pages are then merged is ksmd's work, the node's setting: this
// machine's is off and not ours to change, so the shim's warning says
// so; the merging itself is checked in the VM guest (tests/vm,
// "ksm-merge").
func TestMemoryMerge(t *testing.T) {
	if _, err := ksm.Merging(); errors.Is(err, ksm.ErrUnsupported) {
		prereq.Missing(t, "%v", err)
	}
	s := newSuite(t, node{memoryMerge: true})
	ann := map[string]string{"initial-cpu": "0.25", "initial-memory": "128Mi"}
	merged, err := s.run(t, ann, "-mode", "idle", "-hold", "30m")
	if err != nil {
		t.Fatal(err)
	}
	plain, err := s.runWith(t, runOpts{runtime: "io.containerd.runc.v2"}, "-mode", "idle", "-hold", "30m")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		c    *ctr
		want bool
	}{{merged, true}, {plain, false}} {
		p, err := ksm.ReadProcess(int(c.c.task.Pid()))
		if err != nil {
			t.Fatal(err)
		}
		if p.MergeAny != c.want {
			t.Errorf("container %s: ksm_merge_any %v, want %v", c.c.id, p.MergeAny, c.want)
		}
	}

	n, err := ksm.ReadNode()
	if err != nil {
		t.Fatal(err)
	}
	if n.Run == 1 {
		return
	}
	// The node does not merge: the shim says so where an operator looks.
	const warning = "the node's ksmd is not merging"
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		raw, err := os.ReadFile(s.env.Containerd.LogPath)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(raw), warning) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("ksmd off (run=%d) and containerd's log has no %q", n.Run, warning)
		}
	}
}
