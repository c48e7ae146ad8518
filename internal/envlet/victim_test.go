package envlet

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestChooseVictims(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	cands := []Candidate{
		{Env: "old-low", Priority: 0, Admitted: t0, Frees: 2 * GiB},
		{Env: "young-low", Priority: 0, Admitted: t0.Add(time.Minute), Frees: GiB},
		{Env: "young-high", Priority: 5, Admitted: t0.Add(2 * time.Minute), Frees: 4 * GiB},
		{Env: "idle", Priority: 0, Admitted: t0.Add(3 * time.Minute), Frees: 0},
		{Env: "big-mid", Priority: 1, Admitted: t0, Frees: 8 * GiB},
	}
	tests := []struct {
		policy string
		excess int64
		want   []string
	}{
		{"priority,youngest", GiB / 2, []string{"young-low"}},
		{"priority,youngest", 2 * GiB, []string{"young-low", "old-low"}},
		{"priority,youngest", 4 * GiB, []string{"young-low", "old-low", "big-mid"}},
		{"priority,oldest", GiB, []string{"old-low"}},
		{"largest", GiB, []string{"big-mid"}},
		{"priority,largest", 3 * GiB, []string{"old-low", "young-low"}},
		{"youngest", GiB, []string{"young-high"}},
		{"priority,youngest", 0, nil},
		{"priority,youngest", 100 * GiB, []string{"young-low", "old-low", "big-mid", "young-high"}},
	}
	for _, tt := range tests {
		p, err := ParseVictimPolicy(tt.policy)
		if err != nil {
			t.Fatal(err)
		}
		got := p.ChooseVictims(cands, tt.excess)
		if fmt.Sprint(got) != fmt.Sprint(tt.want) {
			t.Errorf("%s, excess %s: %v, want %v", tt.policy, FormatBytes(tt.excess), got, tt.want)
		}
	}
	if _, err := ParseVictimPolicy("priority,random"); err == nil {
		t.Error("unknown key accepted")
	}
}

// When promised memory is really used and the counted use passes the
// eviction line, the lowest priority, then youngest, environment is told
// to fail at its next report; the others keep running.
func TestNodeArbiterEvicts(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { now = now.Add(time.Second); return now }
	a := NewNodeArbiter(Resources{CPU: 8, Memory: 8 * GiB}, 0.2, WithNodeClock(clock))
	base := Resources{CPU: 1, Memory: 4 * GiB}
	for _, e := range []struct {
		id  string
		pri int
	}{{"old", 0}, {"young", 0}, {"important", 9}} {
		if err := a.Admit(ctx, e.id, base, WithPriority(e.pri)); err != nil {
			t.Fatal(err)
		}
	}
	use := func(id string, mem int64) error {
		_, err := a.Report(ctx, id, base, Resources{CPU: 0.5, Memory: mem})
		return err
	}
	// 3 x 2 GiB = 6 GiB: under the line (8 GiB x 0.9 = 7.2 GiB).
	for _, id := range []string{"old", "young", "important"} {
		if err := use(id, 2*GiB); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
	}
	// important uses its promise: 8 GiB counted.
	if err := use("important", 4*GiB); err != nil {
		t.Fatalf("important: %v", err)
	}
	var ev *EvictionError
	if err := use("old", 2*GiB); err != nil {
		t.Fatalf("old evicted: %v", err)
	}
	if err := use("young", 2*GiB); !errors.As(err, &ev) {
		t.Fatalf("young: %v, want an eviction", err)
	}
	t.Logf("eviction: %v", ev)
	// Marked once: nobody else goes while young's memory is on its way out.
	if err := use("important", 4*GiB); err != nil {
		t.Fatalf("important: %v", err)
	}
	a.Release(ctx, "young")
	if err := use("old", 2*GiB); err != nil {
		t.Fatalf("old after young's release: %v", err)
	}
}

// An evicted environment's controller ends Run with MEM_NODE_EXHAUSTED and
// the arbiter's reason.
func TestTraceEvicted(t *testing.T) {
	arb := NewNodeArbiter(Resources{CPU: 4, Memory: GiB}, 0.2)
	tr := newTrace(t, testConfig(), arb, 2)
	if err := arb.Admit(context.Background(), "hog", Resources{CPU: 1, Memory: 900 * MiB}, WithPriority(1)); err != nil {
		t.Fatal(err)
	}
	if _, err := arb.Report(context.Background(), "hog", Resources{CPU: 1, Memory: 900 * MiB}, Resources{Memory: 800 * MiB}); err != nil {
		t.Fatal(err)
	}
	var err error
	for range 10 {
		if err = tr.step(func(s *Sample) { s.MemUsage = 200 * MiB }); err != nil {
			break
		}
	}
	var fe *FailureError
	if !errors.As(err, &fe) || fe.Reason != ReasonNodeExhausted || fe.Cap != GiB {
		t.Fatalf("got %v, want MEM_NODE_EXHAUSTED from the victim policy", err)
	}
	t.Log(fe.Message)
}
