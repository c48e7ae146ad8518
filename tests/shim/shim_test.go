// Package shim_test runs containers through containerd with the envlet
// runtime (bin/containerd-shim-envlet-v2, from `make build`) next to a node
// arbiter (bin/containerd-envsnap arbiter), and checks the elastic quota
// from the host's view of the container cgroups.
package shim_test

import (
	"encoding/csv"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/prereq"
)

// TestCPUJump: an idle container at 0.25 cores whose demand jumps to 8
// busy threads has >= 1.6 cores within 1 s (the published 47x jump; the
// machine has 2 cores and the arbiter keeps 15% for admissions).
//
// The jump starts from idle, not from one busy thread: on a 2-core node
// one thread alone already drives the quota to the node's grow limit
// TestCPUJump: a container at 0.25 cores whose demand jumps to 8 threads
// gets 1.6+ cores within three controller ticks that saw the demand (x4
// on heavy throttling, x2 otherwise). Ticks, not seconds: on a loaded host
// the ticks themselves come late, and a container can get less CPU than
// its quota without being throttled, so no tick sees demand; that run
// cannot decide and says so.
func TestCPUJump(t *testing.T) {
	s := newSuite(t, node{})
	c, err := s.run(t, map[string]string{"initial-cpu": "0.25", "initial-memory": "256Mi"},
		"-mode", "cpu", "-threads", "0", "-threads2", "8", "-jump", "2s", "-duration", "4s")
	if err != nil {
		t.Fatal(err)
	}
	c.prioritize(t)
	if code := c.wait(t, time.Minute); code != 0 {
		t.Fatalf("exit %d; output:\n%s", code, c.out.String())
	}
	jump := c.stamp(t, "jump")
	timeline := s.envsnap(t, "envs", "--timeline", c.id)
	ticks := parseTimeline(t, timeline)
	const want = 1.6
	var before float64
	demand, reached := 0, false
	for i, tk := range ticks {
		if i == 0 || !tk.time.After(jump) {
			before = tk.cpuLimit
			continue
		}
		prev := ticks[i-1].cpuLimit
		if prev >= want {
			reached = true
			break
		}
		if !tk.cpuDemand(prev) {
			continue
		}
		demand++
		if tk.cpuLimit <= prev {
			t.Errorf("tick at %s saw demand (%.2f of %.2f cores used, %.0f%% throttled) and left the quota at %.2f; timeline:\n%s",
				tk.time.Format(time.RFC3339Nano), tk.cpuUsed, prev, 100*tk.throttled, tk.cpuLimit, timeline)
		}
	}
	if before <= 0 || before > 0.5 {
		t.Fatalf("quota before the jump %.2f cores, want the initial 0.25; timeline:\n%s", before, timeline)
	}
	switch {
	case reached && demand <= 3:
		t.Logf("quota %.2f -> %.2f+ cores after %d ticks that saw the demand", before, want, demand)
	case reached:
		t.Errorf("quota reached %.2f cores only after %d ticks that saw the demand, want <= 3; timeline:\n%s", want, demand, timeline)
	case demand < 3:
		prereq.Skip(t, prereq.HostSaturated, "load %s: %d ticks after the jump saw demand (usage near the quota or throttling); timeline:\n%s", loadavg(), demand, timeline)
	default:
		t.Errorf("quota never reached %.2f cores in %d ticks that saw the demand; timeline:\n%s", want, demand, timeline)
	}
}

// tick is one row of the controller timeline CSV (envs --timeline): what
// the controller observed over the last period, and the limits it set.
type tick struct {
	time                         time.Time
	cpuLimit, cpuUsed, throttled float64
}

// cpuDemand tells whether the tick met the CPU grow conditions against the
// limit in force during its period (usage >= 85% of it, or >= 10% of the
// period throttled).
func (tk tick) cpuDemand(limit float64) bool {
	return tk.throttled >= 0.10 || (limit > 0 && tk.cpuUsed >= 0.85*limit)
}

