package headline

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/bench/modelstub"
	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/egress"
	"github.com/envsnap/envsnap/internal/envlet"
)

// Rollout systems: the snapshotter, the runtime and how environments are
// admitted.
const (
	// StatusQuo is what a Kubernetes node runs today: overlayfs, runc, a
	// fixed quota per environment (requests = limits), and only as many
	// environments at once as the node's CPU and memory hold at that
	// request, as the scheduler places them.
	StatusQuo = "status-quo"
	// OverlayfsAll is overlayfs and runc with no quota, every environment
	// started at once.
	OverlayfsAll = "overlayfs-all"
	// Envsnap (the snapshotter with background fill, the envlet shim with
	// its defaults, every environment submitted at once) is the product.
	// The ablations swap one part each.
	EnvsnapRuncFixed = "envsnap-runc-fixed"
	OverlayfsEnvlet  = "overlayfs-envlet"
	// EnvsnapUnordered is envsnap with the envlet shim's start order off
	// (start-order=false): every start shares the CPU equally.
	EnvsnapUnordered = "envsnap-unordered"
)

// RolloutSystems in the order they run by default.
var RolloutSystems = []string{StatusQuo, OverlayfsAll, Envsnap, EnvsnapRuncFixed, OverlayfsEnvlet, EnvsnapUnordered}

type rolloutSystem struct {
	snapshotter string
	envlet      bool // the envlet shim (its quotas, admission and egress); else runc
	fixed       bool // a fixed quota per environment, admitted by request
	unordered   bool // the envlet shim's start order off
}

var rolloutSystems = map[string]rolloutSystem{
	StatusQuo:        {snapshotter: "overlayfs", fixed: true},
	OverlayfsAll:     {snapshotter: "overlayfs"},
	Envsnap:          {snapshotter: "envsnap", envlet: true},
	EnvsnapRuncFixed: {snapshotter: "envsnap", fixed: true},
	OverlayfsEnvlet:  {snapshotter: "overlayfs", envlet: true},
	EnvsnapUnordered: {snapshotter: "envsnap", envlet: true, unordered: true},
}

// RolloutConfig is the rollout scenario: a batch of agent episodes
// submitted at once to one node, gated by the slowest.
type RolloutConfig struct {
	Tasks    string // workload task list
	Rollouts int    // the batch: tasks x samples per task
	// TaskCount distinct tasks (spread over the workload's repositories);
	// rollout i runs task i mod TaskCount. 0 means every task in the list.
	TaskCount int
	// Repo, when set, keeps only the tasks of that repository (the last
	// element of a task's repo path: "uuid").
	Repo    string
	Think   modelstub.Think
	Systems []string // subset of RolloutSystems, run in this order
	RTT     time.Duration
	Rate    int64
	Timeout time.Duration // per rollout, agent and evaluator
	// FixedCPU and FixedMemory are the fixed quota (requests = limits) of
	// the systems that have one.
	FixedCPU    float64
	FixedMemory int64
	NoPrefetch  bool
	Log         io.Writer
	// ModelLog receives the model stand-in's log, one JSON line a turn.
	ModelLog io.Writer
	// Measured, when set, gets the report after each system's batch
	// (the systems so far), so a long run that is stopped keeps what it
	// measured.
	Measured func(*RolloutReport) error
}

func (c *RolloutConfig) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, format+"\n", args...)
	}
}

// RolloutReport is what the rollout scenario measured, every system side
// by side in one run.
type RolloutReport struct {
	Started  time.Time     `json:"started"`
	Duration time.Duration `json:"duration_ns"`
	Command  string        `json:"command"`
	Machine  string        `json:"machine"`
	Link     string        `json:"link"`
	Workload string        `json:"workload"`
	Agent    string        `json:"agent"` // the agent CLI's User-Agent (its release)
	Rollouts int           `json:"rollouts"`
	Tasks    []string      `json:"tasks"`
	Think    string        `json:"think"`
	FixedCPU float64       `json:"fixed_cpu"`
	FixedMem int64         `json:"fixed_memory"`
	Order    []string      `json:"order"`
	// Systems: system -> its iteration.
	Systems map[string]*RolloutIteration `json:"systems"`
	// RewardsIdentical: every rollout got the same reward on every system.
	RewardsIdentical bool     `json:"rewards_identical"`
	Notes            []string `json:"notes"`
}

