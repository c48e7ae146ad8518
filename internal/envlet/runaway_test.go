package envlet

import (
	"context"
	"errors"
	"testing"
)

// A node of the size where one environment holds all the
// grantable memory (20.4 of 24 GiB, working set 1.1 GiB), as one did
// after an arbiter outage.
func runawayNode(t *testing.T) *NodeArbiter {
	t.Helper()
	ctx := context.Background()
	a := NewNodeArbiter(Resources{CPU: 2, Memory: 24 * GiB}, DefaultReserve)
	base := Resources{CPU: 2, Memory: GiB}
	mustAdmit(t, a, "runaway", base)
	g, err := a.Grow(ctx, "runaway", Resources{CPU: 2, Memory: 24 * GiB})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Report(ctx, "runaway", g, Resources{CPU: 0.1, Memory: 1100 * MiB}); err != nil {
		t.Fatal(err)
	}
	return a
}

// Neighbours ramping next to a grant far above its holder's working set
// get what they ask: the idle grant is reclaimed first, down to the
// policy's margin above the holder's working set, and the holder learns
// it at its next report. Ramping neighbours keep what they were just
// granted.
func TestNodeArbiterGrowReclaimsIdleGrant(t *testing.T) {
	ctx := context.Background()
	a := runawayNode(t)
	small := Resources{CPU: 0.5, Memory: 256 * MiB}
	mustAdmit(t, a, "b", small)
	mustAdmit(t, a, "c", small)
	for _, want := range []int64{GiB, 4 * GiB} {
		for _, id := range []string{"b", "c"} {
			g, err := a.Grow(ctx, id, Resources{Memory: want})
			if err != nil {
				t.Fatal(err)
			}
			if g.Memory != want {
				t.Fatalf("%s asked for %s next to an idle 20 GiB grant, got %s", id, FormatBytes(want), FormatBytes(g.Memory))
			}
		}
	}
	l := a.Leases()
	if l["b"].Grant.Memory != 4*GiB || l["c"].Grant.Memory != 4*GiB {
		t.Fatalf("ramping grants reclaimed: b %v c %v", l["b"].Grant, l["c"].Grant)
	}
	lim, err := a.Report(ctx, "runaway", Resources{CPU: 2, Memory: l["runaway"].Grant.Memory}, Resources{CPU: 0.1, Memory: 1100 * MiB})
	if err != nil {
		t.Fatal(err)
	}
	floor := belowGrow(1100*MiB, DefaultConfig().MemGrowWS)
	if lim.Memory >= 20*GiB || lim.Memory < floor {
		t.Fatalf("runaway's limit after the neighbours ramped: %s, want below 20Gi and at least %s", FormatBytes(lim.Memory), FormatBytes(floor))
	}
	if u := a.Used(); float64(u.Memory) > 0.85*24*float64(GiB)+1 {
		t.Fatalf("counted use %s above capacity minus reserve", FormatBytes(u.Memory))
	}
}

// The controller's view of the same node: a neighbour paused at its
// 256 MiB limit next to the idle 20 GiB grant grows at once; it used to
// be denied and failed MEM_NODE_EXHAUSTED after fail-paused (2 s) while
// the node had 17 GiB free.
func TestTraceNeighbourNotFailedWhileNodeFree(t *testing.T) {
	a := runawayNode(t)
	tr := newTrace(t, testConfig(), a, 2)
	for range 20 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true })
	}
	equalLog(t, tr.log, []string{"1: mem x4"})
}

// The victim policy fails nobody while the node's counted use is only
// promises: a restored grant far above its holder's working set is
// reclaimed first.
func TestNodeArbiterReclaimsBeforeEvicting(t *testing.T) {
	ctx := context.Background()
	a := NewNodeArbiter(Resources{CPU: 2, Memory: 24 * GiB}, DefaultReserve)
	// An arbiter restarted from its ledger: the runaway's grant is above
	// the line at which victims are chosen (92.5% of 24 GiB).
	a.Restore("runaway", Lease{Base: Resources{CPU: 2, Memory: GiB}, Grant: Resources{CPU: 2, Memory: 23 * GiB},
		Used: Resources{CPU: 0.1, Memory: 1100 * MiB}, Reported: true})
	base := Resources{CPU: 0.5, Memory: 256 * MiB}
	for _, id := range []string{"b", "c"} {
		a.Restore(id, Lease{Base: base, Grant: base, Used: Resources{Memory: 200 * MiB}, Reported: true})
	}
	for _, id := range []string{"b", "c", "runaway"} {
		_, err := a.Report(ctx, id, a.Leases()[id].Grant, a.Leases()[id].Used)
		var ev *EvictionError
		if errors.As(err, &ev) {
			t.Fatalf("%s evicted with 1.5 GiB of 24 in use: %v", id, ev)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}
