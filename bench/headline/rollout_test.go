package headline

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/envsnap/envsnap/bench/episode"
)

func TestRequestSlots(t *testing.T) {
	for _, c := range []struct {
		cpu    float64
		mem    int64
		reqCPU float64
		reqMem int64
		want   int
	}{
		{2, 24 << 30, 0.5, 2 << 30, 4},   // CPU-bound: this machine
		{64, 24 << 30, 0.5, 2 << 30, 12}, // memory-bound
		{1, 1 << 30, 2, 8 << 30, 1},      // one always fits, or nothing runs
		{2, 24 << 30, 0, 2 << 30, 0},     // no request: no limit
	} {
		if got := RequestSlots(c.cpu, c.mem, c.reqCPU, c.reqMem); got != c.want {
			t.Errorf("RequestSlots(%v, %v, %v, %v) = %d, want %d", c.cpu, c.mem, c.reqCPU, c.reqMem, got, c.want)
		}
	}
}

// TestAdmitInOrder: waiters that reach the queue in reverse order are
// still admitted oldest first, one at a time with one slot.
func TestAdmitInOrder(t *testing.T) {
	const n = 5
	slots := make(chan struct{}, 1)
	admitted := admitInOrder(context.Background(), n, slots)
	got := make(chan int)
	release := make([]chan struct{}, n)
	var wg sync.WaitGroup
	for i := n - 1; i >= 0; i-- {
		release[i] = make(chan struct{})
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-admitted[i]
			got <- i
			<-release[i]
			<-slots
		}()
	}
	for want := range n {
		if i := <-got; i != want {
			t.Fatalf("admitted waiter %d, want %d (the oldest waiting)", i, want)
		}
		select {
		case i := <-got:
			t.Fatalf("admitted waiter %d while %d held the only slot", i, want)
		case <-time.After(10 * time.Millisecond):
		}
		close(release[want])
	}
	wg.Wait()
}

// TestAdmitInOrderCancelled: a cancelled batch admits no one else.
func TestAdmitInOrderCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	slots := make(chan struct{}, 1)
	admitted := admitInOrder(ctx, 3, slots)
	<-admitted[0]
	cancel()
	select {
	case <-admitted[1]:
		t.Fatal("admitted a waiter after the batch was cancelled, with its slot held")
	case <-time.After(50 * time.Millisecond):
	}
}

func TestTouchedFiles(t *testing.T) {
	// build.sh's fix is `git diff -R`: the paths come as "+++ a/...".
	diff := "diff --git b/hash.go a/hash.go\n--- b/hash.go\n+++ a/hash.go\n@@ -1 +1 @@\n-x\n+y\ndiff --git b/sub/x.go a/sub/x.go\n--- b/sub/x.go\n+++ a/sub/x.go\n"
	if got := touchedFiles(diff); !slices.Equal(got, []string{"hash.go", "sub/x.go"}) {
		t.Fatalf("touchedFiles = %v", got)
	}
}

func TestAgentAnswer(t *testing.T) {
	out := "2.1.332 (Claude Code)\n{\"type\":\"result\",\"subtype\":\"success\",\"is_error\":false,\"result\":\"The tests pass.\"}\nagent-exit=0\nok\nreward=1\n"
	if got := agentAnswer(out); got != "The tests pass." {
		t.Fatalf("agentAnswer = %q", got)
	}
	if got := agentAnswer("agent-exit=1\nreward=0\n"); got != "" {
		t.Fatalf("agentAnswer without a result = %q", got)
	}
}

func TestRewardsIdentical(t *testing.T) {
	it := func(rewards ...int) *RolloutIteration {
		r := &RolloutIteration{}
		for _, w := range rewards {
			run := RolloutRun{Reward: w}
			if w < 0 {
				run.Error = "failed"
			}
			r.Runs = append(r.Runs, run)
		}
		return r
	}
	rep := &RolloutReport{Order: []string{StatusQuo, Envsnap}, Systems: map[string]*RolloutIteration{StatusQuo: it(1, 1), Envsnap: it(1, 1)}}
	if !rewardsIdentical(rep) {
		t.Fatal("same rewards reported different")
	}
	rep.Systems[Envsnap] = it(1, -1)
	if rewardsIdentical(rep) {
		t.Fatal("a failed rollout counted as the same reward")
	}
}

