package cgroupfs_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3/cgroup1"

	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
	"github.com/envsnap/envsnap/internal/envlet/envlettest"
)

func TestMain(m *testing.M) {
	envlettest.HelperMain()
	os.Exit(m.Run())
}

func openV1(t testing.TB) (*envlettest.V1, *cgroupfs.V1) {
	t.Helper()
	m := envlettest.RequireV1(t)
	cg := envlettest.NewV1(t, m)
	c, err := cgroupfs.OpenV1(m, cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return cg, c
}

func TestV1ApplySample(t *testing.T) {
	cg, c := openV1(t)
	if err := c.Apply(cgroupfs.Limits{CPU: 0.5, Memory: 256 << 20}); err != nil {
		t.Fatal(err)
	}
	for hier, files := range map[string]map[string]string{
		"cpu":    {"cpu.cfs_quota_us": "50000", "cpu.cfs_burst_us": "50000"},
		"memory": {"memory.limit_in_bytes": "268435456"},
	} {
		for f, want := range files {
			if got := strings.TrimSpace(cg.Read(t, hier, f)); got != want {
				t.Errorf("%s = %s, want %s", f, got, want)
			}
		}
	}
	// Raising then lowering both orders the burst/quota writes correctly.
	if err := c.Apply(cgroupfs.Limits{CPU: 2, Memory: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if err := c.Apply(cgroupfs.Limits{CPU: 0.25, Memory: 128 << 20}); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(cg.Read(t, "cpu", "cpu.cfs_burst_us")); got != "25000" {
		t.Errorf("burst after lowering %s", got)
	}

	p := envlettest.Start(t)
	cg.Add(t, p.Pid())
	if _, err := p.Do("threads 8 100"); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Do("alloc 64"); err != nil {
		t.Fatal(err)
	}
	var s0, s1 cgroupfs.Sample
	if err := c.Sample(&s0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if err := c.Sample(&s1); err != nil {
		t.Fatal(err)
	}
	used := float64(s1.CPUUsageNs-s0.CPUUsageNs) / 0.5e9
	t.Logf("8 busy threads at 0.25 cores: used %.2f cores, throttled_time rate %.2f, ws %d MiB",
		used, float64(s1.ThrottledNs-s0.ThrottledNs)/0.5e9, s1.WorkingSet()>>20)
	// Quota 0.25 plus at most one burst (25 ms) over the 0.5 s window.
	if used > 0.35 {
		t.Fatalf("quota not enforced: %.2f cores used", used)
	}
	// The host may be saturated by others, so throttling is awaited rather
	// than expected in a fixed window.
	deadline := time.Now().Add(10 * time.Second)
	for s1.ThrottledNs == 0 || s1.ThrottledPeriods == 0 || s1.Periods == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no throttling seen with 8 threads at 0.25 cores: %+v", s1)
		}
		time.Sleep(100 * time.Millisecond)
		if err := c.Sample(&s1); err != nil {
			t.Fatal(err)
		}
	}
	if s1.MemUsage < 64<<20 {
		t.Fatalf("memory usage %d below the 64 MiB allocated", s1.MemUsage)
	}
}

// v1 refuses a limit below usage with EBUSY and kills nothing.
func TestV1ShrinkBusy(t *testing.T) {
	cg, c := openV1(t)
	if err := c.Apply(cgroupfs.Limits{CPU: 1, Memory: 512 << 20}); err != nil {
		t.Fatal(err)
	}
	p := envlettest.Start(t)
	cg.Add(t, p.Pid())
	if _, err := p.Do("alloc 200"); err != nil {
		t.Fatal(err)
	}
	err := c.Apply(cgroupfs.Limits{CPU: 0.5, Memory: 64 << 20})
	if !errors.Is(err, cgroupfs.ErrBusy) || !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("shrink below usage: %v, want ErrBusy", err)
	}
	if c.Limits() != (cgroupfs.Limits{CPU: 0.5, Memory: 512 << 20}) {
		t.Fatalf("limits after EBUSY %+v: cpu applied, memory kept", c.Limits())
	}
	if _, err := p.Do("free"); err != nil {
		t.Fatalf("child after refused shrink: %v", err)
	}
	if n := cg.OOMKills(t); n != 0 {
		t.Fatalf("%d OOM kills", n)
	}
}

// The usage threshold eventfd fires when memory crosses 60% of the limit,
// and is re-armed at the new limit.
func TestV1ThresholdEvent(t *testing.T) {
	cg, c := openV1(t)
	if err := c.Apply(cgroupfs.Limits{CPU: 1, Memory: 256 << 20}); err != nil {
		t.Fatal(err)
	}
	p := envlettest.Start(t)
	cg.Add(t, p.Pid())
	if _, err := p.Do("alloc 170"); err != nil { // 66%
		t.Fatal(err)
	}
	select {
	case e := <-c.Events():
		if e.Kind != cgroupfs.EventMemThreshold {
			t.Fatalf("event %v", e.Kind)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no threshold event at 66% of the limit")
	}
	var s cgroupfs.Sample
	if err := c.Sample(&s); err != nil || !s.MemStat {
		t.Fatalf("sample after event: %v %+v", err, s)
	}
	if err := c.Apply(cgroupfs.Limits{CPU: 1, Memory: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Do("alloc 500"); err != nil { // 670 MiB = 65% of 1 GiB
		t.Fatal(err)
	}
	select {
	case <-c.Events():
	case <-time.After(5 * time.Second):
		t.Fatal("no threshold event after re-arming at the new limit")
	}
}

func TestV1Vanished(t *testing.T) {
	m := envlettest.RequireV1(t)
	cg := envlettest.NewV1(t, m)
	c, err := cgroupfs.OpenV1(m, cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, d := range []string{m.CPU, m.CPUAcct, m.Memory} {
		if err := os.Remove(d + cg.Path); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
	}
	var s cgroupfs.Sample
	if err := c.Sample(&s); !errors.Is(err, cgroupfs.ErrVanished) {
		t.Fatalf("sample of a removed cgroup: %v, want ErrVanished", err)
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkSampleV1 samples 200 real v1 cgroups per iteration, as a node
// with 200 environments does every tick, and compares the CPU cost per
// sample with containerd/cgroups' cgroup1 Stat() on the same cgroups.
func BenchmarkSampleV1(b *testing.B) {
	m := envlettest.RequireV1(b)
	const n = 200
	cgs := make([]*cgroupfs.V1, n)
	paths := make([]string, n)
	for i := range cgs {
		cg := envlettest.NewV1(b, m)
		c, err := cgroupfs.OpenV1(m, cg.Path)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		if err := c.Apply(cgroupfs.Limits{CPU: 1, Memory: 1 << 30}); err != nil {
			b.Fatal(err)
		}
		cgs[i], paths[i] = c, cg.Path
	}
	var s cgroupfs.Sample
	b.ResetTimer()
	c0 := cpuTime()
	for b.Loop() {
		for _, c := range cgs {
			if err := c.Sample(&s); err != nil {
				b.Fatal(err)
			}
		}
	}
	lean := (cpuTime() - c0) / time.Duration(b.N*n)
	b.StopTimer()
	// The same with memory.stat, oom_control and failcnt (read once a
	// second, or every tick while usage is above half the limit).
	c0 = cpuTime()
	const fullRounds = 20
	for range fullRounds {
		for _, c := range cgs {
			c.RequestStat()
			if err := c.Sample(&s); err != nil || !s.MemStat {
				b.Fatal(err)
			}
		}
	}
	full := (cpuTime() - c0) / (fullRounds * n)

	// Baseline: the library's Stat on 20 of them.
	hier := func() ([]cgroup1.Subsystem, error) {
		all, err := cgroup1.Default()
		var out []cgroup1.Subsystem
		for _, s := range all {
			switch s.Name() {
			case cgroup1.Cpu, cgroup1.Cpuacct, cgroup1.Memory:
				out = append(out, s)
			}
		}
		return out, err
	}
	const nb, rounds = 20, 10
	lib := make([]cgroup1.Cgroup, nb)
	for i := range lib {
		var err error
		if lib[i], err = cgroup1.Load(cgroup1.StaticPath(paths[i]), cgroup1.WithHierarchy(hier)); err != nil {
			b.Fatal(err)
		}
	}
	c0 = cpuTime()
	for range rounds {
		for _, l := range lib {
			if _, err := l.Stat(cgroup1.IgnoreNotExist); err != nil {
				b.Fatal(err)
			}
		}
	}
	stat := (cpuTime() - c0) / (nb * rounds)
	// At 5 Hz with memory.stat at 1 Hz: four lean samples and one full.
	us := (4*float64(lean) + float64(full)) / 5 / 1e3
	b.ReportMetric(float64(lean)/1e3, "lean-cpu-us/sample")
	b.ReportMetric(float64(full)/1e3, "full-cpu-us/sample")
	b.ReportMetric(us, "cpu-us/sample")
	b.ReportMetric(us*n*5/1e6*100, "%core@200x5Hz")
	b.ReportMetric(float64(stat)/1e3, "stat-cpu-us/sample")
	b.ReportMetric(float64(stat)/(us*1e3), "stat/ours")
}

// SetShares writes a real v1 cpu.shares.
func TestV1SetShares(t *testing.T) {
	cg, c := openV1(t)
	if err := c.SetShares(10240); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(cg.Read(t, "cpu", "cpu.shares")); got != "10240" {
		t.Fatalf("cpu.shares %q, want 10240", got)
	}
}

// under_oom is a level: once tasks were seen paused at the limit, the next
// sample after the limit is raised reads it again and says they run,
// although usage is far below half the new limit (where memory.stat is
// otherwise read once a second). A stale pause made the controller grow
// x4 again at every tick.
func TestV1UnderOOMNotStale(t *testing.T) {
	cg, c := openV1(t)
	if err := c.Apply(cgroupfs.Limits{CPU: 1, Memory: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetPauseOnOOM(true); err != nil {
		t.Fatal(err)
	}
	p := envlettest.Start(t)
	cg.Add(t, p.Pid())
	done := make(chan error, 1)
	go func() { _, err := p.Do("alloc 100"); done <- err }()
	var s cgroupfs.Sample
	deadline := time.Now().Add(30 * time.Second)
	for !s.UnderOOM {
		if time.Now().After(deadline) {
			t.Fatalf("no under_oom with 100 MiB allocated at a 64 MiB limit: %+v", s)
		}
		time.Sleep(20 * time.Millisecond)
		if err := c.Sample(&s); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Apply(cgroupfs.Limits{CPU: 1, Memory: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("child after the limit was raised: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("child still paused after the limit was raised")
	}
	// The controller samples into the same struct every tick.
	if err := c.Sample(&s); err != nil {
		t.Fatal(err)
	}
	if s.UnderOOM {
		t.Fatalf("under_oom still reported after the limit was raised and the task ran on (memory.stat read: %v)", s.MemStat)
	}
}

// TestV1Restore: limits rewritten behind the controller's back (systemd
// applying a scope's properties) are put back by Restore, once.
func TestV1Restore(t *testing.T) {
	cg, c := openV1(t)
	if err := c.Apply(cgroupfs.Limits{CPU: 0.5, Memory: 256 << 20}); err != nil {
		t.Fatal(err)
	}
	if restored, err := c.Restore(); err != nil || restored {
		t.Fatalf("restore with nothing rewritten: %v, %v; want false", restored, err)
	}
	for hier, f := range map[string]string{"cpu": "cpu.cfs_quota_us", "memory": "memory.limit_in_bytes"} {
		dir := map[string]string{"cpu": cg.Mounts.CPU, "memory": cg.Mounts.Memory}[hier]
		if err := os.WriteFile(filepath.Join(dir, cg.Path, f), []byte("-1"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if restored, err := c.Restore(); err != nil || !restored {
		t.Fatalf("restore after the limits were lifted: %v, %v; want true", restored, err)
	}
	for hier, want := range map[string]string{"cpu.cfs_quota_us": "50000", "memory.limit_in_bytes": "268435456"} {
		h := "cpu"
		if strings.HasPrefix(hier, "memory") {
			h = "memory"
		}
		if got := strings.TrimSpace(cg.Read(t, h, hier)); got != want {
			t.Errorf("%s = %s after restore, want %s", hier, got, want)
		}
	}
	if restored, err := c.Restore(); err != nil || restored {
		t.Fatalf("second restore: %v, %v; want false", restored, err)
	}
}

// Demand counts what the group's threads want, not what they get: a
// spinning thread held to a tenth of a core by its quota still shows
// most of a core of demand, and the same process with nothing to run
// shows none.
func TestV1Demand(t *testing.T) {
	cg, c := openV1(t)
	if err := c.Apply(cgroupfs.Limits{CPU: 0.1, Memory: 256 << 20}); err != nil {
		t.Fatal(err)
	}
	p := envlettest.Start(t)
	cg.Add(t, p.Pid())
	if _, err := p.Do("threads 1 100"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	var before, after cgroupfs.Sample
	if _, err := c.Demand(); err != nil {
		t.Fatal(err)
	}
	if err := c.Sample(&before); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	time.Sleep(time.Second)
	demand, err := c.Demand()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Sample(&after); err != nil {
		t.Fatal(err)
	}
	wall := time.Since(start)
	used := time.Duration(after.CPUUsageNs - before.CPUUsageNs)
	t.Logf("spinning at a 0.1-core quota: demand %v, used %v in %v", time.Duration(demand), used, wall)
	if time.Duration(demand) < wall*6/10 || time.Duration(demand) < 3*used {
		t.Fatalf("a spinning thread at a 0.1-core quota: demand %v, used %v in %v; want most of the wall time and over 3x the use", time.Duration(demand), used, wall)
	}
	if _, err := p.Do("threads 0 0"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := c.Demand(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if idle, err := c.Demand(); err != nil || time.Duration(idle) > 25*time.Millisecond {
		t.Fatalf("the same process idle: demand %v (%v), want under 25ms in 500ms", time.Duration(idle), err)
	}
}
