package shim_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
)

// BenchmarkTierSlowdown measures, on this node's cgroups, how much a
// latency-tier environment (one thread, CPU bursts with short gaps, the
// shape of tool calls) is slowed by best-effort environments that
// saturate the node (two, 4 spinning threads each), started before it and
// after it, against the same episode alone (the DSec form: slowdown =
// elapsed / elapsed alone - 1).
//
//	ENVSNAP_BENCH=1 go test -run '^$' -bench TierSlowdown -benchtime 1x ./tests/shim/
func BenchmarkTierSlowdown(b *testing.B) {
	prereq.RequireBench(b)
	s := newSuite(b, node{})
	lat := []string{"-mode", "bench", "-threads", "1", "-work", "300", "-to", "16", "-bursts", "4", "-gap", "250ms"}
	hog := []string{"-mode", "cpu", "-threads", "4", "-threads2", "4", "-jump", "1s", "-duration", "5m"}
	latAnn := map[string]string{"tier": "latency", "initial-cpu": "0.25", "initial-memory": "256Mi"}
	hogAnn := map[string]string{"tier": "besteffort", "initial-cpu": "1", "initial-memory": "256Mi"}
	episode := func(started func()) time.Duration {
		c, err := s.run(b, latAnn, lat...)
		if err != nil {
			b.Fatal(err)
		}
		raiseParent(b, c.ns)
		if started != nil {
			started()
		}
		if code := c.wait(b, 5*time.Minute); code != 0 {
			b.Fatalf("latency episode exit %d:\n%s", code, c.out.String())
		}
		return elapsed(b, c)
	}
	var hogs []*ctr
	startHogs := func() {
		for range 2 {
			c, err := s.run(b, hogAnn, hog...)
			if err != nil {
				b.Fatal(err)
			}
			raiseParent(b, c.ns)
			hogs = append(hogs, c)
		}
	}
	stopHogs := func() {
		for _, c := range hogs {
			_ = c.task.Kill(s.env.Context(), syscall.SIGKILL)
			c.wait(b, time.Minute)
		}
		hogs = nil
	}
	b.ResetTimer()
	alone := episode(nil)
	startHogs()
	time.Sleep(5 * time.Second) // the hogs grow their quotas first
	hogsFirst := episode(nil)
	stopHogs()
	time.Sleep(2 * time.Second)
	latFirst := episode(startHogs)
	stopHogs()
	again := episode(nil)
	b.StopTimer()
	base := (alone + again) / 2
	slow := func(d time.Duration) float64 { return (float64(d)/float64(base) - 1) * 100 }
	b.ReportMetric(slow(hogsFirst), "slowdown%-besteffort-first")
	b.ReportMetric(slow(latFirst), "slowdown%-latency-first")
	b.Logf("latency episode alone %v / %v; best-effort started first %v (%+.1f%%); latency started first %v (%+.1f%%)",
		alone.Round(time.Millisecond), again.Round(time.Millisecond), hogsFirst.Round(time.Millisecond), slow(hogsFirst),
		latFirst.Round(time.Millisecond), slow(latFirst))
}
