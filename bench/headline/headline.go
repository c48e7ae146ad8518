// Package headline is `make bench`'s main measurement: agentic-RL
// environments started from composed layer groups through a registry link
// shaped like a datacenter uplink (1 Gbit/s, 20 ms round trip), on envsnap
// and on the usual full pull with overlayfs, cold and warm, one at a time
// and several at once, all in one run on one machine and one registry.
package headline

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes/docker"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/plan"
)

// Config is what one benchmark run measures.
type Config struct {
	Tasks      string // workload task list
	Envs       int    // environments per system and phase (envsnap, overlayfs)
	AuxEnvs    int    // the same for envsnap-nofill and envsnap-eager
	Concurrent int    // environments started at once
	// IterationEnvs environments (distinct tasks, shared groups) run
	// IterationConcurrent at a time from an empty node: one RL
	// iteration (runIteration). Zero skips the scenario.
	IterationEnvs       int
	IterationConcurrent int
	// IterationRounds runs the iteration scenario this many times per
	// system, the systems' order alternating from round to round: on a
	// shared VM the machine's speed drifts by about 10% between runs of
	// the same system, as much as the systems differ, so the headline is
	// the median of the rounds' ratios. Zero means one round.
	IterationRounds int
	RTT             time.Duration // registry round trip added by the proxy
	Rate            int64         // registry link rate, bits/s
	Systems         []string      // subset of AllSystems
	Timeout         time.Duration // per episode
	// NoPrefetch skips recording footprints and attaching them to the
	// shared groups before the runs (recordPrefetch).
	NoPrefetch bool
	// SettleWarm makes an envsnap warm run wait until the node holds its
	// layers fully (every chunk cached, and the native copies built when
	// the daemon makes them), as overlayfs's warm node holds the
	// unpacked image: the steady state of later environments of an
	// iteration rather than the one right after a cold start.
	SettleWarm bool
	// SecondAfter: for envsnap and overlayfs, pairs of environments
	// start on a cold node, the second SecondAfter after the first,
	// while the first runs (runSecond): the second, third, ...
	// environment of an RL iteration arrives while the first still runs,
	// on the groups the first is still fetching. Zero skips the pairs.
	SecondAfter time.Duration
	// NoSingle skips the cold and warm runs one at a time (the pairs,
	// the concurrent runs and the iteration still run): a run measuring
	// only the second-environment pairs.
	NoSingle bool
	// Checkpoint, when set, is given the report so far once the
	// iteration scenario is done: a run cut short afterwards still
	// leaves its headline.
	Checkpoint func(*Report) error
	Log        io.Writer
}

// System names.
const (
	Envsnap       = "envsnap"        // lazy, background fill on
	EnvsnapNoFill = "envsnap-nofill" // lazy, nothing fetched but what is read
	EnvsnapEager  = "envsnap-eager"  // on-demand off: whole layers fetched before the mount is used
	// EnvsnapNice0: envsnap with its file-system requests served at
	// the default priority (--serve-nice=0), the ablation of
	// serve_nice. Not in AllSystems: asked for by name.
	EnvsnapNice0 = "envsnap-nice0"
	// EnvsnapDurable: envsnap with containers' writable layers mounted
	// without overlayfs' volatile option (--writable-volatile=false),
	// the ablation of writable_volatile. Not in AllSystems either.
	EnvsnapDurable = "envsnap-durable"
	Overlayfs      = "overlayfs" // containerd's default: full pull and unpack
)

// AllSystems in the order they run.
var AllSystems = []string{Envsnap, Overlayfs, EnvsnapNoFill, EnvsnapEager}

// daemonArgs are the envsnap daemon flags for each envsnap system.
var daemonArgs = map[string][]string{
	Envsnap:        {"--fill=true"},
	EnvsnapNoFill:  {"--fill=false"},
	EnvsnapEager:   {"--eager"},
	EnvsnapNice0:   {"--fill=true", "--serve-nice=0"},
	EnvsnapDurable: {"--fill=true", "--writable-volatile=false"},
}

// Run is one measured environment.
type Run struct {
	episode.Result
	Concurrent bool             `json:"concurrent"`
	GroupBytes map[string]int64 `json:"group_bytes"` // registry bytes per group kind
	ReadBytes  int64            `json:"read_bytes"`  // file bytes the episode read through FUSE
}