// RolloutIteration is one system's batch.
type RolloutIteration struct {
	// Slots is how many environments were admitted at once (0: all).
	Slots    int           `json:"slots"`
	Makespan time.Duration `json:"makespan_ns"` // submit to the last rollout's end
	// InitShare is the time from submit to ready (the agent's first
	// request to the model), summed over rollouts, over the summed
	// rollout time (submit to end), as WeEnv reports it.
	InitShare float64 `json:"init_share"`
	// InitShareFloor is the least InitShare the environments' own work
	// before ready allows on the node's cores (initShareFloor); InitCPU
	// that work per environment.
	InitShareFloor float64 `json:"init_share_floor"`
	InitCPU        Summary `json:"init_cpu_s"`
	Ready          Summary `json:"ready_s"`
	Rollout        Summary `json:"rollout_s"`
	// Queue is the time from submit to admission (fixed quotas).
	Queue Summary `json:"queue_s"`
	// Where ready goes, per rollout: Pull from admission to the image on
	// the node, Start from there to the container's first process, Agent
	// from there to the agent's first request (RolloutRun).
	Pull           Summary `json:"pull_s"`
	Start          Summary `json:"start_s"`
	Agent          Summary `json:"agent_start_s"`
	PeakConcurrent int     `json:"peak_concurrent"`
	// NodeMemoryBase and NodeMemoryPeak are the node's used memory
	// (MemTotal - MemAvailable) before the batch and at its peak.
	NodeMemoryBase int64 `json:"node_memory_base"`
	NodeMemoryPeak int64 `json:"node_memory_peak"`
	// EnvMemory is each environment's working set (cgroup usage less
	// inactive file) while the agent waited on the model, the median of
	// its samples, over environments (MiB); EnvMemoryPeak the largest.
	EnvMemory     Summary            `json:"env_memory_mib"`
	EnvMemoryPeak Summary            `json:"env_memory_peak_mib"`
	RegistryBytes int64              `json:"registry_bytes"`
	CPU           map[string]float64 `json:"cpu_s,omitempty"`
	// StartCPU is CPU seconds from the submit until the batch's last
	// ready (StartWindow: the first 2-s sample after it), by who used
	// them: "node" for the whole node, the containers' cgroups ("envs
	// before ready": their starts, "envs after ready": the episodes of
	// those already ready), "shims", the daemons by name, and "other".
	StartCPU    map[string]float64 `json:"start_cpu_s,omitempty"`
	StartWindow time.Duration      `json:"start_window_ns,omitempty"`
	Cores       int                `json:"cores"`
	Failed      int                `json:"failed"`
	// ArbiterGaps counts the times an envlet shim lost the node arbiter
	// during the batch and decided locally (its log line in containerd's
	// log, arbiterGapLine); runc systems have none to lose.
	ArbiterGaps int `json:"arbiter_gaps"`
	// DaemonGC is the envsnap daemon's garbage collection over the batch
	// (systems on the envsnap snapshotter): every stop-the-world pause
	// stops its file-system serving too.
	DaemonGC *GCPauses `json:"daemon_gc,omitempty"`
	// AdmissionRetries counts creates the envlet arbiter refused (node
	// full) and the bench submitted again a second later.
	AdmissionRetries int             `json:"admission_retries"`
	Timeline         []TimelinePoint `json:"timeline"`
	Runs             []RolloutRun    `json:"runs"`
}

// GCPauses is what a process's garbage collector stopped it for, from
// its go_gc_duration_seconds summary: Count and Total over a span, Max
// the longest of its latest pauses (the summary's quantile 1, over the
// runtime's last 256) at the span's end.
type GCPauses struct {
	Count int     `json:"count"`
	Total float64 `json:"total_s"`
	Max   float64 `json:"max_s"`
}

func (p GCPauses) String() string {
	return fmt.Sprintf("%d pauses, %.2f s in all, the longest of the latest %.0f ms", p.Count, p.Total, 1e3*p.Max)
}

// readGCPauses reads the go_gc_duration_seconds summary from metrics
// (Prometheus text format), cumulative since the process started.
func readGCPauses(metricsURL string) (GCPauses, error) {
	resp, err := http.Get(metricsURL)
	if err != nil {
		return GCPauses{}, fmt.Errorf("read the daemon's metrics: %w", err)
	}
	defer resp.Body.Close()
	var p GCPauses
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if !ok || !strings.HasPrefix(name, "go_gc_duration_seconds") {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		switch name {
		case `go_gc_duration_seconds{quantile="1"}`:
			p.Max = v
		case "go_gc_duration_seconds_sum":
			p.Total = v
		case "go_gc_duration_seconds_count":
			p.Count = int(v)
		}
	}
	return p, sc.Err()
}

// TimelinePoint is one sample of the node during a batch.
type TimelinePoint struct {
	T          float64 `json:"t_s"`
	Concurrent int     `json:"concurrent"`
	MemoryMiB  float64 `json:"node_memory_mib"` // above the batch's base
}

// RolloutRun is one rollout. Times are from the batch's submit.
type RolloutRun struct {
	Name     string        `json:"name"`
	Task     string        `json:"task"`
	Sample   string        `json:"sample"`
	Admitted time.Duration `json:"admitted_ns"`
	// Pulled is when the image was on the node (for a lazy snapshotter:
	// its manifest and config, the layers mounted on demand), Started
	// when the container's first process ran (the shell's first command:
	// snapshot, create and start done), Ready the agent's first request;
	// Ready - Started is the agent CLI's own start (its files read, lazily
	// on envsnap).
	Pulled    time.Duration `json:"pulled_ns"`
	Started   time.Duration `json:"started_ns"`
	Ready     time.Duration `json:"ready_ns"`
	End       time.Duration `json:"end_ns"`
	Think     time.Duration `json:"think_ns"` // the model's share
	Turns     int           `json:"turns"`
	Reward    int           `json:"reward"`
	Retries   int           `json:"admission_retries"`
	Container string        `json:"container"`
	// MemoryMiB is the median of the working set samples, PeakMiB the
	// largest; 0 when no sample caught the container running.
	MemoryMiB float64 `json:"memory_mib"`
	PeakMiB   float64 `json:"peak_mib"`
	// InitCPU is the CPU time the environment's cgroup had used when
	// its agent first called the model (read just after, while the agent
	// waits), seconds; 0 when it could not be read.
	InitCPU float64 `json:"init_cpu_s"`
	Error   string  `json:"error,omitempty"`
}

