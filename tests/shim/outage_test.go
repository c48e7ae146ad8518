package shim_test

import (
	"github.com/envsnap/envsnap/internal/prereq"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

// TestArbiterKilledDuringRamp: the arbiter daemon is SIGKILLed as a
// container's working set starts ramping from 100 MiB to 1.5 GiB on a
// 256 MiB limit. The task reaches its limit and sleeps there (v1
// under_oom) with nobody to grant it more; the arbiter stays dead 3 s past
// that, longer than fail-paused (after which an unanswered grow used to
// fail the task as MEM_NODE_EXHAUSTED), and is restarted. The task
// completes, nothing fails, and the timeline shows the wait.
func TestArbiterKilledDuringRamp(t *testing.T) {
	s := newSuite(t, node{memory: "8Gi"})
	events := s.watch(t)
	c, err := s.run(t, map[string]string{"initial-cpu": "1", "initial-memory": "256Mi"},
		"-mode", "ramp", "-from", "100", "-to", "1536", "-step", "64", "-pace", "0s", "-hold", "1s")
	if err != nil {
		t.Fatal(err)
	}
	c.waitStamp(t, "ramp", time.Minute)
	s.arbiter.Kill()
	killed := time.Now()
	oomCtl := filepath.Join("/sys/fs/cgroup/memory", c.ns, c.id, "memory.oom_control")
	if _, err := os.Stat(oomCtl); err != nil {
		prereq.Skip(t, prereq.NoCgroupV1, "no v1 memory cgroup for the container (%v): this test watches v1 under_oom", err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		b, err := os.ReadFile(oomCtl)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), "under_oom 1") {
			break
		}
		if time.Now().After(deadline) || strings.Contains(c.out.String(), "allocated ") {
			t.Fatalf("the task never reached its limit while the arbiter was down; output:\n%s", c.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	paused := time.Now()
	time.Sleep(3 * time.Second)
	s.startArbiter(t)
	t.Logf("arbiter down for %v, task paused at its limit for %v of it", time.Since(killed).Round(time.Millisecond), time.Since(paused).Round(time.Millisecond))
	code := c.wait(t, 3*time.Minute)
	timeline := s.envsnap(t, "envs", "--timeline", c.id)
	if code != 0 {
		t.Fatalf("exit %d; output:\n%s\ntimeline:\n%s", code, c.out.String(), timeline)
	}
	// runc's OOM notifier publishes /tasks/oom when the task pauses at
	// its limit (the v1 OOM eventfd fires with oom_kill_disable too):
	// only a failure event would mean the environment was given up.
	for _, e := range events() {
		if e.id == c.id && e.failure != nil {
			t.Errorf("event %s for %s: %+v", e.topic, e.id, e.failure)
		}
	}
	if !strings.Contains(timeline, "mem wait") {
		t.Errorf("no 'mem wait' in the timeline; timeline:\n%s", timeline)
	}
	t.Logf("ramp done %v after the kill", c.stamp(t, "allocated").Sub(killed).Round(time.Millisecond))
}

// TestArbiterUnreachable: with the arbiter dead for longer than
// arbiter-wait, a task stuck at its memory limit fails with its own
// reason, ARBITER_UNREACHABLE, not as a node failure.
func TestArbiterUnreachable(t *testing.T) {
	s := newSuite(t, node{memory: "8Gi"})
	events := s.watch(t)
	c, err := s.run(t, map[string]string{"initial-cpu": "1", "initial-memory": "256Mi", "arbiter-wait": "3s"},
		"-mode", "ramp", "-from", "100", "-to", "1536", "-step", "64", "-pace", "150ms", "-hold", "1s")
	if err != nil {
		t.Fatal(err)
	}
	c.waitStamp(t, "ramp", time.Minute)
	s.arbiter.Kill()
	if code := c.wait(t, 2*time.Minute); code != 137 {
		t.Fatalf("exit %d, want 137; output:\n%s", code, c.out.String())
	}
	var failure *envlet.Failure
	deadline := time.Now().Add(5 * time.Second)
	for failure == nil && time.Now().Before(deadline) {
		for _, e := range events() {
			if e.id == c.id && e.failure != nil {
				failure = e.failure
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	if failure == nil {
		t.Fatalf("no failure event for %s", c.id)
	}
	t.Logf("failure: %+v", *failure)
	if failure.Reason != envlet.ReasonArbiterUnreachable {
		t.Errorf("reason %s, want %s", failure.Reason, envlet.ReasonArbiterUnreachable)
	}
}