// Report is everything a run produced.
type Report struct {
	Started   time.Time                     `json:"started"`
	Duration  time.Duration                 `json:"duration_ns"`
	Machine   string                        `json:"machine"`
	Link      string                        `json:"link"`
	Workload  string                        `json:"workload"`
	Images    map[string]int64              `json:"image_bytes"` // env -> image size
	GroupSize map[string]int64              `json:"group_bytes"` // kind -> layer bytes (one env)
	Runs      []Run                         `json:"runs"`
	Summary   map[string]map[string]Summary `json:"summary"` // system/phase -> measure -> summary
	// Iterations: system -> the iteration scenario's outcome, one per
	// round (Config.IterationRounds), in round order.
	Iterations map[string][]Iteration `json:"iterations,omitempty"`
	Headline   Headline               `json:"headline"`
	// Command is how the run was started (the report says what ran).
	Command string `json:"command"`
	// SettleWarm: envsnap warm runs waited for their layers to be fully
	// present (Config.SettleWarm); Settle is how long they waited.
	SettleWarm bool `json:"settle_warm"`
	// SecondAfter: the delay between the pairs' starts (Config.SecondAfter), seconds.
	SecondAfter float64 `json:"second_after_s,omitempty"`
	Settle      Summary `json:"settle_s"`
	// Agent is what `agent --version` printed in the environments: the
	// agent CLI release the workload was built with.
	Agent string   `json:"agent"`
	Notes []string `json:"notes"`
}

// Iteration is one system's run of the iteration scenario: an empty node,
// then Envs environments, Concurrent at a time.
type Iteration struct {
	Envs          int           `json:"envs"`
	Concurrent    int           `json:"concurrent"`
	Makespan      time.Duration `json:"makespan_ns"` // first pull to last episode's end
	Episode       Summary       `json:"episode_s"`   // per environment, pull to evaluator
	Ready         Summary       `json:"ready_s"`
	RegistryBytes int64         `json:"registry_bytes"` // every blob byte of the iteration
	Failed        int           `json:"failed"`
	// CPU is the CPU seconds used during the iteration: "node" for the
	// whole node, then the bench's daemons by name (sampleCPU).
	CPU map[string]float64 `json:"cpu_s,omitempty"`
	// Cores is how many CPUs the node had (the Go runtime's count).
	Cores int `json:"cores,omitempty"`
}

// rigProcesses are the processes whose CPU is the environment tax or the
// rig's, not the environments' work: the snapshot daemons (containerd
// pulls and unpacks for overlayfs), envlet's node arbiter, the registry,
// and the bench process (the registry's link proxy and the episode
// clients).
var rigProcesses = []string{"arbiter", "bench", "containerd", "envsnap", "registry"}

// workSeconds is the CPU time of the environments' own work: the node's
// busy time less rigProcesses. What the kernel's writeback threads spent
// on the bytes the snapshotters wrote stays in it. 0 when the iteration
// has no CPU record.
func (it Iteration) workSeconds() float64 { return workSeconds(it.CPU) }

// workSeconds is the node's busy CPU seconds in cpu less those of
// rigProcesses (cpuLine's map: "node" and each process); 0 without
// the node's.
func workSeconds(cpu map[string]float64) float64 {
	node, ok := cpu["node"]
	if !ok {
		return 0
	}
	for _, p := range rigProcesses {
		node -= cpu[p]
	}
	return node
}

// floor is the fraction of the makespan the environments' own work kept
// every core busy for: a snapshotter costing no CPU at all could not
// finish the same iteration on this node in less (while the node is
// CPU-bound). 0 when unknown.
func (it Iteration) floor() float64 {
	w := it.workSeconds()
	if w <= 0 || it.Cores <= 0 || it.Makespan <= 0 {
		return 0
	}
	return w / float64(it.Cores) / it.Makespan.Seconds()
}

// Headline ratios (median, cold).
type Headline struct {
	// IterationRatio: envsnap makespan / overlayfs makespan of the
	// iteration scenario, the median over the rounds of each round's
	// ratio (IterationRatios).
	IterationRatio  float64   `json:"iteration_ratio,omitempty"`
	IterationRatios []float64 `json:"iteration_ratios,omitempty"`
	// IterationBytesRatio: envsnap registry bytes / overlayfs registry
	// bytes over the iteration scenario.
	IterationBytesRatio float64 `json:"iteration_bytes_ratio,omitempty"`
	// IterationFloor: the median over overlayfs's rounds of the share of
	// its makespan that the environments' own work filled every core for
	// (Iteration.floor): about the lowest iteration ratio any snapshotter
	// could reach on this node.
	IterationFloor float64 `json:"iteration_floor,omitempty"`
	InitRatio      float64 `json:"init_ratio"`    // envsnap ready / overlayfs ready
	EpisodeRatio   float64 `json:"episode_ratio"` // envsnap episode / overlayfs episode
	// Warm: the same environment again (see Config.SettleWarm), envsnap
	// / overlayfs, medians.
	WarmInitRatio    float64 `json:"warm_init_ratio,omitempty"`
	WarmEpisodeRatio float64 `json:"warm_episode_ratio,omitempty"`
	// Second: the second environment of a pair started while the first
	// runs (Config.SecondAfter), envsnap / overlayfs, medians.
	SecondInitRatio    float64 `json:"second_init_ratio,omitempty"`
	SecondEpisodeRatio float64 `json:"second_episode_ratio,omitempty"`
	PulledPerRead      float64 `json:"pulled_per_read"`  // envsnap-nofill registry bytes / bytes read
	FillPulledFrac     float64 `json:"fill_pulled_frac"` // envsnap registry bytes / image bytes
}

