package cgroupfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeV2 builds a cgroup v2 directory with the kernel's file formats.
func fakeV2(t *testing.T, files map[string]string) (root, path string) {
	t.Helper()
	root = t.TempDir()
	path = "/kubepods/envtest"
	dir := filepath.Join(root, path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	base := map[string]string{
		"cpu.stat":       "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\nnr_periods 40\nnr_throttled 10\nthrottled_usec 250000\nnr_bursts 2\nburst_usec 3000\n",
		"cpu.max":        "max 100000\n",
		"cpu.max.burst":  "0\n",
		"memory.current": "104857600\n",
		"memory.stat":    "anon 73400320\nfile 31457280\nkernel 1048576\nactive_anon 73400320\ninactive_anon 0\nactive_file 10485760\ninactive_file 20971520\nunevictable 0\n",
		"memory.events":  "low 0\nhigh 3\nmax 1\noom 0\noom_kill 0\noom_group_kill 0\n",
		"memory.high":    "max\n",
		"memory.max":     "max\n",
		// A v2 container cgroup also has these; the tree is a regular
		// directory, so the PSI files take triggers but cannot be polled.
		"cgroup.controllers": "cpuset cpu io memory pids\n",
		"memory.oom.group":   "1\n",
		"cgroup.freeze":      "0\n",
		"cpu.pressure":       "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
		"memory.pressure":    "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
	}
	for k, v := range files {
		base[k] = v
	}
	for k, v := range base {
		if err := os.WriteFile(filepath.Join(dir, k), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root, path
}

// readFile returns a control file's value as cgroupfs shows it: its first
// line. The fake tree is regular files, where a shorter value written over
// a longer one leaves the tail behind on the following line (cfile.write
// ends every value in a newline).
func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	v, _, _ := strings.Cut(string(b), "\n")
	return strings.TrimSpace(v)
}

func TestV2Sample(t *testing.T) {
	root, path := fakeV2(t, nil)
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	var s Sample
	if err := c.Sample(&s); err != nil {
		t.Fatal(err)
	}
	want := Sample{CPUUsageNs: 1.5e9, ThrottledNs: 2.5e8, Periods: 40, ThrottledPeriods: 10, BurstNs: 3e6,
		MemUsage: 100 << 20, InactiveFile: 20 << 20, MemStat: true, Failcnt: 1, High: 3}
	if s != want {
		t.Fatalf("sample\n got %+v\nwant %+v", s, want)
	}
	if s.WorkingSet() != 80<<20 {
		t.Fatalf("working set %d", s.WorkingSet())
	}
	// Within a second and below half the limit, memory.stat is not re-read.
	os.WriteFile(filepath.Join(root, path, "memory.stat"), []byte("inactive_file 0\n"), 0o644)
	if err := c.Sample(&s); err != nil {
		t.Fatal(err)
	}
	if s.MemStat || s.InactiveFile != 20<<20 {
		t.Fatalf("memory.stat re-read on a lean tick: %+v", s)
	}
	// A second later with usage where it was (idle): not before 10 s.
	c.lastStat = time.Now().Add(-2 * time.Second)
	if err := c.Sample(&s); err != nil || s.MemStat {
		t.Fatalf("memory.stat re-read after 2 s of still usage: %+v (%v)", s, err)
	}
	c.lastStat = time.Now().Add(-statSteadyEvery)
	if err := c.Sample(&s); err != nil || !s.MemStat || s.InactiveFile != 0 {
		t.Fatalf("memory.stat not re-read after 10 s of still usage: %+v (%v)", s, err)
	}
	// Usage moved: read again after a second.
	os.WriteFile(filepath.Join(root, path, "memory.current"), []byte(fmt.Sprint(101<<20)), 0o644)
	os.WriteFile(filepath.Join(root, path, "memory.stat"), []byte("inactive_file 4096\n"), 0o644)
	c.lastStat = time.Now().Add(-2 * time.Second)
	if err := c.Sample(&s); err != nil || !s.MemStat || s.InactiveFile != 4096 {
		t.Fatalf("memory.stat not re-read a second after usage moved: %+v (%v)", s, err)
	}
}

func TestV2Apply(t *testing.T) {
	root, path := fakeV2(t, nil)
	dir := filepath.Join(root, path)
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetMemoryCap(1 << 30)
	steps := []struct {
		l                     Limits
		cpuMax, burst         string
		high, max, memCurrent string
	}{
		{Limits{CPU: 0.25, Memory: 256 << 20}, "25000 100000", "25000", "268435456", "335544320", ""},
		{Limits{CPU: 2, Memory: 1 << 30}, "200000 100000", "200000", "1073741824", "1073741824", ""}, // max capped
		// Shrinking below usage: memory.max keeps 1.25 x usage (600 MiB) of headroom.
		{Limits{CPU: 0.5, Memory: 128 << 20}, "50000 100000", "50000", "134217728", "786432000", "629145600"},
		// Unlimited: shorter values over longer ones.
		{Limits{}, "max 100000", "0", "max", "max", ""},
		{Limits{CPU: 0.5, Memory: 128 << 20}, "50000 100000", "50000", "134217728", "786432000", ""},
	}
	for i, st := range steps {
		if st.memCurrent != "" {
			os.WriteFile(filepath.Join(dir, "memory.current"), []byte(st.memCurrent+"\n"), 0o644)
		}
		if err := c.Apply(st.l); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		for f, want := range map[string]string{"cpu.max": st.cpuMax, "cpu.max.burst": st.burst, "memory.high": st.high, "memory.max": st.max} {
			if got := readFile(t, filepath.Join(dir, f)); got != want {
				t.Errorf("step %d: %s = %q, want %q", i, f, got, want)
			}
		}
	}
	if c.Limits() != (Limits{CPU: 0.5, Memory: 128 << 20}) {
		t.Fatalf("limits %+v", c.Limits())
	}
}

func TestV2EventsInotify(t *testing.T) {
	root, path := fakeV2(t, nil)
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	var s Sample
	c.Sample(&s)
	ev := filepath.Join(root, path, "memory.events")
	if err := os.WriteFile(ev, []byte("low 0\nhigh 9\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-c.Events():
		if e.Kind != EventMemEvents {
			t.Fatalf("event %v", e.Kind)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no event after memory.events changed")
	}
	// The event forces a memory.stat/memory.events read on the next sample.
	if err := c.Sample(&s); err != nil {
		t.Fatal(err)
	}
	if !s.MemStat || s.OOM != 1 || s.OOMKill != 1 || s.High != 9 || s.Failcnt != 4 {
		t.Fatalf("sample after event %+v", s)
	}
}

func TestV2Vanished(t *testing.T) {
	root, path := fakeV2(t, nil)
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := OpenV2(filepath.Join(root, "/missing")); !errors.Is(err, ErrVanished) {
		t.Fatalf("open of a missing cgroup: %v, want ErrVanished", err)
	}
}

// A delegated subtree without the cpu or memory controller has no
// cpu.max or memory.high: opening it names the cgroup and what is missing
// instead of running the container unlimited.
func TestV2MissingControllers(t *testing.T) {
	root, path := fakeV2(t, map[string]string{"cgroup.controllers": "cpu pids\n"})
	dir := filepath.Join(root, path)
	_, err := OpenV2(dir)
	if err == nil || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "[memory]") || errors.Is(err, ErrVanished) {
		t.Fatalf("open without the memory controller: %v", err)
	}
}

func TestV2FreezeAndOOMGroup(t *testing.T) {
	root, path := fakeV2(t, nil)
	dir := filepath.Join(root, path)
	c, err := OpenV2(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.SetOOMGroup(false); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "memory.oom.group")); got != "0" {
		t.Fatalf("memory.oom.group = %q", got)
	}
	if err := c.Freeze(true); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "cgroup.freeze")); got != "1" {
		t.Fatalf("cgroup.freeze = %q", got)
	}
	// The triggers went to the PSI files (a regular file keeps them).
	if got := readFile(t, filepath.Join(dir, "cpu.pressure")); !strings.HasPrefix(got, string(CPUPressureTrigger)) {
		t.Fatalf("cpu.pressure = %q", got)
	}
}

