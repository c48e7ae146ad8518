// Package envlet_test runs the envlet controller against real cgroup v1
// groups on this host (root only): a CPU burst, a fast memory growth that
// must not OOM, and idle shrinking. Set ENVSNAP_BENCH=1 for the
// fixed-quota vs envlet vs unlimited comparison and the 200-environment
// controller cost.
package envlet_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/containerd/log"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/envlet/envlettest"
)

func TestMain(m *testing.M) {
	envlettest.HelperMain()
	os.Exit(m.Run())
}

const (
	MiB = envlet.MiB
	GiB = envlet.GiB
)

// env is one workload child in a scratch cgroup under a running controller.
type env struct {
	cg   *envlettest.V1
	proc *envlettest.Proc
	ctl  *envlet.Controller
	arb  *envlet.NodeArbiter
	done chan error
}

// startEnv runs a controller for a fresh v1 cgroup holding a workload
// child, against an in-process arbiter for node with the given admission
// reserve.
func startEnv(t *testing.T, cfg envlet.Config, node envlet.Resources, reserve float64) *env {
	t.Helper()
	m := envlettest.RequireV1(t)
	e := &env{cg: envlettest.NewV1(t, m), done: make(chan error, 1)}
	e.proc = envlettest.Start(t)
	e.cg.Add(t, e.proc.Pid())
	cg, err := envlet.OpenCgroup(e.cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cg.Close() })
	e.arb = envlet.NewNodeArbiter(node, reserve)
	e.ctl, err = envlet.NewController(t.Name(), cg, cfg, e.arb)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(log.WithLogger(context.Background(), log.L))
	go func() { e.done <- e.ctl.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-e.done; err != nil {
			t.Errorf("controller: %v", err)
		}
	})
	waitFor(t, 5*time.Second, "first sample", func() bool { return len(e.ctl.Timeline()) > 0 })
	return e
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func printTimeline(t *testing.T, tl []envlet.TimelinePoint, from, to time.Time, onlyActions bool) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "%9s %6s %9s %6s %6s %9s %s\n", "t", "cpu", "mem", "used", "thr", "ws", "wake/actions")
	for _, p := range tl {
		if p.T.Before(from) || p.T.After(to) || (onlyActions && p.Actions == "") {
			continue
		}
		fmt.Fprintf(&b, "%+8.3fs %6.2f %9s %6.2f %5.0f%% %9s %s %s\n", p.T.Sub(from).Seconds(), p.Limit.CPU,
			envlet.FormatBytes(p.Limit.Memory), p.CPUUsed, p.Throttled*100, envlet.FormatBytes(p.WS), p.Wake, p.Actions)
	}
	t.Logf("timeline:\n%s", b.String())
}