type env struct {
	task  episode.Task
	name  string
	ref   string
	image *plan.Image
}

func (c *Config) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, format+"\n", args...)
	}
}

// Measure runs the benchmark.
func Measure(ctx context.Context, cfg Config) (*Report, error) {
	rep := &Report{Started: time.Now(), Images: map[string]int64{}, GroupSize: map[string]int64{}, Summary: map[string]map[string]Summary{},
		Iterations: map[string][]Iteration{}, SettleWarm: cfg.SettleWarm,
		SecondAfter: cfg.SecondAfter.Seconds()}
	var settled []float64
	rep.Machine = machine()
	w, err := episode.LoadWorkload(cfg.Tasks)
	if err != nil {
		return nil, err
	}
	rep.Workload = reportPath(cfg.Tasks)

	denv, link, metricsAddr, closeNode, err := startNode(ctx, cfg.Rate, cfg.RTT)
	if err != nil {
		return nil, err
	}
	defer closeNode()
	rep.Link = link

	cfg.logf("publishing groups through the shaped link")
	tasks := w.Tasks
	pub, err := episode.PublishGroups(ctx, denv.Hosts(), denv.Registry.Host, &episode.Workload{Tasks: tasks})
	if err != nil {
		return nil, err
	}
	cfg.logf("published %d groups in %s", len(pub.Refs), pub.Duration.Round(time.Second))
	// The link's real rate depends on the CPU left for the veth and the
	// proxy: measure it with the largest blob rather than assume it.
	if mbps, err := measureLink(ctx, denv, pub); err == nil {
		rep.Link += fmt.Sprintf("; measured %.0f Mbit/s for one blob download", mbps)
	} else {
		rep.Notes = append(rep.Notes, "link throughput not measured: "+err.Error())
	}
	cfg.logf("link: %s", rep.Link)
	b := &bench{cfg: cfg, env: denv, metrics: "http://" + metricsAddr + "/metrics"}
	if !cfg.NoPrefetch {
		cfg.logf("recording footprints with one episode of %s and attaching them to the shared groups", tasks[0].ID)
		note, err := b.recordPrefetch(ctx, pub, tasks[0])
		if err != nil {
			return nil, fmt.Errorf("record prefetch lists: %w", err)
		}
		rep.Notes = append(rep.Notes, note)
	}
	envs, err := composeEnvs(ctx, denv.Hosts(), denv.Registry.Host, pub, tasks, max(cfg.Envs, cfg.IterationEnvs))
	if err != nil {
		return nil, err
	}
	iterEnvs := envs[:min(cfg.IterationEnvs, len(envs))]
	envs = envs[:min(cfg.Envs, len(envs))]
	for _, e := range envs {
		rep.Images[e.name] = episode.ImageSize(e.image)
	}
	// Every environment has the same groups; the iteration's list is the
	// longer one (-envs 0 runs the iteration alone).
	sample := iterEnvs
	if len(envs) > 0 {
		sample = envs
	}
	if len(sample) > 0 {
		for i, l := range sample[0].image.Manifest.Layers {
			rep.GroupSize[kindOf(sample[0].image, i)] += l.Size
		}
	}

	systems := cfg.Systems
	if len(systems) == 0 {
		systems = AllSystems
	}
	// The iteration first: it is the headline, and a run cut short
	// should still have it.
	rounds := max(1, cfg.IterationRounds)
	for round := range rounds {
		if len(iterEnvs) == 0 {
			break
		}
		order := []string{Overlayfs, Envsnap}
		if round%2 == 1 {
			order = []string{Envsnap, Overlayfs}
		}
		for _, sys := range order {
			if !slices.Contains(systems, sys) {
				continue
			}
			if err := b.useSystem(sys); err != nil {
				return nil, fmt.Errorf("iteration on %s: %w", sys, err)
			}
			cfg.logf("%-15s iteration round %d of %d", sys, round+1, rounds)
			it, rs, err := b.runIteration(ctx, iterEnvs, sys, max(1, cfg.IterationConcurrent))
			if err != nil {
				return nil, fmt.Errorf("iteration on %s: %w", sys, err)
			}
			rep.Runs = append(rep.Runs, rs...)
			rep.Iterations[sys] = append(rep.Iterations[sys], it)
			cfg.logf("%-15s iteration of %d envs, %d at a time: makespan %.1fs, episode p50 %.2fs p95 %.2fs, registry %s, %d failed",
				sys, it.Envs, it.Concurrent, it.Makespan.Seconds(), it.Episode.Median, it.Episode.P95, mib(it.RegistryBytes), it.Failed)
			cfg.logf("%-15s iteration CPU seconds: %s", sys, cpuLine(it.CPU))
		}
	}
	if len(rep.Iterations) > 0 && cfg.Checkpoint != nil {
		rep.summarize()
		rep.Duration = time.Since(rep.Started)
		if err := cfg.Checkpoint(rep); err != nil {
			return nil, fmt.Errorf("checkpoint after the iteration: %w", err)
		}
	}
	// The environments one at a time, cold then warm: the systems take
	// turns environment by environment, so that a drift of the machine
	// over the run (other work, the page cache, the disk) lands on all of
	// them instead of on whichever ran last.
	skipped := map[string]bool{}
	for i, e := range envs {
		if cfg.NoSingle {
			break
		}
		for _, sys := range systems {
			n := len(envs)
			if sys == EnvsnapNoFill || sys == EnvsnapEager {
				n = min(n, max(1, cfg.AuxEnvs))
			}
			if i >= n || skipped[sys] {
				continue
			}
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if err := b.useSystem(sys); err != nil {
				rep.Notes = append(rep.Notes, fmt.Sprintf("%s skipped: %v", sys, err))
				cfg.logf("%s skipped: %v", sys, err)
				skipped[sys] = true
				continue
			}
			for _, phase := range []string{"cold", "warm"} {
				if phase == "cold" {
					if err := b.reset(); err != nil {
						return nil, fmt.Errorf("reset before %s %s: %w", sys, e.name, err)
					}
				}
				// Without fill a layer is never fully present: nothing
				// to wait for.
				if phase == "warm" && cfg.SettleWarm && (sys == Envsnap || sys == EnvsnapEager || sys == EnvsnapDurable) {
					if took, err := b.settle(ctx, 3*time.Minute); err != nil {
						cfg.logf("%-15s settle %s: %v; measuring anyway", sys, e.name, err)
					} else {
						cfg.logf("%-15s settle %s: layers fully present %.1fs after the cold run", sys, e.name, took.Seconds())
						if sys == Envsnap {
							settled = append(settled, took.Seconds())
						}
					}
				}
				r := b.run(ctx, e, sys, phase)
				rep.Runs = append(rep.Runs, r)
				cfg.logf("%-15s %-5s %2d/%d %-28s ready %6.2fs episode %6.2fs reward %d registry %s read %s %s",
					sys, phase, i+1, n, e.name, r.Ready.Seconds(), r.Episode.Seconds(), r.Reward, mib(r.RegistryBytes), mib(r.ReadBytes), r.Error)
			}
		}
	}
	for _, sys := range systems {
		if skipped[sys] {
			continue
		}
		if err := b.useSystem(sys); err != nil {
			rep.Notes = append(rep.Notes, fmt.Sprintf("%s skipped: %v", sys, err))
			cfg.logf("%s skipped: %v", sys, err)
			continue
		}
		if (sys == Envsnap || sys == Overlayfs || sys == EnvsnapNice0 || sys == EnvsnapDurable) && cfg.SecondAfter > 0 {
			for i := 0; i+1 < len(envs); i += 2 {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				rs, err := b.runSecond(ctx, envs[i], envs[i+1], sys, cfg.SecondAfter)
				if err != nil {
					return nil, err
				}
				rep.Runs = append(rep.Runs, rs...)
				for _, r := range rs {
					cfg.logf("%-15s %-6s %-28s ready %6.2fs episode %6.2fs reward %d %s", sys, r.Phase, r.Task, r.Ready.Seconds(), r.Episode.Seconds(), r.Reward, r.Error)
				}
			}
		}
		if sys == Envsnap || sys == Overlayfs {
			if err := b.reset(); err != nil {
				return nil, err
			}
			rs := b.runConcurrent(ctx, envs, sys, cfg.Concurrent)
			rep.Runs = append(rep.Runs, rs...)
			for _, r := range rs {
				cfg.logf("%-15s x%d   %-28s ready %6.2fs episode %6.2fs reward %d %s", sys, cfg.Concurrent, r.Task, r.Ready.Seconds(), r.Episode.Seconds(), r.Reward, r.Error)
			}
		}
	}
	rep.Settle = summarize(settled)
	rep.summarize()
	rep.Duration = time.Since(rep.Started)
	return rep, nil
}