func TestParse(t *testing.T) {
	b := []byte("nr_periods 12\nnr_throttled 3\nthrottled_time 4567\n")
	for key, want := range map[string]uint64{"nr_periods": 12, "nr_throttled": 3, "throttled_time": 4567} {
		if v, ok := field(b, key); !ok || v != want {
			t.Errorf("field %s = %d %v", key, v, ok)
		}
	}
	if _, ok := field(b, "throttled"); ok {
		t.Error("prefix matched a longer key")
	}
	for in, want := range map[string]int64{"max\n": -1, "-1\n": -1, "123\n": 123} {
		if v, ok := parseLimit([]byte(in)); !ok || v != want {
			t.Errorf("parseLimit(%q) = %d %v", in, v, ok)
		}
	}
	if got := string(appendInt(nil, -42)); got != "-42" {
		t.Errorf("appendInt = %q", got)
	}
}

func TestSampleAllocs(t *testing.T) {
	root, path := fakeV2(t, nil)
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	var s Sample
	if n := testing.AllocsPerRun(100, func() { c.Sample(&s) }); n != 0 {
		t.Fatalf("Sample allocates %.1f times per call", n)
	}
}

// BenchmarkSampleV2 samples a fake v2 tree (tmpfs/disk files, so it
// measures the parser and syscalls, not cgroupfs' own cost).
func BenchmarkSampleV2(b *testing.B) {
	root := b.TempDir()
	path := "/bench"
	os.MkdirAll(filepath.Join(root, path), 0o755)
	for k, v := range map[string]string{
		"cpu.stat": "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\nnr_periods 40\nnr_throttled 10\nthrottled_usec 250000\nnr_bursts 2\nburst_usec 3000\n",
		"cpu.max":  "max 100000\n", "memory.current": "104857600\n", "memory.high": "max\n", "memory.max": "max\n",
		"memory.stat":   strings.Repeat("anon 73400320\n", 40) + "inactive_file 20971520\n",
		"memory.events": "low 0\nhigh 3\nmax 1\noom 0\noom_kill 0\n",
	} {
		os.WriteFile(filepath.Join(root, path, k), []byte(v), 0o644)
	}
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	var s Sample
	for b.Loop() {
		c.Sample(&s)
	}
}

