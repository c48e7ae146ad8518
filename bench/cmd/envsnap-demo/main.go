// Command envsnap-demo is `make demo`: it starts a private containerd,
// registry and envsnap daemon, publishes the small benchmark workload as
// layer groups, composes environments for a few tasks, runs their agent
// episodes lazily under the envlet shim, and prints what each one fetched,
// with a comparison against the usual full pull on overlayfs.
package main

import (
	"context"
	"encoding/csv"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/containerd/log"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/plan"
)

func main() {
	tasksPath := flag.String("tasks", "", "workload task list (default: build and use the small workload)")
	n := flag.Int("n", 3, "environments to run")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *tasksPath, *n); err != nil {
		fmt.Fprintf(os.Stderr, "envsnap-demo: %v\n", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) {
	fmt.Printf("==> "+format+"\n", args...)
}

func run(ctx context.Context, tasksPath string, n int) error {
	// Library progress goes to the report, not to the log.
	_ = log.SetLevel("error")
	if err := devenv.CheckMachine(); err != nil {
		return err
	}
	root, err := devenv.RepoRoot()
	if err != nil {
		return err
	}
	if tasksPath == "" {
		tasksPath = filepath.Join(root, ".cache/bench/workload/small/tasks.jsonl")
		if _, err := os.Stat(tasksPath); err != nil {
			step("building the small workload (cached in .cache/bench; Debian rootfs, Go toolchain, Go repositories, an agent CLI from npm)")
			cmd := exec.CommandContext(ctx, filepath.Join(root, "bench/workload/build.sh"), "--small", "--no-verify")
			cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("build workload: %w", err)
			}
		}
	}
	w, err := episode.LoadWorkload(tasksPath)
	if err != nil {
		return err
	}
	if n > len(w.Tasks) {
		n = len(w.Tasks)
	}

	step("starting a private registry, containerd and the envsnap daemon")
	// Environments start small and grow with their demand (the envlet
	// shim, with the node arbiter); the report shows the quota changes.
	// Background fill is off so "fetched" is what each environment needed
	// (with fill on, the rest of the image follows within seconds).
	env, err := devenv.Start(ctx, devenv.WithEnvsnap("--fill=false"), devenv.WithDirPrefix("envsnap-demo-"),
		devenv.WithEnvlet(devenv.EnvletConfig{Policy: map[string]string{"initial-cpu": "0.25", "initial-memory": "256Mi"}}))
	if err != nil {
		return err
	}
	defer func() {
		step("stopping everything the demo started")
		if leaked := env.Close(); len(leaked) > 0 {
			fmt.Fprintf(os.Stderr, "warning: mounts were left behind and have been unmounted: %v\n", leaked)
		}
	}()

	step("publishing %d tasks' layer groups (each distinct group once)", n)
	pub, err := episode.PublishGroups(ctx, env.Hosts(), env.Registry.Host, &episode.Workload{Tasks: w.Tasks[:n]})
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "    group\tlayer bytes\tuploaded")
	for path, ref := range pub.Refs {
		r := pub.Results[path]
		var size int64
		for _, l := range r.Layers {
			size += l.Size
		}
		fmt.Fprintf(tw, "    %s\t%s\t%s\n", ref, mib(size), mib(r.UploadedBytes))
	}
	tw.Flush()
	fmt.Printf("    published in %s\n", pub.Duration.Round(time.Millisecond))

	step("composing %d environments (metadata only)", n)
	composer := &plan.Composer{Hosts: env.Hosts(), OpenLayer: plan.RemoteLayerOpener(env.Hosts())}
	refs := make([]string, n)
	sizes := make([]int64, n)
	for i, t := range w.Tasks[:n] {
		start := time.Now()
		img, err := composer.Compose(ctx, pub.Plan(t))
		if err != nil {
			return err
		}
		refs[i] = fmt.Sprintf("%s/envsnap/env/%s:1", env.Registry.Host, t.ID)
		st, err := composer.Push(ctx, img, refs[i])
		if err != nil {
			return err
		}
		sizes[i] = episode.ImageSize(img)
		fmt.Printf("    %s: %d layers, %s image, %d layers linked, %d bytes uploaded, %s\n",
			t.ID, len(img.Manifest.Layers), mib(sizes[i]), st.LayersLinked, st.UploadedBytes, time.Since(start).Round(time.Millisecond))
	}

	lazy := episode.System{Name: "envsnap", Snapshotter: "envsnap", Runtime: "io.containerd.envlet.v2"}
	// Same runtime and quota policy: only the snapshotter differs.
	full := episode.System{Name: "overlayfs", Snapshotter: "overlayfs", Runtime: "io.containerd.envlet.v2"}
	step("running %d agent episodes lazily (envsnap snapshotter, envlet shim starting at 0.25 cores / 256 MiB)", n)
	var results []episode.Result
	quotas := map[string]string{}
	for i, t := range w.Tasks[:n] {
		r := episode.Run(ctx, env, refs[i], t, lazy, 10*time.Minute)
		r.ImageBytes = sizes[i]
		results = append(results, r)
		if r.Error != "" {
			fmt.Printf("    %s: FAILED: %s\n", t.ID, r.Error)
		}
		quotas[t.ID] = quotaChanges(env, r.Container)
	}
	step("the same first environment the usual way (full pull + unpack on overlayfs)")
	base := episode.Run(ctx, env, refs[0], w.Tasks[0], full, 10*time.Minute)
	base.ImageBytes = sizes[0]
	baseQuota := quotaChanges(env, base.Container)

	fmt.Println()
	tw = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "environment\tsystem\tready\tepisode\treward\tfetched when ready\tfetched by the end\timage\tquota")
	for _, r := range append(results, base) {
		q := quotas[r.Task]
		if r.System != lazy.Name {
			q = baseQuota
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s (%.1f%%)\t%s\t%s\t%s\n", r.Task, r.System, dur(r.Ready), dur(r.Episode), reward(r),
			mib(r.ReadyRegistryBytes), 100*float64(r.ReadyRegistryBytes)/float64(max(r.ImageBytes, 1)), mib(r.RegistryBytes), mib(r.ImageBytes), q)
	}
	tw.Flush()
	if first := results[0]; first.Error == "" && base.Error == "" {
		fmt.Printf("\nfirst environment: ready %.2fx and episode %.2fx of overlayfs time; %.2fx of its registry bytes\n",
			first.Ready.Seconds()/base.Ready.Seconds(), first.Episode.Seconds()/base.Episode.Seconds(),
			float64(first.RegistryBytes)/float64(max(base.RegistryBytes, 1)))
	}
	return nil
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func dur(d time.Duration) string {
	if d == 0 {
		return "-"
	}
	return d.Round(10 * time.Millisecond).String()
}

func reward(r episode.Result) string {
	if r.Error != "" {
		return "error"
	}
	return fmt.Sprint(r.Reward)
}

// quotaChanges summarises an environment's quota timeline from the node
// arbiter: start and peak CPU and memory, and how many changes.
func quotaChanges(env *devenv.Env, container string) string {
	out, err := env.EnvsnapCLI("envs", "--timeline", env.Namespace+"/"+container)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	rows, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(rows) < 2 {
		return "no timeline"
	}
	var cpu0, cpuMax float64
	var mem0, memMax int64
	changes := 0
	for i, row := range rows[1:] {
		if len(row) < 10 {
			continue
		}
		cpu, _ := strconv.ParseFloat(row[2], 64)
		mem, _ := strconv.ParseInt(row[3], 10, 64)
		if i == 0 {
			cpu0, mem0 = cpu, mem
		}
		cpuMax, memMax = max(cpuMax, cpu), max(memMax, mem)
		if row[9] != "" {
			changes++
		}
	}
	return fmt.Sprintf("%.2g->%.2g cores, %s->%s (%d changes)", cpu0, cpuMax, mib(mem0), mib(memMax), changes)
}
