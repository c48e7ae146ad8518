package shim_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
)

// BenchmarkIdleShimCost runs idle containers (the workload asleep) under
// the envlet shim and under containerd's runc shim side by side, one shim
// per container, waits until the envlet controllers sample at their idle
// period, and reports what each kind of shim costs the node over a
// minute: CPU time (all threads, from /proc/<pid>/task/*/schedstat, ns
// resolution) as a share of one core, and resident memory (VmRSS, and Pss,
// which counts the binary's shared pages once per sharer).
//
//	ENVSNAP_BENCH=1 go test -run '^$' -bench IdleShimCost -benchtime 1x ./tests/shim/
func BenchmarkIdleShimCost(b *testing.B) {
	prereq.RequireBench(b)
	perKind := 5
	if v, err := strconv.Atoi(os.Getenv("ENVSNAP_IDLE_SHIMS")); err == nil && v > 0 {
		perKind = v
	}
	window := time.Minute
	s := newSuite(b, node{})
	shims := map[string][]int{}
	b.ResetTimer()
	for i := range 2 * perKind {
		kind, o := "envlet", runOpts{ann: map[string]string{"initial-cpu": "0.5", "initial-memory": "256Mi"}}
		if i%2 == 1 {
			kind, o = "runc", runOpts{runtime: "io.containerd.runc.v2"}
		}
		c, err := s.runWith(b, o, "-mode", "idle", "-hold", "30m")
		if err != nil {
			b.Fatal(err)
		}
		pid, err := shimPid(c)
		if err != nil {
			b.Fatal(err)
		}
		shims[kind] = append(shims[kind], pid)
	}
	// Past idle-after (5 s) with room for the start-up work of the last
	// containers to end.
	time.Sleep(20 * time.Second)
	cpu0, err := shimsCPU(shims)
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	time.Sleep(window)
	cpu1, err := shimsCPU(shims)
	if err != nil {
		b.Fatal(err)
	}
	wall := time.Since(start)
	b.StopTimer()
	res := map[string][3]float64{}
	for kind, pids := range shims {
		var rss, pss int64
		for _, pid := range pids {
			r, p, err := shimMemory(pid)
			if err != nil {
				b.Fatal(err)
			}
			rss += r
			pss += p
		}
		n := float64(len(pids))
		pct := float64(cpu1[kind]-cpu0[kind]) / float64(wall) / n * 100
		res[kind] = [3]float64{pct, float64(rss) / n / (1 << 20), float64(pss) / n / (1 << 20)}
		b.ReportMetric(pct, kind+"-cpu%/shim")
		b.ReportMetric(res[kind][1], kind+"-RSS-MiB/shim")
		b.ReportMetric(res[kind][2], kind+"-PSS-MiB/shim")
	}
	if r := res["runc"][0]; r > 0 {
		b.ReportMetric(res["envlet"][0]/r, "envlet/runc-cpu")
	}
	b.Logf("%d idle containers per shim kind, %s: envlet shim %.3f%% of a core, RSS %.1f MiB, PSS %.1f MiB; runc shim %.3f%% of a core, RSS %.1f MiB, PSS %.1f MiB",
		perKind, wall.Round(time.Second), res["envlet"][0], res["envlet"][1], res["envlet"][2], res["runc"][0], res["runc"][1], res["runc"][2])
}

// shimPid is the pid of the shim that runs c: the parent of its init
// process (the shim is the subreaper of what runc starts).
func shimPid(c *ctr) (int, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", c.task.Pid()))
	if err != nil {
		return 0, fmt.Errorf("shim of %s: %w", c.id, err)
	}
	// The command name may hold spaces: fields start after the last ')'.
	f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
	if len(f) < 2 {
		return 0, fmt.Errorf("shim of %s: short stat %q", c.id, raw)
	}
	return strconv.Atoi(f[1])
}

// shimsCPU sums the CPU time of every thread of every shim, per kind.
func shimsCPU(shims map[string][]int) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	for kind, pids := range shims {
		for _, pid := range pids {
			tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
			if err != nil || len(tasks) == 0 {
				return nil, fmt.Errorf("threads of shim %d: %v", pid, err)
			}
			for _, p := range tasks {
				raw, err := os.ReadFile(p)
				if err != nil {
					continue // a thread that exited in between
				}
				f := strings.Fields(string(raw))
				ns, err := strconv.ParseInt(f[0], 10, 64)
				if err != nil {
					return nil, fmt.Errorf("parse %s: %q", p, raw)
				}
				out[kind] += time.Duration(ns)
			}
		}
	}
	return out, nil
}

// shimMemory returns the shim's VmRSS and Pss in bytes.
func shimMemory(pid int) (rss, pss int64, err error) {
	kb := func(file, key string) (int64, error) {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", pid, file))
		if err != nil {
			return 0, err
		}
		for _, line := range strings.Split(string(raw), "\n") {
			if v, ok := strings.CutPrefix(line, key+":"); ok {
				n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				return n << 10, err
			}
		}
		return 0, fmt.Errorf("no %s in /proc/%d/%s", key, pid, file)
	}
	if rss, err = kb("status", "VmRSS"); err != nil {
		return 0, 0, err
	}
	pss, err = kb("smaps_rollup", "Pss")
	return rss, pss, err
}
