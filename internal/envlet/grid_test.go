package envlet

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"
)

// timedCgroup records when the controller samples it.
type timedCgroup struct {
	*fakeCgroup
	mu sync.Mutex
	at []time.Time
}

func (c *timedCgroup) Sample(s *Sample) error {
	c.mu.Lock()
	c.at = append(c.at, time.Now())
	c.mu.Unlock()
	return c.fakeCgroup.Sample(s)
}

func (c *timedCgroup) times() []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.at)
}

// Active controllers of one shim, started half a period apart, sample on
// the same instants (UntilTick): one wake-up of the process serves them
// all, where samples at each controller's own phase woke it once per
// environment (docs/envlet.md, "Measured").
func TestControllersSampleTogether(t *testing.T) {
	cfg := testConfig()
	cfg.SamplePeriod = 100 * time.Millisecond
	a := NewNodeArbiter(Resources{CPU: 64, Memory: 64 * GiB}, DefaultReserve)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	cgs := make([]*timedCgroup, 2)
	for i := range cgs {
		if i > 0 {
			time.Sleep(cfg.SamplePeriod / 2)
		}
		cgs[i] = &timedCgroup{fakeCgroup: newFakeCgroup()}
		c, err := NewController([]string{"first", "second"}[i], cgs[i], cfg, a)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := c.Run(ctx); err != nil {
				t.Error(err)
			}
		}()
	}
	time.Sleep(15 * cfg.SamplePeriod)
	cancel()
	wg.Wait()
	first, second := cgs[0].times(), cgs[1].times()
	// The second's samples after its first interval, each against the
	// first's nearest.
	if len(second) < 5 || len(first) < 5 {
		t.Fatalf("samples: %d and %d in %v, want 5 or more each", len(first), len(second), 15*cfg.SamplePeriod)
	}
	var apart []time.Duration
	for _, s := range second[2:] {
		nearest := time.Hour
		for _, f := range first {
			nearest = min(nearest, max(s.Sub(f), f.Sub(s)))
		}
		apart = append(apart, nearest)
	}
	slices.Sort(apart)
	if med := apart[len(apart)/2]; med > cfg.SamplePeriod/5 {
		t.Errorf("controllers started %v apart sample a median %v apart (%v), want the same instants", cfg.SamplePeriod/2, med, apart)
	}
}
