package envlet

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
)

// The controller on a (fake) cgroup v2 tree: memory.high follows the
// grant, memory.max stays 1.25x above it within the cap, cpu.max and
// cpu.max.burst follow the CPU quota, and a memory.events change wakes
// Run between ticks.
func TestControllerV2Tree(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "pod", "ctr")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name, v string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// rewrite replaces same-length content with one pwrite, as the kernel
	// updates memory.events atomically: os.WriteFile truncates first, and
	// the inotify event of the truncation would wake the controller on an
	// empty file.
	rewrite := func(name, v string) {
		t.Helper()
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if fi, _ := f.Stat(); fi.Size() != int64(len(v)) {
			t.Fatalf("rewrite %s: %d bytes over %d", name, len(v), fi.Size())
		}
		if _, err := f.WriteAt([]byte(v), 0); err != nil {
			t.Fatal(err)
		}
	}
	read := func(name string) string {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		// The value as cgroupfs shows it: the first line (a shorter
		// value written over a longer one leaves the tail below it).
		v, _, _ := strings.Cut(string(b), "\n")
		return strings.TrimSpace(v)
	}
	write("cpu.stat", "usage_usec 0\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
	write("cpu.max", "max 100000\n")
	write("cpu.max.burst", "0\n")
	write("memory.current", "10485760\n")
	write("memory.stat", "anon 10485760\ninactive_file 0\n")
	write("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
	write("memory.high", "max\n")
	write("memory.max", "max\n")
	write("cgroup.controllers", "cpu memory pids\n")
	write("memory.oom.group", "1\n")
	write("cgroup.freeze", "0\n")
	v2, err := cgroupfs.OpenV2(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v2.Close() })
	cfg := testConfig()
	cfg.Initial = Resources{CPU: 0.5, Memory: 256 * MiB}
	cfg.Cap = Resources{CPU: 4, Memory: 600 * MiB}
	clk := newFakeClock()
	c, err := NewController("v2", &v2Cgroup{v2}, cfg, bigNode(), WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	waitTL := func(n int) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for len(c.Timeline()) < n {
			if time.Now().After(deadline) {
				t.Fatalf("controller did not reach %d ticks", n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitTL(1)
	for f, want := range map[string]string{"cpu.max": "50000 100000", "cpu.max.burst": "50000", "memory.high": "268435456", "memory.max": "335544320", "memory.oom.group": "0"} {
		if got := read(f); got != want {
			t.Errorf("initial %s = %q, want %q", f, got, want)
		}
	}
	// Working set at 78% of the grant with memory.high hits: the
	// memory.events change wakes Run without the clock moving, pressure at
	// the limit grows memory x4, bounded by the 600 MiB cap, and
	// memory.max is held at the cap.
	write("memory.current", "209715200\n")
	rewrite("memory.events", "low 0\nhigh 5\nmax 0\noom 0\noom_kill 0\n")
	waitTL(2)
	p := c.Timeline()[1]
	if p.Wake != "event" || !strings.Contains(p.Actions, "mem x4") {
		t.Fatalf("tick after memory.events: %+v", p)
	}
	for f, want := range map[string]string{"memory.high": "629145600", "memory.max": "629145600"} {
		if got := read(f); got != want {
			t.Errorf("after the grow %s = %q, want %q", f, got, want)
		}
	}
}
