package shim_test

import (
	"fmt"
	"github.com/envsnap/envsnap/internal/prereq"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
)

// rlEnv is one environment of an RL iteration.
type rlEnv struct {
	kind string // idle, latency, burst
	args []string
}

// rlMix is an RL iteration on a 2-core node: most environments wait on the
// model (idle), a few run short latency-sensitive episodes (a tool call, a
// quick test), two burst (a compile, a test run). Idle ones are submitted
// first, the bursts last, like a rollout whose agents start thinking
// before they build.
func rlMix() []rlEnv {
	var m []rlEnv
	for range 14 {
		m = append(m, rlEnv{"idle", []string{"-mode", "idle", "-hold", "8s"}})
	}
	for range 4 {
		m = append(m, rlEnv{"latency", []string{"-mode", "bench", "-threads", "1", "-work", "40", "-to", "64", "-bursts", "3", "-gap", "500ms"}})
	}
	for range 2 {
		m = append(m, rlEnv{"burst", []string{"-mode", "bench", "-threads", "4", "-work", "400", "-to", "256", "-bursts", "1"}})
	}
	return m
}

// rlResult is one scheduling of the mix.
type rlResult struct {
	firstTry  int // admitted when first submitted
	peak      int // most running at once
	finished  int
	makespan  time.Duration
	latencies []time.Duration
}

// runMix submits the mix as a FIFO scheduler would: in order, retrying
// the refused ones whenever an environment finishes.
func (s *suite) runMix(b *testing.B, mix []rlEnv, tiers bool) rlResult {
	b.Helper()
	type done struct {
		c    *ctr
		kind string
		code uint32
	}
	finished := make(chan done, len(mix))
	var res rlResult
	pending := slices.Clone(mix)
	tried := make([]bool, len(mix))
	idx := make([]int, len(mix))
	for i := range idx {
		idx[i] = i
	}
	running := 0
	start := time.Now()
	lastDone := start
	var lastRefusal error
	for len(pending) > 0 || running > 0 {
		for len(pending) > 0 {
			e := pending[0]
			ann := map[string]string{}
			if tiers {
				switch e.kind {
				case "latency":
					ann["tier"] = "latency"
				case "burst":
					ann["tier"] = "besteffort"
				}
			}
			c, err := s.run(b, ann, e.args...)
			if err != nil {
				if !errdefs.IsResourceExhausted(errgrpc.ToNative(err)) && !strings.Contains(err.Error(), "ADMISSION_REJECTED") {
					b.Fatalf("start %s: %v", e.kind, err)
				}
				tried[idx[0]] = true
				lastRefusal = err
				break
			}
			if !tried[idx[0]] {
				res.firstTry++
			}
			raiseParent(b, c.ns)
			pending, idx = pending[1:], idx[1:]
			running++
			res.peak = max(res.peak, running)
			go func(c *ctr, kind string) {
				st := <-c.statusC
				if tio := c.task.IO(); tio != nil {
					tio.Wait()
				}
				finished <- done{c, kind, st.ExitCode()}
			}(c, e.kind)
		}
		if running == 0 {
			// The last one's grant is released just after its exit.
			if time.Since(lastDone) > 30*time.Second {
				b.Fatalf("nothing running and %d refused for 30 s: the node admits none; last refusal: %v\n%s", len(pending), lastRefusal, s.envsnap(b, "envs", "--all"))
			}
			time.Sleep(100 * time.Millisecond)
			continue
		}
		select {
		case d := <-finished:
			running--
			lastDone = time.Now()
			if d.code != 0 {
				b.Fatalf("%s environment %s exit %d; output:\n%s", d.kind, d.c.id, d.code, d.c.out.String())
			}
			res.finished++
			if d.kind == "latency" {
				res.latencies = append(res.latencies, elapsed(b, d.c))
			}
		case <-time.After(5 * time.Minute):
			b.Fatalf("no environment finished in 5 minutes (%d running)", running)
		}
	}
	res.makespan = time.Since(start)
	return res
}

// raiseParent gives the test namespace's parent cgroup the highest CPU
// weight against the other work on this shared machine, leaving the
// containers' own weights (the tiers) as they are.
func raiseParent(b *testing.B, ns string) {
	p := filepath.Join("/sys/fs/cgroup/cpu", ns, "cpu.shares")
	if _, err := os.Stat(p); err != nil {
		return
	}
	if err := os.WriteFile(p, []byte("262144"), 0o644); err != nil {
		b.Fatalf("raise cpu.shares of %s: %v", ns, err)
	}
}