func composeEnvs(ctx context.Context, hosts docker.RegistryHosts, registry string, pub *episode.Published, tasks []episode.Task, n int) ([]env, error) {
	c := &plan.Composer{Hosts: hosts, OpenLayer: plan.RemoteLayerOpener(hosts)}
	var envs []env
	for i := 0; i < n; i++ {
		t := tasks[i%len(tasks)]
		name := fmt.Sprintf("%s-%02d", t.ID, i)
		p := pub.Plan(t)
		p.Name = name
		// A label per environment makes every image distinct, as every
		// task's image would be, so no run finds another's snapshots.
		p.Labels = map[string]string{"io.envsnap.bench.env": name}
		img, err := c.Compose(ctx, p)
		if err != nil {
			return nil, err
		}
		ref := fmt.Sprintf("%s/envsnap/env/%s:1", registry, name)
		if _, err := c.Push(ctx, img, ref); err != nil {
			return nil, err
		}
		envs = append(envs, env{task: t, name: name, ref: ref, image: img})
	}
	return envs, nil
}

func kindOf(img *plan.Image, layer int) string {
	if gi := img.LayerGroup[layer]; gi >= 0 {
		return img.Groups[gi].Kind
	}
	return "mutation"
}

type bench struct {
	cfg     Config
	env     *devenv.Env
	sys     string
	metrics string
	// keepPageCache: reset leaves the machine's page cache alone (a
	// scenario that reads only its own cgroups' charges, run beside
	// other work it must not disturb).
	keepPageCache bool
}

