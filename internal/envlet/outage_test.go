package envlet

import (
	"bytes"
	"strings"

	"context"
	"errors"
	"fmt"
	"github.com/sirupsen/logrus"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

// flakyArbiter is an arbiter that can be taken down and brought back.
type flakyArbiter struct {
	Arbiter
	down atomic.Bool
}

var errDown = fmt.Errorf("node arbiter unreachable: %w", errdefs.ErrUnavailable)

func (a *flakyArbiter) Grow(ctx context.Context, env string, want Resources) (Resources, error) {
	if a.down.Load() {
		return Resources{}, errDown
	}
	return a.Arbiter.Grow(ctx, env, want)
}

func (a *flakyArbiter) Report(ctx context.Context, env string, current, used Resources) (Resources, error) {
	if a.down.Load() {
		return Resources{}, errDown
	}
	return a.Arbiter.Report(ctx, env, current, used)
}

// freezeCgroup records cgroup.freeze writes (v2).
type freezeCgroup struct {
	*fakeCgroup
	frozen  bool
	freezes []bool
}

func (f *freezeCgroup) Freeze(on bool) error {
	f.frozen = on
	f.freezes = append(f.freezes, on)
	return nil
}

// An arbiter that does not answer is not a full node: a task paused at its
// limit waits for ArbiterWait (frozen where the cgroup can), and when the
// arbiter answers within it, the grow goes through and nothing fails.
func TestTraceArbiterOutageWaits(t *testing.T) {
	cfg := testConfig()
	cfg.ArbiterWait = 10 * time.Second
	arb := &flakyArbiter{Arbiter: bigNode()}
	tr := newTrace(t, cfg, arb, 2)
	fc := &freezeCgroup{fakeCgroup: tr.cg}
	tr.c.cg = fc
	arb.down.Store(true)
	// 5 s (25 ticks) paused at the limit: well past FailPaused (2 s),
	// which is what used to fail it as MEM_NODE_EXHAUSTED.
	for range 25 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true })
	}
	if !fc.frozen {
		t.Fatal("task not frozen while waiting for the arbiter")
	}
	arb.down.Store(false)
	tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true })
	tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = false })
	want := make([]string, 0, 26)
	for i := 1; i <= 25; i++ {
		want = append(want, fmt.Sprintf("%d: mem wait", i))
	}
	want = append(want, "26: mem x4")
	equalLog(t, tr.log, want)
	if fc.frozen || fmt.Sprint(fc.freezes) != "[true false]" {
		t.Fatalf("freezes %v, want frozen once and thawed when the arbiter answered", fc.freezes)
	}
	if got := tr.c.Status().Limit.Memory; got != GiB {
		t.Fatalf("memory limit %s after the arbiter came back, want 1Gi", FormatBytes(got))
	}
}

// Past ArbiterWait the environment fails with ARBITER_UNREACHABLE, not
// MEM_NODE_EXHAUSTED: the node was never asked. It stays frozen for the
// caller's kill.
func TestTraceArbiterOutageFails(t *testing.T) {
	cfg := testConfig()
	cfg.ArbiterWait = 4 * time.Second
	arb := &flakyArbiter{Arbiter: bigNode()}
	arb.down.Store(true)
	tr := newTrace(t, cfg, arb, 2)
	fc := &freezeCgroup{fakeCgroup: tr.cg}
	tr.c.cg = fc
	var err error
	for range 40 {
		if err = tr.step(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true }); err != nil {
			break
		}
	}
	var fe *FailureError
	if !errors.As(err, &fe) || fe.Reason != ReasonArbiterUnreachable {
		t.Fatalf("got %v, want ARBITER_UNREACHABLE", err)
	}
	// Waiting since tick 1, failed ArbiterWait = 4 s (20 ticks) later.
	if tr.tick != 21 {
		t.Fatalf("failed at tick %d, want 21", tr.tick)
	}
	if fe.Granted != 256*MiB || fe.Requested != 250*MiB*5/4 || fe.Asked != GiB || fe.WorkingSet != 250*MiB {
		t.Fatalf("failure %+v", fe.Failure)
	}
	if !fc.frozen {
		t.Fatal("thawed before the caller's kill")
	}
}

// A task at its per-environment cap fails with MEM_CAP_EXCEEDED even while
// the arbiter is down: the arbiter was never asked for memory.
func TestTraceArbiterOutageAtCap(t *testing.T) {
	cfg := testConfig()
	cfg.Cap.Memory = 256 * MiB
	arb := &flakyArbiter{Arbiter: bigNode()}
	arb.down.Store(true)
	tr := newTrace(t, cfg, arb, 2)
	var err error
	for range 20 {
		if err = tr.step(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true; tr.cpu(4) }); err != nil {
			break
		}
	}
	var fe *FailureError
	if !errors.As(err, &fe) || fe.Reason != ReasonCapExceeded || tr.tick != 11 {
		t.Fatalf("got %v at tick %d, want MEM_CAP_EXCEEDED at 11", err, tr.tick)
	}
}

// An outage is logged when it starts and when it ends, not at every
// failed call (5 per second per environment).
func TestArbiterOutageLogOnce(t *testing.T) {
	cfg := testConfig()
	arb := &flakyArbiter{Arbiter: bigNode()}
	tr := newTrace(t, cfg, arb, 2)
	var buf bytes.Buffer
	lg := logrus.New()
	lg.SetOutput(&buf)
	tr.c.log = logrus.NewEntry(lg)
	arb.down.Store(true)
	for range 50 { // 10 s of a grow every tick
		tr.mustStep(func(s *Sample) { s.MemUsage = 200 * MiB })
	}
	arb.down.Store(false)
	tr.mustStep(func(s *Sample) { s.MemUsage = 200 * MiB })
	out := buf.String()
	if n := strings.Count(out, "\n"); n != 2 || !strings.Contains(out, "arbiter grow failed") || !strings.Contains(out, "failed_calls=50") {
		t.Fatalf("%d log lines, want the outage's start and end:\n%s", n, out)
	}
}

// After an arbiter outage a task paused at its limit grows once, from its
// working set, and stops there. The v1 sampler refreshes under_oom with
// memory.stat (once a second, or at half the limit and above), so the
// ticks after the grow still carry the pause seen before it; growing on
// that compounded x4 per tick (256Mi -> 1Gi -> 4Gi -> 16Gi) for a task
// whose working set stayed at 250Mi.
func TestTraceOutageGrowsOnce(t *testing.T) {
	cfg := testConfig()
	arb := &flakyArbiter{Arbiter: bigNode()}
	tr := newTrace(t, cfg, arb, 2)
	arb.down.Store(true)
	for range 10 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true })
	}
	arb.down.Store(false)
	for range 5 { // one second: the stale flag until memory.stat is read again
		tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = true })
	}
	for range 5 {
		tr.mustStep(func(s *Sample) { s.MemUsage = 250 * MiB; s.UnderOOM = false })
	}
	want := make([]string, 0, 11)
	for i := 1; i <= 10; i++ {
		want = append(want, fmt.Sprintf("%d: mem wait", i))
	}
	want = append(want, "11: mem x4")
	equalLog(t, tr.log, want)
	if got := tr.c.Status().Limit.Memory; got != GiB {
		t.Fatalf("memory limit %s, want 1Gi (one x4 grow from 256Mi)", FormatBytes(got))
	}
}
