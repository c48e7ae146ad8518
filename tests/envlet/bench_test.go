package envlet_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
	"github.com/envsnap/envsnap/internal/envlet/envlettest"
	"github.com/envsnap/envsnap/internal/prereq"
)

func requireBench(t *testing.T) {
	t.Helper()
	prereq.RequireBench(t)
}

// burstyTask is an agent-like episode: three rounds of a parallel CPU
// burst (600 core-ms over 8 threads) holding 768 MiB, separated by idle
// "thinking" pauses.
func burstyTask(p *envlettest.Proc) (time.Duration, error) {
	start := time.Now()
	for range 3 {
		for _, cmd := range []string{"alloc 768", "work 600 8", "free"} {
			if _, err := p.Do(cmd); err != nil {
				return 0, err
			}
		}
		time.Sleep(300 * time.Millisecond)
	}
	return time.Since(start), nil
}

// TestBenchBurstyTask runs the same bursty task under a fixed small quota
// (0.25 cores, 1 GiB), under envlet starting from 0.25 cores / 256 MiB, and
// unlimited, side by side, and prints the completion times and ratios.
func TestBenchBurstyTask(t *testing.T) {
	requireBench(t)
	m := envlettest.RequireV1(t)
	type result struct {
		mode  string
		took  time.Duration
		ooms  int
		limit string
	}
	var results []result
	for _, mode := range []string{"unlimited", "envlet", "fixed"} {
		var p *envlettest.Proc
		var cg *envlettest.V1
		var ctl *envlet.Controller
		switch mode {
		case "envlet":
			cfg := envlet.DefaultConfig()
			cfg.Initial = envlet.Resources{CPU: 0.25, Memory: 256 * MiB}
			cfg.Cap = envlet.Resources{CPU: 2, Memory: 4 * GiB}
			e := startEnv(t, cfg, envlet.Resources{CPU: 2, Memory: 16 * GiB}, envlet.DefaultReserve)
			p, cg, ctl = e.proc, e.cg, e.ctl
		default:
			cg = envlettest.NewV1(t, m)
			p = envlettest.Start(t)
			cg.Add(t, p.Pid())
			if mode == "fixed" {
				c, err := cgroupfs.OpenV1(m, cg.Path)
				if err != nil {
					t.Fatal(err)
				}
				if err := c.Apply(cgroupfs.Limits{CPU: 0.25, Memory: GiB}); err != nil {
					t.Fatal(err)
				}
				c.Close()
			}
		}
		took, err := burstyTask(p)
		if err != nil {
			t.Fatalf("%s: %v (oom kills %d)", mode, err, cg.OOMKills(t))
		}
		r := result{mode: mode, took: took, ooms: cg.OOMKills(t)}
		if ctl != nil {
			st := ctl.Status()
			r.limit = fmt.Sprintf("grows cpu %d mem %d, shrinks cpu %d mem %d", st.CPUGrows, st.MemGrows, st.CPUShrinks, st.MemShrinks)
		}
		results = append(results, r)
	}
	var b strings.Builder
	for _, r := range results {
		fmt.Fprintf(&b, "%-9s %8.2fs  oom kills %d  %s\n", r.mode, r.took.Seconds(), r.ooms, r.limit)
	}
	un, el, fx := results[0].took.Seconds(), results[1].took.Seconds(), results[2].took.Seconds()
	fmt.Fprintf(&b, "fixed/envlet %.2fx   envlet/unlimited %.2fx   fixed/unlimited %.2fx   (host cpu pressure some avg10 %.0f%%)\n",
		fx/el, el/un, fx/un, hostCPUPressure(t))
	t.Logf("bursty task (3 x {768 MiB, 600 core-ms on 8 threads, 300 ms idle}):\n%s", b.String())
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestBenchControllers200 runs 200 controllers on 200 v1 cgroups at the
// 200 ms tick for 5 s and reports the whole loop's CPU cost (sampling,
// policy, timeline, runtime and GC), per tick and as a share of one core.
func TestBenchControllers200(t *testing.T) {
	requireBench(t)
	m := envlettest.RequireV1(t)
	const n = 200
	arb := envlet.NewNodeArbiter(envlet.Resources{CPU: 1000, Memory: 10000 * GiB}, envlet.DefaultReserve)
	cfg := envlet.DefaultConfig()
	cfg.Initial = envlet.Resources{CPU: 0.5, Memory: 256 * MiB}
	cfg.IdleAfter = time.Hour // measure the active 200 ms tick, not the idle one
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ctls := make([]*envlet.Controller, n)
	done := make(chan error, n)
	for i := range ctls {
		v1 := envlettest.NewV1(t, m)
		cg, err := envlet.OpenCgroup(v1.Path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cg.Close() })
		if ctls[i], err = envlet.NewController(fmt.Sprintf("env-%d", i), cg, cfg, arb, envlet.WithTimeline(100)); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range ctls {
		go func() { done <- c.Run(ctx) }()
	}
	time.Sleep(time.Second) // start-up: admission, initial apply, first samples
	ticks0 := 0
	for _, c := range ctls {
		ticks0 += len(c.Timeline())
	}
	cpu0, wall0 := processCPU(), time.Now()
	time.Sleep(5 * time.Second)
	cpu, wall := processCPU()-cpu0, time.Since(wall0)
	ticks := -ticks0
	for _, c := range ctls {
		ticks += min(len(c.Timeline()), 100)
	}
	cancel()
	for range ctls {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	// Timelines are capped at 100 points; count ticks from the clock when
	// the cap was hit.
	expected := int(wall / cfg.SamplePeriod * n)
	if ticks <= 0 || ticks > expected {
		ticks = expected
	}
	t.Logf("200 controllers, %v: %d ticks, process CPU %v = %.2f%% of one core, %.1f us per tick (sample + policy + runtime)",
		wall.Round(time.Millisecond), ticks, cpu.Round(time.Millisecond), cpu.Seconds()/wall.Seconds()*100, float64(cpu.Microseconds())/float64(ticks))
}
