package headline

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	v1 "github.com/containerd/cgroups/v3/cgroup1/stats"
	v2 "github.com/containerd/cgroups/v3/cgroup2/stats"
	tasks "github.com/containerd/containerd/api/services/tasks/v1"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/typeurl/v2"
	"github.com/google/nftables"
	"github.com/opencontainers/runtime-spec/specs-go"
	"github.com/prometheus/procfs"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/bench/modelstub"
	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/egress"
)

// DensitySystems are the systems the density scenario compares by
// default: the product against the status quo (overlayfs, runc, a fixed
// request per environment, admitted by request), and overlayfs + runc
// with no limit at all, whose knee is the node's and the workload's own:
// the floor the product's is read against.
var DensitySystems = []string{Envsnap, OverlayfsAll, StatusQuo}

// DensityConfig is the density scenario: agent environments started one
// after another on one node until the node refuses one, one fails, or
// the tool calls slow down past Limit times one environment alone.
type DensityConfig struct {
	Tasks     string
	TaskCount int // distinct tasks; environment i runs task i mod TaskCount (0: every task)
	Max       int // stop after this many environments
	// Step environments are added between two measurements (the first
	// level is one environment alone).
	Step int
	// Settle is how long a level runs before it is measured: the agents
	// started last load their code (seconds of CPU each) in it.
	Settle time.Duration
	// Window is how long each level is then measured.
	Window time.Duration
	// Limit is the degradation bound: the level's p95 tool-call latency
	// over the reference (DensityRun.Reference: one environment alone).
	Limit   float64
	Think   modelstub.Think
	Systems []string
	RTT     time.Duration
	Rate    int64
	// ReadyTimeout bounds the wait for a started environment's first
	// model request; past it the environment counts as failed.
	ReadyTimeout time.Duration
	FixedCPU     float64
	FixedMemory  int64
	NoPrefetch   bool
	Log          io.Writer
	ModelLog     io.Writer
}

func (c *DensityConfig) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, format+"\n", args...)
	}
}

// DensityReport is what the density scenario measured, the systems side
// by side in one run.
type DensityReport struct {
	Started  time.Time              `json:"started"`
	Duration time.Duration          `json:"duration_ns"`
	Command  string                 `json:"command"`
	Machine  string                 `json:"machine"`
	Link     string                 `json:"link"`
	Workload string                 `json:"workload"`
	Agent    string                 `json:"agent"`
	Tasks    []string               `json:"tasks"`
	Think    string                 `json:"think"`
	Max      int                    `json:"max"`
	Step     int                    `json:"step"`
	Settle   time.Duration          `json:"settle_ns"`
	Window   time.Duration          `json:"window_ns"`
	Limit    float64                `json:"limit"`
	FixedCPU float64                `json:"fixed_cpu"`
	FixedMem int64                  `json:"fixed_memory"`
	Cores    int                    `json:"cores"`
	MemTotal int64                  `json:"mem_total"`
	Order    []string               `json:"order"`
	Systems  map[string]*DensityRun `json:"systems"`
	Notes    []string               `json:"notes"`
}

// DensityRun is one system's ramp.
type DensityRun struct {
	// Slots is how many environments a scheduler placing them by request
	// admits (0: no request, the node decides).
	Slots int `json:"slots"`
	// Alone is the tool-call latency (s) of one environment alone on the
	// node, over its first episode.
	Alone Summary `json:"alone_tool_call_s"`
	// Reference is the p95 tool-call latency (s) the levels are held to:
	// the first level's, one environment alone measured as every level
	// is (past its first episode), or Alone's p95 when that level saw no
	// call.
	Reference float64 `json:"reference_p95_s"`
	// Held is the most environments the node held with no failure and
	// the p95 tool-call latency within the limit.
	Held int `json:"held"`
	// Stop is why the ramp ended.
	Stop   string         `json:"stop"`
	Levels []DensityLevel `json:"levels"`
	// CPUCeiling is how many environments working as the first level's
	// did would keep every core of the node busy with their own work
	// alone (cores / EnvCPU per environment at the first level): past it
	// tool calls queue for CPU whatever the runtime costs. 0 unknown.
	CPUCeiling float64 `json:"cpu_ceiling"`
	// Episodes is how many agent episodes completed over the ramp.
	Episodes int      `json:"episodes"`
	Failures []string `json:"failures,omitempty"`
}