func TestSpreadTasks(t *testing.T) {
	var all []episode.Task
	for _, id := range []string{"u1", "u2", "u3", "u4", "u5", "c1", "c2", "c3", "c4", "c5"} {
		all = append(all, episode.Task{ID: id})
	}
	ids := func(ts []episode.Task) (out []string) {
		for _, t := range ts {
			out = append(out, t.ID)
		}
		return out
	}
	if got := ids(spreadTasks(all, 2, 8)); !slices.Equal(got, []string{"u1", "c1"}) {
		t.Fatalf("2 of 10: %v", got)
	}
	if got := ids(spreadTasks(all, 0, 4)); len(got) != 4 || got[0] != "u1" {
		t.Fatalf("all, at most 4: %v", got)
	}
}

func TestRolloutComparison(t *testing.T) {
	rep := &RolloutReport{Rollouts: 8, Order: []string{StatusQuo, OverlayfsAll, Envsnap}, RewardsIdentical: true, Systems: map[string]*RolloutIteration{
		StatusQuo:    {Makespan: 200 * time.Second, PeakConcurrent: 4},
		OverlayfsAll: {Makespan: 100 * time.Second, PeakConcurrent: 8},
		Envsnap:      {Makespan: 50 * time.Second, PeakConcurrent: 8, InitShare: 0.04, Failed: 1},
	}}
	got := rep.Comparison()
	for _, want := range []string{"makespan 0.25x the status quo (50 s vs 200 s)", "0.50x overlayfs with everything at once (100 s)",
		"initialisation 4.0%", "2.0x the peak concurrent environments of the status quo (8 vs 4)", "1 failed, rewards identical"} {
		if !strings.Contains(got, want) {
			t.Errorf("comparison %q lacks %q", got, want)
		}
	}
}

func TestStartedAt(t *testing.T) {
	at, ok := startedAt("started-at=1764800000.012345678\n2.1.332 (Claude Code)\n")
	if !ok || !at.Equal(time.Unix(1764800000, 12345678)) {
		t.Fatalf("startedAt = %v, %v", at, ok)
	}
	// date without %N support prints the literal N: no time, not a wrong one.
	if _, ok := startedAt("started-at=1764800000.N\n"); ok {
		t.Fatal("startedAt parsed a date without nanoseconds")
	}
	if _, ok := startedAt("agent-exit=0\n"); ok {
		t.Fatal("startedAt without the marker")
	}
}