// useSystem restarts the envsnap daemon in the system's mode.
func (b *bench) useSystem(sys string) error {
	b.sys = sys
	args, ok := daemonArgs[sys]
	if !ok {
		return nil
	}
	if b.env.Envsnap != nil {
		b.env.Envsnap.Stop(30 * time.Second)
	}
	b.env.SetEnvsnapArgs(append([]string{"--metrics-address", strings.TrimSuffix(strings.TrimPrefix(b.metrics, "http://"), "/metrics")}, args...)...)
	_, err := b.env.StartEnvsnap()
	return err
}

// reset makes the node cold: no image, container, snapshot or cached chunk
// from earlier runs, and an empty page cache.
func (b *bench) reset() error {
	ctx := b.env.Context()
	is := b.env.Client.ImageService()
	imgs, err := is.List(ctx)
	if err != nil {
		return err
	}
	for i, img := range imgs {
		var opts []images.DeleteOpt
		if i == len(imgs)-1 {
			opts = append(opts, images.SynchronousDelete())
		}
		if err := is.Delete(ctx, img.Name, opts...); err != nil {
			return fmt.Errorf("delete image %s: %w", img.Name, err)
		}
	}
	if _, ok := daemonArgs[b.sys]; ok {
		// The chunk cache survives daemon restarts by design; a cold node
		// has none.
		b.env.Envsnap.Stop(30 * time.Second)
		// Native layer copies too: they outlive restarts like the chunks.
		for _, dir := range []string{"cache", "native"} {
			if err := os.RemoveAll(filepath.Join(b.env.EnvsnapRoot, dir)); err != nil {
				return err
			}
		}
		if _, err := b.env.StartEnvsnap(); err != nil {
			return err
		}
		if err := b.checkCold(); err != nil {
			return err
		}
	}
	if b.keepPageCache {
		return nil
	}
	return dropPageCache()
}

// checkCold fails unless the restarted daemon serves no layer and caches
// no chunk. A snapshot the image deletion left behind would be restored
// on startup, and its layer (with fill or --eager) downloaded into the
// emptied cache before the run starts counting registry bytes.
func (b *bench) checkCold() error {
	st, err := daemon.GetStatus(context.Background(), b.env.SnapshotterSocket)
	if err != nil {
		return fmt.Errorf("check the node is cold: %w", err)
	}
	if st.Native != nil && st.Native.Copies > 0 {
		return fmt.Errorf("node not cold after reset: %d native layer copies left", st.Native.Copies)
	}
	if len(st.Layers) > 0 || st.Cache.Entries > 0 {
		var layers []string
		for _, l := range st.Layers {
			layers = append(layers, l.Digest.String())
		}
		return fmt.Errorf("node not cold after reset: the daemon restored %d layers of deleted images [%s] and caches %d chunks (%s)",
			len(st.Layers), strings.Join(layers, " "), st.Cache.Entries, mib(st.Cache.Size))
	}
	return nil
}