// arbiterGapLine is what an envlet shim logs when its node arbiter
// stops answering (internal/arbiter's client, once per gap).
const arbiterGapLine = "node arbiter unreachable; deciding locally"

// gatewayPort is where the model stand-in listens in its namespace.
const gatewayPort = 8080

// MeasureRollout runs the rollout scenario on every system of cfg.
func MeasureRollout(ctx context.Context, cfg RolloutConfig) (_ *RolloutReport, retErr error) {
	// One network namespace per rollout and one for the model, on one
	// bridge (netshape.NewBridge holds 60).
	if cfg.Rollouts < 1 || cfg.Rollouts > 59 {
		return nil, fmt.Errorf("rollout scenario: %d rollouts, want 1 to 59", cfg.Rollouts)
	}
	for _, s := range cfg.Systems {
		if _, ok := rolloutSystems[s]; !ok {
			return nil, fmt.Errorf("rollout scenario: unknown system %q (want some of %s)", s, strings.Join(RolloutSystems, ", "))
		}
	}
	if len(cfg.Systems) == 0 {
		cfg.Systems = RolloutSystems
	}
	w, err := episode.LoadWorkload(cfg.Tasks)
	if err != nil {
		return nil, err
	}
	all := w.Tasks
	if cfg.Repo != "" {
		all = slices.DeleteFunc(slices.Clone(all), func(t episode.Task) bool { return path.Base(t.Repo) != cfg.Repo })
		if len(all) == 0 {
			return nil, fmt.Errorf("rollout scenario: no task of repository %q in %s", cfg.Repo, cfg.Tasks)
		}
	}
	tasks := spreadTasks(all, cfg.TaskCount, cfg.Rollouts)
	rep := &RolloutReport{Started: time.Now(), Machine: machine(), Workload: reportPath(cfg.Tasks), Rollouts: cfg.Rollouts,
		Think: describeThink(cfg.Think), FixedCPU: cfg.FixedCPU, FixedMem: cfg.FixedMemory, Order: cfg.Systems, Systems: map[string]*RolloutIteration{}}
	for _, t := range tasks {
		rep.Tasks = append(rep.Tasks, t.ID)
	}

	denv, link, metricsAddr, closeNode, err := startNode(ctx, cfg.Rate, cfg.RTT)
	if err != nil {
		return nil, err
	}
	defer closeNode()
	rep.Link = link
	b := &bench{cfg: Config{Timeout: cfg.Timeout, Log: cfg.Log}, env: denv, metrics: "http://" + metricsAddr + "/metrics"}

	// The model's network: the stand-in in a namespace of its own (node 0
	// of a bridge), each rollout in another, as a node's pods reach a
	// model gateway; never the host's network.
	br, err := netshape.NewBridge(ctx, fmt.Sprintf("%sro-%d", netshape.NamePrefix, os.Getpid()), cfg.Rollouts+1)
	if err != nil {
		return nil, fmt.Errorf("rollout namespaces: %w", err)
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
	initCPU := &initCPURecorder{env: denv, cpu: map[string]map[string]float64{}}
	stub.OnFirstRequest = initCPU.record
	ln, err := br.Nodes[0].Listen(ctx, gatewayPort)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: stub, ReadHeaderTimeout: time.Minute}
	go srv.Serve(ln)
	defer srv.Close()
	gw := net.JoinHostPort(br.Nodes[0].Addr.String(), strconv.Itoa(gatewayPort))
	allow := fmt.Sprintf("%s:%d/tcp", br.Nodes[0].Addr, gatewayPort)
	rep.Link += fmt.Sprintf("; the model stand-in at %s in its own network namespace, each rollout in another on bridge %s, egress allow-list %q", gw, br.Prefix, allow)

	cfg.logf("publishing groups through the shaped link")
	pub, err := episode.PublishGroups(ctx, denv.Hosts(), denv.Registry.Host, &episode.Workload{Tasks: tasks})
	if err != nil {
		return nil, err
	}
	cfg.logf("published %d groups in %s", len(pub.Refs), pub.Duration.Round(time.Second))
	if !cfg.NoPrefetch {
		cfg.logf("recording footprints with one episode of %s and attaching them to the shared groups", tasks[0].ID)
		note, err := b.recordPrefetch(ctx, pub, tasks[0])
		if err != nil {
			return nil, fmt.Errorf("record prefetch lists: %w", err)
		}
		rep.Notes = append(rep.Notes, note)
	}
	// One image per task: the samples of a task share it, as GRPO's do.
	envs, err := composeEnvs(ctx, denv.Hosts(), denv.Registry.Host, pub, tasks, len(tasks))
	if err != nil {
		return nil, err
	}

	memTotal, err := meminfo("MemTotal")
	if err != nil {
		return nil, err
	}
	rb := &rolloutBench{bench: b, cfg: cfg, stub: stub, gateway: gw, allow: allow, nodes: br.Nodes[1:], envs: envs, memTotal: memTotal, initCPU: initCPU}
	for _, sys := range cfg.Systems {
		cfg.logf("%-18s %d rollouts from an empty node", sys, cfg.Rollouts)
		it, err := rb.iteration(ctx, sys)
		if err != nil {
			return nil, fmt.Errorf("rollouts on %s: %w", sys, err)
		}
		rep.Systems[sys] = it
		cfg.logf("%-18s makespan %.1fs, init share %.1f%%, ready p50 %.1fs p95 %.1fs, rollout p50 %.1fs p95 %.1fs max %.1fs, peak %d envs, node memory +%s, env memory p50 %.0f MiB, registry %s, %d failed",
			sys, it.Makespan.Seconds(), 100*it.InitShare, it.Ready.Median, it.Ready.P95, it.Rollout.Median, it.Rollout.P95, it.Rollout.Max,
			it.PeakConcurrent, mib(it.NodeMemoryPeak-it.NodeMemoryBase), it.EnvMemory.Median, mib(it.RegistryBytes), it.Failed)
		if len(it.StartCPU) > 0 {
			cfg.logf("%-18s until the last ready: %s", sys, shareLine(it.StartCPU, it.StartWindow))
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		rep.Agent = rb.agent
		rep.RewardsIdentical = rewardsIdentical(rep)
		rep.Duration = time.Since(rep.Started)
		if cfg.Measured != nil {
			if err := cfg.Measured(rep); err != nil {
				return nil, err
			}
		}
	}
	return rep, nil
}

// spreadTasks picks n tasks (all when n is 0, at most max) spread evenly
// over the list, which build.sh writes grouped by repository.
func spreadTasks(all []episode.Task, n, limit int) []episode.Task {
	if n <= 0 || n > len(all) {
		n = len(all)
	}
	n = min(n, limit)
	out := make([]episode.Task, n)
	for i := range n {
		out[i] = all[i*len(all)/n]
	}
	return out
}

func describeThink(t modelstub.Think) string {
	if t.Fixed || t.P95 <= t.Median {
		return fmt.Sprintf("fixed %s", t.Median)
	}
	return fmt.Sprintf("lognormal, median %s, p95 %s (capped at %s), seed %d", t.Median, t.P95, t.Max, t.Seed)
}

// admitInOrder admits n waiters, at most cap(slots) at a time, in the
// order of their index: waiter i may start once admitted[i] is closed and
// gives its slot back with <-slots. A scheduler binds pending pods of one
// priority oldest first, so a freed slot goes to the earliest submitted
// rollout still waiting; goroutines blocked on the channel itself would
// take it in whatever order they happened to block, which moved the
// status quo's makespan by a tenth from run to run.
func admitInOrder(ctx context.Context, n int, slots chan struct{}) []chan struct{} {
	admitted := make([]chan struct{}, n)
	for i := range admitted {
		admitted[i] = make(chan struct{})
	}
	go func() {
		for i := range n {
			select {
			case slots <- struct{}{}:
				close(admitted[i])
			case <-ctx.Done():
				return
			}
		}
	}()
	return admitted
}

// RequestSlots is how many environments a scheduler placing them by
// request admits at once: the node's CPU and memory divided by one
// environment's request, the smaller.
func RequestSlots(nodeCPU float64, nodeMemory int64, cpu float64, memory int64) int {
	if cpu <= 0 || memory <= 0 {
		return 0
	}
	return max(1, min(int(math.Floor(nodeCPU/cpu+1e-9)), int(nodeMemory/memory)))
}

type rolloutBench struct {
	*bench
	cfg      RolloutConfig
	stub     *modelstub.Server
	gateway  string
	allow    string
	nodes    []netshape.BridgeNode
	envs     []env
	memTotal int64
	initCPU  *initCPURecorder
	// agent is the User-Agent the agent CLI sent the model.
	agentOnce sync.Once
	agent     string
}

// iteration runs the batch on sys from an empty node.
func (rb *rolloutBench) iteration(ctx context.Context, sys string) (*RolloutIteration, error) {
	spec := rolloutSystems[sys]
	// The envsnap daemon runs (and is emptied) for every system: a
	// background fill left from an earlier system must not run beside
	// this one.
	if err := rb.useSystem(Envsnap); err != nil {
		return nil, err
	}
	if err := rb.reset(); err != nil {
		return nil, err
	}
	if !spec.envlet {
		// runc has no egress policy of its own: install the same one the
		// shim would, as a network plugin's policy would on a node.
		for _, n := range rb.nodes {
			if err := applyEgress(ctx, n.Path(), rb.allow); err != nil {
				return nil, err
			}
		}
	}
	it := &RolloutIteration{Cores: runtime.NumCPU()}
	n := rb.cfg.Rollouts
	var slots chan struct{}
	if spec.fixed {
		it.Slots = RequestSlots(float64(it.Cores), rb.memTotal, rb.cfg.FixedCPU, rb.cfg.FixedMemory)
		slots = make(chan struct{}, it.Slots)
	}
	rb.env.Registry.ResetCounters()
	var err error
	if it.NodeMemoryBase, err = nodeMemoryUsed(); err != nil {
		return nil, err
	}
	lazy := spec.snapshotter == rolloutSystems[Envsnap].snapshotter
	var gcFrom GCPauses
	if lazy {
		if gcFrom, err = readGCPauses(rb.metrics); err != nil {
			return nil, err
		}
	}
	var running gauge
	smp := newSampler(rb.bench, &running, it.NodeMemoryBase)
	sctx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() { defer close(sampled); smp.run(sctx, 2*time.Second) }()

	it.Runs = make([]RolloutRun, n)
	logFrom := rb.env.Containerd.LogSize()
	start, cpu := time.Now(), rb.sampleCPU()
	var wg sync.WaitGroup
	var admitted []chan struct{}
	if slots != nil {
		admitted = admitInOrder(ctx, n, slots)
	}
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if slots != nil {
				select {
				case <-admitted[i]:
					defer func() { <-slots }()
				case <-ctx.Done():
					it.Runs[i] = RolloutRun{Name: fmt.Sprintf("%s-%02d", sys, i), Error: ctx.Err().Error()}
					return
				}
			}
			it.Runs[i] = rb.rollout(ctx, sys, spec, i, start, &running)
			r := it.Runs[i]
			rb.cfg.logf("%-18s %2d/%d %-28s ready %6.1fs end %6.1fs reward %d turns %d %s", sys, i+1, n, r.Sample, r.Ready.Seconds(), r.End.Seconds(), r.Reward, r.Turns, r.Error)
		}()
	}
	wg.Wait()
	it.Makespan = time.Since(start)
	it.CPU = rb.sampleCPU().since(cpu)
	stopSampling()
	<-sampled
	it.RegistryBytes = rb.env.Registry.BlobBytesServed()
	if lazy {
		gc, err := readGCPauses(rb.metrics)
		if err != nil {
			return nil, err
		}
		it.DaemonGC = &GCPauses{Count: gc.Count - gcFrom.Count, Total: gc.Total - gcFrom.Total, Max: gc.Max}
	}
	if spec.envlet {
		if it.ArbiterGaps, err = rb.env.Containerd.CountLogLines(logFrom, arbiterGapLine); err != nil {
			return nil, fmt.Errorf("count arbiter gaps: %w", err)
		}
	}
	it.Timeline, _, it.NodeMemoryPeak = smp.timeline(start)
	it.PeakConcurrent = int(running.peak.Load())
	it.NodeMemoryPeak += it.NodeMemoryBase
	var ready, total, queue, pull, startup, agent, envMem, envPeak, initCPU []float64
	var readySum, totalSum float64
	for i := range it.Runs {
		r := &it.Runs[i]
		r.MemoryMiB, r.PeakMiB = smp.memory(r.Container)
		it.AdmissionRetries += r.Retries
		if r.Error != "" {
			it.Failed++
			continue
		}
		ready, total, queue = append(ready, r.Ready.Seconds()), append(total, r.End.Seconds()), append(queue, r.Admitted.Seconds())
		readySum, totalSum = readySum+r.Ready.Seconds(), totalSum+r.End.Seconds()
		initCPU = append(initCPU, r.InitCPU)
		if r.Started > 0 {
			pull = append(pull, (r.Pulled - r.Admitted).Seconds())
			startup = append(startup, (r.Started - r.Pulled).Seconds())
			agent = append(agent, (r.Ready - r.Started).Seconds())
		}
		if r.MemoryMiB > 0 {
			envMem, envPeak = append(envMem, r.MemoryMiB), append(envPeak, r.PeakMiB)
		}
	}
	it.Ready, it.Rollout, it.Queue = summarize(ready), summarize(total), summarize(queue)
	it.Pull, it.Start, it.Agent = summarize(pull), summarize(startup), summarize(agent)
	it.EnvMemory, it.EnvMemoryPeak = summarize(envMem), summarize(envPeak)
	if totalSum > 0 {
		it.InitShare = readySum / totalSum
	}
	it.InitCPU = summarize(initCPU)
	it.InitShareFloor = initShareFloor(it.Runs, it.Cores)
	if it.Ready.N > 0 {
		var starts float64
		for _, r := range it.Runs {
			starts += r.InitCPU
		}
		it.StartCPU, it.StartWindow = smp.startCPU(start, time.Duration(it.Ready.Max*float64(time.Second)), starts)
	}
	return it, nil
}