// DensityLevel is the node holding Envs environments for one window.
type DensityLevel struct {
	Envs     int     `json:"envs"`
	ToolCall Summary `json:"tool_call_s"`      // the calls that ended in the window
	Ratio    float64 `json:"p95_vs_reference"` // over DensityRun.Reference
	// NodeMemory is MemTotal - MemAvailable and NodeFile the page cache
	// (Cached), both above the node before the first environment, at the
	// window's end.
	NodeMemory int64 `json:"node_memory"`
	NodeFile   int64 `json:"node_file"`
	// EnvFile is the file pages charged to the environments' cgroups,
	// summed: a page several environments map is charged to one of them.
	EnvFile int64 `json:"env_file"`
	// WorkingSet is each environment's working set (MiB).
	WorkingSet Summary `json:"working_set_mib"`
	// NodeCPU is the node's busy cores over the window (every process on
	// the machine, not only the bench's).
	NodeCPU float64 `json:"node_cpu_cores"`
	// EnvCPU is the cores the environments' own cgroups used over the
	// window, summed (their agents' and tools' work, not the node's).
	EnvCPU float64 `json:"env_cpu_cores"`
	// Shims is how many shim processes served the environments, ShimCPU
	// the cores they used together over the window, ShimPss their
	// proportional set size summed (shared pages split between them).
	Shims   int     `json:"shims"`
	ShimCPU float64 `json:"shim_cpu_cores"`
	ShimPss int64   `json:"shim_pss"`
	OK      bool    `json:"ok"`
}

// levelCalls is how many tool calls every level, the reference
// included, collects, in at most maxLevelWindows windows: about what a
// level of 8 environments makes in one.
const (
	levelCalls      = 40
	maxLevelWindows = 6
)

