package ksm

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/procfs"

	"github.com/envsnap/envsnap/internal/prereq"
)

// agentEnv names the agent CLI's launcher for TestBenchAgents (the
// benchmark workload's /opt/harness/bin/agent); agentsEnv how many run.
const (
	agentEnv  = "ENVSNAP_KSM_AGENT"
	agentsEnv = "ENVSNAP_KSM_AGENTS"
)

// TestBenchAgents measures what KSM saves across N identical agent CLIs
// and what it costs ksmd. It runs where the node is ours to configure
// (the VM guest of tests/vm, TestBenchKSMAgents): it starts ksmd with the
// kernel's default scan rate and stops it again. The agents run in print
// mode against a stand-in that holds their first model request open, so
// each has loaded its code and waits, as an agent waiting on the model
// does. The same N agents run twice, unmarked and then marked
// (MergeSelf before exec, as the shim marks its containers); each run
// gives ksmd the same time.
func TestBenchAgents(t *testing.T) {
	prereq.RequireBench(t)
	agent := os.Getenv(agentEnv)
	if agent == "" {
		t.Fatalf("%s names the agent CLI's launcher (tests/vm TestBenchKSMAgents sets it)", agentEnv)
	}
	n := 4
	if v := os.Getenv(agentsEnv); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 2 {
			t.Fatalf("%s=%q: want a count of at least 2", agentsEnv, v)
		}
	}
	if _, err := Merging(); err != nil {
		t.Fatal(err)
	}
	node, err := ReadNode()
	if err != nil {
		t.Fatal(err)
	}
	if node.Run != 0 {
		t.Fatalf("ksmd already running (run=%d): the node is not idle", node.Run)
	}
	t.Cleanup(func() { setRun(t, 2); setRun(t, 0) })
	for _, f := range []string{"pages_to_scan", "sleep_millisecs"} {
		b, _ := os.ReadFile(filepath.Join(sysDir, f))
		t.Logf("ksmd %s %s (the kernel's default)", f, strings.TrimSpace(string(b)))
	}

	hold := holdRequests(t)
	for _, marked := range []bool{false, true} {
		label := map[bool]string{false: "unmarked", true: "marked"}[marked]
		r := runAgents(t, agent, n, marked, hold)
		t.Logf("%s: %d agents, anonymous memory %s in all (%s per agent, process trees), ready in %s; after %s of ksmd: saved %s (general_profit; %s per agent, %.0f%% of an agent's anonymous memory), pages_sharing %d, full scans %d; ksmd CPU %.2f s (%.1f%% of a core)",
			label, n, mib(r.anon), mib(r.anon/int64(n)), r.ready.Round(time.Second), r.wall.Round(time.Second),
			mib(r.profit), mib(r.profit/int64(n)), 100*float64(r.profit)/float64(r.anon), r.sharing, r.scans, r.ksmdCPU, 100*r.ksmdCPU/r.wall.Seconds())
		if marked && r.profit <= 0 {
			t.Errorf("marked agents: nothing merged (general_profit %d)", r.profit)
		}
		if !marked && r.sharing > 0 {
			t.Errorf("unmarked agents: %d pages shared, want none (nothing marks them)", r.sharing)
		}
	}
}

type agentsRun struct {
	anon, profit   int64
	sharing, scans int64
	ready, wall    time.Duration
	ksmdCPU        float64
}

// ksmdTime is how long ksmd runs on each batch of agents: with the
// kernel's default rate (100 pages every 20 ms) a full scan of 1 GiB of
// mergeable memory takes about 50 s on hardware, longer emulated.
const ksmdTime = 4 * time.Minute

