package envlet

import (
	"context"
	"math"
	"testing"

	"github.com/containerd/errdefs"
)

func TestNodeArbiter(t *testing.T) {
	ctx := context.Background()
	node := Resources{CPU: 10, Memory: 10 * GiB}
	base := Resources{CPU: 2, Memory: 2 * GiB}
	tests := []struct {
		name string
		run  func(t *testing.T, a *NodeArbiter)
	}{
		{"grow is partial at capacity minus reserve", func(t *testing.T, a *NodeArbiter) {
			mustAdmit(t, a, "a", base)
			g, err := a.Grow(ctx, "a", Resources{CPU: 20, Memory: 20 * GiB})
			if err != nil {
				t.Fatal(err)
			}
			if g.CPU != 8.5 || g.Memory != int64(8.5*float64(GiB)) {
				t.Fatalf("granted %v, want 85%% of the node", g)
			}
		}},
		{"zero field leaves the grant alone", func(t *testing.T, a *NodeArbiter) {
			mustAdmit(t, a, "a", base)
			g, _ := a.Grow(ctx, "a", Resources{CPU: 4})
			if g.CPU != 4 || g.Memory != 2*GiB {
				t.Fatalf("granted %v", g)
			}
		}},
		{"admission reclaims idle burst, largest idle first, floor 1.5x usage", func(t *testing.T, a *NodeArbiter) {
			mustAdmit(t, a, "busy", base)
			mustAdmit(t, a, "idle", base)
			a.Grow(ctx, "busy", Resources{CPU: 4.5, Memory: 4 * GiB})
			a.Grow(ctx, "idle", Resources{CPU: 4, Memory: 4 * GiB})
			a.Report(ctx, "busy", Resources{CPU: 4.5, Memory: 4 * GiB}, Resources{CPU: 4, Memory: 3 * GiB})
			a.Report(ctx, "idle", Resources{CPU: 4, Memory: 4 * GiB}, Resources{CPU: 0.1, Memory: 1 * GiB})
			// Granted 8.5 cores / 8Gi; admitting 2 cores / 2Gi dips into the
			// reserve, then grants are reclaimed back to 85% from the idle
			// env (floor: its base, 1.5 x usage is lower).
			mustAdmit(t, a, "new", base)
			l := a.Leases()
			if l["idle"].Grant.CPU != 2 || l["busy"].Grant.CPU != 4.5 {
				t.Fatalf("cpu grants %v / %v: want idle reclaimed to its base, busy untouched", l["idle"].Grant, l["busy"].Grant)
			}
			if l["idle"].Grant.Memory != 5*GiB/2 || l["busy"].Grant.Memory != 4*GiB {
				t.Fatalf("memory grants idle %v busy %v", l["idle"].Grant, l["busy"].Grant)
			}
			got, _ := a.Report(ctx, "idle", Resources{CPU: 4, Memory: 4 * GiB}, Resources{CPU: 0.1, Memory: GiB})
			if got.CPU != 2 || got.Memory != 5*GiB/2 {
				t.Fatalf("report to the reclaimed env returned %v, want the lowered grant", got)
			}
		}},
		{"admission rejected when nothing idle", func(t *testing.T, a *NodeArbiter) {
			for _, id := range []string{"a", "b", "c", "d", "e"} {
				mustAdmit(t, a, id, base)
			}
			err := a.Admit(ctx, "f", base)
			if !errdefs.IsResourceExhausted(err) {
				t.Fatalf("got %v, want ErrResourceExhausted", err)
			}
			if len(a.Leases()) != 5 {
				t.Fatal("rejected admission left a lease")
			}
		}},
		{"shrink reported frees burst, release frees all", func(t *testing.T, a *NodeArbiter) {
			mustAdmit(t, a, "a", base)
			a.Grow(ctx, "a", Resources{CPU: 8, Memory: 8 * GiB})
			a.Report(ctx, "a", Resources{CPU: 4, Memory: 3 * GiB}, Resources{})
			if g := a.Granted(); g.CPU != 4 || g.Memory != 3*GiB {
				t.Fatalf("granted %v after shrink", g)
			}
			a.Release(ctx, "a")
			if g := a.Granted(); g != (Resources{}) {
				t.Fatalf("granted %v after release", g)
			}
		}},
		{"unknown env is not found", func(t *testing.T, a *NodeArbiter) {
			if _, err := a.Report(ctx, "x", base, base); !errdefs.IsNotFound(err) {
				t.Fatalf("got %v", err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { tt.run(t, NewNodeArbiter(node, DefaultReserve)) })
	}
}

func mustAdmit(t *testing.T, a *NodeArbiter, env string, base Resources) {
	t.Helper()
	if err := a.Admit(context.Background(), env, base); err != nil {
		t.Fatal(err)
	}
}

// A controller whose burst was reclaimed for an admission shrinks at its
// next report, but never below 1.25x its working set.
func TestTraceAdmissionReclaim(t *testing.T) {
	cfg := testConfig()
	arb := NewNodeArbiter(Resources{CPU: 4, Memory: 2 * GiB}, 0.15)
	tr := newTrace(t, cfg, arb, 4)
	for range 3 { // burst to 1Gi, 3.4 cores
		tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; tr.cpu(4) })
	}
	for range 10 { // idle: 0.1 core, 300 MiB working set
		tr.mustStep(func(s *Sample) { s.MemUsage = 300 * MiB; tr.cpu(0.1) })
	}
	mustAdmit(t, arb, "newcomer", Resources{CPU: 1, Memory: GiB})
	for range 5 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 300 * MiB; tr.cpu(0.1) })
	}
	lim := tr.c.Status().Limit
	// The arbiter's floor is 1.5 x the reported working set.
	if lim.Memory < 450*MiB || lim.Memory >= GiB || math.Abs(lim.CPU-2.4) > 1e-9 {
		t.Fatalf("limits after reclaim %v; log %q", lim, tr.log)
	}
	if tr.c.Status().Reclaims != 1 {
		t.Fatalf("reclaims %d, want 1; log %q", tr.c.Status().Reclaims, tr.log)
	}
	if g := arb.Granted(); g.CPU > 4*0.85+1e-9 || float64(g.Memory) > 0.85*2*float64(GiB) {
		t.Fatalf("grants %v above capacity minus reserve after reclaim", g)
	}
}