// initShareFloor is the least init share (InitShare) the environments'
// own work before ready allows on cores, with the batch's times after
// ready as measured: each environment needs its InitCPU before it is
// ready, and no schedule of that work on the cores gives a smaller sum
// of ready times than running it shortest first at the speed of every
// core together (environment k ready when the k shortest are done).
// Failed rollouts are left out; 0 when nothing was measured.
func initShareFloor(runs []RolloutRun, cores int) float64 {
	if cores <= 0 {
		return 0
	}
	var work []float64
	after := 0.0
	for _, r := range runs {
		if r.Error != "" {
			continue
		}
		work = append(work, r.InitCPU)
		after += (r.End - r.Ready).Seconds()
	}
	slices.Sort(work)
	done, readySum := 0.0, 0.0
	for _, c := range work {
		done += c / float64(cores)
		readySum += done
	}
	if readySum+after <= 0 {
		return 0
	}
	return readySum / (readySum + after)
}

// initCPURecorder holds, by rollout key, every container's CPU time read
// at the rollout's first model request (modelstub.Server.OnFirstRequest).
type initCPURecorder struct {
	env *devenv.Env
	mu  sync.Mutex
	cpu map[string]map[string]float64
}

func (rec *initCPURecorder) record(key string) {
	cpu := map[string]float64{}
	for id, st := range containerStats(rec.env) {
		cpu[id] = st.cpu
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	rec.cpu[key] = cpu
}

// of is container's CPU time read at rollout key's first request.
func (rec *initCPURecorder) of(key, container string) float64 {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.cpu[key][container]
}

// agentEnv is what the agent CLI needs to run offline against the model
// stand-in in print mode (docs/benchmarks.md, "The rollout").
func agentEnv(gateway, key string) []string {
	return []string{"ANTHROPIC_BASE_URL=http://" + gateway, "ANTHROPIC_API_KEY=" + key, "IS_SANDBOX=1",
		"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1", "DISABLE_AUTOUPDATER=1", "DISABLE_TELEMETRY=1", "DISABLE_ERROR_REPORTING=1"}
}

// agentExitMarker follows the agent's output; the evaluator's comes after.
const agentExitMarker = "agent-exit="

// startedMarker is the first line a rollout prints: the wall clock (the
// host's: a container shares its clock) when its shell ran.
const startedMarker = "started-at="

// rolloutScript runs the agent on the task, then the evaluator.
func rolloutScript(t episode.Task) string {
	prompt := fmt.Sprintf("The tests of the Go repository in %s fail. Find the bug and fix it.", t.Repo)
	return fmt.Sprintf("echo %s$(date +%%s.%%N); cd %s && agent -p '%s' --output-format json --dangerously-skip-permissions --max-turns 40 </dev/null; echo %s$?; /opt/evaluator/run.sh %s",
		startedMarker, t.Repo, prompt, agentExitMarker, t.Repo)
}

// rollout runs rollout i of the batch: pull, the agent episode against the
// model stand-in, the evaluator.
func (rb *rolloutBench) rollout(ctx context.Context, sys string, spec rolloutSystem, i int, start time.Time, running *gauge) RolloutRun {
	e := rb.envs[i%len(rb.envs)]
	key := fmt.Sprintf("%s-%02d", sys, i)
	r := RolloutRun{Name: key, Task: e.task.ID, Sample: fmt.Sprintf("%s/%d", e.task.ID, i/len(rb.envs)), Admitted: time.Since(start)}
	fix, err := os.ReadFile(e.task.Fix)
	if err != nil {
		r.Error = fmt.Sprintf("read the task's fix: %v", err)
		return r
	}
	final := fmt.Sprintf("The tests of %s pass now (rollout %s).", e.task.Repo, key)
	rb.stub.Register(key, r.Sample, modelstub.EpisodeScript(e.task.Repo, e.task.FixInRootfs, touchedFiles(string(fix)), final))

	running.add(1)
	defer running.add(-1)
	img, err := rb.env.Pull(ctx, e.ref, spec.snapshotter)
	if err != nil {
		r.End, r.Error = time.Since(start), err.Error()
		return r
	}
	r.Pulled = time.Since(start)
	opts := devenv.RunOptions{
		Snapshotter: spec.snapshotter,
		Runtime:     "io.containerd.runc.v2",
		Args:        []string{"/bin/sh", "-c", rolloutScript(e.task)},
		Env:         agentEnv(rb.gateway, key),
		Timeout:     rb.cfg.Timeout,
		SpecOpts:    []oci.SpecOpts{oci.WithLinuxNamespace(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: rb.nodes[i].Path()})},
	}
	if spec.envlet {
		opts.Runtime = "io.containerd.envlet.v2"
		opts.Annotations = map[string]string{egress.Annotation: rb.allow}
		if spec.unordered {
			opts.Annotations[envlet.AnnotationPrefix+"start-order"] = "false"
		}
	}
	if spec.fixed {
		opts.SpecOpts = append(opts.SpecOpts, oci.WithCPUCFS(int64(rb.cfg.FixedCPU*100000), 100000), oci.WithMemoryLimit(uint64(rb.cfg.FixedMemory)))
	}
	// The envlet arbiter refuses an environment the node cannot take
	// now; a scheduler would place it again later.
	out, refused, err := rb.env.RunAdmitted(ctx, img, opts, rb.cfg.Timeout-time.Since(start))
	r.Retries = refused
	r.End, r.Container = time.Since(start), out.ID
	r.InitCPU = rb.initCPU.of(key, out.ID)
	o, _ := rb.stub.Outcome(key)
	if !o.FirstRequest.IsZero() {
		r.Ready = o.FirstRequest.Sub(start)
	}
	r.Turns, r.Think = o.Requests, o.Think
	if at, ok := startedAt(out.Stdout); ok {
		r.Started = at.Sub(start)
	}
	if err != nil {
		r.Error = err.Error()
		return r
	}
	if o.UserAgent != "" {
		rb.agentOnce.Do(func() { rb.agent = o.UserAgent })
	}
	reward, ok := episode.ParseReward(out.Stdout)
	r.Reward = reward
	switch verdict := o.Verdict(); {
	case verdict != nil:
		r.Error = "model: " + verdict.Error()
	case agentAnswer(out.Stdout) != final:
		r.Error = fmt.Sprintf("the agent did not print the model's final answer (printed %q); %s", agentAnswer(out.Stdout), episode.LastLines(out.Stdout+out.Stderr, 5))
	case !ok:
		r.Error = "the evaluator printed no reward: " + episode.LastLines(out.Stdout+out.Stderr, 5)
	case reward != 1:
		r.Error = fmt.Sprintf("reward %d after a completed episode; the evaluator's last lines: %s", reward, episode.LastLines(out.Stdout+out.Stderr, 8))
	case r.Ready == 0:
		r.Error = "never ready"
	case r.Started == 0:
		r.Error = "the rollout did not print when it started: " + episode.LastLines(out.Stdout+out.Stderr, 5)
	}
	return r
}

