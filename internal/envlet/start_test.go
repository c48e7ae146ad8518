package envlet

import (
	"context"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

// Starts are ranked oldest first among those still starting; a start that
// ends, or an environment that leaves, moves the ones behind it up.
func TestNodeArbiterStartRank(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	a := NewNodeArbiter(Resources{CPU: 64, Memory: 64 * GiB}, DefaultReserve, WithNodeClock(clk.Now))
	for _, id := range []string{"c", "a", "b", "d"} { // admitted in this order
		if err := a.Admit(ctx, id, Resources{CPU: 1, Memory: GiB}); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
	}
	rank := func(id string, done bool) int {
		t.Helper()
		r, err := a.StartRank(ctx, id, done)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	// b asks first: nobody admitted before it has joined the queue yet.
	if r := rank("b", false); r != 0 {
		t.Fatalf("rank of b alone in the queue = %d, want 0", r)
	}
	if got := []int{rank("c", false), rank("a", false), rank("b", false)}; got[0] != 0 || got[1] != 1 || got[2] != 2 {
		t.Fatalf("ranks c, a, b = %v, want 0 1 2 (admitted c, a, b)", got)
	}
	if r := rank("d", false); r != 3 {
		t.Fatalf("rank of d = %d, want 3", r)
	}
	if r := rank("a", true); r != 0 {
		t.Fatalf("a done: rank %d, want 0", r)
	}
	if r := rank("b", false); r != 1 {
		t.Fatalf("rank of b after a's start ended = %d, want 1", r)
	}
	// An ended start does not rejoin the queue.
	if r := rank("a", false); r != 0 {
		t.Fatalf("a asked again after its start: rank %d, want 0", r)
	}
	if r := rank("b", false); r != 1 {
		t.Fatalf("a's second ask put it back in the queue: rank of b %d", r)
	}
	if err := a.Release(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if b, d := rank("b", false), rank("d", false); b != 0 || d != 1 {
		t.Fatalf("after c left: ranks b %d, d %d, want 0, 1", b, d)
	}
	if _, err := a.StartRank(ctx, "nobody", false); !errdefs.IsNotFound(err) {
		t.Fatalf("rank of an unknown environment: %v, want NotFound", err)
	}
}

func TestStartWeight(t *testing.T) {
	for _, tc := range []struct {
		base, least uint64
		rank        int
		want        uint64
	}{
		{1024, 2, 0, 1024}, {1024, 2, 1, 256}, {1024, 2, 2, 64}, {1024, 2, 4, 4}, {1024, 2, 5, 2}, {1024, 2, 40, 2},
		{100, 1, 1, 25}, {100, 1, 3, 1}, {100, 1, 200, 1},
		{262144, 2, 1, 65536},
	} {
		if got := StartWeight(tc.base, tc.least, tc.rank); got != tc.want {
			t.Errorf("StartWeight(%d, %d, %d) = %d, want %d", tc.base, tc.least, tc.rank, got, tc.want)
		}
	}
}

// startCgroup is a fake cgroup with a CPU weight and a demand counter.
type startCgroup struct {
	*fakeCgroup
	weight, least uint64
	demandNs      uint64 // gained since the last Demand
	writes        []uint64
}

func (c *startCgroup) CPUWeight() (uint64, uint64, error) { return c.weight, c.least, nil }
func (c *startCgroup) SetCPUWeight(w uint64) error {
	c.weight = w
	c.writes = append(c.writes, w)
	return nil
}
func (c *startCgroup) Demand() (uint64, error) {
	d := c.demandNs
	c.demandNs = 0
	return d, nil
}

// startTrace is a controller whose environment was admitted behind
// another one still starting.
func startTrace(t *testing.T, cfg Config) (*Controller, *startCgroup, *NodeArbiter, *fakeClock) {
	t.Helper()
	ctx := context.Background()
	clk := newFakeClock()
	a := NewNodeArbiter(Resources{CPU: 64, Memory: 64 * GiB}, DefaultReserve, WithNodeClock(clk.Now))
	if err := a.Admit(ctx, "first", Resources{CPU: 1, Memory: GiB}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.StartRank(ctx, "first", false); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	cg := &startCgroup{fakeCgroup: newFakeCgroup(), weight: 1024, least: 2}
	c, err := NewController("env", cg, cfg, a, WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Admit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cg.Apply(cfg.Initial); err != nil {
		t.Fatal(err)
	}
	c.lastReport = clk.Now()
	c.beginStart(ctx, clk.Now())
	return c, cg, a, clk
}

// stepFor runs the controller's ticks for d with the environment wanting
// demand cores.
func stepFor(t *testing.T, c *Controller, cg *startCgroup, clk *fakeClock, d time.Duration, demand float64) {
	t.Helper()
	for range int(d / tick) {
		clk.Advance(tick)
		cg.demandNs += uint64(demand * float64(tick))
		if err := c.step(context.Background(), "tick"); err != nil {
			t.Fatal(err)
		}
	}
}

// A start behind another one runs at a quarter of its weight, gets its own
// weight back when it reaches the head, and leaves the queue when its
// demand goes idle (its agent waits on the model), so a later start is
// not held back by it.
func TestControllerStartOrder(t *testing.T) {
	ctx := context.Background()
	c, cg, a, clk := startTrace(t, testConfig())
	if cg.weight != 256 || !c.Status().Starting || c.Status().StartRank != 1 {
		t.Fatalf("behind one start: weight %d, status %+v; want 256, starting at rank 1", cg.weight, c.Status())
	}
	// behind runs env's ticks while the start ahead of it keeps asking
	// its rank, as a start under way does.
	behind := func(d time.Duration, demand float64) {
		t.Helper()
		for range int(d / (startAskEvery * tick)) {
			if _, err := a.StartRank(ctx, "first", false); err != nil {
				t.Fatal(err)
			}
			stepFor(t, c, cg, clk, startAskEvery*tick, demand)
		}
	}
	behind(2*time.Second, 0.8)
	if cg.weight != 256 {
		t.Fatalf("still behind: weight %d, want 256", cg.weight)
	}
	// No demand behind the head is a start waiting (for CPU, for lazily
	// fetched files), not one that is over.
	behind(2*time.Second, 0)
	if !c.Status().Starting || cg.weight != 256 {
		t.Fatalf("idle behind the head: %+v, weight %d; want still starting at 256", c.Status(), cg.weight)
	}
	if _, err := a.StartRank(ctx, "first", true); err != nil {
		t.Fatal(err)
	}
	stepFor(t, c, cg, clk, time.Second, 0.8)
	if cg.weight != 1024 || c.Status().StartRank != 0 {
		t.Fatalf("at the head: weight %d, rank %d; want 1024, 0", cg.weight, c.Status().StartRank)
	}
	// Busy, then idle for a report period: the start is over.
	stepFor(t, c, cg, clk, time.Second, 0.02)
	if c.start != nil || c.Status().Starting {
		t.Fatalf("idle for a period: still starting (%+v)", c.Status())
	}
	if err := a.Admit(ctx, "later", Resources{CPU: 1, Memory: GiB}); err != nil {
		t.Fatal(err)
	}
	if r, err := a.StartRank(ctx, "later", false); err != nil || r != 0 {
		t.Fatalf("a later start after env's ended: rank %d (%v), want 0", r, err)
	}
	if cg.weight != 1024 || len(cg.writes) != 2 {
		t.Fatalf("weights written %v, now %d; want [256 1024], 1024", cg.writes, cg.weight)
	}
}

// Samples on the shim's grid (UntilTick) come a period apart give or
// take the wake-up's lateness: two of them can be a little less than two
// periods of real time apart, and a start still asks its rank every
// other sample, not every third.
func TestControllerStartAsksOnGrid(t *testing.T) {
	cfg := testConfig()
	c, cg, _, clk := startTrace(t, cfg)
	late, early := cfg.SamplePeriod+10*time.Millisecond, cfg.SamplePeriod-15*time.Millisecond
	asks, last := 0, c.start.asked
	const samples = 20
	for i := range samples {
		d := late
		if i%2 == 1 {
			d = early
		}
		clk.Advance(d)
		cg.demandNs += uint64(0.8 * float64(d))
		if err := c.step(context.Background(), "tick"); err != nil {
			t.Fatal(err)
		}
		if c.start == nil {
			t.Fatal("the start ended behind the head")
		}
		if c.start.asked != last {
			asks, last = asks+1, c.start.asked
		}
	}
	if want := samples / startAskEvery; asks != want {
		t.Errorf("%d samples %v and %v apart asked the rank %d times, want %d", samples, late, early, asks, want)
	}
}

// A start whose end the arbiter never heard (the call was lost while the
// arbiter was away, or its shim died) stops holding the ones behind it
// once it has not asked for StartStaleAfter; asking again puts it back.
// Without the bound, every later start stayed behind it at a fraction of
// its weight until it was released.
func TestNodeArbiterStartRankStale(t *testing.T) {
	ctx := context.Background()
	clk := newFakeClock()
	a := NewNodeArbiter(Resources{CPU: 64, Memory: 64 * GiB}, DefaultReserve, WithNodeClock(clk.Now))
	for _, id := range []string{"lost", "next"} {
		if err := a.Admit(ctx, id, Resources{CPU: 1, Memory: GiB}); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
	}
	rank := func(id string) int {
		t.Helper()
		r, err := a.StartRank(ctx, id, false)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	rank("lost")
	const ask = 400 * time.Millisecond
	var r int
	for waited := time.Duration(0); waited < StartStaleAfter; waited += ask {
		if r = rank("next"); r != 1 {
			t.Fatalf("%v after lost's last ask: rank of next %d, want 1", waited, r)
		}
		clk.Advance(ask)
	}
	if r = rank("next"); r != 0 {
		t.Fatalf("lost silent for %v: rank of next %d, want 0", StartStaleAfter, r)
	}
	rank("lost")
	if r = rank("next"); r != 1 {
		t.Fatalf("lost asked again: rank of next %d, want 1", r)
	}
}

// A busy job at the head of the queue leaves it after StartMax: it is not
// a start, and the ones behind it must not wait for it forever.
func TestControllerStartMax(t *testing.T) {
	ctx := context.Background()
	cfg := testConfig()
	cfg.StartMax = 5 * time.Second
	c, cg, a, clk := startTrace(t, cfg)
	if _, err := a.StartRank(ctx, "first", true); err != nil {
		t.Fatal(err)
	}
	stepFor(t, c, cg, clk, 2*time.Second, 1)
	if !c.Status().Starting || cg.weight != 1024 {
		t.Fatalf("busy at the head: %+v, weight %d", c.Status(), cg.weight)
	}
	stepFor(t, c, cg, clk, 5*time.Second, 1)
	if c.start != nil {
		t.Fatalf("busy at the head for more than StartMax: still starting")
	}
}

// A weight someone else wrote while the environment started (an in-place
// resize) is the one its start ends with.
func TestControllerStartKeepsForeignWeight(t *testing.T) {
	ctx := context.Background()
	c, cg, a, clk := startTrace(t, testConfig())
	cg.weight = 2048 // kubelet resized the request
	stepFor(t, c, cg, clk, time.Second, 1)
	if cg.weight != 512 {
		t.Fatalf("behind one start after a resize to 2048: weight %d, want 512", cg.weight)
	}
	if _, err := a.StartRank(ctx, "first", true); err != nil {
		t.Fatal(err)
	}
	stepFor(t, c, cg, clk, time.Second, 0)
	if c.start != nil || cg.weight != 2048 {
		t.Fatalf("start over: weight %d, want the resized 2048", cg.weight)
	}
}

// Without the start order (its knob off, another tier, or an arbiter
// without a queue) the weight is never touched.
func TestControllerStartOrderOff(t *testing.T) {
	for name, set := range map[string]func(*Config){
		"knob off": func(c *Config) { c.StartOrder = false },
		"latency":  func(c *Config) { c.Tier = TierLatency },
	} {
		cfg := testConfig()
		set(&cfg)
		c, cg, _, clk := startTrace(t, cfg)
		stepFor(t, c, cg, clk, 2*time.Second, 1)
		if c.start != nil || len(cg.writes) != 0 {
			t.Errorf("%s: start ordered (weights written %v)", name, cg.writes)
		}
	}
}

// plainArbiter hides NodeArbiter's start queue; notImplementedQueue is
// an arbiter older than it (the shim's passthrough to such an arbiter).
type plainArbiter struct{ Arbiter }

type notImplementedQueue struct{ Arbiter }

func (notImplementedQueue) StartRank(context.Context, string, bool) (int, error) {
	return 0, errdefs.ErrNotImplemented
}

// An arbiter without a start queue leaves the weight alone.
func TestControllerStartNoQueue(t *testing.T) {
	for name, wrap := range map[string]func(Arbiter) Arbiter{
		"no StartRank":  func(a Arbiter) Arbiter { return plainArbiter{a} },
		"Unimplemented": func(a Arbiter) Arbiter { return notImplementedQueue{a} },
	} {
		ctx := context.Background()
		clk := newFakeClock()
		arb := wrap(NewNodeArbiter(Resources{CPU: 64, Memory: 64 * GiB}, DefaultReserve, WithNodeClock(clk.Now)))
		cg := &startCgroup{fakeCgroup: newFakeCgroup(), weight: 1024, least: 2}
		c, err := NewController("env", cg, testConfig(), arb, WithClock(clk))
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Admit(ctx); err != nil {
			t.Fatal(err)
		}
		c.beginStart(ctx, clk.Now())
		stepFor(t, c, cg, clk, 2*time.Second, 1)
		if c.start != nil || len(cg.writes) != 0 || c.Status().Starting {
			t.Errorf("%s: start ordered (weights written %v, status %+v)", name, cg.writes, c.Status())
		}
	}
}