// MeasureDensity runs the density scenario on every system of cfg.
func MeasureDensity(ctx context.Context, cfg DensityConfig) (_ *DensityReport, retErr error) {
	if cfg.Max < 2 || cfg.Max > netshape.MaxBridgeNodes-1 {
		return nil, fmt.Errorf("density scenario: at most %d environments, want 2 to %d", cfg.Max, netshape.MaxBridgeNodes-1)
	}
	if cfg.Step < 1 || cfg.Window <= 0 || cfg.Limit <= 1 {
		return nil, fmt.Errorf("density scenario: step %d, window %s, limit %.2f: want step >= 1, a window, limit > 1", cfg.Step, cfg.Window, cfg.Limit)
	}
	if len(cfg.Systems) == 0 {
		cfg.Systems = DensitySystems
	}
	for _, s := range cfg.Systems {
		if _, ok := rolloutSystems[s]; !ok {
			return nil, fmt.Errorf("density scenario: unknown system %q (want some of %s)", s, strings.Join(RolloutSystems, ", "))
		}
	}
	w, err := episode.LoadWorkload(cfg.Tasks)
	if err != nil {
		return nil, err
	}
	taskList := spreadTasks(w.Tasks, cfg.TaskCount, cfg.Max)
	memTotal, err := meminfo("MemTotal")
	if err != nil {
		return nil, err
	}
	rep := &DensityReport{Started: time.Now(), Machine: machine(), Workload: reportPath(cfg.Tasks), Think: describeThink(cfg.Think),
		Max: cfg.Max, Step: cfg.Step, Settle: cfg.Settle, Window: cfg.Window, Limit: cfg.Limit, FixedCPU: cfg.FixedCPU, FixedMem: cfg.FixedMemory,
		Cores: runtime.NumCPU(), MemTotal: memTotal, Order: cfg.Systems, Systems: map[string]*DensityRun{}}
	for _, t := range taskList {
		rep.Tasks = append(rep.Tasks, t.ID)
	}

	denv, link, metricsAddr, closeNode, err := startNode(ctx, cfg.Rate, cfg.RTT)
	if err != nil {
		return nil, err
	}
	defer closeNode()
	rep.Link = link
	b := &bench{cfg: Config{Log: cfg.Log}, env: denv, metrics: "http://" + metricsAddr + "/metrics"}

	br, err := netshape.NewBridge(ctx, fmt.Sprintf("%sde-%d", netshape.NamePrefix, os.Getpid()), cfg.Max+1)
	if err != nil {
		return nil, fmt.Errorf("density namespaces: %w", err)
	}
	defer func() {
		if err := br.Close(context.Background()); err != nil && retErr == nil {
			retErr = err
		}
	}()
	modelLog := cfg.ModelLog
	if modelLog == nil {
		modelLog = io.Discard
	}
	stub, err := modelstub.New(cfg.Think, modelLog)
	if err != nil {
		return nil, err
	}
	rec := &toolRecorder{stub: stub, scripts: map[string]envScript{}, episodes: map[string]int{}, lastEnd: map[string]time.Time{}, ready: map[string]chan struct{}{}}
	ln, err := br.Nodes[0].Listen(ctx, gatewayPort)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: rec, ReadHeaderTimeout: time.Minute}
	go srv.Serve(ln)
	defer srv.Close()
	gw := net.JoinHostPort(br.Nodes[0].Addr.String(), strconv.Itoa(gatewayPort))
	allow := fmt.Sprintf("%s:%d/tcp", br.Nodes[0].Addr, gatewayPort)
	rep.Link += fmt.Sprintf("; the model stand-in in its own network namespace, each environment in another on one bridge, egress allow-list %q", allow)

	cfg.logf("publishing groups through the shaped link")
	pub, err := episode.PublishGroups(ctx, denv.Hosts(), denv.Registry.Host, &episode.Workload{Tasks: taskList})
	if err != nil {
		return nil, err
	}
	if !cfg.NoPrefetch {
		cfg.logf("recording footprints with one episode of %s and attaching them to the shared groups", taskList[0].ID)
		note, err := b.recordPrefetch(ctx, pub, taskList[0])
		if err != nil {
			return nil, fmt.Errorf("record prefetch lists: %w", err)
		}
		rep.Notes = append(rep.Notes, note)
	}
	envs, err := composeEnvs(ctx, denv.Hosts(), denv.Registry.Host, pub, taskList, len(taskList))
	if err != nil {
		return nil, err
	}
	db := &densityBench{bench: b, cfg: cfg, rec: rec, gateway: gw, allow: allow, nodes: br.Nodes[1:], envs: envs, memTotal: memTotal}
	for _, sys := range cfg.Systems {
		cfg.logf("%-12s ramp to %d environments, %d at a time, %s a level", sys, cfg.Max, cfg.Step, cfg.Window)
		run, err := db.ramp(ctx, sys)
		if err != nil {
			return nil, fmt.Errorf("density on %s: %w", sys, err)
		}
		rep.Systems[sys] = run
		cfg.logf("%-12s held %d environments (%s); alone p95 tool call %.2fs over its first episode, %.2fs after it (the reference)", sys, run.Held, run.Stop, run.Alone.P95, run.Reference)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}
	rep.Agent = rec.agent()
	rep.Duration = time.Since(rep.Started)
	return rep, nil
}

type densityBench struct {
	*bench
	cfg      DensityConfig
	rec      *toolRecorder
	gateway  string
	allow    string
	nodes    []netshape.BridgeNode
	envs     []env
	memTotal int64
}

// densityEnv is one started environment.
type densityEnv struct {
	key  string
	done chan struct{}
	err  error // set before done closes
}

