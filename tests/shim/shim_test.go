// Package shim_test runs containers through containerd with the envlet
// runtime (bin/containerd-shim-envlet-v2, from `make build`) next to a node
// arbiter (bin/containerd-envsnap arbiter), and checks the elastic quota
// from the host's view of the container cgroups.
package shim_test

import (
	"encoding/csv"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

// TestCPUJump: an idle container at 0.25 cores whose demand jumps to 8
// busy threads has >= 1.6 cores within 1 s (the published 47x jump; the
// machine has 2 cores and the arbiter keeps 15% for admissions).
//
// The jump starts from idle, not from one busy thread: on a 2-core node
// one thread alone already drives the quota to the node's grow limit
// (1.7 cores) before any jump, which would make the check vacuous.
func TestCPUJump(t *testing.T) {
	s := newSuite(t, node{})
	c, err := s.run(t, "", map[string]string{"initial-cpu": "0.25", "initial-memory": "256Mi"},
		"-mode", "cpu", "-threads", "0", "-threads2", "8", "-jump", "2s", "-duration", "4s")
	if err != nil {
		t.Fatal(err)
	}
	sp := c.sample(t)
	if code := c.wait(t, time.Minute); code != 0 {
		t.Fatalf("exit %d; output:\n%s", code, c.out.String())
	}
	sp.Stop()
	jump := c.stamp(t, "jump")
	var before *sample
	var reached *sample
	all := sp.samples()
	for i := range all {
		x := all[i]
		if x.t.Before(jump) {
			before = &all[i]
			continue
		}
		if x.cpu >= 1.6 {
			reached = &all[i]
			break
		}
	}
	if before == nil || before.cpu <= 0 || before.cpu > 0.5 {
		t.Fatalf("quota before the jump: %+v, want the initial 0.25 cores", before)
	}
	timeline := s.envsnap(t, "envs", "--timeline", c.id)
	if reached != nil && reached.t.Sub(jump) <= time.Second {
		t.Logf("quota %.2f -> %.2f cores %v after the jump", before.cpu, reached.cpu, reached.t.Sub(jump))
		return
	}
	// The controller grows on demand it can see: usage near the quota or
	// throttling. On a saturated host the container gets less than its
	// quota without being throttled (research §4, "host starvation"):
	// then this run cannot tell whether the controller is fast enough.
	if !demandVisible(t, timeline, jump, jump.Add(time.Second)) {
		t.Skipf("host saturated (load %s): no throttling or quota-bound usage within 1 s of the jump; timeline:\n%s", loadavg(), timeline)
	}
	if reached == nil {
		t.Fatalf("quota never reached 1.6 cores after the jump (at %s); controller timeline:\n%s",
			jump.UTC().Format(time.RFC3339Nano), timeline)
	}
	t.Errorf("quota reached %.2f cores %v after the jump (at %s), want <= 1s; controller timeline:\n%s",
		reached.cpu, reached.t.Sub(jump), jump.UTC().Format(time.RFC3339Nano), timeline)
}

// demandVisible tells whether any tick of the controller timeline CSV in
// [from, to] met the CPU grow conditions (usage >= 85% of the quota, or
// >= 10% of the tick throttled).
func demandVisible(t *testing.T, timeline string, from, to time.Time) bool {
	t.Helper()
	rows, err := csv.NewReader(strings.NewReader(timeline)).ReadAll()
	if err != nil || len(rows) < 1 {
		t.Fatalf("timeline CSV: %v\n%s", err, timeline)
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	for _, r := range rows[1:] {
		ts, err := time.Parse(time.RFC3339Nano, r[col["time"]])
		if err != nil || ts.Before(from) || ts.After(to) {
			continue
		}
		limit, _ := strconv.ParseFloat(r[col["cpu_limit"]], 64)
		used, _ := strconv.ParseFloat(r[col["cpu_used"]], 64)
		thr, _ := strconv.ParseFloat(r[col["throttled"]], 64)
		if thr >= 0.10 || (limit > 0 && used >= 0.85*limit) {
			return true
		}
	}
	return false
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.TrimSpace(string(b))
}

func tail(s []sample, n int) []sample {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

var _ = envlet.GiB
