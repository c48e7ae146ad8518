package envlet_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/envlet/envlettest"
)

// pollOnly hides the kernel events from the controller, leaving it the
// 200 ms poll alone.
type pollOnly struct{ envlet.Cgroup }

func (pollOnly) Events() <-chan envlet.Event { return nil }

// TestBenchMemoryRace is the "memrace" experiment: a 3 GiB
// burst from a 128 MiB start, allocated as fast as the child can, with and
// without the threshold eventfds, counting OOM-killed runs.
func TestBenchMemoryRace(t *testing.T) {
	requireBench(t)
	m := envlettest.RequireV1(t)
	const runs = 8
	cfg := envlet.DefaultConfig()
	cfg.Initial = envlet.Resources{CPU: 2, Memory: 128 * MiB}
	cfg.Cap = envlet.Resources{CPU: 2, Memory: 8 * GiB}
	// Measure what the events buy on their own: with tasks paused at the
	// limit nothing would be killed either way.
	cfg.PauseOnOOM = false
	killed := map[string]int{}
	rate, ok := map[string]float64{}, map[string]int{}
	for i := range 2 * runs {
		mode := []string{"events", "poll-only"}[i%2]
		v1 := envlettest.NewV1(t, m)
		p := envlettest.Start(t)
		v1.Add(t, p.Pid())
		cg, err := envlet.OpenCgroup(v1.Path)
		if err != nil {
			t.Fatal(err)
		}
		if mode == "poll-only" {
			cg = pollOnly{cg}
		}
		arb := envlet.NewNodeArbiter(envlet.Resources{CPU: 2, Memory: 16 * GiB}, envlet.DefaultReserve)
		ctl, err := envlet.NewController(fmt.Sprintf("race-%d", i), cg, cfg, arb)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- ctl.Run(ctx) }()
		waitFor(t, 5*time.Second, "first sample", func() bool { return len(ctl.Timeline()) > 0 })
		took, err := p.Do("alloc 3072")
		if err != nil || v1.OOMKills(t) > 0 {
			killed[mode]++
		} else {
			rate[mode] += 3 / took.Seconds()
			ok[mode]++
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("%s run %d: %v", mode, i/2, err)
		}
		cg.Close()
	}
	t.Logf("3 GiB burst from 128 MiB, %d runs each: OOM-killed with events %d/%d, poll-only %d/%d (surviving runs allocated at %.2f / %.2f GiB/s)",
		runs, killed["events"], runs, killed["poll-only"], runs,
		rate["events"]/float64(max(ok["events"], 1)), rate["poll-only"]/float64(max(ok["poll-only"], 1)))
	if killed["events"] != 0 {
		t.Errorf("%d runs OOM-killed with the threshold events", killed["events"])
	}
}
