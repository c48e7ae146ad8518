package shim_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/contrib/seccomp"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/envsnap/envsnap/internal/prereq"
)

// BenchmarkStartOverhead starts a container whose process exits at once,
// with runc's shim and with the envlet shim, alternating, and reports
// where the envlet shim's extra time goes: the task's Create (spec
// hardening, admission at the arbiter, runc create, cgroup check, egress
// and LSM rules), its Start (the controller's cgroup files, the arbiter's
// tracking, runc start) and the time from Start's return to the
// process's first output. Medians, side by side in one run. runc's shim
// runs twice: as the spec comes (no seccomp filter) and with containerd's
// default seccomp profile, which is what the envlet shim's hardening adds
// to a spec without one (what nerdctl and Kubernetes' RuntimeDefault give
// runc anyway), so the second difference is the shim's own. Gated by
// ENVSNAP_BENCH=1:
//
//	ENVSNAP_BENCH=1 go test -run '^$' -bench StartOverhead -benchtime 10x ./tests/shim/
func BenchmarkStartOverhead(b *testing.B) {
	prereq.RequireBench(b)
	s := newSuite(b, node{})
	type variant struct {
		name, runtime string
		seccomp       bool
	}
	variants := []variant{
		{"runc", "io.containerd.runc.v2", false},
		{"runc-seccomp", "io.containerd.runc.v2", true},
		{"envlet", envletRuntime, false},
	}
	phases := []string{"create", "start", "first-output", "total"}
	got := map[string]map[string][]time.Duration{}
	for _, v := range variants {
		got[v.name] = map[string][]time.Duration{}
	}
	b.ResetTimer()
	for i := range b.N {
		// Rotate the order so that no variant always follows the same one.
		for j := range variants {
			v := variants[(i+j)%len(variants)]
			d := s.timeStart(b, v.runtime, v.seccomp)
			for k, p := range phases {
				got[v.name][p] = append(got[v.name][p], d[k])
			}
		}
	}
	b.StopTimer()
	med := func(ds []time.Duration) time.Duration {
		ds = slices.Clone(ds)
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	for _, p := range phases {
		r, rs, e := med(got["runc"][p]), med(got["runc-seccomp"][p]), med(got["envlet"][p])
		b.ReportMetric(r.Seconds(), "runc-"+p+"-s")
		b.ReportMetric(rs.Seconds(), "runc-seccomp-"+p+"-s")
		b.ReportMetric(e.Seconds(), "envlet-"+p+"-s")
		b.Logf("%-12s runc %7.3fs  runc+seccomp %7.3fs  envlet %7.3fs  envlet-runc %+7.3fs  envlet-(runc+seccomp) %+7.3fs",
			p, r.Seconds(), rs.Seconds(), e.Seconds(), (e - r).Seconds(), (e - rs).Seconds())
	}
	b.Logf("load %s", loadavg())
	// The shim's own account of its Create steps and of its process
	// start-ups (see shim.Service.Create), from containerd's log.
	raw, err := os.ReadFile(s.env.Containerd.LogPath)
	if err != nil {
		b.Fatal(err)
	}
	steps := map[string][]time.Duration{}
	var order []string
	inits := 0
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.Contains(line, `msg="envlet: shim ready"`) {
			inits++
			if _, v, ok := strings.Cut(line, "init="); ok {
				if d, err := time.ParseDuration(strings.Fields(v)[0]); err == nil {
					steps["shim-init"] = append(steps["shim-init"], d)
				}
			}
			continue
		}
		if !strings.Contains(line, `msg="envlet: created"`) {
			continue
		}
		_, v, ok := strings.Cut(line, ` phases="`)
		if !ok {
			continue
		}
		v, _, _ = strings.Cut(v, `"`)
		for _, f := range strings.Fields(v) {
			name, ms, _ := strings.Cut(f, "=")
			d, err := time.ParseDuration(ms)
			if err != nil {
				continue
			}
			if _, seen := steps[name]; !seen {
				order = append(order, name)
			}
			steps[name] = append(steps[name], d)
		}
	}
	b.Logf("envlet shim processes started: %d for %d containers", inits, b.N)
	for _, name := range append(order, "shim-init") {
		if len(steps[name]) > 0 {
			b.Logf("envlet create step %-9s median %7.1fms (%d)", name, float64(med(steps[name]).Microseconds())/1000, len(steps[name]))
		}
	}
}

// timeStart creates, starts and waits for one container of runtime rt
// whose process prints its start time and exits, with containerd's
// default seccomp profile if withSeccomp: the durations of NewTask (the
// shim's Create), Start, from Start's return to the process's stamp, and
// the sum.
func (s *suite) timeStart(b *testing.B, rt string, withSeccomp bool) [4]time.Duration {
	b.Helper()
	ctx := s.env.Context()
	id := fmt.Sprintf("start-overhead-%d", ctrCount.Add(1))
	specOpts := []oci.SpecOpts{oci.WithImageConfig(s.img), oci.WithProcessArgs("/workload", "-mode", "idle", "-hold", "0s")}
	if withSeccomp {
		specOpts = append(specOpts, seccomp.WithDefaultProfile())
	}
	c, err := s.env.Client.NewContainer(ctx, id,
		client.WithSnapshotter("overlayfs"),
		client.WithNewSnapshot(id+"-snap", s.img),
		client.WithRuntime(rt, nil),
		client.WithNewSpec(specOpts...),
	)
	if err != nil {
		b.Fatalf("create container %s: %v", id, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(s.env.Context(), 30*time.Second)
		defer cancel()
		_ = c.Delete(dctx, client.WithSnapshotCleanup)
	}()
	out := &syncBuffer{}
	t0 := time.Now()
	task, err := c.NewTask(ctx, cio.NewCreator(cio.WithStreams(nil, out, out)))
	if err != nil {
		b.Fatalf("%s: new task: %v", rt, err)
	}
	t1 := time.Now()
	defer func() {
		dctx, cancel := context.WithTimeout(s.env.Context(), 30*time.Second)
		defer cancel()
		_, _ = task.Delete(dctx, client.WithProcessKill)
	}()
	statusC, err := task.Wait(ctx)
	if err != nil {
		b.Fatal(err)
	}
	t2 := time.Now()
	if err := task.Start(ctx); err != nil {
		b.Fatalf("%s: start: %v", rt, err)
	}
	t3 := time.Now()
	k := &ctr{id: id, task: task, statusC: statusC, out: out}
	if code := k.wait(b, time.Minute); code != 0 {
		b.Fatalf("%s: exit %d: %s", rt, code, out.String())
	}
	first := k.stamp(b, "done")
	return [4]time.Duration{t1.Sub(t0), t3.Sub(t2), first.Sub(t3), t1.Sub(t0) + first.Sub(t2)}
}