// settle waits until every layer the daemon serves is fully cached and,
// when the daemon builds native copies, each has one. An interrupted
// benchmark (ctx) stops waiting at once.
func (b *bench) settle(ctx context.Context, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		st, err := daemon.GetStatus(ctx, b.env.SnapshotterSocket)
		if err != nil {
			return 0, fmt.Errorf("wait for the node to settle: %w", err)
		}
		done := len(st.Layers) > 0
		for _, l := range st.Layers {
			done = done && l.FetchedPct >= 100
		}
		if st.Native != nil && st.Native.Copies < len(st.Layers) {
			done = false
		}
		if done {
			return time.Since(start), nil
		}
		if time.Since(start) > timeout {
			return 0, fmt.Errorf("layers not fully present after %s: %+v", timeout, st)
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("wait for the node to settle: %w", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func dropPageCache() error {
	syscall.Sync()
	return os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200)
}

func (b *bench) system(sys string) episode.System {
	sn := "envsnap"
	if sys == Overlayfs {
		sn = "overlayfs"
	}
	return episode.System{Name: sys, Snapshotter: sn, Runtime: "io.containerd.envlet.v2"}
}

func (b *bench) run(ctx context.Context, e env, sys, phase string) Run {
	b.env.Registry.ResetCounters()
	readBefore := b.readBytes()
	res := episode.Run(ctx, b.env, e.ref, e.task, b.system(sys), b.cfg.Timeout)
	res.Phase, res.ImageBytes = phase, episode.ImageSize(e.image)
	r := Run{Result: res, GroupBytes: map[string]int64{}}
	for i, l := range e.image.Manifest.Layers {
		r.GroupBytes[kindOf(e.image, i)] += b.env.Registry.BlobBytesServedFor(l.Digest.String())
	}
	if sys != Overlayfs {
		r.ReadBytes = b.readBytes() - readBefore
	}
	return r
}

func (b *bench) runConcurrent(ctx context.Context, envs []env, sys string, n int) []Run {
	n = min(n, len(envs))
	out := make([]Run, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e := envs[i]
			res := episode.Run(ctx, b.env, e.ref, e.task, b.system(sys), b.cfg.Timeout)
			res.Phase, res.ImageBytes = "cold", episode.ImageSize(e.image)
			// Registry bytes cannot be told apart per environment here.
			res.RegistryBytes = 0
			out[i] = Run{Result: res, Concurrent: true}
		}()
	}
	wg.Wait()
	return out
}

// runSecond starts first on a cold node and second after the given
// delay, while first runs: phases "first" and "second". Both are distinct
// environments of the same groups, as an iteration's are.
func (b *bench) runSecond(ctx context.Context, first, second env, sys string, after time.Duration) ([]Run, error) {
	if err := b.reset(); err != nil {
		return nil, fmt.Errorf("reset before %s %s, %s: %w", sys, first.name, second.name, err)
	}
	out := make([]Run, 2)
	var wg sync.WaitGroup
	for i, e := range []env{first, second} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == 1 {
				select {
				case <-time.After(after):
				case <-ctx.Done():
				}
			}
			res := episode.Run(ctx, b.env, e.ref, e.task, b.system(sys), b.cfg.Timeout)
			res.Phase, res.ImageBytes = []string{"first", "second"}[i], episode.ImageSize(e.image)
			// Registry bytes cannot be told apart per environment here.
			res.RegistryBytes = 0
			out[i] = Run{Result: res}
		}()
	}
	wg.Wait()
	return out, nil
}

// runIteration runs envs on an empty node, k at a time in list order (a
// new one starts when one ends), as an RL iteration's rollout workers
// do: the first environments are cold, later ones find the shared
// groups on the node.
func (b *bench) runIteration(ctx context.Context, envs []env, sys string, k int) (Iteration, []Run, error) {
	if err := b.reset(); err != nil {
		return Iteration{}, nil, err
	}
	b.env.Registry.ResetCounters()
	out := make([]Run, len(envs))
	next := make(chan int)
	var wg sync.WaitGroup
	b.cfg.logf("%-15s iteration: %d environments, %d at a time, from an empty node", sys, len(envs), k)
	start, cpu := time.Now(), b.sampleCPU()
	for range min(k, len(envs)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				e := envs[i]
				res := episode.Run(ctx, b.env, e.ref, e.task, b.system(sys), b.cfg.Timeout)
				res.Phase, res.ImageBytes = "iteration", episode.ImageSize(e.image)
				// Registry bytes cannot be told apart per environment here.
				res.RegistryBytes = 0
				out[i] = Run{Result: res}
				refused := ""
				if res.Refused > 0 {
					refused = fmt.Sprintf("(admitted after %d refusals) ", res.Refused)
				}
				b.cfg.logf("%-15s iter  %2d/%d %-28s ready %6.2fs episode %6.2fs reward %d %s%s",
					sys, i+1, len(envs), e.name, res.Ready.Seconds(), res.Episode.Seconds(), res.Reward, refused, res.Error)
			}
		}()
	}
	for i := range envs {
		next <- i
	}
	close(next)
	wg.Wait()
	it := Iteration{Envs: len(envs), Concurrent: k, Makespan: time.Since(start), RegistryBytes: b.env.Registry.BlobBytesServed(),
		CPU: b.sampleCPU().since(cpu), Cores: runtime.NumCPU()}
	var ready, ep []time.Duration
	for _, r := range out {
		if r.Error != "" {
			it.Failed++
			continue
		}
		ready, ep = append(ready, r.Ready), append(ep, r.Episode)
	}
	it.Ready, it.Episode = summarize(seconds(ready)), summarize(seconds(ep))
	return it, out, nil
}

