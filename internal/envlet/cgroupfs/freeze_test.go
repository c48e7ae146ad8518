package cgroupfs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/cgroups"

	"github.com/envsnap/envsnap/internal/prereq"
)

// cpuTicks is a process's user+system time in clock ticks
// (/proc/PID/stat fields 14 and 15).
func cpuTicks(t *testing.T, pid int) uint64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// The command name (field 2) may hold spaces; count from its ')'.
	fields := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	u, _ := strconv.ParseUint(fields[11], 10, 64)
	s, _ := strconv.ParseUint(fields[12], 10, 64)
	return u + s
}

// runsIn starts a busy loop in a new cgroup below root and returns the
// cgroup's directory and the process.
func runsIn(t *testing.T, root string) (string, *exec.Cmd) {
	t.Helper()
	dir := filepath.Join(root, fmt.Sprintf("envsnap-freeze-test-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/bin/sh", "-c", "while :; do :; done")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cgroups.WriteFile(dir, filepath.Base(freezeFile(dir)), thawValue(dir))
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = os.Remove(dir)
	})
	if err := cgroups.WriteCgroupProc(dir, cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	return dir, cmd
}

func freezeFile(dir string) string {
	if _, err := os.Stat(filepath.Join(dir, "cgroup.freeze")); err == nil {
		return filepath.Join(dir, "cgroup.freeze")
	}
	return filepath.Join(dir, "freezer.state")
}

func thawValue(dir string) string {
	if strings.HasSuffix(freezeFile(dir), "cgroup.freeze") {
		return "0"
	}
	return "THAWED"
}

// checkFreezer freezes and thaws a cgroup running a busy loop: frozen, the
// loop gets no CPU time; thawed, it runs again.
func checkFreezer(t *testing.T, f *Freezer, pid int) {
	t.Helper()
	if err := f.Freeze(); err != nil {
		t.Fatal(err)
	}
	if frozen, err := f.Frozen(); err != nil || !frozen {
		t.Fatalf("after Freeze: frozen %v, %v", frozen, err)
	}
	before := cpuTicks(t, pid)
	time.Sleep(100 * time.Millisecond) // ten clock ticks for a running loop
	if after := cpuTicks(t, pid); after != before {
		t.Errorf("the frozen loop used CPU: %d -> %d ticks", before, after)
	}
	if err := f.Thaw(); err != nil {
		t.Fatal(err)
	}
	if frozen, err := f.Frozen(); err != nil || frozen {
		t.Fatalf("after Thaw: frozen %v, %v", frozen, err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for cpuTicks(t, pid) == before {
		if time.Now().After(deadline) {
			t.Fatalf("the loop did not run again after Thaw")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestFreezerV1(t *testing.T) {
	prereq.RequireRoot(t)
	if cgroups.IsCgroup2UnifiedMode() {
		prereq.Skip(t, prereq.NoCgroupV1, "")
	}
	mnt, err := cgroups.FindCgroupMountpoint("", "freezer")
	if err != nil {
		prereq.Missing(t, "v1 freezer hierarchy: %v", err)
	}
	dir, cmd := runsIn(t, mnt)
	f, err := FreezerOf(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if f.Dir() != dir || f.v2 {
		t.Fatalf("FreezerOf: %s (v2 %v), want the v1 cgroup %s", f.Dir(), f.v2, dir)
	}
	checkFreezer(t, f, cmd.Process.Pid)
}

// TestFreezerV2 runs on the unified hierarchy: /sys/fs/cgroup on a v2
// host, /sys/fs/cgroup/unified on a hybrid one (cgroup.freeze needs no
// controller, so the hybrid mount freezes like a v2 host's).
func TestFreezerV2(t *testing.T) {
	prereq.RequireRoot(t)
	root := "/sys/fs/cgroup/unified"
	if cgroups.IsCgroup2UnifiedMode() {
		root = "/sys/fs/cgroup"
	} else if !cgroups.IsCgroup2HybridMode() {
		prereq.Missing(t, "no cgroup v2 hierarchy")
	}
	dir, cmd := runsIn(t, root)
	f, err := OpenFreezer(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !f.v2 {
		t.Fatalf("OpenFreezer(%s) did not detect cgroup v2", dir)
	}
	if cgroups.IsCgroup2UnifiedMode() {
		g, err := FreezerOf(cmd.Process.Pid)
		if err != nil || g.Dir() != dir {
			t.Fatalf("FreezerOf: %v, %v; want %s", g, err, dir)
		}
	}
	checkFreezer(t, f, cmd.Process.Pid)
}

func TestOpenFreezerNotACgroup(t *testing.T) {
	if _, err := OpenFreezer(t.TempDir()); err == nil {
		t.Fatal("OpenFreezer of a plain directory succeeded")
	}
}
