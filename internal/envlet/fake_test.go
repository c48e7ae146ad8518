package envlet

import (
	"io"
	"os"

	"context"
	"errors"
	"fmt"
	"github.com/containerd/log"
	"sync"
	"testing"
	"time"
)

// fakeClock advances only when told to.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	waiters []fakeWaiter
}

type fakeWaiter struct {
	at time.Time
	ch chan time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	c.waiters = append(c.waiters, fakeWaiter{c.now.Add(d), ch})
	return ch
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	kept := c.waiters[:0]
	for _, w := range c.waiters {
		if !w.at.After(c.now) {
			w.ch <- c.now
		} else {
			kept = append(kept, w)
		}
	}
	c.waiters = kept
}

// fakeCgroup replays scripted samples and records what is applied.
type fakeCgroup struct {
	mu        sync.Mutex
	s         Sample
	sampleErr error
	applyErr  func(Resources) error
	applied   []Resources
	events    chan Event
	limit     Resources
	// rewritten: someone else changed the limits (Restore puts them
	// back); checks counts Restore calls.
	rewritten bool
	checks    int
}

func newFakeCgroup() *fakeCgroup { return &fakeCgroup{events: make(chan Event, 1)} }

func (f *fakeCgroup) Sample(s *Sample) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.sampleErr != nil {
		return f.sampleErr
	}
	*s = f.s
	s.MemStat = true
	return nil
}

func (f *fakeCgroup) Apply(r Resources) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.applyErr != nil {
		if err := f.applyErr(r); err != nil {
			if errors.Is(err, ErrBusy) {
				// v1 semantics: the CPU part went through.
				f.limit.CPU = r.CPU
				f.applied = append(f.applied, Resources{CPU: r.CPU, Memory: f.limit.Memory})
			}
			return err
		}
	}
	f.limit = r
	f.applied = append(f.applied, r)
	return nil
}

func (f *fakeCgroup) Restore() (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.checks++
	r := f.rewritten
	f.rewritten = false
	return r, nil
}

func (f *fakeCgroup) Events() <-chan Event { return f.events }
func (f *fakeCgroup) Close() error         { return nil }

// trace drives a controller tick by tick on the fake clock. Workloads are
// described per tick as demand; the trace turns them into the cumulative
// counters a cgroup would show.
type trace struct {
	t    *testing.T
	ctx  context.Context
	clk  *fakeClock
	cg   *fakeCgroup
	c    *Controller
	tick int
	log  []string
}

const tick = 200 * time.Millisecond

func newTrace(t *testing.T, cfg Config, arb Arbiter, ncpu int) *trace {
	t.Helper()
	clk, cg := newFakeClock(), newFakeCgroup()
	c, err := NewController("env", cg, cfg, arb, WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	c.ncpu = ncpu
	ctx := context.Background()
	if err := c.Admit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cg.Apply(cfg.Initial); err != nil {
		t.Fatal(err)
	}
	c.lastReport = clk.Now()
	tr := &trace{t: t, ctx: ctx, clk: clk, cg: cg, c: c}
	// Prime: the first sample has no rate.
	if err := c.step(ctx, "tick"); err != nil {
		t.Fatal(err)
	}
	return tr
}

// cpu accounts one tick of a workload that wants demand cores: it gets
// min(demand, limit) and is throttled for the rest of the tick on every
// runqueue it occupies.
func (tr *trace) cpu(demand float64) {
	lim := tr.c.st.Limit.CPU
	used := min(demand, lim)
	tr.cg.s.CPUUsageNs += uint64(used * float64(tick))
	if demand > lim {
		n := min(max(float64(int(lim+0.999999)), 1), float64(tr.c.ncpu))
		share := 1 - lim/demand
		tr.cg.s.ThrottledNs += uint64(share * n * float64(tick))
	}
}

// step advances one tick, lets set adjust the sample, runs the controller
// and logs the actions taken as "tick: actions".
func (tr *trace) step(set func(s *Sample)) error {
	tr.t.Helper()
	tr.tick++
	tr.clk.Advance(tick)
	if set != nil {
		set(&tr.cg.s)
	}
	err := tr.c.step(tr.ctx, "tick")
	if p, ok := tr.c.last(); ok && p.Actions != "" && p.T.Equal(tr.clk.Now()) {
		tr.log = append(tr.log, fmt.Sprintf("%d: %s", tr.tick, p.Actions))
	}
	return err
}

func (tr *trace) mustStep(set func(s *Sample)) {
	tr.t.Helper()
	if err := tr.step(set); err != nil {
		tr.t.Fatalf("tick %d: %v", tr.tick, err)
	}
}

func equalLog(t *testing.T, got, want []string) {
	t.Helper()
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("action log\n got: %q\nwant: %q", got, want)
	}
}

func TestMain(m *testing.M) {
	// The controller logs every denied grow; keep test output readable.
	log.L.Logger.SetOutput(io.Discard)
	os.Exit(m.Run())
}