// What systemd does to a scope's cgroup when it applies the unit's
// properties (runc update through the systemd driver): memory.high back
// to max, memory.max and cpu.max to the creation values; runc writes
// kubelet's memory.oom.group=1. Restore puts envlet's values back, once.
func TestV2Restore(t *testing.T) {
	root, path := fakeV2(t, nil)
	dir := filepath.Join(root, path)
	c, err := OpenV2(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetMemoryCap(512 << 20)
	if err := c.Apply(Limits{CPU: 0.5, Memory: 128 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := c.SetOOMGroup(false); err != nil {
		t.Fatal(err)
	}
	if restored, err := c.Restore(); err != nil || restored {
		t.Fatalf("restore with nothing rewritten: %v, %v; want false", restored, err)
	}
	want := map[string]string{"cpu.max": "50000 100000", "memory.high": "134217728", "memory.max": "167772160", "memory.oom.group": "0"}
	for f, v := range map[string]string{"cpu.max": "max 100000", "memory.high": "max", "memory.max": "201326592", "memory.oom.group": "1"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if restored, err := c.Restore(); err != nil || !restored {
		t.Fatalf("restore after systemd's rewrite: %v, %v; want true", restored, err)
	}
	for f, v := range want {
		if got := readFile(t, filepath.Join(dir, f)); got != v {
			t.Errorf("%s = %q after restore, want %q", f, got, v)
		}
	}
	if restored, err := c.Restore(); err != nil || restored {
		t.Fatalf("second restore: %v, %v; want false", restored, err)
	}
}
