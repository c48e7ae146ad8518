package envlet

import (
	"context"
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

// countingArbiter counts reports.
type countingArbiter struct {
	Arbiter
	reports int
}

func (a *countingArbiter) Report(ctx context.Context, env string, current, used Resources) (Resources, error) {
	a.reports++
	return a.Arbiter.Report(ctx, env, current, used)
}

// An idle environment whose limits do not change reports every
// IdleReportPeriod, not every second: the report is most of what an idle
// shim costs. A change of its limits is reported at the next
// ReportPeriod.
func TestIdleReportsLessOften(t *testing.T) {
	cfg := testConfig()
	cfg.IdleReclaimAfter = 0
	arb := &countingArbiter{Arbiter: bigNode()}
	tr := newTrace(t, cfg, arb, 2)
	idle := func(s *Sample) { s.MemUsage = 10 * MiB; tr.cpu(0.001) }
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
	if err := tr.c.SetCap(Resources{CPU: 0.5, Memory: 128 * MiB}); err != nil {
		t.Fatal(err)
	}
	arb.reports = 0
	for range 5 { // one second: the lowered limits are reported
		tr.mustStep(idle)
	}
	if arb.reports != 1 {
		t.Fatalf("%d reports in the second after the limits changed, want 1", arb.reports)
	}
}
