package shim_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
)

// BenchmarkIdleShimCost runs idle containers (the workload asleep) under
// the envlet shim and under containerd's runc shim side by side (the
// envlet shims as the node's config groups them, runc's one per
// container), waits until the envlet controllers sample at their idle
// period, and reports what each kind of shim costs the node per
// container over a minute: CPU time (all threads of every shim process,
// from /proc/<pid>/task/*/schedstat, ns resolution) as a share of one
// core, and resident memory (VmRSS; Pss, which counts the binary's
// shared pages once per sharer; and Uss, the pages only that shim
// holds), summed over the shim processes and divided by the containers.
// ENVSNAP_IDLE_SHIMS sets the containers per kind (default 5),
// ENVSNAP_GROUP_SIZE the envlet shim's [shim] group-size.
// ENVSNAP_IDLE_ACTIVE=1 keeps the envlet controllers at their active
// period (idle-util=0: never idle; start-order off, as a start would then
// hold the queue for start-max): what watching costs per environment
// while its episode runs.
//
//	ENVSNAP_BENCH=1 ENVSNAP_IDLE_SHIMS=20 go test -run '^$' -bench IdleShimCost -benchtime 1x ./tests/shim/
func BenchmarkIdleShimCost(b *testing.B) {
	prereq.RequireBench(b)
	perKind := 5
	if v, err := strconv.Atoi(os.Getenv("ENVSNAP_IDLE_SHIMS")); err == nil && v > 0 {
		perKind = v
	}
	window := time.Minute
	active := os.Getenv("ENVSNAP_IDLE_ACTIVE") == "1"
	s := newSuite(b, node{groupSize: os.Getenv("ENVSNAP_GROUP_SIZE")})
	shims := map[string][]int{}
	containers := map[string]int{}
	b.ResetTimer()
	for i := range 2 * perKind {
		kind, o := "envlet", runOpts{ann: map[string]string{"initial-cpu": "0.5", "initial-memory": "256Mi"}}
		if active {
			o.ann["idle-util"], o.ann["start-order"] = "0", "false"
		}
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
		containers[kind]++
		if !slices.Contains(shims[kind], pid) {
			shims[kind] = append(shims[kind], pid)
		}
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
	res := map[string][4]float64{}
	for kind, pids := range shims {
		var rss, pss, uss int64
		for _, pid := range pids {
			m, err := shimMemory(pid)
			if err != nil {
				b.Fatal(err)
			}
			rss += m[0]
			pss += m[1]
			uss += m[2]
		}
		n := float64(containers[kind])
		pct := float64(cpu1[kind]-cpu0[kind]) / float64(wall) / n * 100
		res[kind] = [4]float64{pct, float64(rss) / n / (1 << 20), float64(pss) / n / (1 << 20), float64(uss) / n / (1 << 20)}
		b.ReportMetric(pct, kind+"-cpu%/env")
		b.ReportMetric(res[kind][1], kind+"-RSS-MiB/env")
		b.ReportMetric(res[kind][2], kind+"-PSS-MiB/env")
		b.ReportMetric(res[kind][3], kind+"-USS-MiB/env")
	}
	if r := res["runc"][0]; r > 0 {
		b.ReportMetric(res["envlet"][0]/r, "envlet/runc-cpu")
	}
	for _, kind := range []string{"envlet", "runc"} {
		r := res[kind]
		b.Logf("%s: %d idle containers (active envlet sampling: %v), %d shim processes, %s: per container %.4f%% of a core, RSS %.2f MiB, PSS %.2f MiB, USS %.2f MiB",
			kind, containers[kind], active, len(shims[kind]), wall.Round(time.Second), r[0], r[1], r[2], r[3])
	}
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

// shimMemory returns the shim's VmRSS, Pss and Uss (private pages) in
// bytes.
func shimMemory(pid int) ([3]int64, error) {
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
	var out [3]int64
	var err error
	if out[0], err = kb("status", "VmRSS"); err != nil {
		return out, err
	}
	if out[1], err = kb("smaps_rollup", "Pss"); err != nil {
		return out, err
	}
	for _, k := range []string{"Private_Clean", "Private_Dirty"} {
		v, err := kb("smaps_rollup", k)
		if err != nil {
			return out, err
		}
		out[2] += v
	}
	return out, nil
}
