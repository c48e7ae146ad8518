package shim_test

import (
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

// TestArbiterKilledDuringRamp: the arbiter daemon is SIGKILLed while a
// container's working set ramps from 100 MiB to 1.5 GiB, stays dead for
// 5 s (more than fail-paused, after which an unanswered grow used to fail
// the task as MEM_NODE_EXHAUSTED), and is restarted: the task waits at its
// limit and completes, nothing fails, and the restarted arbiter lists it.
func TestArbiterKilledDuringRamp(t *testing.T) {
	s := newSuite(t, node{memory: "8Gi"})
	events := s.watch(t)
	c, err := s.run(t, map[string]string{"initial-cpu": "1", "initial-memory": "256Mi"},
		"-mode", "ramp", "-from", "100", "-to", "1536", "-step", "64", "-pace", "150ms", "-hold", "1s")
	if err != nil {
		t.Fatal(err)
	}
	c.waitStamp(t, "ramp", time.Minute)
	time.Sleep(300 * time.Millisecond)
	s.arbiter.Kill()
	killed := time.Now()
	time.Sleep(5 * time.Second)
	if strings.Contains(c.out.String(), "allocated ") {
		t.Fatalf("the ramp finished while the arbiter was down: nothing was tested; output:\n%s", c.out.String())
	}
	s.startArbiter(t)
	t.Logf("arbiter down for %v", time.Since(killed).Round(time.Millisecond))
	time.Sleep(3 * time.Second)
	t.Logf("timeline 3 s after the restart:\n%s\n%s", s.envsnap(t, "envs", "--timeline", c.id), s.envsnap(t, "envs"))
	code := c.wait(t, 2*time.Minute)
	timeline := s.envsnap(t, "envs", "--timeline", c.id)
	if code != 0 {
		t.Fatalf("exit %d; output:\n%s\ntimeline:\n%s", code, c.out.String(), timeline)
	}
	for _, e := range events() {
		if e.id == c.id && (e.failure != nil || e.topic == "/tasks/oom") {
			t.Errorf("event %s for %s: %+v", e.topic, e.id, e.failure)
		}
	}
	if !strings.Contains(timeline, "mem wait") {
		t.Errorf("the task never waited for the arbiter: the outage did not meet a grow; timeline:\n%s", timeline)
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
