package envlet

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

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
		{"admission reclaims idle burst, largest idle first, above its floors", func(t *testing.T, a *NodeArbiter) {
			mustAdmit(t, a, "busy", base)
			mustAdmit(t, a, "idle", base)
			a.Grow(ctx, "busy", Resources{CPU: 4.5, Memory: 4 * GiB})
			a.Grow(ctx, "idle", Resources{CPU: 4, Memory: 4 * GiB})
			a.Report(ctx, "busy", Resources{CPU: 4.5, Memory: 4 * GiB}, Resources{CPU: 4, Memory: 3 * GiB})
			a.Report(ctx, "idle", Resources{CPU: 4, Memory: 4 * GiB}, Resources{CPU: 0.1, Memory: 1 * GiB})
			// Counted use: busy 2.5+2 cores / 2+2 GiB, idle 2+0.1 /
			// 2+1. The newcomer, counted at its base (2 / 2Gi) until it
			// reports, puts the node 0.1 core / 0.5 GiB above 85%: that
			// much of the idle env's burst is reclaimed (the largest
			// idle grant; its floor, the base, is further down), busy is
			// untouched.
			mustAdmit(t, a, "new", base)
			l := a.Leases()
			if math.Abs(l["idle"].Grant.CPU-3.9) > 1e-9 || l["busy"].Grant.CPU != 4.5 {
				t.Fatalf("cpu grants %v / %v: want idle reclaimed by 0.1, busy untouched", l["idle"].Grant, l["busy"].Grant)
			}
			if l["idle"].Grant.Memory != 7*GiB/2 || l["busy"].Grant.Memory != 4*GiB {
				t.Fatalf("memory grants idle %v busy %v", l["idle"].Grant, l["busy"].Grant)
			}
			got, _ := a.Report(ctx, "idle", Resources{CPU: 4, Memory: 4 * GiB}, Resources{CPU: 0.1, Memory: GiB})
			if math.Abs(got.CPU-3.9) > 1e-9 || got.Memory != 7*GiB/2 {
				t.Fatalf("report to the reclaimed env returned %v, want the lowered grant", got)
			}
		}},
		{"admission by use: idle environments do not fill the node", func(t *testing.T, a *NodeArbiter) {
			// 20 environments with a 2-core / 2 GiB base on a 10-core /
			// 10 GiB node (4x its size promised), each using 0.1 core and
			// 100 MiB: all fit.
			for i := range 20 {
				id := fmt.Sprint("e", i)
				mustAdmit(t, a, id, base)
				if _, err := a.Report(ctx, id, base, Resources{CPU: 0.1, Memory: 100 * MiB}); err != nil {
					t.Fatal(err)
				}
			}
			if u := a.Used(); math.Abs(u.CPU-2) > 1e-9 || u.Memory != 2000*MiB {
				t.Fatalf("counted use %v, want 2 cores / 2000 MiB", u)
			}
		}},
		{"admission rejected when memory use leaves no reserve", func(t *testing.T, a *NodeArbiter) {
			for _, id := range []string{"a", "b", "c", "d", "e"} {
				mustAdmit(t, a, id, base)
				a.Report(ctx, id, base, Resources{CPU: 0.1, Memory: 1800 * MiB})
			}
			// 9000 MiB in use of 10 GiB, 85% = 8704 MiB.
			err := a.Admit(ctx, "f", base)
			if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "reserve") || !strings.Contains(err.Error(), "memory short by 296.0Mi") {
				t.Fatalf("got %v, want ErrResourceExhausted for the reserve", err)
			}
			if len(a.Leases()) != 5 {
				t.Fatal("rejected admission left a lease")
			}
		}},
		{"a node whose CPU is busy admits: CPU use only slows", func(t *testing.T, a *NodeArbiter) {
			for _, id := range []string{"a", "b", "c", "d", "e"} {
				mustAdmit(t, a, id, base)
				a.Report(ctx, id, base, Resources{CPU: 1.8, Memory: GiB})
			}
			// 9 cores in use of 10 (above 85%), 5 GiB of memory.
			mustAdmit(t, a, "f", base)
		}},
		{"admission rejected beyond an operator's overcommit bound", func(t *testing.T, _ *NodeArbiter) {
			a := NewNodeArbiter(node, DefaultReserve, WithOvercommit(Overcommit{Memory: 8}))
			// 8 x 10 GiB of memory may be promised: 40 bases of 2 GiB.
			for i := range 40 {
				mustAdmit(t, a, fmt.Sprint("e", i), base)
			}
			if err := a.Admit(ctx, "one-more", base); !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "overcommit") || !strings.Contains(err.Error(), "memory short by 2.00Gi") {
				t.Fatalf("got %v, want ErrResourceExhausted for the overcommit bound", err)
			}
		}},
		{"grow counts the others' use, not their limits", func(t *testing.T, a *NodeArbiter) {
			mustAdmit(t, a, "idle", Resources{CPU: 8, Memory: 8 * GiB})
			a.Report(ctx, "idle", Resources{CPU: 8, Memory: 8 * GiB}, Resources{CPU: 0.5, Memory: GiB})
			mustAdmit(t, a, "a", base)
			// 8.5 - 0.5 (idle's use) - 2 (a's grant) = 6 more cores;
			// 8.5 GiB - 1 - 2 = 5.5 GiB more.
			g, _ := a.Grow(ctx, "a", Resources{CPU: 20, Memory: 20 * GiB})
			if math.Abs(g.CPU-8) > 1e-9 || g.Memory != int64(7.5*float64(GiB)) {
				t.Fatalf("granted %v, want 8 cores / 7.5 GiB", g)
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

// A CPU that just became busy does not refuse a newcomer: 3 environments
// with the default 2-core / 8 GiB base report 1.83 cores in all (above
// 85% of a 2-core node) at the moment the fourth asks, and it is admitted:
// admission reads CPU use averaged over DefaultCPUWindow (a CPU busy for a
// whole window refuses: TestNodeArbiterRefusesOnSustainedCPU). Memory in
// use gates at once.
func TestNodeArbiterAdmitsOnBusyCPU(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	a := NewNodeArbiter(Resources{CPU: 2, Memory: 23 * GiB}, DefaultReserve, WithNodeClock(func() time.Time { return now }))
	base := DefaultConfig().Initial
	for i, cpu := range []float64{0.58, 0.62, 0.63} {
		id := fmt.Sprint("running", i)
		mustAdmit(t, a, id, base)
		if _, err := a.Report(ctx, id, base, Resources{CPU: cpu, Memory: 80 * MiB}); err != nil {
			t.Fatal(err)
		}
	}
	now = now.Add(time.Second)
	if err := a.Admit(ctx, "next", base); err != nil {
		t.Fatalf("admit next to 1.83 busy cores and 240 MiB: %v", err)
	}
	// Memory still gates: the same node with its memory in use refuses.
	for i := range 3 {
		if _, err := a.Report(ctx, fmt.Sprint("running", i), base, Resources{CPU: 0.6, Memory: 7 * GiB}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Admit(ctx, "one-more", base); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("admit next to 21 GiB in use of 23: got %v, want ErrResourceExhausted", err)
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
	// The arbiter's floor is 1.85 x the reported working set; it takes
	// what the newcomer's base needs: 1 - (3.4 - 2.5) cores, 1 GiB - (1.7
	// GiB - 1 GiB) of memory.
	if lim.Memory < 450*MiB || lim.Memory >= GiB || math.Abs(lim.CPU-3.3) > 1e-9 {
		t.Fatalf("limits after reclaim %v; log %q", lim, tr.log)
	}
	if tr.c.Status().Reclaims != 1 {
		t.Fatalf("reclaims %d, want 1; log %q", tr.c.Status().Reclaims, tr.log)
	}
	// The newcomer counts at its base until it reports.
	if u := arb.Used(); u.CPU+1 > 4*0.85+1e-9 || float64(u.Memory+GiB) > 0.85*2*float64(GiB)+1 {
		t.Fatalf("counted use %v plus the newcomer's base above capacity minus reserve after reclaim", u)
	}
	// A second newcomer takes the idle burst down to the arbiter's floor.
	// What was reclaimed stays reclaimed: the same working set does not
	// reach the grow threshold of the lowered limit.
	grows := tr.c.Status().MemGrows
	mustAdmit(t, arb, "second", Resources{CPU: 0.1, Memory: GiB})
	for range 15 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 300 * MiB; tr.cpu(0.1) })
	}
	st := tr.c.Status()
	if st.Reclaims != 2 || st.MemGrows != grows || st.Limit.Memory >= lim.Memory {
		t.Fatalf("after the second reclaim: limit %v (was %v), %d reclaims, %d grows since; log %q",
			st.Limit, lim, st.Reclaims, st.MemGrows-grows, tr.log)
	}
}

// A base larger than the node (found by FuzzServer: a 7-core base on a
// 4-core node was granted 7 cores) counts as the whole node, also at
// re-admission and after a report.
func TestNodeArbiterBaseLargerThanNode(t *testing.T) {
	ctx := context.Background()
	node := Resources{CPU: 4, Memory: 4 * GiB}
	a := NewNodeArbiter(node, DefaultReserve)
	huge := Resources{CPU: 7, Memory: 8 * GiB}
	mustAdmit(t, a, "big", huge)
	if g := a.Granted(); g != node {
		t.Fatalf("granted %v for a base of %v, want the node %v", g, huge, node)
	}
	mustAdmit(t, a, "big", huge)
	if _, err := a.Report(ctx, "big", huge, Resources{CPU: 1, Memory: GiB}); err != nil {
		t.Fatal(err)
	}
	if g := a.Granted(); g.CPU > node.CPU || g.Memory > node.Memory {
		t.Fatalf("granted %v after re-admission and a report, more than the node %v", g, node)
	}
}

// The node (2 cores, 24 GiB): idle agent environments (0.5% of a
// core, 190 MiB each) with the default 2-core / 8 GiB initial quota are
// admitted by what they use. The former 20x CPU bound on the sum of
// initial quotas refused the 21st while the node was idle.
func TestNodeArbiterAdmitsIdleBeyondBases(t *testing.T) {
	ctx := context.Background()
	a := NewNodeArbiter(Resources{CPU: 2, Memory: 24 * GiB}, DefaultReserve)
	base := DefaultConfig().Initial
	for i := range 64 {
		id := fmt.Sprint("idle", i)
		if err := a.Admit(ctx, id, base); err != nil {
			t.Fatalf("environment %d refused on an idle node: %v", i+1, err)
		}
		if _, err := a.Report(ctx, id, base, Resources{CPU: 0.005, Memory: 190 * MiB}); err != nil {
			t.Fatal(err)
		}
	}
}

// A node whose CPU stays saturated refuses newcomers, naming CPU and by
// how much; a busy second does not (TestNodeArbiterAdmitsOnBusyCPU).
func TestNodeArbiterRefusesOnSustainedCPU(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	a := NewNodeArbiter(Resources{CPU: 2, Memory: 24 * GiB}, DefaultReserve, WithNodeClock(func() time.Time { return now }))
	base := DefaultConfig().Initial
	for i := range 3 {
		mustAdmit(t, a, fmt.Sprint("busy", i), base)
	}
	report := func(cpu float64) {
		for i := range 3 {
			if _, err := a.Report(ctx, fmt.Sprint("busy", i), base, Resources{CPU: cpu, Memory: 200 * MiB}); err != nil {
				t.Fatal(err)
			}
		}
	}
	report(0.65)
	now = now.Add(2 * time.Second)
	report(0.65)
	if err := a.Admit(ctx, "after-a-busy-second", base); err != nil {
		t.Fatalf("admit after 2 s at 1.95 cores: %v", err)
	}
	a.Release(ctx, "after-a-busy-second")
	for range 60 {
		now = now.Add(time.Second)
		report(0.65)
	}
	err := a.Admit(ctx, "late", base)
	if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "cpu short by 0.2") {
		t.Fatalf("admit next to 1.95 of 2 cores busy for a minute: %v, want cpu short by about 0.25 cores", err)
	}
	// The CPU frees up: admitted again.
	for range 60 {
		now = now.Add(time.Second)
		report(0.1)
	}
	if err := a.Admit(ctx, "late", base); err != nil {
		t.Fatalf("admit after the node went idle: %v", err)
	}
}

// Memory in use outside the leases is not handed out (WithNodeMemory): on
// a 4 GiB machine whose kernel and daemons hold 700 MiB, a lease grows to
// (4 GiB - 700 MiB) x 85%, not 4 GiB x 85% (the Kubernetes node's pod got
// 3.3 GiB that way and the kernel's OOM killer stopped it), and a refusal
// says what the machine holds outside. The configured capacity still
// bounds when it is the smaller; an unreadable meminfo leaves it alone.
func TestNodeArbiterMemoryOutsideLeases(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	const total = 4 * GiB
	var leases int64 // what the environments hold, as the kernel sees it
	var outside int64 = 700 * MiB
	meminfo := func() (int64, int64, error) { return total, total - outside - leases, nil }
	a := NewNodeArbiter(Resources{CPU: 2, Memory: total}, DefaultReserve,
		WithNodeClock(func() time.Time { return now }), WithNodeMemory(meminfo))
	base := Resources{CPU: 0.5, Memory: 128 * MiB}
	mustAdmit(t, a, "fill", base)
	got, err := a.Grow(ctx, "fill", Resources{CPU: 0.5, Memory: 3584 * MiB})
	if err != nil {
		t.Fatal(err)
	}
	reserve := DefaultReserve
	want := int64(float64(total-outside) * (1 - reserve))
	if got.Memory != want {
		t.Fatalf("grant %s, want (4 GiB - 700 MiB) x 85%% = %s", FormatBytes(got.Memory), FormatBytes(want))
	}
	// The lease holds it, and the daemons outside grow by 200 MiB: a
	// newcomer is refused, and the refusal names the memory outside.
	leases, outside = got.Memory, 900*MiB
	if _, err := a.Report(ctx, "fill", got, Resources{CPU: 0.5, Memory: got.Memory}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(time.Second)
	err = a.Admit(ctx, "next", base)
	if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "900.0Mi in use outside") {
		t.Fatalf("admit next to a full machine: %v, want a refusal naming 900 MiB in use outside", err)
	}

	// A configured capacity below what the machine has bounds alone.
	leases, outside = 0, 700*MiB
	small := NewNodeArbiter(Resources{CPU: 2, Memory: GiB}, DefaultReserve, WithNodeMemory(meminfo))
	mustAdmit(t, small, "e", base)
	if got, _ := small.Grow(ctx, "e", Resources{CPU: 0.5, Memory: 2 * GiB}); got.Memory != int64(float64(GiB)*(1-reserve)) {
		t.Fatalf("grant on a 1 GiB node: %s", FormatBytes(got.Memory))
	}
	// Unreadable: the configured capacity.
	blind := NewNodeArbiter(Resources{CPU: 2, Memory: total}, DefaultReserve,
		WithNodeMemory(func() (int64, int64, error) { return 0, 0, errors.New("no /proc") }))
	mustAdmit(t, blind, "e", base)
	if got, _ := blind.Grow(ctx, "e", Resources{CPU: 0.5, Memory: total}); got.Memory != int64(float64(total)*(1-reserve)) {
		t.Fatalf("grant with meminfo unreadable: %s", FormatBytes(got.Memory))
	}
}

func TestReadMeminfo(t *testing.T) {
	total, avail, err := ReadMeminfo()
	if err != nil {
		t.Fatal(err)
	}
	if total <= 0 || avail <= 0 || avail > total {
		t.Fatalf("MemTotal %d, MemAvailable %d", total, avail)
	}
}

// A grant that runs ahead of its holder's use does not hide the memory in
// use outside the leases: after a grow to 2 GiB whose holder reports a
// 1 GiB working set, the machine's 700 MiB outside still bound the next
// grow (counting grants made outside 0 and handed out the whole machine).
func TestNodeArbiterOutsideAfterGrantAhead(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	const total, outside = 4 * GiB, 700 * MiB
	var ws int64
	a := NewNodeArbiter(Resources{CPU: 2, Memory: total}, DefaultReserve, WithNodeClock(func() time.Time { return now }),
		WithNodeMemory(func() (int64, int64, error) { return total, total - outside - ws, nil }))
	base := Resources{CPU: 0.5, Memory: 128 * MiB}
	mustAdmit(t, a, "fill", base)
	got, err := a.Grow(ctx, "fill", Resources{CPU: 0.5, Memory: 2 * GiB})
	if err != nil || got.Memory != 2*GiB {
		t.Fatalf("grow to 2 GiB: %v, %v", got, err)
	}
	ws = GiB
	if _, err := a.Report(ctx, "fill", got, Resources{CPU: 0.5, Memory: ws}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(time.Second)
	got, err = a.Grow(ctx, "fill", Resources{CPU: 0.5, Memory: total})
	if err != nil {
		t.Fatal(err)
	}
	reserve := DefaultReserve
	if want := int64(float64(total-outside) * (1 - reserve)); got.Memory != want {
		t.Fatalf("grant %s, want (4 GiB - 700 MiB) x 85%% = %s", FormatBytes(got.Memory), FormatBytes(want))
	}
}