// readBytes sums envsnap_lazyfs_read_bytes_total over the daemon's mounts.
func (b *bench) readBytes() int64 {
	resp, err := http.Get(b.metrics)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var total float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "envsnap_lazyfs_read_bytes_total") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			total += v
		}
	}
	return int64(total)
}

// stepPrefix marks the summaries of episode steps (Run.Steps) among a
// group's measures.
const stepPrefix = "step:"

func (rep *Report) summarize() {
	groups := map[string][]Run{}
	for _, r := range rep.Runs {
		if rep.Agent == "" && r.Error == "" && r.Output != "" {
			rep.Agent, _, _ = strings.Cut(r.Output, "\n")
		}
		key := r.System + "/" + r.Phase
		if r.Concurrent {
			key = r.System + "/concurrent"
		}
		if r.Error == "" {
			groups[key] = append(groups[key], r)
		}
	}
	for key, rs := range groups {
		var ready, ep []time.Duration
		var bytes, read []float64
		for _, r := range rs {
			ready, ep = append(ready, r.Ready), append(ep, r.Episode)
			bytes = append(bytes, float64(r.RegistryBytes))
			read = append(read, float64(r.ReadBytes))
		}
		rep.Summary[key] = map[string]Summary{
			"ready_s": summarize(seconds(ready)), "episode_s": summarize(seconds(ep)),
			"registry_bytes": summarize(bytes), "read_bytes": summarize(read),
		}
		steps := map[string][]float64{}
		for _, r := range rs {
			for name, v := range r.Steps {
				steps[name] = append(steps[name], v)
			}
		}
		for name, vs := range steps {
			rep.Summary[key][stepPrefix+name] = summarize(vs)
		}
	}
	med := func(key, m string) float64 { return rep.Summary[key][m].Median }
	rep.Headline.IterationRatios = nil
	for i, o := range rep.Iterations[Overlayfs] {
		if i >= len(rep.Iterations[Envsnap]) {
			break
		}
		e := rep.Iterations[Envsnap][i]
		if o.Makespan > 0 && e.Makespan > 0 && o.Failed == 0 && e.Failed == 0 {
			rep.Headline.IterationRatios = append(rep.Headline.IterationRatios, e.Makespan.Seconds()/o.Makespan.Seconds())
			if rep.Headline.IterationBytesRatio == 0 {
				rep.Headline.IterationBytesRatio = float64(e.RegistryBytes) / float64(max(o.RegistryBytes, 1))
			}
		}
	}
	if len(rep.Headline.IterationRatios) > 0 {
		rep.Headline.IterationRatio = median(rep.Headline.IterationRatios)
	}
	var floors []float64
	for _, o := range rep.Iterations[Overlayfs] {
		if f := o.floor(); f > 0 && o.Failed == 0 {
			floors = append(floors, f)
		}
	}
	rep.Headline.IterationFloor = 0
	if len(floors) > 0 {
		rep.Headline.IterationFloor = median(floors)
	}
	if o := med(Overlayfs+"/warm", "ready_s"); o > 0 {
		rep.Headline.WarmInitRatio = med(Envsnap+"/warm", "ready_s") / o
		rep.Headline.WarmEpisodeRatio = med(Envsnap+"/warm", "episode_s") / med(Overlayfs+"/warm", "episode_s")
	}
	if o := med(Overlayfs+"/second", "ready_s"); o > 0 {
		rep.Headline.SecondInitRatio = med(Envsnap+"/second", "ready_s") / o
		rep.Headline.SecondEpisodeRatio = med(Envsnap+"/second", "episode_s") / med(Overlayfs+"/second", "episode_s")
	}
	if o := med(Overlayfs+"/cold", "ready_s"); o > 0 {
		rep.Headline.InitRatio = med(Envsnap+"/cold", "ready_s") / o
		rep.Headline.EpisodeRatio = med(Envsnap+"/cold", "episode_s") / med(Overlayfs+"/cold", "episode_s")
	}
	if rd := med(EnvsnapNoFill+"/cold", "read_bytes"); rd > 0 {
		rep.Headline.PulledPerRead = med(EnvsnapNoFill+"/cold", "registry_bytes") / rd
	}
	var img float64
	for _, v := range rep.Images {
		img = float64(v)
		break
	}
	if img > 0 {
		rep.Headline.FillPulledFrac = med(Envsnap+"/cold", "registry_bytes") / img
	}
}

