// Command envsnap-demo is `make demo`: a small rollout batch (package
// bench/headline, MeasureRollout) on a private containerd, registry and
// envsnap daemon. It publishes the small benchmark workload as layer
// groups, composes one environment per task, and submits 8 rollouts of
// 2 tasks (of the uuid repository, -repo) at once to the node, each
// running the agent CLI against the model stand-in (median think time
// 2 s) and then the evaluator: first as
// a Kubernetes node does today (overlayfs + runc, fixed 0.5 core / 2 GiB,
// admitted by request), then envsnap. The registry sits behind the
// benchmark's link (1 Gbit/s, 20 ms round trip: bench/netshape). Its last
// line is the comparison. Overlayfs with everything at once is make
// bench's (-systems adds it): the model's think time alone keeps its
// batch over 40 s, which would put the demo over its 3 minutes.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/log"

	"github.com/envsnap/envsnap/bench/headline"
	"github.com/envsnap/envsnap/bench/modelstub"
	"github.com/envsnap/envsnap/internal/devenv"
)

func main() {
	cfg := headline.RolloutConfig{Think: modelstub.Think{Median: 2 * time.Second, P95: 20 * time.Second / 3, Max: time.Minute, Seed: 1},
		FixedCPU: 0.5, FixedMemory: 2 << 30, Log: os.Stdout}
	flag.StringVar(&cfg.Tasks, "tasks", "", "workload task list (default: build and use the small workload)")
	flag.IntVar(&cfg.Rollouts, "rollouts", 8, "rollouts submitted at once")
	flag.IntVar(&cfg.TaskCount, "rollout-tasks", 2, "distinct tasks")
	// The small workload's uuid tasks: their first `go test` rebuilds a
	// small package, where cli's rebuilds take a minute under the status
	// quo's 0.5 core and would make the demo a wait for two compiles.
	flag.StringVar(&cfg.Repo, "repo", "uuid", "only tasks of this repository (\"\": spread over every repository)")
	flag.DurationVar(&cfg.Think.Median, "think-median", cfg.Think.Median, "the model's median think time")
	flag.DurationVar(&cfg.Think.P95, "think-p95", cfg.Think.P95, "the think time's 95th percentile (lognormal)")
	systems := flag.String("systems", strings.Join([]string{headline.StatusQuo, headline.Envsnap}, ","), "systems, in order ("+headline.OverlayfsAll+" adds overlayfs with everything at once)")
	flag.DurationVar(&cfg.RTT, "rtt", 20*time.Millisecond, "registry round trip")
	flag.Int64Var(&cfg.Rate, "rate", 1_000_000_000, "registry link rate in bits/s")
	flag.DurationVar(&cfg.Timeout, "timeout", 10*time.Minute, "per-rollout timeout")
	modelLog := flag.String("model-log", "", "write every model turn here, one JSON line each")
	flag.Parse()
	if *modelLog != "" {
		f, err := os.Create(*modelLog)
		if err != nil {
			fmt.Fprintf(os.Stderr, "envsnap-demo: %v\n", err)
			os.Exit(1)
		}
		defer f.Close()
		cfg.ModelLog = f
	}
	cfg.Systems = strings.Split(*systems, ",")
	// The demo shows the batch; the prefetch lists' profiling run is
	// make bench's.
	cfg.NoPrefetch = true
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintf(os.Stderr, "envsnap-demo: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg headline.RolloutConfig) error {
	// Library progress goes to the report, not to the log.
	_ = log.SetLevel("error")
	if err := devenv.CheckMachine(); err != nil {
		return err
	}
	root, err := devenv.RepoRoot()
	if err != nil {
		return err
	}
	if cfg.Tasks == "" {
		cfg.Tasks = filepath.Join(root, ".cache/bench/workload/small/tasks.jsonl")
		if _, err := os.Stat(cfg.Tasks); err != nil {
			fmt.Println("==> building the small workload (cached in .cache/bench; Debian rootfs, Go toolchain, Go repositories, an agent CLI from npm)")
			cmd := exec.CommandContext(ctx, filepath.Join(root, "bench/workload/build.sh"), "--small", "--no-verify")
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("build workload: %w", err)
			}
		}
	}
	start := time.Now()
	rep, err := headline.MeasureRollout(ctx, cfg)
	if err != nil {
		return err
	}
	fmt.Println()
	for _, sys := range rep.Order {
		it := rep.Systems[sys]
		slots := "all at once"
		if it.Slots > 0 {
			slots = fmt.Sprintf("%d at a time", it.Slots)
		}
		fmt.Printf("%-14s %-12s makespan %6.1f s  init share %5.1f%%  ready p50 %5.1f s  rollout p95 %6.1f s  peak envs %2d  node memory +%5.0f MiB  env memory p50 %4.0f MiB  failed %d\n",
			sys, slots, it.Makespan.Seconds(), 100*it.InitShare, it.Ready.Median, it.Rollout.P95, it.PeakConcurrent,
			float64(it.NodeMemoryPeak-it.NodeMemoryBase)/(1<<20), it.EnvMemory.Median, it.Failed)
		fmt.Printf("%-14s %-12s ready p50 split: queue %.1f s, pull %.1f s, create+start %.1f s, agent start %.1f s\n", "", "",
			it.Queue.Median, it.Pull.Median, it.Start.Median, it.Agent.Median)
		fmt.Printf("%-14s %-12s init share floor %.1f%%: each environment's own CPU before ready (p50 %.2f s, max %.2f s), run shortest first on %d cores\n", "", "",
			100*it.InitShareFloor, it.InitCPU.Median, it.InitCPU.Max, it.Cores)
		if it.DaemonGC != nil {
			fmt.Printf("%-14s %-12s envsnap daemon's garbage collector: %s\n", "", "", it.DaemonGC)
		}
		for _, r := range it.Runs {
			if r.Error != "" {
				fmt.Printf("    %s failed: %s\n", r.Name, r.Error)
			}
		}
	}
	// What the model's think time alone forbids any runtime: the demo's
	// length target set against its floor, measured in the same run.
	took, batches, floor := time.Since(start), 0.0, 0.0
	var floors []string
	for _, sys := range rep.Order {
		f := rep.ThinkFloor(sys)
		batches += rep.Systems[sys].Makespan.Seconds()
		floor += f
		floors = append(floors, fmt.Sprintf("%s %.0f s", sys, f))
	}
	fmt.Printf("\n(demo took %s: batches %.0f s, set-up %.0f s; the model's think time alone keeps the batches at %.0f s or more on any runtime: %s)\n%s\n",
		took.Round(time.Second), batches, took.Seconds()-batches, floor, strings.Join(floors, ", "), rep.Comparison())
	return nil
}