// ramp starts environments on sys one after another from an empty node.
func (db *densityBench) ramp(ctx context.Context, sys string) (*DensityRun, error) {
	spec := rolloutSystems[sys]
	if err := db.useSystem(Envsnap); err != nil {
		return nil, err
	}
	if err := db.reset(); err != nil {
		return nil, err
	}
	for _, n := range db.nodes {
		// A table left by the system before (the shim's, or the bench's
		// for runc) goes first: egress.Apply replaces one in a single
		// batch, which failed with netlink ENOBUFS on this loaded node.
		// The shim installs its own; runc gets the bench's.
		if err := clearEgress(n.Path()); err != nil {
			return nil, err
		}
		if !spec.envlet {
			if err := applyEgress(ctx, n.Path(), db.allow); err != nil {
				return nil, err
			}
		}
	}
	run := &DensityRun{}
	limit := db.cfg.Max
	if spec.fixed {
		run.Slots = RequestSlots(float64(runtime.NumCPU()), db.memTotal, db.cfg.FixedCPU, db.cfg.FixedMemory)
	}
	baseUsed, err := nodeMemoryUsed()
	if err != nil {
		return nil, err
	}
	baseFile, err := meminfo("Cached")
	if err != nil {
		return nil, err
	}
	// Every environment loops over episodes until the ramp ends; then
	// they are killed together.
	rctx, stopAll := context.WithCancel(ctx)
	var started []*densityEnv
	defer func() {
		stopAll()
		for _, e := range started {
			<-e.done
		}
	}()
	failed := func() string {
		for _, e := range started {
			select {
			case <-e.done:
				return fmt.Sprintf("%s ended: %v", e.key, e.err)
			default:
			}
		}
		if f := db.rec.failures(sys); len(f) > 0 {
			return f[0]
		}
		return ""
	}
	start := func(i int) (string, error) {
		e := &densityEnv{key: fmt.Sprintf("%s-%02d", sys, i), done: make(chan struct{})}
		ready := db.rec.expect(e.key, db.envs[i%len(db.envs)])
		started = append(started, e)
		go func() {
			defer close(e.done)
			e.err = db.runEnv(rctx, sys, spec, i, e.key)
		}()
		select {
		case <-ready:
			return "", nil
		case <-e.done:
			if devenv.AdmissionRejected(e.err) {
				return fmt.Sprintf("the node refused environment %d: %v", i+1, e.err), nil
			}
			return "", fmt.Errorf("environment %d ended before its first model request: %v", i+1, e.err)
		case <-time.After(db.cfg.ReadyTimeout):
			return "", fmt.Errorf("environment %d not ready within %s", i+1, db.cfg.ReadyTimeout)
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}

	// One environment alone: its first episode is the reference.
	if refused, err := start(0); err != nil || refused != "" {
		run.Stop = refused
		if err != nil {
			run.Stop = err.Error()
		}
		return run, nil
	}
	db.cfg.logf("%-12s one environment alone: waiting for its first episode", sys)
	if err := db.rec.waitEpisodes(ctx, started[0].key, 1, started[0].done); err != nil {
		run.Stop = fmt.Sprintf("the environment alone did not finish an episode: %v", err)
		run.Failures = db.rec.failures(sys)
		return run, nil
	}
	run.Alone = summarize(db.rec.latencies(sys, time.Time{}, time.Now()))
	db.cfg.logf("%-12s alone: %d tool calls, p50 %.2fs p95 %.2fs", sys, run.Alone.N, run.Alone.Median, run.Alone.P95)

	for n := 1; ; {
		// Measure the level, once its last agents have started.
		select {
		case <-time.After(db.cfg.Settle):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		from, cpu0, shim0, env0 := time.Now(), db.sampleCPU(), db.shims(), containerStats(db.env)
		// Every level is measured until it has levelCalls tool calls: a
		// p95 of the ten calls one agent makes in a minute, or of the 17
		// two make, is their slowest call, and the ramp's stop would
		// follow that one call.
		for w := 0; ; w++ {
			select {
			case <-time.After(db.cfg.Window):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			if w+1 >= maxLevelWindows || len(db.rec.latencies(sys, from, time.Now())) >= levelCalls {
				break
			}
		}
		now, cpu1, shim1 := time.Now(), db.sampleCPU(), db.shims()
		secs := now.Sub(from).Seconds()
		lv := DensityLevel{Envs: n, ToolCall: summarize(db.rec.latencies(sys, from, now)), NodeCPU: (cpu1.busy - cpu0.busy) / secs,
			Shims: len(shim1.cpu), ShimPss: shim1.pss}
		for pid, t := range shim1.cpu {
			if t0, ok := shim0.cpu[pid]; ok {
				lv.ShimCPU += (t - t0) / secs
			}
		}
		if len(run.Levels) == 0 {
			run.Reference = lv.ToolCall.P95
			if lv.ToolCall.N == 0 {
				run.Reference = run.Alone.P95
			}
		}
		lv.Ratio = ratio(lv.ToolCall.P95, run.Reference)
		if used, err := nodeMemoryUsed(); err == nil {
			lv.NodeMemory = used - baseUsed
		}
		if c, err := meminfo("Cached"); err == nil {
			lv.NodeFile = c - baseFile
		}
		var ws []float64
		for id, m := range containerStats(db.env) {
			ws = append(ws, float64(m.workingSet)/(1<<20))
			lv.EnvFile += m.file
			if m0, ok := env0[id]; ok {
				lv.EnvCPU += (m.cpu - m0.cpu) / secs
			}
		}
		lv.WorkingSet = summarize(ws)
		if len(run.Levels) == 0 && lv.EnvCPU > 0 {
			run.CPUCeiling = float64(runtime.NumCPU()) * float64(n) / lv.EnvCPU
		}
		fail := failed()
		lv.OK = fail == "" && lv.Ratio <= db.cfg.Limit
		run.Levels = append(run.Levels, lv)
		db.cfg.logf("%-12s %3d envs: tool call p50 %.2fs p95 %.2fs (%.2fx the reference, %d calls), node memory +%s (file +%s), node CPU %.2f cores (environments %.2f), %d shims %.3f cores %s Pss",
			sys, n, lv.ToolCall.Median, lv.ToolCall.P95, lv.Ratio, lv.ToolCall.N, mib(lv.NodeMemory), mib(lv.NodeFile), lv.NodeCPU, lv.EnvCPU, lv.Shims, lv.ShimCPU, mib(lv.ShimPss))
		switch {
		case fail != "":
			run.Stop = "a rollout failed at " + strconv.Itoa(n) + " environments: " + fail
		case !lv.OK:
			run.Stop = fmt.Sprintf("p95 tool-call latency %.2fx the reference at %d environments (limit %.2fx)", lv.Ratio, n, db.cfg.Limit)
		case n >= limit:
			run.Stop = fmt.Sprintf("reached the scenario's maximum, %d environments", limit)
		case run.Slots > 0 && n >= run.Slots:
			run.Stop = fmt.Sprintf("admitted by request: the node's %d cores and %s hold %d environments of %.2g cores / %s", runtime.NumCPU(), mib(db.memTotal), run.Slots, db.cfg.FixedCPU, mib(db.cfg.FixedMemory))
		}
		if lv.OK {
			run.Held = n
		}
		if run.Stop != "" {
			break
		}
		next := min(limit, (n/db.cfg.Step+1)*db.cfg.Step)
		if run.Slots > 0 {
			next = min(next, run.Slots)
		}
		var refused string
		first := n
		for i := n; i < next && refused == ""; i++ {
			if refused, err = start(i); err != nil {
				run.Stop = fmt.Sprintf("starting environment %d of %d: %v", i+1, next, err)
				break
			}
			n = i + 1
			db.cfg.logf("%-12s environment %d ready", sys, n)
		}
		if refused != "" {
			run.Stop = refused
		}
		if run.Stop != "" {
			break
		}
		// A level is measured in its steady state: a new environment's
		// first episode pays the cold start of its tools (the first
		// build, lazily read layers), which is start-up, not density.
		waited := time.Now()
		for _, e := range started[first:n] {
			if err := db.rec.waitEpisodes(ctx, e.key, 1, e.done); err != nil {
				run.Stop = fmt.Sprintf("environment %s did not finish its first episode at %d environments: %v", e.key, n, err)
				break
			}
		}
		if run.Stop != "" {
			break
		}
		db.cfg.logf("%-12s %3d envs: the new environments' first episodes ended %.0fs after the last start", sys, n, time.Since(waited).Seconds())
	}
	run.Episodes = db.rec.completed(sys)
	run.Failures = db.rec.failures(sys)
	return run, nil
}

// densityScript runs the agent on the task episode after episode, each
// with its own API key (the model stand-in sees each as a rollout), the
// bug applied again between them (the fix is its reverse).
func densityScript(t episode.Task, key string) string {
	prompt := fmt.Sprintf("The tests of the Go repository in %s fail. Find the bug and fix it.", t.Repo)
	return fmt.Sprintf("cd %s || exit 2; i=0; while :; do i=$((i+1)); ANTHROPIC_API_KEY=%s-ep$i agent -p '%s' --output-format json --dangerously-skip-permissions --max-turns 40 </dev/null >/dev/null; echo %s$?; git apply -R %s || exit 3; done",
		t.Repo, key, prompt, agentExitMarker, t.FixInRootfs)
}

// runEnv runs environment i until ctx ends (nil then) or it fails.
func (db *densityBench) runEnv(ctx context.Context, sys string, spec rolloutSystem, i int, key string) error {
	e := db.envs[i%len(db.envs)]
	img, err := db.env.Pull(ctx, e.ref, spec.snapshotter)
	if err != nil {
		return err
	}
	opts := devenv.RunOptions{
		Snapshotter: spec.snapshotter,
		Runtime:     "io.containerd.runc.v2",
		Args:        []string{"/bin/sh", "-c", densityScript(e.task, key)},
		Env:         agentEnv(db.gateway, key),
		Timeout:     24 * time.Hour, // the ramp ends it
		SpecOpts:    []oci.SpecOpts{oci.WithLinuxNamespace(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: db.nodes[i].Path()})},
	}
	if spec.envlet {
		opts.Runtime = "io.containerd.envlet.v2"
		opts.Annotations = map[string]string{egress.Annotation: db.allow}
	}
	if spec.fixed {
		opts.SpecOpts = append(opts.SpecOpts, oci.WithCPUCFS(int64(db.cfg.FixedCPU*100000), 100000), oci.WithMemoryLimit(uint64(db.cfg.FixedMemory)))
	}
	out, err := db.env.Run(ctx, img, opts)
	if ctx.Err() != nil {
		return nil
	}
	if err != nil {
		return err
	}
	return fmt.Errorf("the environment exited with %d: %s", out.ExitCode, episode.LastLines(out.Stdout+out.Stderr, 5))
}

// shimSample is the CPU seconds of each shim process of this node's
// containerd and their summed Pss.
type shimSample struct {
	cpu map[int]float64
	pss int64
}

// shims finds the shims serving this bench's containerd (their -address
// is its socket; other containerds on the machine have their own).
func (b *bench) shims() shimSample {
	s := shimSample{cpu: map[int]float64{}}
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return s
	}
	procs, err := fs.AllProcs()
	if err != nil {
		return s
	}
	for _, p := range procs {
		args, err := p.CmdLine()
		if err != nil || len(args) == 0 || !strings.Contains(args[0], "containerd-shim") {
			continue
		}
		if i := slices.Index(args, "-address"); i < 0 || i+1 >= len(args) || args[i+1] != b.env.Address {
			continue
		}
		st, err := p.Stat()
		if err != nil {
			continue
		}
		s.cpu[p.PID] = st.CPUTime()
		if r, err := p.ProcSMapsRollup(); err == nil {
			s.pss += int64(r.Pss)
		}
	}
	return s
}

type containerStat struct {
	workingSet int64   // usage less inactive file
	file       int64   // page cache charged to the cgroup
	cpu        float64 // CPU seconds the cgroup used since it was created
}

// containerStats is every running container's memory and CPU time, from
// containerd's task metrics.
func containerStats(env *devenv.Env) map[string]containerStat {
	out := map[string]containerStat{}
	ctx, cancel := context.WithTimeout(env.Context(), 10*time.Second)
	defer cancel()
	resp, err := env.Client.TaskService().Metrics(ctx, &tasks.MetricsRequest{})
	if err != nil {
		return out
	}
	for _, m := range resp.Metrics {
		if m.Data == nil {
			continue
		}
		switch {
		case typeurl.Is(m.Data, (*v1.Metrics)(nil)):
			var st v1.Metrics
			if typeurl.UnmarshalTo(m.Data, &st) == nil && st.Memory != nil && st.Memory.Usage != nil {
				u := st.Memory.Usage.Usage
				c := containerStat{workingSet: int64(u - min(st.Memory.TotalInactiveFile, u)), file: int64(st.Memory.TotalCache)}
				if st.CPU != nil && st.CPU.Usage != nil {
					c.cpu = float64(st.CPU.Usage.Total) / 1e9
				}
				out[m.ID] = c
			}
		case typeurl.Is(m.Data, (*v2.Metrics)(nil)):
			var st v2.Metrics
			if typeurl.UnmarshalTo(m.Data, &st) == nil && st.Memory != nil {
				u := st.Memory.Usage
				c := containerStat{workingSet: int64(u - min(st.Memory.InactiveFile, u)), file: int64(st.Memory.File)}
				if st.CPU != nil {
					c.cpu = float64(st.CPU.UsageUsec) / 1e6
				}
				out[m.ID] = c
			}
		}
	}
	return out
}

// toolRecorder stands in front of the model stand-in and times every
// tool call from the outside: from the end of the answer that asked for
// it to the agent's next request carrying its result (the tool's run and
// the agent's own handling, what an environment adds to a turn). It
// registers each episode's key with the stand-in when the episode's
// agent first calls (environment KEY runs episodes KEY-1, KEY-2, ...).
type toolRecorder struct {
	stub *modelstub.Server

	mu       sync.Mutex
	scripts  map[string]envScript     // environment key -> its episode
	episodes map[string]int           // environment key -> episodes started
	lastEnd  map[string]time.Time     // episode key -> end of its last tool_use answer
	ready    map[string]chan struct{} // environment key -> closed at its first request
	calls    []toolCall
	fails    []string
	ua       string
}

// envScript is the episode an environment runs again and again.
type envScript struct {
	task   episode.Task
	script modelstub.Script
}

type toolCall struct {
	env string
	end time.Time
	d   time.Duration
}

// expect registers environment key (the task of e) and returns a
// channel closed when its agent first calls the model.
func (r *toolRecorder) expect(key string, e env) <-chan struct{} {
	fix, err := os.ReadFile(e.task.Fix)
	touched := []string{}
	if err == nil {
		touched = touchedFiles(string(fix))
	}
	final := fmt.Sprintf("The tests of %s pass now (environment %s).", e.task.Repo, key)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.scripts[key] = envScript{task: e.task, script: modelstub.EpisodeScript(e.task.Repo, e.task.FixInRootfs, touched, final)}
	ch := make(chan struct{})
	r.ready[key] = ch
	return ch
}

func apiKeyOf(h http.Header) string {
	if k := h.Get("x-api-key"); k != "" {
		return k
	}
	k, _ := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	return k
}

func (r *toolRecorder) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	arrived := time.Now()
	key := apiKeyOf(req.Header)
	envKey, epStr, _ := strings.Cut(strings.TrimSpace(key), "-ep")
	ep, _ := strconv.Atoi(epStr)
	body, err := io.ReadAll(req.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req.Body = io.NopCloser(bytes.NewReader(body))
	var msg struct {
		Tools []struct {
			Name string `json:"name"`
		} `json:"tools"`
		Messages []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	_ = json.Unmarshal(body, &msg)
	main := slices.ContainsFunc(msg.Tools, func(t struct {
		Name string `json:"name"`
	}) bool {
		return t.Name == "Bash"
	})
	toolResult := false
	if n := len(msg.Messages); n > 0 && msg.Messages[n-1].Role == "user" {
		var blocks []struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(msg.Messages[n-1].Content, &blocks) == nil {
			toolResult = slices.ContainsFunc(blocks, func(b struct {
				Type string `json:"type"`
			}) bool {
				return b.Type == "tool_result"
			})
		}
	}

	r.mu.Lock()
	sc, known := r.scripts[envKey]
	if known && ep > r.episodes[envKey] {
		// A new episode of this environment: the one before must have
		// completed its script.
		if prev := ep - 1; prev >= 1 {
			if o, ok := r.stub.Outcome(fmt.Sprintf("%s-ep%d", envKey, prev)); ok {
				if v := o.Verdict(); v != nil {
					r.fails = append(r.fails, fmt.Sprintf("%s episode %d: %v", envKey, prev, v))
				}
			}
		}
		r.episodes[envKey] = ep
		r.stub.Register(key, fmt.Sprintf("%s/%d", sc.task.ID, ep), sc.script)
	}
	if ch, ok := r.ready[envKey]; ok && ch != nil {
		close(ch)
		r.ready[envKey] = nil
	}
	if main && toolResult {
		if end, ok := r.lastEnd[key]; ok {
			r.calls = append(r.calls, toolCall{env: envKey, end: arrived, d: arrived.Sub(end)})
		}
	}
	if r.ua == "" {
		r.ua = req.UserAgent()
	}
	r.mu.Unlock()

	r.stub.ServeHTTP(w, req)
	if main {
		r.mu.Lock()
		r.lastEnd[key] = time.Now()
		r.mu.Unlock()
	}
}

// latencies are the tool calls of sys's environments that ended in
// [from, to), in seconds.
func (r *toolRecorder) latencies(sys string, from, to time.Time) []float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []float64
	for _, c := range r.calls {
		if strings.HasPrefix(c.env, sys+"-") && !c.end.Before(from) && c.end.Before(to) {
			out = append(out, c.d.Seconds())
		}
	}
	return out
}

// waitEpisodes waits until environment key has completed n episodes (its
// episode n+1 called the model, or episode n's script is done).
func (r *toolRecorder) waitEpisodes(ctx context.Context, key string, n int, ended <-chan struct{}) error {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		r.mu.Lock()
		started := r.episodes[key]
		r.mu.Unlock()
		o, _ := r.stub.Outcome(fmt.Sprintf("%s-ep%d", key, n))
		if o.Err != "" {
			return fmt.Errorf("episode %d: %s", n, o.Err)
		}
		if started > n || o.Done {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ended:
			return fmt.Errorf("the environment ended")
		case <-t.C:
		}
	}
}