// A light single-thread load at 0.25 cores jumps to 8 busy threads: the
// quota must reach 1.6 cores within 1 s of the jump (2-core host, cap 2).
func TestCPUBurst(t *testing.T) {
	cfg := envlet.DefaultConfig()
	cfg.Initial = envlet.Resources{CPU: 0.25, Memory: 256 * MiB}
	cfg.Cap = envlet.Resources{CPU: 2, Memory: 1 * GiB}
	// Alone on the node, capped at the whole 2-core machine: no admission
	// reserve, or the arbiter would hold it at
	// 1.7 cores and 8 busy threads would be throttled 15% by design.
	e := startEnv(t, cfg, envlet.Resources{CPU: 2, Memory: 16 * GiB}, 0)
	// 1 thread at 15% duty: 0.15 cores, 60% of the quota, no grow.
	loaded := time.Now()
	if _, err := e.proc.Do("threads 1 15"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	before := e.ctl.Status().Limit.CPU
	jump := time.Now()
	// The first tick after the thread starts can see it run at the
	// quota for a moment (seen in CI runs: 0.25 cores, one x2); the
	// steady 0.15-core load after that must not grow the quota.
	var steadyGrows []string
	for _, p := range e.ctl.Timeline() {
		if p.T.After(loaded.Add(300*time.Millisecond)) && p.T.Before(jump) && strings.Contains(p.Actions, "cpu x") {
			steadyGrows = append(steadyGrows, fmt.Sprintf("%s at %.2f cores used", p.Actions, p.CPUUsed))
		}
	}
	if _, err := e.proc.Do("threads 8 100"); err != nil {
		t.Fatal(err)
	}
	var reached time.Duration
	waitFor(t, 5*time.Second, "cpu quota >= 1.6", func() bool {
		for _, p := range e.ctl.Timeline() {
			if p.T.After(jump) && p.Limit.CPU >= 1.6 {
				reached = p.T.Sub(jump)
				return true
			}
		}
		return false
	})
	time.Sleep(2 * time.Second)
	printTimeline(t, e.ctl.Timeline(), jump.Add(-time.Second), jump.Add(3*time.Second), false)
	var used, thr float64
	var n int
	for _, p := range e.ctl.Timeline() {
		if p.T.After(jump.Add(time.Second+200*time.Millisecond)) && p.T.Before(jump.Add(3*time.Second)) {
			used, thr, n = used+p.CPUUsed, thr+p.Throttled, n+1
		}
	}
	used, thr = used/float64(max(n, 1)), thr/float64(max(n, 1))
	psi := hostCPUPressure(t)
	t.Logf("quota before the jump %.2f; >= 1.6 cores %v after the jump; from 1 s to 3 s after: %.2f cores used, %.0f%% throttled; host cpu pressure some avg10 %.0f%%",
		before, reached.Round(time.Millisecond), used, thr*100, psi)
	if len(steadyGrows) > 0 || before >= 1 {
		t.Errorf("quota grew to %.2f before the jump under a steady 0.15-core load: %v", before, steadyGrows)
	}
	if reached <= time.Second {
		if thr > 0.10 {
			t.Errorf("%.0f%% throttled from 1 s after the jump, want <= 10%%", thr*100)
		}
		return
	}
	// On a saturated host (other builds on the 2 cores) the 8 threads
	// cannot use even 1 core, so nothing throttles them and a quota-driven
	// policy rightly stops growing: growing quota does not buy CPU the host
	// does not have. Then the property left to check is that the quota was
	// not what held the task back once the controller had reacted.
	if psi > 50 {
		if thr > 0.10 {
			t.Errorf("host saturated, yet %.0f%% throttled from 1 s after the jump: the quota held the task back", thr*100)
		}
		t.Logf("host saturated: quota reached 1.6 cores only after %v, but the task was not quota-bound (%.0f%% throttled)", reached, thr*100)
		return
	}
	t.Errorf("quota reached 1.6 cores %v after the jump, want <= 1s", reached)
}

// hostCPUPressure returns the host's "some" CPU stall share over 10 s.
func hostCPUPressure(t *testing.T) float64 {
	b, err := os.ReadFile("/proc/pressure/cpu")
	if err != nil {
		return 0
	}
	var v float64
	if _, err := fmt.Sscanf(string(b), "some avg10=%f", &v); err != nil {
		t.Logf("parse /proc/pressure/cpu: %v", err)
	}
	return v
}

// Memory grows 100 MiB -> 6 GiB as fast as the child can touch pages,
// from a 256 MiB start: threshold eventfds wake the controller between
// ticks, and nothing is OOM-killed.
func TestMemoryGrowthNoOOM(t *testing.T) {
	cfg := envlet.DefaultConfig()
	cfg.Initial = envlet.Resources{CPU: 1, Memory: 256 * MiB}
	cfg.Cap = envlet.Resources{CPU: 2, Memory: 8 * GiB}
	e := startEnv(t, cfg, envlet.Resources{CPU: 2, Memory: 16 * GiB}, envlet.DefaultReserve)
	start := time.Now()
	if _, err := e.proc.Do("alloc 100"); err != nil {
		t.Fatal(err)
	}
	took, err := e.proc.Do("alloc 6044")
	if err != nil {
		t.Fatalf("allocating to 6 GiB: %v (oom kills %d)", err, e.cg.OOMKills(t))
	}
	time.Sleep(300 * time.Millisecond)
	printTimeline(t, e.ctl.Timeline(), start, time.Now(), true)
	st := e.ctl.Status()
	t.Logf("6 GiB allocated in %v (%.1f GiB/s); limit %s, %d memory grows, oom kills %d", took,
		6/took.Seconds(), envlet.FormatBytes(st.Limit.Memory), st.MemGrows, e.cg.OOMKills(t))
	if n := e.cg.OOMKills(t); n != 0 {
		t.Fatalf("%d OOM kills", n)
	}
	events := 0
	for _, p := range e.ctl.Timeline() {
		if p.Wake == "event" && strings.Contains(p.Actions, "mem x") {
			events++
		}
	}
	if events == 0 {
		t.Errorf("no memory grow was woken by a threshold event")
	}
	if st.Limit.Memory < 6*GiB+GiB/2 {
		t.Fatalf("limit %s below the 6 GiB working set plus headroom", envlet.FormatBytes(st.Limit.Memory))
	}
}

// After a burst the quotas halve once per (shortened) window back to the
// base, without a refused (EBUSY) shrink.
func TestIdleShrink(t *testing.T) {
	cfg := envlet.DefaultConfig()
	cfg.Initial = envlet.Resources{CPU: 0.25, Memory: 256 * MiB}
	cfg.Cap = envlet.Resources{CPU: 2, Memory: 4 * GiB}
	cfg.CPUShrinkAfter, cfg.CPUCooldown, cfg.MemShrinkAfter = time.Second, time.Second, 2*time.Second
	e := startEnv(t, cfg, envlet.Resources{CPU: 2, Memory: 16 * GiB}, envlet.DefaultReserve)
	start := time.Now()
	if _, err := e.proc.Do("threads 8 100"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.Do("alloc 700"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "growth", func() bool {
		l := e.ctl.Status().Limit
		return l.CPU >= 1 && l.Memory >= GiB
	})
	peak := e.ctl.Status().Limit
	if _, err := e.proc.Do("threads 0 0"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.Do("free"); err != nil {
		t.Fatal(err)
	}
	idle := time.Now()
	waitFor(t, 30*time.Second, "shrink back to the base", func() bool {
		return e.ctl.Status().Limit == cfg.Initial
	})
	tl := e.ctl.Timeline()
	printTimeline(t, tl, start, time.Now(), true)
	st := e.ctl.Status()
	t.Logf("peak %v, back to the base %v after going idle; shrinks cpu %d mem %d, busy %d",
		peak, time.Since(idle).Round(100*time.Millisecond), st.CPUShrinks, st.MemShrinks, st.Busy)
	if st.Busy != 0 {
		t.Errorf("%d shrinks refused with EBUSY", st.Busy)
	}
	last := map[string]time.Time{}
	for _, p := range tl {
		for res, window := range map[string]time.Duration{"cpu": cfg.CPUShrinkAfter, "mem": cfg.MemShrinkAfter} {
			if strings.Contains(p.Actions, res+" /2") {
				if l, ok := last[res]; ok && p.T.Sub(l) < window {
					t.Errorf("%s shrinks %v apart, window %v", res, p.T.Sub(l), window)
				}
				last[res] = p.T
			}
		}
	}
}