// startedAt is the time the rollout's shell printed after startedMarker.
func startedAt(stdout string) (time.Time, bool) {
	for _, line := range strings.Split(stdout, "\n") {
		v, ok := strings.CutPrefix(line, startedMarker)
		if !ok {
			continue
		}
		sec, frac, _ := strings.Cut(strings.TrimSpace(v), ".")
		s, err := strconv.ParseInt(sec, 10, 64)
		if err != nil {
			return time.Time{}, false
		}
		var ns int64
		if frac != "" {
			frac = (frac + "000000000")[:9]
			if ns, err = strconv.ParseInt(frac, 10, 64); err != nil {
				return time.Time{}, false
			}
		}
		return time.Unix(s, ns), true
	}
	return time.Time{}, false
}

// touchedFiles lists the files a diff changes ("+++ b/PATH"; a reversed
// diff names them "+++ a/PATH").
func touchedFiles(diff string) []string {
	var out []string
	for _, line := range strings.Split(diff, "\n") {
		p, ok := strings.CutPrefix(line, "+++ ")
		if !ok || p == "/dev/null" {
			continue
		}
		if _, rest, ok := strings.Cut(p, "/"); ok {
			p = rest
		}
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

// agentAnswer is the result the agent CLI printed (--output-format
// json: one object whose "result" is the final answer's text).
func agentAnswer(stdout string) string {
	for _, line := range strings.Split(stdout, "\n") {
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var res struct {
			Type   string `json:"type"`
			Result string `json:"result"`
		}
		if json.Unmarshal([]byte(line), &res) == nil && res.Type == "result" {
			return res.Result
		}
	}
	return ""
}

// applyEgress installs the egress policy allowing only allow in the
// network namespace at path, as the envlet shim does for its containers.
func applyEgress(ctx context.Context, path, allow string) error {
	p, _, err := egress.Node{}.Policy(ctx, map[string]string{egress.Annotation: allow}, egress.LookupIP, egress.NodeAddresses)
	if err != nil {
		return fmt.Errorf("egress policy for %s: %w", path, err)
	}
	rules, err := p.Rules()
	if err != nil {
		return fmt.Errorf("egress policy for %s: %w", path, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("egress policy: %w", err)
	}
	defer f.Close()
	if err := egress.Apply(int(f.Fd()), rules); err != nil {
		return fmt.Errorf("egress policy for %s: %w", path, err)
	}
	return nil
}

// rewardsIdentical says whether every rollout got the same reward on
// every system (rollout i is the same task and sample everywhere).
func rewardsIdentical(rep *RolloutReport) bool {
	var ref []int
	for _, sys := range rep.Order {
		it := rep.Systems[sys]
		if it == nil {
			continue
		}
		var got []int
		for _, r := range it.Runs {
			reward := r.Reward
			if r.Error != "" {
				reward = -1
			}
			got = append(got, reward)
		}
		if ref == nil {
			ref = got
		} else if !slices.Equal(ref, got) {
			return false
		}
	}
	return ref != nil
}

// meminfo reads one field of /proc/meminfo, in bytes.
func meminfo(field string) (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				break
			}
			kb, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/meminfo %s: %w", field, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("/proc/meminfo has no %s", field)
}

// nodeMemoryUsed is the memory the node cannot hand out without
// reclaiming (MemTotal - MemAvailable).
func nodeMemoryUsed() (int64, error) {
	total, avail, err := envlet.ReadMeminfo()
	if err != nil {
		return 0, err
	}
	return total - avail, nil
}

// WriteJSON writes the raw report.
func (rep *RolloutReport) WriteJSON(path string) error { return writeJSON(path, rep) }

// Ratio of a to b, 0 when b is 0.
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// Comparison is the sentence that states the result: envsnap against
// the status quo and against overlayfs with everything at once.
// Floor is a lower bound on any system's makespan for this batch on
// this node: the environments' own CPU work (the least any system's
// batch needed, workSeconds) spread over every core, or the longest
// rollout's model think time, whichever is longer. A makespan ratio
// below Floor over the other system's makespan is below what the node
// allows, whatever the runtime costs. why says which bound it is.
func (rep *RolloutReport) Floor() (seconds float64, why string) {
	work, from, cores := 0.0, "", 0
	for _, sys := range rep.Order {
		it := rep.Systems[sys]
		if it == nil || it.Failed > 0 || it.Cores <= 0 {
			continue
		}
		if w := workSeconds(it.CPU); w > 0 && (from == "" || w < work) {
			work, from, cores = w, sys, it.Cores
		}
	}
	think := 0.0
	for _, it := range rep.Systems {
		for _, r := range it.Runs {
			think = max(think, r.Think.Seconds())
		}
	}
	if from != "" && work/float64(cores) >= think {
		return work / float64(cores), fmt.Sprintf("the environments' own work, %.0f CPU-s on %s, over %d cores", work, from, cores)
	}
	if think > 0 {
		return think, "the longest rollout's model think time"
	}
	return 0, ""
}

// ThinkFloor is the least makespan the model's think time alone allows
// system sys's batch, whatever the runtime: its longest rollout's think
// time and, with Slots environments admitted at a time, the batch's
// whole think time spread over the slots (every rollout holds a slot at
// least while it waits on the model).
func (rep *RolloutReport) ThinkFloor(sys string) float64 {
	it := rep.Systems[sys]
	if it == nil {
		return 0
	}
	var longest, total time.Duration
	for _, r := range it.Runs {
		longest, total = max(longest, r.Think), total+r.Think
	}
	floor := longest.Seconds()
	if it.Slots > 0 {
		floor = max(floor, total.Seconds()/float64(it.Slots))
	}
	return floor
}

func (rep *RolloutReport) Comparison() string {
	e, sq, all := rep.Systems[Envsnap], rep.Systems[StatusQuo], rep.Systems[OverlayfsAll]
	if e == nil {
		return "no envsnap batch measured"
	}
	if e.Failed == len(e.Runs) {
		// A batch whose every rollout failed has a makespan (its
		// timeouts) and no ready time: no ratio to state.
		return fmt.Sprintf("%d rollouts, envsnap: every rollout FAILED (see the reasons), no comparison", rep.Rollouts)
	}
	var parts []string
	if sq != nil {
		parts = append(parts, fmt.Sprintf("makespan %.2fx the status quo (%.0f s vs %.0f s)", ratio(e.Makespan.Seconds(), sq.Makespan.Seconds()), e.Makespan.Seconds(), sq.Makespan.Seconds()))
	}
	if all != nil {
		parts = append(parts, fmt.Sprintf("%.2fx overlayfs with everything at once (%.0f s)", ratio(e.Makespan.Seconds(), all.Makespan.Seconds()), all.Makespan.Seconds()))
	}
	if f, why := rep.Floor(); f > 0 {
		floor := fmt.Sprintf("floor on this node %.0f s (%s)", f, why)
		if sq != nil {
			floor += fmt.Sprintf(": %.2fx the status quo", ratio(f, sq.Makespan.Seconds()))
		}
		if all != nil {
			floor += fmt.Sprintf(", %.2fx overlayfs everything at once", ratio(f, all.Makespan.Seconds()))
		}
		parts = append(parts, floor)
	}
	init := fmt.Sprintf("environment initialisation %.1f%% of rollout time", 100*e.InitShare)
	if e.InitShareFloor > 0 {
		init += fmt.Sprintf(" (floor on this node %.1f%%: its environments' own CPU before ready, %.1f CPU-s median, run shortest first on %d cores)", 100*e.InitShareFloor, e.InitCPU.Median, e.Cores)
	}
	parts = append(parts, init)
	if sq != nil {
		parts = append(parts, fmt.Sprintf("%.1fx the peak concurrent environments of the status quo (%d vs %d)", ratio(float64(e.PeakConcurrent), float64(sq.PeakConcurrent)), e.PeakConcurrent, sq.PeakConcurrent))
	}
	failed := 0
	for _, it := range rep.Systems {
		failed += it.Failed
	}
	rewards := "rewards identical on every system"
	switch {
	case len(rep.Systems) < 2:
		rewards = "rewards of one system only"
	case !rep.RewardsIdentical:
		rewards = "rewards DIFFER between systems"
	}
	return fmt.Sprintf("%d rollouts, envsnap: %s; %d failed, %s", rep.Rollouts, strings.Join(parts, ", "), failed, rewards)
}