// cpuDemandBetween tells whether any tick in [from, to] met the CPU grow
// conditions.
func cpuDemandBetween(ticks []tick, from, to time.Time) bool {
	for i := 1; i < len(ticks); i++ {
		tk := ticks[i]
		if !tk.time.Before(from) && !tk.time.After(to) && tk.cpuDemand(ticks[i-1].cpuLimit) {
			return true
		}
	}
	return false
}

func parseTimeline(t *testing.T, timeline string) []tick {
	t.Helper()
	rows, err := csv.NewReader(strings.NewReader(timeline)).ReadAll()
	if err != nil || len(rows) < 2 {
		t.Fatalf("timeline CSV: %v\n%s", err, timeline)
	}
	col := map[string]int{}
	for i, h := range rows[0] {
		col[h] = i
	}
	num := func(r []string, name string) float64 {
		v, err := strconv.ParseFloat(r[col[name]], 64)
		if err != nil {
			t.Fatalf("timeline column %s: %v\n%s", name, err, timeline)
		}
		return v
	}
	var out []tick
	for _, r := range rows[1:] {
		ts, err := time.Parse(time.RFC3339Nano, r[col["time"]])
		if err != nil {
			t.Fatalf("timeline time: %v\n%s", err, timeline)
		}
		out = append(out, tick{time: ts, cpuLimit: num(r, "cpu_limit"), cpuUsed: num(r, "cpu_used"), throttled: num(r, "throttled")})
	}
	return out
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

// TestMemoryGrowth: a container starting at 256 MiB whose working set
// grows from 100 MiB to 6 GiB as fast as it can touch pages finishes
// without a single OOM kill.
func TestMemoryGrowth(t *testing.T) {
	s := newSuite(t, node{})
	events := s.watch(t)
	c, err := s.run(t, map[string]string{"initial-cpu": "1", "initial-memory": "256Mi"},
		"-mode", "mem", "-from", "100", "-to", "6144", "-step", "64", "-hold", "500ms")
	if err != nil {
		t.Fatal(err)
	}
	sp := c.sample(t)
	code := c.wait(t, 2*time.Minute)
	sp.Stop()
	var peak int64
	for _, x := range sp.samples() {
		peak = max(peak, x.mem)
	}
	if code != 0 {
		t.Fatalf("exit %d (137 = killed); peak limit %s; output:\n%s\ntimeline:\n%s",
			code, envlet.FormatBytes(peak), c.out.String(), s.envsnap(t, "envs", "--timeline", c.id))
	}
	c.stamp(t, "allocated")
	for _, e := range events() {
		if e.topic == "/tasks/oom" || e.failure != nil {
			t.Errorf("event %s for %s", e.topic, e.id)
		}
	}
	if peak < 6*envlet.GiB {
		t.Errorf("peak memory limit %s: the 6 GiB working set cannot have fit", envlet.FormatBytes(peak))
	}
	t.Logf("256 MiB -> %s limit, 6 GiB allocated in %v, no OOM", envlet.FormatBytes(peak), c.stamp(t, "allocated").Sub(c.start).Round(time.Millisecond))
}

// TestIdleShrink: after a burst the controller gives CPU and memory back
// once the container has been idle for the (shortened) shrink windows.
func TestIdleShrink(t *testing.T) {
	s := newSuite(t, node{})
	c, err := s.run(t, map[string]string{
		"initial-cpu": "0.5", "initial-memory": "256Mi",
		"cpu-shrink-after": "2s", "cpu-cooldown": "1s", "mem-shrink-after": "3s",
	}, "-mode", "burst", "-threads", "2", "-duration", "3s", "-to", "1024", "-hold", "14s")
	if err != nil {
		t.Fatal(err)
	}
	sp := c.sample(t)
	idle := c.waitStamp(t, "idle", time.Minute)
	if code := c.wait(t, time.Minute); code != 0 {
		t.Fatalf("exit %d; output:\n%s", code, c.out.String())
	}
	sp.Stop()
	var peakCPU float64
	var peakMem int64
	var last sample
	for _, x := range sp.samples() {
		if !x.t.After(idle) {
			peakCPU, peakMem = max(peakCPU, x.cpu), max(peakMem, x.mem)
		}
		last = x
	}
	timeline := s.envsnap(t, "envs", "--timeline", c.id)
	t.Logf("burst: %.2f cores, %s; after %v idle: %.2f cores, %s", peakCPU, envlet.FormatBytes(peakMem),
		last.t.Sub(idle).Round(time.Second), last.cpu, envlet.FormatBytes(last.mem))
	if peakMem < envlet.GiB {
		t.Fatalf("memory limit peaked at %s during a 1 GiB burst; timeline:\n%s", envlet.FormatBytes(peakMem), timeline)
	}
	if last.mem > peakMem/2 {
		t.Errorf("memory limit %s after idling, want at most half the burst's %s; timeline:\n%s",
			envlet.FormatBytes(last.mem), envlet.FormatBytes(peakMem), timeline)
	}
	if peakCPU > 0.5 && last.cpu > peakCPU/2+0.01 {
		t.Errorf("cpu quota %.2f after idling, want at most half the burst's %.2f; timeline:\n%s", last.cpu, peakCPU, timeline)
	}
	if peakCPU <= 0.5 && !cpuDemandBetween(parseTimeline(t, timeline), c.start, idle) {
		t.Logf("host saturated (load %s): the CPU burst never showed as demand, CPU shrink not checked", loadavg())
	} else if peakCPU <= 0.5 {
		t.Errorf("cpu quota never grew during the burst; timeline:\n%s", timeline)
	}
}

// TestNodeExhausted: on a node of 4 GiB, a container that keeps needing
// 6 GiB (its build retried after each OOM kill) is failed loudly: the
// client sees /envlet/env/failed with the reason, /tasks/oom, and exit
// status 137; the arbiter lists it as ended with that reason.
func TestNodeExhausted(t *testing.T) {
	s := newSuite(t, node{memory: "4Gi"})
	events := s.watch(t)
	// A host file bind-mounted at kubelet's default termination message
	// path, as kubelet does.
	termLog := filepath.Join(s.dir, "termination-log")
	if err := os.WriteFile(termLog, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := s.runWith(t, runOpts{
		ann: map[string]string{"initial-cpu": "1", "initial-memory": "256Mi", "fail-window": "30s"},
		specOpts: []oci.SpecOpts{oci.WithMounts([]specs.Mount{{
			Destination: "/dev/termination-log", Source: termLog, Type: "bind", Options: []string{"rbind", "rw"}}})},
	}, "-mode", "respawn", "-from", "100", "-to", "6144", "-step", "64", "-hold", "1s")
	if err != nil {
		t.Fatal(err)
	}
	code := c.wait(t, 2*time.Minute)
	if code != 137 {
		t.Fatalf("exit %d, want 137; output:\n%s", code, c.out.String())
	}
	var failure *envlet.Failure
	var oom bool
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && (failure == nil || !oom) {
		for _, e := range events() {
			if e.id != c.id {
				continue
			}
			if e.failure != nil {
				failure = e.failure
			}
			oom = oom || e.topic == "/tasks/oom"
		}
		time.Sleep(50 * time.Millisecond)
	}
	if failure == nil {
		t.Fatalf("no %s event for %s; output:\n%s", "/envlet/env/failed", c.id, c.out.String())
	}
	if !oom {
		t.Error("no /tasks/oom event")
	}
	t.Logf("failure event: %+v", *failure)
	if failure.Reason != envlet.ReasonNodeExhausted {
		t.Errorf("reason %q, want %s", failure.Reason, envlet.ReasonNodeExhausted)
	}
	if failure.Requested <= failure.Granted || failure.Granted > 4*envlet.GiB || failure.OOMs < 1 && failure.WorkingSet == 0 {
		t.Errorf("implausible failure figures: %+v", *failure)
	}
	if msg, err := os.ReadFile(termLog); err != nil || !strings.Contains(string(msg), envlet.ReasonNodeExhausted) {
		t.Errorf("termination message %q (%v), want the reason", msg, err)
	}
	list := s.envsnap(t, "envs", "--all")
	if !strings.Contains(list, c.id) || !strings.Contains(list, envlet.ReasonNodeExhausted) {
		t.Errorf("envs --all does not list %s as ended with %s:\n%s", c.id, envlet.ReasonNodeExhausted, list)
	}
}

// TestAdmissionReclaim: a container that burst to the node's grow limit
// and went idle is shrunk when a new container needs the room: the
// newcomer is admitted (it would not fit next to the idle burst) and the
// idle one's memory limit drops within about a report period.
func TestAdmissionReclaim(t *testing.T) {
	s := newSuite(t, node{memory: "4Gi"})
	// The shrink window is long: only the admission can take the burst.
	a, err := s.run(t, map[string]string{"initial-cpu": "0.5", "initial-memory": "512Mi", "mem-shrink-after": "10m"},
		"-mode", "burst", "-threads", "1", "-duration", "1s", "-to", "2400", "-hold", "60s")
	if err != nil {
		t.Fatal(err)
	}
	sp := a.sample(t)
	a.waitStamp(t, "idle", time.Minute)
	// Two reports so the arbiter knows a is idle.
	time.Sleep(2500 * time.Millisecond)
	_, burst, err := a.limits()
	if err != nil {
		t.Fatal(err)
	}
	if burst < 3*envlet.GiB {
		t.Fatalf("a's memory limit %s after a 2.4 GiB burst: expected the node's grow limit (3.4 GiB)", envlet.FormatBytes(burst))
	}
	admitted := time.Now()
	b, err := s.run(t, map[string]string{"initial-cpu": "0.5", "initial-memory": "1536Mi"}, "-mode", "idle", "-hold", "3s")
	if err != nil {
		t.Fatalf("b not admitted next to a's idle burst (%s of 4 GiB): %v", envlet.FormatBytes(burst), err)
	}
	var shrunk *sample
	deadline := admitted.Add(5 * time.Second)
	for shrunk == nil && time.Now().Before(deadline) {
		for _, x := range sp.samples() {
			if x.t.After(admitted) && x.mem < burst {
				shrunk = &x
				break
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	if shrunk == nil {
		t.Fatalf("a's limit stayed at %s after b was admitted; a's timeline:\n%s", envlet.FormatBytes(burst), s.envsnap(t, "envs", "--timeline", a.id))
	}
	t.Logf("a: %s -> %s %v after b's admission", envlet.FormatBytes(burst), envlet.FormatBytes(shrunk.mem), shrunk.t.Sub(admitted).Round(time.Millisecond))
	if lag := shrunk.t.Sub(admitted); lag > 2500*time.Millisecond {
		t.Errorf("reclaim took %v, want about one report period (1 s)", lag)
	}
	if code := b.wait(t, time.Minute); code != 0 {
		t.Errorf("b exit %d", code)
	}
}

// TestArbiterRestart: the shims hold the truth. After the arbiter daemon
// dies and comes back empty, a running container is registered again, with
// the grant it holds, at its next report.
func TestArbiterRestart(t *testing.T) {
	s := newSuite(t, node{memory: "4Gi"})
	c, err := s.run(t, map[string]string{"initial-cpu": "0.5", "initial-memory": "512Mi", "mem-shrink-after": "10m"},
		"-mode", "burst", "-threads", "1", "-duration", "1s", "-to", "1024", "-hold", "30s")
	if err != nil {
		t.Fatal(err)
	}
	c.waitStamp(t, "idle", time.Minute)
	_, held, err := c.limits()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(s.envsnap(t, "envs"), c.id) {
		t.Fatalf("%s not listed before the restart", c.id)
	}
	s.arbiter.Kill()
	s.startArbiter(t)
	var list string
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		list = s.envsnap(t, "envs", "--json")
		if strings.Contains(list, c.id) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !strings.Contains(list, c.id) {
		t.Fatalf("%s not re-registered with the restarted arbiter:\n%s", c.id, list)
	}
	var envs []struct {
		Env     string
		Current struct{ Memory int64 }
	}
	if err := json.Unmarshal([]byte(list), &envs); err != nil {
		t.Fatal(err)
	}
	for _, e := range envs {
		if e.Env == c.ns+"/"+c.id && e.Current.Memory != held {
			t.Errorf("re-registered with %s, the container holds %s", envlet.FormatBytes(e.Current.Memory), envlet.FormatBytes(held))
		}
	}
	t.Logf("re-registered with %s held\n%s", envlet.FormatBytes(held), s.envsnap(t, "envs"))
}

// TestNoArbiter: with the arbiter down, containers are still admitted (by
// the shim, against the configured node size), CPU may burst to twice its
// initial quota and no further, and memory does not grow (the 200 MiB
// working set is 78% of the 256 MiB limit: the controller asks to grow).
func TestNoArbiter(t *testing.T) {
	s := newSuite(t, node{})
	s.arbiter.Stop(5 * time.Second)
	c, err := s.run(t, map[string]string{"initial-cpu": "0.25", "initial-memory": "256Mi"},
		"-mode", "burst", "-threads", "4", "-duration", "4s", "-to", "200", "-hold", "100ms")
	if err != nil {
		t.Fatalf("not admitted without an arbiter: %v", err)
	}
	sp := c.sample(t)
	if code := c.wait(t, time.Minute); code != 0 {
		t.Fatalf("exit %d; output:\n%s", code, c.out.String())
	}
	sp.Stop()
	var peakCPU float64
	var peakMem int64
	for _, x := range sp.samples() {
		peakCPU, peakMem = max(peakCPU, x.cpu), max(peakMem, x.mem)
	}
	t.Logf("4 busy threads without an arbiter: peak %.2f cores, %s", peakCPU, envlet.FormatBytes(peakMem))
	if peakCPU > 0.5+1e-3 {
		t.Errorf("cpu grew to %.2f cores without an arbiter, want at most 2 x 0.25", peakCPU)
	}
	if peakMem > 256*envlet.MiB {
		t.Errorf("memory grew to %s without an arbiter, want it held at 256 MiB", envlet.FormatBytes(peakMem))
	}
	if peakCPU <= 0.25 {
		t.Logf("host saturated (load %s): the CPU never grew, fail-open not observed", loadavg())
	}
}

// TestStartOrder: a start behind a busy one runs at a quarter of its CPU
// weight, and gets it back once the one ahead has gone; a start that goes
// idle at the head of the queue leaves it, so it holds no later start
// back.
func TestStartOrder(t *testing.T) {
	s := newSuite(t, node{memory: "4Gi"})
	ann := map[string]string{"initial-cpu": "0.5", "initial-memory": "256Mi"}
	busy := []string{"-mode", "cpu", "-threads", "1", "-threads2", "1", "-duration", "2m"}
	a, err := s.run(t, ann, busy...)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.run(t, ann, busy...)
	if err != nil {
		t.Fatal(err)
	}
	_, dflt, err := b.cpuWeight()
	if err != nil {
		t.Fatal(err)
	}
	behind := envlet.StartWeight(dflt, 2, 1)
	if dflt == 100 {
		behind = envlet.StartWeight(dflt, 1, 1)
	}
	b.waitWeight(t, behind, 5*time.Second)
	a.waitWeight(t, dflt, time.Second)
	if err := a.task.Kill(s.env.Context(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	a.wait(t, 30*time.Second)
	b.waitWeight(t, dflt, 5*time.Second)
	if err := b.task.Kill(s.env.Context(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	b.wait(t, 30*time.Second)

	c, err := s.run(t, ann, "-mode", "idle", "-hold", "1m")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // idle at the head: its start is over
	d, err := s.run(t, ann, busy...)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if w, _, err := d.cpuWeight(); err != nil || w != dflt {
		t.Fatalf("a start after an idle one: CPU weight %d (%v), want %d: the idle start still holds the queue", w, err, dflt)
	}
	for _, x := range []*ctr{c, d} {
		if err := x.task.Kill(s.env.Context(), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		x.wait(t, 30*time.Second)
	}
}
