package shim_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/prereq"
)

// BenchmarkBurstyTask runs one bursty CPU+memory task (two bursts of 4
// busy threads over 768 MiB, 1 s apart) three ways side by side: runc with
// a fixed small quota (0.5 cores, 1.5 GiB), envlet starting from the same
// 0.5 cores (and 256 MiB), and runc unlimited. It reports the completion
// times and their ratios. Gated by ENVSNAP_BENCH=1:
//
//	ENVSNAP_BENCH=1 go test -run '^$' -bench BurstyTask -benchtime 1x ./tests/shim/
func BenchmarkBurstyTask(b *testing.B) {
	prereq.RequireBench(b)
	s := newSuite(b, node{})
	args := []string{"-mode", "bench", "-threads", "4", "-work", "200", "-to", "768", "-bursts", "2", "-gap", "1s"}
	runs := []struct {
		name string
		o    runOpts
	}{
		{"fixed", runOpts{runtime: "io.containerd.runc.v2", specOpts: []oci.SpecOpts{
			oci.WithCPUCFS(50000, 100000), oci.WithMemoryLimit(uint64(1536 * envlet.MiB))}}},
		{"envlet", runOpts{ann: map[string]string{"initial-cpu": "0.5", "initial-memory": "256Mi"}}},
		{"unlimited", runOpts{runtime: "io.containerd.runc.v2"}},
	}
	total := map[string]time.Duration{}
	b.ResetTimer()
	for range b.N {
		for _, r := range runs {
			c, err := s.runWith(b, r.o, args...)
			if err != nil {
				b.Fatal(err)
			}
			c.prioritize(b)
			if code := c.wait(b, 5*time.Minute); code != 0 {
				b.Fatalf("%s: exit %d; output:\n%s", r.name, code, c.out.String())
			}
			total[r.name] += elapsed(b, c)
		}
	}
	n := time.Duration(b.N)
	fixed, el, unl := total["fixed"]/n, total["envlet"]/n, total["unlimited"]/n
	b.ReportMetric(fixed.Seconds(), "fixed-s")
	b.ReportMetric(el.Seconds(), "envlet-s")
	b.ReportMetric(unl.Seconds(), "unlimited-s")
	b.ReportMetric(fixed.Seconds()/el.Seconds(), "fixed/envlet")
	b.ReportMetric(el.Seconds()/unl.Seconds(), "envlet/unlimited")
	b.Logf("fixed 0.5 cores: %v, envlet from 0.5 cores: %v, unlimited: %v (fixed/envlet %.2fx, envlet/unlimited %.2fx, load %s)",
		fixed.Round(time.Millisecond), el.Round(time.Millisecond), unl.Round(time.Millisecond),
		fixed.Seconds()/el.Seconds(), el.Seconds()/unl.Seconds(), loadavg())
}

// elapsed is the completion time the workload measured itself.
func elapsed(t testing.TB, c *ctr) time.Duration {
	for _, l := range strings.Split(c.out.String(), "\n") {
		if v, ok := strings.CutPrefix(l, "elapsed "); ok {
			ns, err := strconv.ParseInt(v, 10, 64)
			if err == nil {
				return time.Duration(ns)
			}
		}
	}
	t.Fatalf("no elapsed time in output:\n%s", c.out.String())
	return 0
}