// failures are sys's failed episodes so far, with the stand-in's reason,
// including any running episode that already failed.
func (r *toolRecorder) failures(sys string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, f := range r.fails {
		if strings.HasPrefix(f, sys+"-") {
			out = append(out, f)
		}
	}
	for envKey, ep := range r.episodes {
		if !strings.HasPrefix(envKey, sys+"-") {
			continue
		}
		if o, ok := r.stub.Outcome(fmt.Sprintf("%s-ep%d", envKey, ep)); ok && o.Err != "" {
			out = append(out, fmt.Sprintf("%s episode %d: %s", envKey, ep, o.Err))
		}
	}
	slices.Sort(out)
	return out
}

// completed counts sys's episodes whose script completed.
func (r *toolRecorder) completed(sys string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for envKey, last := range r.episodes {
		if !strings.HasPrefix(envKey, sys+"-") {
			continue
		}
		for ep := 1; ep <= last; ep++ {
			if o, ok := r.stub.Outcome(fmt.Sprintf("%s-ep%d", envKey, ep)); ok && o.Done && o.Err == "" {
				n++
			}
		}
	}
	return n
}

func (r *toolRecorder) agent() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ua
}

// WriteJSON writes the raw report.
func (rep *DensityReport) WriteJSON(path string) error { return writeJSON(path, rep) }

// clearEgress removes the egress table from the network namespace at
// path, if it has one.
func clearEgress(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("clear egress policy: %w", err)
	}
	defer f.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(f.Fd())))
	if err != nil {
		return fmt.Errorf("clear egress policy of %s: %w", path, err)
	}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("clear egress policy of %s: %w", path, err)
	}
	for _, t := range tables {
		if t.Name == egress.TableName {
			c.DelTable(t)
			if err := c.Flush(); err != nil {
				return fmt.Errorf("clear egress policy of %s: %w", path, err)
			}
		}
	}
	return nil
}