// p95 of d (nearest rank).
func p95(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[(len(s)*95+99)/100-1]
}

// setOvercommit rewrites the arbiter's bound and restarts it.
func (s *suite) setOvercommit(b *testing.B, ratio string) {
	b.Helper()
	cfg, err := os.ReadFile(s.cfgPath)
	if err != nil {
		b.Fatal(err)
	}
	text := string(cfg)
	if i := strings.Index(text, "[node.overcommit]"); i >= 0 {
		j := strings.Index(text, "[arbiter]")
		text = text[:i] + text[j:]
	}
	text = strings.Replace(text, "[arbiter]", fmt.Sprintf("[node.overcommit]\ncpu = %s\nmemory = %s\n[arbiter]", ratio, ratio), 1)
	if err := os.WriteFile(s.cfgPath, []byte(text), 0o600); err != nil {
		b.Fatal(err)
	}
	s.arbiter.Stop(5 * time.Second)
	_ = os.Remove(filepath.Join(s.dir, "arbiter-ledger.json"))
	s.startArbiter(b)
}

// BenchmarkRLIteration runs one RL iteration's mix (14 idle, 4
// latency-sensitive, 2 bursting environments, default initial quota 2
// cores / 8 GiB) on this 2-core node four ways in one run:
//
//   - alone: the latency-sensitive episodes by themselves (the reference);
//   - fixed: admission by request (overcommit 1), like fixed quotas;
//   - by use: admission by use, no tiers;
//   - by use + tiers: latency episodes tier=latency, bursts besteffort.
//
// It reports environments admitted at first submission, the most running
// at once, the makespan, and the p95 latency-episode time, with ratios.
//
//	ENVSNAP_BENCH=1 go test -run '^$' -bench RLIteration -benchtime 1x ./tests/shim/
func BenchmarkRLIteration(b *testing.B) {
	prereq.RequireBench(b)
	s := newSuite(b, node{cpu: "2"})
	mix := rlMix()
	var latencyOnly []rlEnv
	for _, e := range mix {
		if e.kind == "latency" {
			latencyOnly = append(latencyOnly, e)
		}
	}
	b.ResetTimer()
	alone := s.runMix(b, latencyOnly, false)
	s.setOvercommit(b, "1")
	fixed := s.runMix(b, mix, false)
	s.setOvercommit(b, "20")
	use := s.runMix(b, mix, false)
	tiered := s.runMix(b, mix, true)
	b.StopTimer()
	if fixed.finished == 0 || use.finished != len(mix) || tiered.finished != len(mix) {
		b.Fatalf("finished: fixed %d, by use %d, tiers %d of %d", fixed.finished, use.finished, tiered.finished, len(mix))
	}
	ref := p95(alone.latencies)
	for _, r := range []struct {
		name string
		res  rlResult
	}{{"fixed", fixed}, {"use", use}, {"tiers", tiered}} {
		b.ReportMetric(float64(r.res.peak), r.name+"-peak-envs")
		b.ReportMetric(r.res.makespan.Seconds(), r.name+"-makespan-s")
		b.ReportMetric(p95(r.res.latencies).Seconds()/ref.Seconds(), r.name+"-p95/alone")
	}
	b.ReportMetric(float64(use.peak)/float64(fixed.peak), "use/fixed-envs")
	b.ReportMetric(fixed.makespan.Seconds()/use.makespan.Seconds(), "fixed/use-makespan")
	b.Logf("alone p95 %v; fixed: %d admitted at once (%d at first try), makespan %v, p95 %v; by use: %d (%d), %v, p95 %v; by use + tiers: %d (%d), %v, p95 %v; load %s",
		ref.Round(time.Millisecond),
		fixed.peak, fixed.firstTry, fixed.makespan.Round(time.Millisecond), p95(fixed.latencies).Round(time.Millisecond),
		use.peak, use.firstTry, use.makespan.Round(time.Millisecond), p95(use.latencies).Round(time.Millisecond),
		tiered.peak, tiered.firstTry, tiered.makespan.Round(time.Millisecond), p95(tiered.latencies).Round(time.Millisecond), loadavg())
}
