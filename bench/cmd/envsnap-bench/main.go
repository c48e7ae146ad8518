// Command envsnap-bench is the headline benchmark of `make bench`: see
// package bench/headline. It writes the raw JSON, regenerates
// docs/benchmarks.md and the plots under docs/img.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/docker/go-units"

	"github.com/envsnap/envsnap/bench/headline"
	"github.com/envsnap/envsnap/bench/modelstub"
	"github.com/envsnap/envsnap/internal/devenv"
)

func main() {
	var cfg headline.Config
	var systems, variant string
	flag.StringVar(&cfg.Tasks, "tasks", "", "workload task list (default: build and use the workload variant)")
	flag.StringVar(&variant, "variant", "full", "workload variant to build when -tasks is not given: full or small")
	flag.IntVar(&cfg.Envs, "envs", 16, "environments per phase for envsnap and overlayfs")
	flag.IntVar(&cfg.AuxEnvs, "aux-envs", 4, "environments per phase for envsnap-nofill and envsnap-eager")
	flag.IntVar(&cfg.Concurrent, "concurrent", 8, "environments started at once")
	flag.IntVar(&cfg.IterationEnvs, "iteration-envs", 32, "environments of the iteration scenario (0 skips it)")
	flag.IntVar(&cfg.IterationConcurrent, "iteration-concurrent", 4, "environments of the iteration scenario running at a time")
	flag.IntVar(&cfg.IterationRounds, "iteration-rounds", 2, "rounds of the iteration scenario per system, the order alternating; the headline is the median of the rounds' ratios")
	flag.DurationVar(&cfg.RTT, "rtt", 20*time.Millisecond, "registry round trip")
	flag.Int64Var(&cfg.Rate, "rate", 1_000_000_000, "registry link rate in bits/s")
	flag.StringVar(&systems, "systems", strings.Join(headline.AllSystems, ","), "systems to measure")
	flag.DurationVar(&cfg.Timeout, "timeout", 15*time.Minute, "per-episode timeout")
	flag.BoolVar(&cfg.NoPrefetch, "no-prefetch", false, "do not record footprints and attach prefetch lists to the shared groups before the runs")
	flag.DurationVar(&cfg.SecondAfter, "second-after", 5*time.Second, "for envsnap and overlayfs, start pairs of environments on a cold node, the second this long after the first (0 skips them)")
	flag.BoolVar(&cfg.NoSingle, "no-single", false, "skip the cold and warm runs one at a time (the pairs, concurrent runs and iteration still run)")
	flag.BoolVar(&cfg.SettleWarm, "settle-warm", false, "before an envsnap warm run, wait until its layers are fully cached (and their native copies built)")
	peers := flag.Int("peers", 0, "run only the peer tier's scenario with this many nodes (network namespaces), with and without peers, and replace its section of the markdown report")
	peerEnvs := flag.Int("peer-envs", 4, "environments each node starts at once in the peer tier's scenario")
	var slow headline.PeersConfig
	flag.DurationVar(&slow.SlowHedgeAfter, "peer-slow-hedge-after", 0, "peer tier's scenario: add a mode with peers hedging after this instead of the default")
	flag.DurationVar(&slow.SlowTimeout, "peer-slow-timeout", 0, "peer tier's scenario: and this peer timeout")
	var ro headline.RolloutConfig
	var roSystems string
	flag.IntVar(&ro.Rollouts, "rollouts", 0, "run only the rollout scenario with this many rollouts submitted at once (the agent CLI against the model stand-in), and replace its section of the markdown report")
	flag.IntVar(&ro.TaskCount, "rollout-tasks", 0, "distinct tasks of the rollout scenario (0: every task of the workload, at most -rollouts)")
	flag.StringVar(&ro.Repo, "rollout-repo", "", "rollout scenario: only tasks of this repository (\"uuid\", as make demo runs)")
	flag.StringVar(&roSystems, "rollout-systems", strings.Join(headline.RolloutSystems, ","), "systems of the rollout scenario, in order")
	ro.Think = modelstub.DefaultThink
	flag.DurationVar(&ro.Think.Median, "think-median", ro.Think.Median, "rollout scenario: the model's median think time per answer")
	flag.DurationVar(&ro.Think.P95, "think-p95", ro.Think.P95, "rollout scenario: the think time's 95th percentile (lognormal)")
	flag.BoolVar(&ro.Think.Fixed, "think-fixed", false, "rollout scenario: every answer takes -think-median")
	flag.Uint64Var(&ro.Think.Seed, "think-seed", ro.Think.Seed, "rollout scenario: seed of the think times")
	flag.Float64Var(&ro.FixedCPU, "fixed-cpu", 0.5, "rollout scenario: the fixed CPU quota (cores) of the status quo")
	fixedMem := flag.String("fixed-memory", "2GiB", "rollout and density scenarios: the fixed memory quota of the status quo (binary units: 2GiB, 512MiB)")
	var de headline.DensityConfig
	var deSystems string
	flag.IntVar(&de.Max, "density", 0, "run only the density scenario: start agent environments one after another up to this many, until the node refuses one, one fails or tool calls slow past -density-limit; replace its section of the markdown report")
	flag.IntVar(&de.Step, "density-step", 8, "density scenario: environments added between two measured levels")
	flag.DurationVar(&de.Settle, "density-settle", 20*time.Second, "density scenario: how long each level runs before it is measured")
	flag.DurationVar(&de.Window, "density-window", 60*time.Second, "density scenario: the measuring window; each level is measured over as many as it takes to collect 40 tool calls (at most 6)")
	flag.Float64Var(&de.Limit, "density-limit", 1.3, "density scenario: the p95 tool-call latency bound, over one environment alone (measured, as every level, past its first episode)")
	flag.StringVar(&deSystems, "density-systems", strings.Join(headline.DensitySystems, ","), "systems of the density scenario, in order")
	var pc headline.PageCacheConfig
	var pcSystems string
	flag.IntVar(&pc.N, "pagecache", 0, "run only the page-cache sharing scenario: this many environments of one image hold the agent CLI resident, on overlayfs and envsnap's lazy and native lowers; print and write its JSON")
	flag.StringVar(&pcSystems, "pagecache-systems", strings.Join(headline.PageCacheSystems, ","), "systems of the page-cache scenario, in order")
	publish := flag.Bool("publish", false, "write the repository's own report, as make bench does: docs/benchmarks*.json, docs/benchmarks.md, docs/img and, for -rollouts, the README's first table (default: the same files under bench/out, which git ignores)")
	out := flag.String("out", "", "raw JSON (default benchmarks.json, benchmarks-peers.json, benchmarks-rollout.json or benchmarks-density.json, by scenario, under bench/out or with -publish docs)")
	doc := flag.String("doc", "", "markdown report (default bench/out/benchmarks.md, with -publish docs/benchmarks.md)")
	flag.Parse()
	cfg.Systems = strings.Split(systems, ",")
	cfg.Log = os.Stdout
	if ro.Rollouts > 0 {
		mem, err := units.RAMInBytes(*fixedMem)
		if err != nil {
			fmt.Fprintf(os.Stderr, "envsnap-bench: -fixed-memory %q: %v\n", *fixedMem, err)
			os.Exit(2)
		}
		ro.FixedMemory, ro.Systems = mem, strings.Split(roSystems, ",")
	}
	if de.Max > 0 {
		mem, err := units.RAMInBytes(*fixedMem)
		if err != nil {
			fmt.Fprintf(os.Stderr, "envsnap-bench: -fixed-memory %q: %v\n", *fixedMem, err)
			os.Exit(2)
		}
		de.FixedMemory, de.FixedCPU, de.Think, de.TaskCount = mem, ro.FixedCPU, ro.Think, ro.TaskCount
		de.Systems = strings.Split(deSystems, ",")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	slow.Nodes, slow.EnvsPerNode = *peers, *peerEnvs
	if err := run(ctx, cfg, variant, *publish, *out, *doc, slow, ro, de, pc, pcSystems); err != nil {
		fmt.Fprintf(os.Stderr, "envsnap-bench: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg headline.Config, variant string, publish bool, out, doc string, peers headline.PeersConfig, ro headline.RolloutConfig, de headline.DensityConfig, pc headline.PageCacheConfig, pcSystems string) error {
	if err := devenv.CheckMachine(); err != nil {
		return err
	}
	root, err := devenv.RepoRoot()
	if err != nil {
		return err
	}
	if cfg.Tasks == "" {
		cfg.Tasks = filepath.Join(root, ".cache/bench/workload", variant, "tasks.jsonl")
		if _, err := os.Stat(cfg.Tasks); err != nil {
			fmt.Printf("==> building the %s workload (cached in .cache/bench)\n", variant)
			args := []string{}
			if variant == "small" {
				args = append(args, "--small")
			}
			cmd := exec.CommandContext(ctx, filepath.Join(root, "bench/workload/build.sh"), args...)
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("build workload: %w", err)
			}
		}
	}
	// A run writes the repository's report only when asked: an
	// experiment run the obvious way must not replace the published
	// figures.
	reports := filepath.Join(root, "bench/out")
	if publish {
		reports = filepath.Join(root, "docs")
	}
	if err := os.MkdirAll(reports, 0o755); err != nil {
		return err
	}
	if out == "" {
		out = filepath.Join(reports, "benchmarks.json")
		if peers.Nodes > 0 {
			out = filepath.Join(reports, "benchmarks-peers.json")
		}
		if ro.Rollouts > 0 {
			out = filepath.Join(reports, "benchmarks-rollout.json")
		}
		if de.Max > 0 {
			out = filepath.Join(reports, "benchmarks-density.json")
		}
	}
	if doc == "" {
		doc = filepath.Join(reports, "benchmarks.md")
	}
	command := strings.Join(append([]string{"go run ./bench/cmd/envsnap-bench"}, redact(os.Args[1:], root)...), " ")
	rel, _ := filepath.Rel(root, out)
	if peers.Nodes > 0 {
		peers.Tasks, peers.RTT, peers.Rate, peers.Timeout, peers.NoPrefetch, peers.Log = cfg.Tasks, cfg.RTT, cfg.Rate, cfg.Timeout, cfg.NoPrefetch, cfg.Log
		return runPeers(ctx, peers, command, out, rel, doc)
	}
	if pc.N > 0 {
		pc.Tasks, pc.RTT, pc.Rate, pc.Timeout, pc.Log = cfg.Tasks, cfg.RTT, cfg.Rate, cfg.Timeout, cfg.Log
		pc.Systems = strings.Split(pcSystems, ",")
		if out == filepath.Join(reports, "benchmarks.json") {
			out = filepath.Join(root, "bench/out/pagecache.json")
		}
		rep, err := headline.MeasurePageCache(ctx, pc)
		if err != nil {
			return err
		}
		rep.Command = command
		if err := rep.WriteJSON(out); err != nil {
			return err
		}
		fmt.Printf("wrote %s\n", out)
		return nil
	}
	if de.Max > 0 {
		de.Tasks, de.RTT, de.Rate, de.NoPrefetch, de.Log = cfg.Tasks, cfg.RTT, cfg.Rate, cfg.NoPrefetch, cfg.Log
		de.ReadyTimeout = cfg.Timeout
		return runDensity(ctx, de, command, out, rel, doc)
	}
	if ro.Rollouts > 0 {
		ro.Tasks, ro.RTT, ro.Rate, ro.Timeout, ro.NoPrefetch, ro.Log = cfg.Tasks, cfg.RTT, cfg.Rate, cfg.Timeout, cfg.NoPrefetch, cfg.Log
		return runRollout(ctx, ro, command, out, rel, doc, publish)
	}
	write := func(rep *headline.Report) ([]string, error) {
		rep.Command = command
		if err := rep.WriteJSON(out); err != nil {
			return nil, err
		}
		plots, err := rep.WritePlots(filepath.Join(filepath.Dir(doc), "img"))
		if err != nil {
			return nil, err
		}
		return plots, rep.WriteMarkdown(doc, rel, plots)
	}
	cfg.Checkpoint = func(rep *headline.Report) error {
		partial := *rep
		partial.Notes = append(slices.Clone(rep.Notes), "this report was written after the iteration scenario, before the runs one at a time: the run was cut short")
		_, err := write(&partial)
		return err
	}
	rep, err := headline.Measure(ctx, cfg)
	if err != nil {
		return err
	}
	plots, err := write(rep)
	if err != nil {
		return err
	}
	h := rep.Headline
	if h.IterationRatio > 0 {
		fmt.Printf("\nheadline: iteration makespan %.3fx overlayfs (floor on this node %.3fx), registry bytes %.2fx\n", h.IterationRatio, h.IterationFloor, h.IterationBytesRatio)
	}
	if h.WarmEpisodeRatio > 0 {
		fmt.Printf("warm, median: init %.3fx overlayfs, episode %.3fx overlayfs\n", h.WarmInitRatio, h.WarmEpisodeRatio)
	}
	fmt.Printf("cold, median: init %.3fx overlayfs, episode %.3fx overlayfs, registry bytes %.2fx bytes read\nwrote %s, %s, %s\n",
		h.InitRatio, h.EpisodeRatio, h.PulledPerRead, out, doc, strings.Join(plots, ", "))
	return nil
}

// redact makes the paths among args (also in -flag=value) relative to
// the repository, so the committed report does not carry this machine's
// absolute paths.
func redact(args []string, root string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		prefix := ""
		if k, v, ok := strings.Cut(a, "="); ok {
			prefix, a = k+"=", v
		}
		if rel, err := filepath.Rel(root, a); err == nil && filepath.IsAbs(a) && filepath.IsLocal(rel) {
			a = rel
		} else if filepath.IsAbs(a) {
			a = "..." + string(filepath.Separator) + filepath.Base(a)
		}
		out[i] = prefix + a
	}
	return out
}

// runRollout runs the rollout scenario and writes its JSON, its plots
// and its section of the markdown report; the last line it prints is
// the comparison.
func runRollout(ctx context.Context, cfg headline.RolloutConfig, command, out, rel, doc string, publish bool) error {
	// Every turn of every rollout: raw output, not the report.
	root, err := devenv.RepoRoot()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(root, "bench/out"), 0o755); err != nil {
		return err
	}
	modelLog, err := os.Create(filepath.Join(root, "bench/out/rollout-model.jsonl"))
	if err != nil {
		return err
	}
	defer modelLog.Close()
	cfg.ModelLog = modelLog
	// Every system's batch is written as it ends: the report then shows
	// the systems measured so far, and a run stopped later keeps them.
	var plots []string
	cfg.Measured = func(rep *headline.RolloutReport) error {
		rep.Command = command
		if err := rep.WriteJSON(out); err != nil {
			return err
		}
		if plots, err = rep.WritePlots(filepath.Join(filepath.Dir(doc), "img")); err != nil {
			return err
		}
		if err := rep.WriteMarkdown(doc, rel, plots); err != nil {
			return err
		}
		// The README's first table is this comparison, from the same
		// run, when the report is the repository's own.
		if !publish {
			return nil
		}
		return rep.WriteReadme(filepath.Join(root, "README.md"))
	}
	rep, err := headline.MeasureRollout(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Printf("wrote %s, %s, %s, %s\n%s\n", out, modelLog.Name(), doc, strings.Join(plots, ", "), rep.Comparison())
	return nil
}

// runDensity runs the density scenario and writes its JSON and its
// section of the markdown report; the last line it prints is the
// comparison.
func runDensity(ctx context.Context, cfg headline.DensityConfig, command, out, rel, doc string) error {
	root, err := devenv.RepoRoot()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(root, "bench/out"), 0o755); err != nil {
		return err
	}
	modelLog, err := os.Create(filepath.Join(root, "bench/out/density-model.jsonl"))
	if err != nil {
		return err
	}
	defer modelLog.Close()
	cfg.ModelLog = modelLog
	rep, err := headline.MeasureDensity(ctx, cfg)
	if err != nil {
		return err
	}
	rep.Command = command
	if err := rep.WriteJSON(out); err != nil {
		return err
	}
	if err := rep.WriteMarkdown(doc, rel); err != nil {
		return err
	}
	fmt.Printf("wrote %s, %s, %s\n%s\n", out, modelLog.Name(), doc, rep.Comparison())
	return nil
}

// runPeers runs the peer tier's scenario and writes its JSON and its
// section of the markdown report.
func runPeers(ctx context.Context, cfg headline.PeersConfig, command, out, rel, doc string) error {
	rep, err := headline.MeasurePeers(ctx, cfg)
	if err != nil {
		return err
	}
	rep.Command = command
	if err := rep.WriteJSON(out); err != nil {
		return err
	}
	if err := rep.WriteMarkdown(doc, rel); err != nil {
		return err
	}
	np := rep.Modes[headline.NoPeers]
	for _, mode := range rep.Order[1:] {
		m := rep.Modes[mode]
		fmt.Printf("%s: registry egress %.2fx no peers; ready p95 %.2fs vs %.2fs; episode p95 %.2fs vs %.2fs\n",
			mode, float64(m.RegistryBytes)/float64(max(np.RegistryBytes, 1)), m.Ready.P95, np.Ready.P95, m.Episode.P95, np.Episode.P95)
	}
	fmt.Printf("wrote %s, %s\n", out, doc)
	return nil
}
