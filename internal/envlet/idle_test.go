package envlet

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// An environment idle past IdleReclaimAfter gives its memory back in
// halvings, below its base, and settles without oscillating (a reclaim
// never triggers a grow); when it wakes, the grow path brings memory back
// within a tick or two, the arbiter granting up to the base at once.
func TestTraceIdleReclaim(t *testing.T) {
	cfg := testConfig()
	cfg.Initial.Memory = GiB
	cfg.IdleReclaimAfter = 10 * time.Second
	tr := newTrace(t, cfg, bigNode(), 2)
	for range 150 { // 30 s asleep: 0.01 core, 40 MiB working set
		tr.mustStep(func(s *Sample) { s.MemUsage = 40 * MiB; tr.cpu(0.01) })
	}
	// CPU idle from tick 1; reclaim due IdleAfter (5 s) + 10 s later, at
	// tick 76; halvings 1Gi -> 512 -> 256 -> 128 -> 75 MiB (40 / 0.54).
	want := []string{"76: mem idle", "77: mem idle", "78: mem idle", "79: mem idle"}
	equalLog(t, tr.log, want)
	if got := tr.c.Status().Limit.Memory; got < 74*MiB || got > 75*MiB {
		t.Fatalf("memory limit %s after idle reclaim", FormatBytes(got))
	}
	// Reclaimed to 54% of its limit, it is still idle: sampled every
	// idle period, reporting on the idle grid.
	if !tr.c.st.Idle {
		t.Fatal("not idle after idle reclaim left the working set at 54% of the limit")
	}
	// Wake up: the working set goes back to 600 MiB.
	woke := tr.tick
	for range 10 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 600 * MiB; s.Failcnt++; tr.cpu(0.5) })
	}
	if got := tr.c.Status().Limit.Memory; got < 750*MiB {
		t.Fatalf("memory limit %s 2 s after waking with a 600 MiB working set; log %q", FormatBytes(got), tr.log)
	}
	var grows []string
	for _, l := range tr.log {
		var tick int
		fmt.Sscanf(l, "%d:", &tick)
		if tick > woke && strings.Contains(l, "mem x") {
			grows = append(grows, l)
		}
	}
	if len(grows) == 0 || !strings.HasPrefix(grows[0], fmt.Sprintf("%d:", woke+1)) {
		t.Fatalf("grows after waking %q, want the first at once", grows)
	}
}

// countingArbiter counts reports; while fail is set they fail.
type countingArbiter struct {
	Arbiter
	reports int
	fail    bool
}

func (a *countingArbiter) Report(ctx context.Context, env string, current, used Resources) (Resources, error) {
	a.reports++
	if a.fail {
		return current, errors.New("arbiter busy")
	}
	return a.Arbiter.Report(ctx, env, current, used)
}

// An idle environment whose limits and working set do not change
// reports every IdleReportPeriod, not every second: the report was most
// of what an idle shim cost. A change of its limits, or of its working
// set by more than a sixteenth of its memory limit, is reported at once
// (the next ReportPeriod), and a failed report is retried at the next
// tick, not a heartbeat later.
func TestIdleReportsLessOften(t *testing.T) {
	cfg := testConfig()
	cfg.IdleReclaimAfter = 0
	arb := &countingArbiter{Arbiter: bigNode()}
	tr := newTrace(t, cfg, arb, 2)
	ws := 10 * MiB
	idle := func(s *Sample) { s.MemUsage = ws; tr.cpu(0.001) }
	for range 50 { // 10 s: idle after 5 s
		tr.mustStep(idle)
	}
	if !tr.c.st.Idle {
		t.Fatal("not idle after 10 s at 0.1% CPU")
	}
	arb.reports = 0
	for range 300 { // one minute idle
		tr.mustStep(idle)
	}
	if want := int(time.Minute / IdleReportPeriod); arb.reports != want {
		t.Fatalf("%d reports in an idle minute, want %d", arb.reports, want)
	}
	steady := func(what string, steps, want int) {
		t.Helper()
		arb.reports = 0
		for range steps {
			tr.mustStep(idle)
		}
		if arb.reports != want {
			t.Fatalf("%s: %d reports in %d ticks, want %d", what, arb.reports, steps, want)
		}
	}
	// 70 s in, reported at 60 s: the next heartbeat is on the grid, at
	// 75 s.
	steady("to the next multiple of the period", 25, 1)
	if got := tr.c.lastReport; !got.Equal(got.Truncate(IdleReportPeriod)) {
		t.Fatalf("heartbeat at %v, off the %v grid", got, IdleReportPeriod)
	}
	// Moves within a sixteenth of the 256 MiB limit wait for the heartbeat.
	ws += 15 * MiB
	steady("working set +15 MiB", 25, 0)
	ws += 2 * MiB // 17 MiB from the last report
	steady("working set +17 MiB", 5, 1)
	if !tr.c.st.Idle {
		t.Fatal("a 27 MiB working set of 256 MiB should stay idle")
	}
	arb.fail = true
	arb.reports = 0
	for i := 0; arb.reports == 0; i++ {
		if i > 80 {
			t.Fatal("no heartbeat in 16 s")
		}
		tr.mustStep(idle)
	}
	steady("retries of a failed report", 10, 2) // every ReportPeriod
	arb.fail = false
	steady("the retry that goes through", 5, 1)
	steady("after it", 25, 0)
	if err := tr.c.SetCap(Resources{CPU: 0.5, Memory: 128 * MiB}); err != nil {
		t.Fatal(err)
	}
	steady("lowered limits", 5, 1)
}