func mib(n int64) string { return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20)) }

// machine describes where the run happened.
func machine() string {
	var parts []string
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		n := 0
		model := ""
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "processor") {
				n++
			}
			if model == "" && strings.HasPrefix(line, "model name") {
				model = strings.TrimSpace(strings.SplitN(line, ":", 2)[1])
			}
		}
		parts = append(parts, fmt.Sprintf("%d x %s", n, model))
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		f := strings.Fields(strings.SplitN(string(b), "\n", 2)[0])
		if len(f) >= 2 {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			parts = append(parts, fmt.Sprintf("%.0f GiB RAM", float64(kb)/(1<<20)))
		}
	}
	var u syscall.Utsname
	if syscall.Uname(&u) == nil {
		rel := make([]byte, 0, len(u.Release))
		for _, c := range u.Release {
			if c == 0 {
				break
			}
			rel = append(rel, byte(c))
		}
		parts = append(parts, "Linux "+string(rel))
	}
	return strings.Join(parts, ", ")
}

// measureLink downloads the largest published layer once through the link
// and returns the rate in Mbit/s.
func measureLink(ctx context.Context, env *devenv.Env, pub *episode.Published) (float64, error) {
	var ref string
	var best int64
	var dgst string
	for path, r := range pub.Results {
		for _, l := range r.Layers {
			if l.Size > best {
				best, dgst, ref = l.Size, l.Digest.String(), pub.Refs[path]
			}
		}
	}
	if ref == "" {
		return 0, fmt.Errorf("no layer")
	}
	repo := strings.TrimPrefix(ref, env.Registry.Host+"/")
	repo = repo[:strings.LastIndex(repo, ":")]
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s/v2/%s/blobs/%s", env.Registry.Host, repo, dgst), nil)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil {
		return 0, err
	}
	if n != best {
		return 0, fmt.Errorf("downloaded %d of %d bytes (%s)", n, best, resp.Status)
	}
	return float64(n) * 8 / time.Since(start).Seconds() / 1e6, nil
}

// reportPath names a file for the committed report: relative to the
// repository when it is inside it, else by its base name. The report is
// read on other machines, where this one's absolute paths mean nothing.
func reportPath(p string) string {
	if root, err := devenv.RepoRoot(); err == nil {
		if abs, err := filepath.Abs(p); err == nil {
			if rel, err := filepath.Rel(root, abs); err == nil && filepath.IsLocal(rel) {
				return rel
			}
		}
	}
	return filepath.Base(p)
}

// freeLocalAddr returns a loopback address with a port nobody listens on
// at the moment of asking.
func freeLocalAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port for the daemon's metrics: %w", err)
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// startNode starts the benchmark's node: a registry behind a link shaped
// to rate and rtt, containerd, the envsnap daemon serving its metrics on
// the returned address, and the envlet shim, under which every system runs
// its environments (Runtime in system). It returns the link's description
// and a function that stops all of it.
func startNode(ctx context.Context, rate int64, rtt time.Duration) (*devenv.Env, string, string, func(), error) {
	link, err := netshape.NewLink(ctx, netshape.WithLinkRate(rate))
	if err != nil {
		return nil, "", "", nil, fmt.Errorf("shaped link: %w", err)
	}
	regNet := netshape.NewRegistryNet(ctx, link, rtt)
	// A free port, not a fixed one: other benchmarks or daemons on the
	// node may hold any given port.
	metricsAddr, err := freeLocalAddr()
	if err != nil {
		link.Close(context.Background())
		return nil, "", "", nil, err
	}
	denv, err := devenv.Start(ctx, devenv.WithEnvsnap(append([]string{"--metrics-address", metricsAddr}, daemonArgs[Envsnap]...)...),
		devenv.WithRegistryNetwork(regNet), devenv.WithDirPrefix("envsnap-bench-"), devenv.WithEnvlet(devenv.EnvletConfig{}), devenv.WithDefaultLazyMinSize())
	if err != nil {
		link.Close(context.Background())
		return nil, "", "", nil, err
	}
	return denv, regNet.Describe(), metricsAddr, func() {
		denv.Close()
		link.Close(context.Background())
	}, nil
}
