package shim_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/envlet"
)

// memUsage reads the memory the container's cgroup holds: v1
// memory.usage_in_bytes or v2 memory.current.
func (c *ctr) memUsage() (int64, error) {
	rel := filepath.Join(c.ns, c.id)
	p := filepath.Join("/sys/fs/cgroup/memory", rel, "memory.usage_in_bytes")
	if _, err := os.Stat(p); err != nil {
		p = filepath.Join("/sys/fs/cgroup", rel, "memory.current")
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// waitStatus polls the arbiter's listing (`envs --json`) until the
// container's status satisfies ok, for up to 30 s (the shim reports every
// second), and returns the last status seen.
func (s *suite) waitStatus(t *testing.T, c *ctr, ok func(envlet.Status) bool) envlet.Status {
	t.Helper()
	var st envlet.Status
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		var envs []arbiter.EnvInfo
		if err := json.Unmarshal([]byte(s.envsnap(t, "envs", "--json")), &envs); err != nil {
			t.Fatal(err)
		}
		for _, e := range envs {
			if e.Env == c.ns+"/"+c.id && len(e.Status) > 0 {
				st = envlet.Status{}
				if err := json.Unmarshal(e.Status, &st); err != nil {
					t.Fatal(err)
				}
			}
		}
		if ok(st) {
			break
		}
	}
	return st
}

// TestPausePushOut: a container paused through containerd gives its
// memory back once it has stayed paused for pause-push-out-after, and a
// pause resumed before that does not; resumed, it runs on and the
// controller does not fail it. The workload holds 32 MiB of anonymous
// memory and 128 MiB of a file it wrote: this host has no swap, so the
// page cache is what can leave (the cgroup v2 guest, with zram, checks
// the anonymous memory too).
func TestPausePushOut(t *testing.T) {
	s := newSuite(t, node{memory: "4Gi"})
	// Idle reclaim off: a paused environment is idle, and idle reclaim
	// would also lower its memory, 35 s into the pause.
	const pushOutAfter = 5 * time.Second
	ann := map[string]string{"initial-cpu": "0.5", "initial-memory": "1Gi", "pause-push-out-after": pushOutAfter.String(), "idle-reclaim-after": "0s"}
	c, err := s.run(t, ann, "-mode", "cache", "-from", "32", "-to", "128", "-hold", "5m")
	if err != nil {
		t.Fatal(err)
	}
	c.waitStamp(t, "cached", time.Minute)
	// The file's pages are dirty until written back; reclaim only drops
	// clean ones.
	unix.Sync()
	ctx := s.env.Context()
	held, err := c.memUsage()
	if err != nil {
		t.Fatal(err)
	}
	if held < 128<<20 {
		t.Fatalf("the container holds %d MiB after writing 128 MiB and allocating 32", held>>20)
	}

	// Resumed within pause-push-out-after: nothing leaves.
	paused := time.Now()
	if err := c.task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	if err := c.task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	pausedFor := time.Since(paused)
	time.Sleep(pushOutAfter)
	short, err := c.memUsage()
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case pausedFor >= pushOutAfter:
		// A stalled test process: the pause really was long.
		t.Logf("the short pause lasted %s on this loaded host, not under %s: its check cannot decide", pausedFor, pushOutAfter)
	case short < held-32<<20:
		t.Errorf("a pause of %s (pause-push-out-after %s) took the container from %d MiB to %d MiB: its memory was pushed out", pausedFor.Round(time.Millisecond), pushOutAfter, held>>20, short>>20)
	}

	// Paused for longer: the page cache leaves.
	if err := c.task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	after := short
	for after > short-96<<20 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		if after, err = c.memUsage(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("paused: the container's memory %d MiB -> %d MiB (before the short pause %d MiB)", short>>20, after>>20, held>>20)
	if after > short-96<<20 {
		t.Errorf("paused for a minute, the container still holds %d MiB of its %d MiB (128 MiB of it a clean file's pages)", after>>20, short>>20)
	}
	// The arbiter hears of both at the shim's next report.
	if st := s.waitStatus(t, c, func(st envlet.Status) bool { return st.Paused && st.PushedOut >= 96<<20 }); !st.Paused || st.PushedOut < 96<<20 {
		t.Errorf("the arbiter's status of the paused container: paused %v, pushed out %d MiB; want paused, at least 96 MiB", st.Paused, st.PushedOut>>20)
	}
	if out := s.envsnap(t, "envs"); !strings.Contains(out, "paused, ") {
		t.Errorf("envs does not say the container is paused:\n%s", out)
	}
	if err := c.task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if st := s.waitStatus(t, c, func(st envlet.Status) bool { return !st.Paused }); st.Paused {
		t.Errorf("the arbiter's status still says paused 30 s after the resume")
	}
	if st, err := c.task.Status(ctx); err != nil || st.Status != "running" {
		t.Fatalf("after the resume: status %v (%v), want running", st.Status, err)
	}
	if err := c.task.Kill(ctx, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if code := c.wait(t, 30*time.Second); code != 128+uint32(syscall.SIGKILL) {
		t.Errorf("exit %d after SIGKILL, want %d; output:\n%s", code, 128+syscall.SIGKILL, c.out.String())
	}
}