// TimelineSince hands out each point once, in order, and skips what the
// ring has already dropped.
func TestTimelineSince(t *testing.T) {
	tr := newTrace(t, testConfig(), bigNode(), 2) // one point: the priming tick
	tr.c.tlCap, tr.c.tl, tr.c.tlNext, tr.c.tlFilled = 4, nil, 0, false
	got, next := tr.c.TimelineSince(0)
	if len(got) != 0 || next != 1 {
		t.Fatalf("empty ring: %d points, next %d; want 0, 1", len(got), next)
	}
	for range 3 {
		tr.mustStep(nil)
	}
	got, next = tr.c.TimelineSince(next)
	if len(got) != 3 || next != 4 || !got[2].T.Equal(tr.clk.Now()) {
		t.Fatalf("after 3 ticks: %d points, next %d", len(got), next)
	}
	if got, n := tr.c.TimelineSince(next); len(got) != 0 || n != next {
		t.Fatalf("nothing new: %d points, next %d", len(got), n)
	}
	for range 6 { // the ring of 4 wraps: 2 of the 6 are gone
		tr.mustStep(nil)
	}
	got, next = tr.c.TimelineSince(next)
	if len(got) != 4 || next != 10 {
		t.Fatalf("after 6 more: %d points, next %d; want the 4 retained, 10", len(got), next)
	}
	for i, p := range got {
		if want := tr.clk.Now().Add(time.Duration(i-3) * tick); !p.T.Equal(want) {
			t.Fatalf("point %d at %v, want %v", i, p.T, want)
		}
	}
}

// Idle reclaim halves the limit on consecutive ticks; the arbiter hears
// where it ended, once it held for a tick, not every halving.
func TestIdleReclaimReportedOnce(t *testing.T) {
	cfg := testConfig()
	cfg.IdleReclaimAfter = 10 * time.Second
	arb := &countingArbiter{Arbiter: bigNode()}
	tr := newTrace(t, cfg, arb, 2)
	asleep := func(s *Sample) { s.MemUsage = 4 * MiB; tr.cpu(0.001) }
	for range 75 { // to the heartbeat at 15 s
		tr.mustStep(asleep)
	}
	arb.reports = 0
	for range 70 {
		tr.mustStep(asleep)
	}
	// Reclaim due at tick 76: 256 -> 128 -> 64 -> 32 MiB (the floor).
	equalLog(t, tr.log, []string{"76: mem idle", "77: mem idle", "78: mem idle"})
	if arb.reports != 1 {
		t.Fatalf("%d reports from tick 76 to 145, want 1: where the limit settled", arb.reports)
	}
	if got := tr.c.reported.Memory; got != IdleReclaimFloor {
		t.Fatalf("reported %s, want the settled %s", FormatBytes(got), FormatBytes(IdleReclaimFloor))
	}
}