func TestWriteReadme(t *testing.T) {
	path := filepath.Join(t.TempDir(), "README.md")
	rep := &RolloutReport{Command: "go run ./bench/cmd/envsnap-bench -rollouts 2", Rollouts: 2, Tasks: []string{"a"}, Order: []string{StatusQuo, Envsnap},
		Systems: map[string]*RolloutIteration{Envsnap: {Makespan: 50 * time.Second, PeakConcurrent: 2}}}
	if err := os.WriteFile(path, []byte("# x\n\nno markers\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteReadme(path); err == nil {
		t.Fatal("a README without the markers was written")
	}
	before, after := "# x\n\nprose before\n\n", "\n\nprose after\n"
	if err := os.WriteFile(path, []byte(before+readmeBegin+"\n\nold table\n\n"+readmeEnd+after), 0o644); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the second run replaces the first's table
		if err := rep.WriteReadme(path); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	got := string(b)
	for _, want := range []string{before + readmeBegin, readmeEnd + after, "| **envsnap** | all | 50.0 s", "Partial: the run was stopped before `status-quo`"} {
		if !strings.Contains(got, want) {
			t.Errorf("README lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "old table") || strings.Count(got, "| system |") != 1 {
		t.Errorf("the old table was not replaced once:\n%s", got)
	}
}

func TestRolloutComparisonAllFailed(t *testing.T) {
	rep := &RolloutReport{Rollouts: 2, Order: []string{StatusQuo, Envsnap}, Systems: map[string]*RolloutIteration{
		StatusQuo: {Makespan: 200 * time.Second, PeakConcurrent: 2, Runs: make([]RolloutRun, 2)},
		Envsnap:   {Makespan: 600 * time.Second, PeakConcurrent: 2, Failed: 2, Runs: []RolloutRun{{Error: "timeout"}, {Error: "timeout"}}},
	}}
	if got := rep.Comparison(); !strings.Contains(got, "every rollout FAILED") || strings.Contains(got, "makespan") {
		t.Fatalf("comparison of a failed batch: %q", got)
	}
}

func TestRolloutFloor(t *testing.T) {
	rep := &RolloutReport{Rollouts: 8, Order: []string{StatusQuo, OverlayfsAll, Envsnap}, RewardsIdentical: true, Systems: map[string]*RolloutIteration{
		// 300 - 20 - 10 = 270 CPU-s of the environments' own work.
		StatusQuo: {Makespan: 200 * time.Second, Cores: 2, CPU: map[string]float64{"node": 300, "containerd": 20, "bench": 10}},
		// 250 - 40 = 210: the least, so the bound is 210 / 2 cores.
		OverlayfsAll: {Makespan: 140 * time.Second, Cores: 2, CPU: map[string]float64{"node": 250, "containerd": 40}},
		// Failed batches do not set the bound, however little they used.
		Envsnap: {Makespan: 120 * time.Second, Cores: 2, Failed: 1, CPU: map[string]float64{"node": 100},
			Runs: []RolloutRun{{Think: 60 * time.Second}, {Think: 90 * time.Second}}},
	}}
	f, why := rep.Floor()
	if f != 105 || !strings.Contains(why, "210 CPU-s on overlayfs-all, over 2 cores") {
		t.Errorf("floor %.1f s (%s), want 105 s from overlayfs-all's work", f, why)
	}
	if got := rep.Comparison(); !strings.Contains(got, "floor on this node 105 s") || !strings.Contains(got, "0.53x the status quo, 0.75x overlayfs everything at once") {
		t.Errorf("comparison %q lacks the floor's ratios", got)
	}
	// A batch whose longest rollout waited on the model for longer than
	// the CPU work takes is bound by that wait.
	rep.Systems[Envsnap].Runs[1].Think = 150 * time.Second
	if f, why := rep.Floor(); f != 150 || !strings.Contains(why, "think time") {
		t.Errorf("floor %.1f s (%s), want the 150 s think time", f, why)
	}
}

func TestRolloutThinkFloor(t *testing.T) {
	runs := []RolloutRun{{Think: 30 * time.Second}, {Think: 10 * time.Second}, {Think: 20 * time.Second}, {Think: 20 * time.Second}}
	rep := &RolloutReport{Systems: map[string]*RolloutIteration{
		// 80 s of think time over 2 slots: 40 s, above the longest 30.
		StatusQuo: {Slots: 2, Runs: runs},
		// All at once: the longest rollout's think time.
		Envsnap: {Runs: runs},
		// 80 s over 4 slots is 20 s: the longest, 30 s, bounds it.
		OverlayfsAll: {Slots: 4, Runs: runs},
	}}
	for sys, want := range map[string]float64{StatusQuo: 40, Envsnap: 30, OverlayfsAll: 30, "unknown": 0} {
		if got := rep.ThinkFloor(sys); got != want {
			t.Errorf("%s: think floor %.1f s, want %.1f s", sys, got, want)
		}
	}
}

func TestInitShareFloor(t *testing.T) {
	sec := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	runs := []RolloutRun{
		// Needs 4 CPU-s before ready; 50 s after it.
		{InitCPU: 4, Ready: sec(30), End: sec(80)},
		{InitCPU: 2, Ready: sec(20), End: sec(70)},
		{InitCPU: 6, Ready: sec(40), End: sec(90)},
		// Failed: left out, whatever it used.
		{InitCPU: 0.1, Ready: sec(1), End: sec(500), Error: "timeout"},
	}
	// Shortest first on 2 cores: ready at 1, 1+2, 1+2+3 s: 10 s in all,
	// against 150 s after ready.
	if got, want := initShareFloor(runs, 2), 10.0/160; math.Abs(got-want) > 1e-12 {
		t.Errorf("floor %.6f, want %.6f", got, want)
	}
	// The measured share is never below it.
	ready, total := 0.0, 0.0
	for _, r := range runs[:3] {
		ready, total = ready+r.Ready.Seconds(), total+r.End.Seconds()
	}
	if share := ready / total; share < initShareFloor(runs, 2) {
		t.Errorf("share %.3f below its floor", share)
	}
	if got := initShareFloor(runs, 0); got != 0 {
		t.Errorf("floor without cores %v, want 0", got)
	}
	if got := initShareFloor(nil, 2); got != 0 {
		t.Errorf("floor of no rollouts %v, want 0", got)
	}
}

func TestReadGCPauses(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `# HELP go_gc_duration_seconds A summary of the wall-time pause (stop-the-world) duration in garbage collection cycles.
# TYPE go_gc_duration_seconds summary
go_gc_duration_seconds{quantile="0"} 2.1e-05
go_gc_duration_seconds{quantile="0.5"} 0.000104
go_gc_duration_seconds{quantile="1"} 0.674
go_gc_duration_seconds_sum 1.25
go_gc_duration_seconds_count 42
go_goroutines 17
`)
	}))
	defer srv.Close()
	p, err := readGCPauses(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if want := (GCPauses{Count: 42, Total: 1.25, Max: 0.674}); p != want {
		t.Fatalf("read %+v, want %+v", p, want)
	}
	if got := p.String(); !strings.Contains(got, "42 pauses") || !strings.Contains(got, "674 ms") {
		t.Errorf("String: %q", got)
	}
	srv.Close()
	if _, err := readGCPauses(srv.URL); err == nil {
		t.Error("no error from a daemon that does not answer")
	}
}

