package pause

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// helperEnv makes the test binary the environment's process: it maps
// that many MiB of anonymous memory, fills it, and answers commands.
const helperEnv = "ENVSNAP_PAUSE_HELPER_MIB"

func TestMain(m *testing.M) {
	if v := os.Getenv(helperEnv); v != "" {
		mib, err := strconv.Atoi(v)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		helper(mib)
		return
	}
	os.Exit(m.Run())
}

// fill writes each 4 KiB page half pseudo-random, half zeros: about 2x
// compressible, as a process heap is, so neither compression nor a file
// write gets an easy ride.
func fill(buf []byte) {
	x := uint64(0x9e3779b97f4a7c15)
	for p := 0; p+4096 <= len(buf); p += 4096 {
		for i := p; i < p+2048; i += 8 {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			for k := range 8 {
				buf[i+k] = byte(x >> (8 * k))
			}
		}
	}
}

func sum(buf []byte) uint64 {
	h := fnv.New64a()
	h.Write(buf)
	return h.Sum64()
}

// helper is the paused environment: "ready SUM" once its memory is
// filled, then per command byte on stdin: 'p' answers "p" (the first
// instruction after a resume), 't' reads every page and answers "t SUM".
func helper(mib int) {
	buf, err := unix.Mmap(-1, 0, mib<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fill(buf)
	fmt.Printf("ready %d\n", sum(buf))
	in := bufio.NewReader(os.Stdin)
	for {
		c, err := in.ReadByte()
		if err != nil {
			os.Exit(0)
		}
		switch c {
		case 'p':
			fmt.Println("p")
		case 't':
			fmt.Printf("t %d\n", sum(buf))
		}
	}
}

// TestPauseResume parks a process holding ENVSNAP_PAUSE_MIB (default 256)
// MiB of anonymous memory in a cgroup of its own and brings it back:
// memory freed, data intact, and the numbers (seconds per GiB to pause,
// time to the first instruction after the thaw, all pages back) next to
// this node's floor, writing the same memory to a file. It needs cgroup
// v2 with swap (the VM guest sets up zram or zswap and sets
// ENVSNAP_PAUSE_REQUIRED=1); elsewhere it checks that Pause refuses with
// the reason.
func TestPauseResume(t *testing.T) {
	prereq.RequireRoot(t)
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		t.Fatal(err)
	}
	swap, err := NodeSwap()
	if err != nil {
		t.Fatal(err)
	}
	required := os.Getenv("ENVSNAP_PAUSE_REQUIRED") == "1"
	if st.Type != unix.CGROUP2_SUPER_MAGIC || swap.Total == 0 {
		if required {
			t.Fatalf("ENVSNAP_PAUSE_REQUIRED=1: cgroup2 %v, swap %d bytes", st.Type == unix.CGROUP2_SUPER_MAGIC, swap.Total)
		}
		if st.Type == unix.CGROUP2_SUPER_MAGIC {
			prereq.Missing(t, "no swap on this node (SwapTotal 0): a pause would have nowhere to put anonymous memory")
		}
		// A v1 host: Pause must refuse, saying why, and leave nothing
		// frozen.
		dir := t.TempDir()
		_, err := Pause(context.Background(), dir)
		if err == nil || !strings.Contains(err.Error(), "memory.reclaim") {
			t.Fatalf("Pause on a directory without memory.reclaim: %v, want the missing memory.reclaim named", err)
		}
		t.Logf("cgroup v1 host: %v", err)
		return
	}

	mib := 256
	if v := os.Getenv("ENVSNAP_PAUSE_MIB"); v != "" {
		if mib, err = strconv.Atoi(v); err != nil {
			t.Fatal(err)
		}
	}
	dir := filepath.Join("/sys/fs/cgroup", fmt.Sprintf("envsnap-pause-test-%d", os.Getpid()))
	if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory"), 0); err != nil {
		t.Fatalf("enable the memory controller: %v", err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cg, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run", "^$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", helperEnv, mib))
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = Resume(dir)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		// The cgroup is empty once the helper is reaped.
		for range 50 {
			if err := os.Remove(dir); err == nil || errors.Is(err, os.ErrNotExist) {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Errorf("cgroup %s left behind", dir)
	})
	out := bufio.NewReader(stdout)
	line := func() string {
		s, err := out.ReadString('\n')
		if err != nil {
			t.Fatalf("helper: %v", err)
		}
		return strings.TrimSpace(s)
	}
	t.Logf("helper started in %s, filling %d MiB", dir, mib)
	ready := line()
	want, ok := strings.CutPrefix(ready, "ready ")
	if !ok {
		t.Fatalf("helper said %q", ready)
	}

	// The floor: the same bytes written to a file and synced, on the
	// disk of this node.
	floorDir := os.Getenv("ENVSNAP_PAUSE_FLOOR_DIR")
	if floorDir == "" {
		floorDir = "/var/tmp"
	}
	buf := make([]byte, mib<<20)
	fill(buf)
	t.Logf("helper ready; writing the floor file in %s", floorDir)
	floor := writeFloor(t, floorDir, buf)
	buf = nil
	t.Logf("floor written in %s; pausing", floor)

	availBefore := memAvailable(t)
	// A bound, not a measurement: a reclaim that never returns fails
	// here with its state rather than at the suite's end.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := Pause(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	availPaused := memAvailable(t)
	frozen, err := os.ReadFile(filepath.Join(dir, "cgroup.events"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(frozen), "frozen 1") {
		t.Fatalf("after Pause, cgroup.events: %s", frozen)
	}
	if rep.PushedOut() < int64(mib)<<20*3/4 {
		t.Errorf("pause pushed out %d MiB (freed %d MiB, zswap holds %d MiB) of the cgroup's %d MiB (the helper holds %d MiB): memory did not go out to swap",
			rep.PushedOut()>>20, rep.Freed()>>20, rep.ZswapAfter>>20, rep.Before>>20, mib)
	}

	// The command waits in the pipe while the helper is frozen; the
	// answer is its first instruction after the thaw.
	if _, err := stdin.Write([]byte("p")); err != nil {
		t.Fatal(err)
	}
	t.Logf("paused: %d MiB -> %d MiB; resuming", rep.Before>>20, rep.After>>20)
	start := time.Now()
	thaw, err := Resume(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := line(); got != "p" {
		t.Fatalf("after resume the helper said %q, want p", got)
	}
	first := time.Since(start)
	start = time.Now()
	if _, err := stdin.Write([]byte("t")); err != nil {
		t.Fatal(err)
	}
	got := line()
	back := time.Since(start)
	if got != "t "+want {
		t.Fatalf("after resume the helper's memory sums to %q, want %q: pages came back wrong", got, "t "+want)
	}
	gib := float64(rep.PushedOut()) / (1 << 30)
	pause := (rep.Freeze + rep.Reclaim).Seconds()
	t.Logf("pause: swap %v (zswap %v); helper %d MiB, cgroup %d MiB -> %d MiB (swap.current %d MiB, zswap.current %d MiB), node MemAvailable %+d MiB while paused",
		swap.Devices, swap.Zswap, mib, rep.Before>>20, rep.After>>20, rep.SwapAfter>>20, rep.ZswapAfter>>20, (availPaused-availBefore)>>20)
	t.Logf("pause: %.2f s (freeze %.3f s, reclaim %.2f s) for %.0f MiB pushed out = %.2f s/GiB; floor (the same bytes to a file + fsync) %.2f s = %.2f s/GiB; pause / floor %.2fx",
		pause, rep.Freeze.Seconds(), rep.Reclaim.Seconds(), gib*1024, pause/gib, floor.Seconds(), floor.Seconds()/(float64(mib)/1024), pause/floor.Seconds())
	t.Logf("resume: thaw %.1f ms, first instruction %.1f ms after the thaw began, every page back in %.2f s (%.2f s/GiB)",
		float64(thaw.Microseconds())/1000, float64(first.Microseconds())/1000, back.Seconds(), back.Seconds()/(float64(mib)/1024))
}

// writeFloor writes buf to a file in dir, syncs it, removes it, and
// returns the time the write and the sync took.
func writeFloor(t *testing.T, dir string, buf []byte) time.Duration {
	t.Helper()
	f, err := os.CreateTemp(dir, "envsnap-pause-floor-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	start := time.Now()
	if _, err := f.Write(buf); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	return time.Since(start)
}

func memAvailable(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no MemAvailable")
	return 0
}

// TestPushOutPageCache pushes out a cgroup whose task read a 64 MiB file
// from disk: with or without swap, on v1 (memory.force_empty) or v2
// (memory.reclaim), its page cache must leave the cgroup.
func TestPushOutPageCache(t *testing.T) {
	prereq.RequireRoot(t)
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("envsnap-pushout-test-%d", os.Getpid())
	dir := filepath.Join("/sys/fs/cgroup/memory", name)
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		dir = filepath.Join("/sys/fs/cgroup", name)
		if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+memory"), 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.Remove(dir); err != nil {
			t.Errorf("remove cgroup %s: %v", dir, err)
		}
	})

	// On disk, not tmpfs: shmem pages would need swap to leave. The
	// file's pages are dropped after writing, so the task's read charges
	// them to its cgroup rather than finding them charged to ours.
	tmp, err := os.MkdirTemp("/var/tmp", "envsnap-pushout-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	path := filepath.Join(tmp, "data")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<20)
	fill(buf)
	if _, err := f.Write(buf); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	f.Close()

	cmd := exec.Command("sh", "-c", `read x; cat "$1" >/dev/null; echo read; exec sleep 600`, "sh", path)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := in.Write([]byte("\n")); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "read\n" {
		t.Fatalf("the task did not read the file: %q, %v", line, err)
	}

	r, err := PushOut(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("push out: cgroup %d MiB -> %d MiB in %s (swap %d MiB)", r.Before>>20, r.After>>20, r.Reclaim, r.SwapAfter>>20)
	if r.Before < 48<<20 {
		t.Fatalf("the cgroup held %d MiB after its task read 64 MiB: the read was not charged to it", r.Before>>20)
	}
	if r.Freed() < 48<<20 {
		t.Errorf("push out freed %d MiB of the cgroup's %d MiB, 64 MiB of it clean page cache", r.Freed()>>20, r.Before>>20)
	}

	_, err = PushOut(context.Background(), t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "memory.reclaim") || !strings.Contains(err.Error(), "memory.force_empty") {
		t.Errorf("PushOut on a directory that is no memory cgroup: %v, want both files named", err)
	}
}