func runAgents(t *testing.T, agent string, n int, marked bool, hold *holder) agentsRun {
	var r agentsRun
	start := time.Now()
	var cmds []*exec.Cmd
	exited := make(chan error, n)
	defer func() {
		for _, c := range cmds {
			_ = syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
		}
		for range cmds {
			<-exited
		}
	}()
	before := hold.count()
	for i := range n {
		home := t.TempDir()
		cmd := exec.Command(os.Args[0], "-p", "Wait.", "--output-format", "json", "--dangerously-skip-permissions")
		mode := "exec"
		if marked {
			mode = "merge-exec"
		}
		cmd.Env = append(os.Environ(), helperEnv+"="+mode, "HOME="+home,
			"ANTHROPIC_BASE_URL=http://"+hold.addr, fmt.Sprintf("ANTHROPIC_API_KEY=key-%d", i), "IS_SANDBOX=1",
			"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1", "DISABLE_AUTOUPDATER=1", "DISABLE_TELEMETRY=1", "DISABLE_ERROR_REPORTING=1")
		cmd.Dir = home
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		out := &tailBuffer{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
		go func() {
			err := cmd.Wait()
			exited <- fmt.Errorf("agent %d exited (%v) before the measurement; its output ends:\n%s", i+1, err, out.String())
		}()
	}
	lastLog := time.Now()
	for hold.count() < before+n {
		if time.Since(lastLog) > time.Minute {
			lastLog = time.Now()
			t.Logf("%s: %d of %d agents asked the model", time.Since(start).Round(time.Second), hold.count()-before, n)
			for i, c := range cmds {
				t.Logf("  agent %d: %s", i+1, describeTree(c.Process.Pid))
			}
		}
		select {
		case err := <-exited:
			// Counted again by the deferred wait.
			exited <- err
			t.Fatal(err)
		case <-time.After(time.Second):
		}
		if time.Since(start) > 20*time.Minute {
			t.Fatalf("%d of %d agents asked the model within 20 min", hold.count()-before, n)
		}
	}
	r.ready = time.Since(start)
	// Let the agents settle after their request.
	time.Sleep(10 * time.Second)
	for _, c := range cmds {
		a, err := treeAnon(c.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		r.anon += a
	}
	cpu0, err := DaemonCPU()
	if err != nil {
		t.Fatal(err)
	}
	n0, err := ReadNode()
	if err != nil {
		t.Fatal(err)
	}
	setRun(t, 1)
	t0 := time.Now()
	time.Sleep(ksmdTime)
	n1, err := ReadNode()
	if err != nil {
		t.Fatal(err)
	}
	cpu1, err := DaemonCPU()
	if err != nil {
		t.Fatal(err)
	}
	r.wall = time.Since(t0)
	setRun(t, 2)
	setRun(t, 0)
	r.ksmdCPU = cpu1 - cpu0
	r.profit, r.sharing, r.scans = n1.Profit, n1.Sharing, n1.FullScans-n0.FullScans
	return r
}

// tree is pid and its descendants (the launcher and the CLI it starts).
func tree(pid int) ([]procfs.Proc, error) {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return nil, err
	}
	procs, err := fs.AllProcs()
	if err != nil {
		return nil, err
	}
	children := map[int][]procfs.Proc{}
	var out []procfs.Proc
	for _, p := range procs {
		if p.PID == pid {
			out = append(out, p)
		}
		if st, err := p.Stat(); err == nil {
			children[st.PPID] = append(children[st.PPID], p)
		}
	}
	for i := 0; i < len(out); i++ {
		out = append(out, children[out[i].PID]...)
	}
	return out, nil
}

// treeAnon is the anonymous resident memory of pid's tree.
func treeAnon(pid int) (int64, error) {
	procs, err := tree(pid)
	if err != nil {
		return 0, err
	}
	var total int64
	for _, p := range procs {
		if st, err := p.NewStatus(); err == nil {
			total += int64(st.RssAnon)
		}
	}
	return total, nil
}

// describeTree says what pid's tree is doing: command, state, kernel
// wait channel, CPU seconds.
func describeTree(pid int) string {
	procs, err := tree(pid)
	if err != nil {
		return err.Error()
	}
	var parts []string
	for _, p := range procs {
		st, err := p.Stat()
		if err != nil {
			continue
		}
		wchan, _ := os.ReadFile(fmt.Sprintf("/proc/%d/wchan", p.PID))
		parts = append(parts, fmt.Sprintf("%s[%d] %s wchan=%s cpu=%.1fs", st.Comm, p.PID, st.State, wchan, st.CPUTime()))
	}
	return strings.Join(parts, "; ")
}

func setRun(t *testing.T, v int) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(sysDir, "run"), []byte(strconv.Itoa(v)), 0o644); err != nil {
		t.Errorf("ksmd run=%d: %v", v, err)
	}
}

// holder accepts the agents' model requests and never answers them.
type holder struct {
	addr string
	reqs chan struct{}
}

func holdRequests(t *testing.T) *holder {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &holder{addr: ln.Addr().String(), reqs: make(chan struct{}, 1024)}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go func() {
				// The request line is enough: the agent then waits.
				if line, err := bufio.NewReader(c).ReadString('\n'); err == nil && strings.HasPrefix(line, "POST ") {
					h.reqs <- struct{}{}
				}
			}()
		}
	}()
	return h
}

func (h *holder) count() int { return len(h.reqs) }

// tailBuffer keeps the last 4 KiB written to it.
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.b = append(b.b, p...)
	if len(b.b) > 4096 {
		b.b = b.b[len(b.b)-4096:]
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.b)
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