// The start window ends at the first sample at or after the last ready,
// and what the listed users did not use of the node's CPU is "other".
func TestStartCPU(t *testing.T) {
	start := time.Unix(1000, 0)
	at := func(s float64, busy, daemon, env, shim float64) sample {
		return sample{at: start.Add(time.Duration(s * float64(time.Second))),
			cpu:    cpuSample{busy: busy, daemons: map[string]float64{"envsnap": daemon}},
			envCPU: env, shimCPU: shim}
	}
	s := &sampler{points: []sample{
		at(0, 100, 10, 0, 0),
		at(2, 104, 11, 2, 0.5),
		at(4, 108, 12, 5, 1),
		at(6, 112, 12.5, 8, 1.2),
	}}
	cpu, window := s.startCPU(start, 3*time.Second, 3)
	if window != 4*time.Second {
		t.Fatalf("window %v, want 4s (the first sample after the last ready at 3s)", window)
	}
	want := map[string]float64{"node": 8, "envsnap": 2, "envs before ready": 3, "envs after ready": 2, "shims": 1, "other": 0}
	for k, v := range want {
		if math.Abs(cpu[k]-v) > 1e-9 {
			t.Errorf("%s = %v, want %v (all: %v)", k, cpu[k], v, cpu)
		}
	}
	if cpu, window = s.startCPU(start, time.Minute, 3); window != 6*time.Second || cpu["node"] != 12 || math.Abs(cpu["other"]-0.3) > 1e-9 {
		t.Errorf("last ready after the last sample: window %v, %v; want the last sample's 6s, node 12, other 0.3", window, cpu)
	}
	if got := shareLine(map[string]float64{"node": 8, "environments": 6, "shims": 2}, 4*time.Second); got != "4.0 s, node 8.0 CPU-s: environments 6.0 (75%), shims 2.0 (25%)" {
		t.Errorf("shareLine: %q", got)
	}
}
