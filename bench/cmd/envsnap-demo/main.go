// Command envsnap-demo is `make demo`: it starts a private containerd,
// registry and envsnap daemon, publishes the small benchmark workload as
// layer groups, composes environments for a few tasks, and runs their
// agent episodes under the envlet shim one after another, as a rollout
// worker runs an iteration: lazily on envsnap, then the same environments
// the usual way (full pull and unpack on overlayfs), from an empty node
// each time. The registry sits behind the link the benchmark uses
// (1 Gbit/s, 20 ms round trip: bench/netshape), so what it prints is the
// real setting. It ends with the iteration's comparison.
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
	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/plan"
)

func main() {
	tasksPath := flag.String("tasks", "", "workload task list (default: build and use the small workload)")
	n := flag.Int("n", 3, "environments to run")
	rtt := flag.Duration("rtt", 20*time.Millisecond, "registry round trip")
	rate := flag.Int64("rate", 1_000_000_000, "registry link rate in bits/s")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *tasksPath, *n, *rtt, *rate); err != nil {
		fmt.Fprintf(os.Stderr, "envsnap-demo: %v\n", err)
		os.Exit(1)
	}
}

func step(format string, args ...any) {
	fmt.Printf("==> "+format+"\n", args...)
}

func run(ctx context.Context, tasksPath string, n int, rtt time.Duration, rate int64) error {
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

	step("starting a private registry behind a shaped link (%d Mbit/s, %s round trip), containerd and the envsnap daemon", rate/1e6, rtt)
	link, err := netshape.NewLink(ctx, netshape.WithLinkRate(rate))
	if err != nil {
		return fmt.Errorf("shaped link: %w", err)
	}
	defer link.Close(context.Background())
	regNet := netshape.NewRegistryNet(ctx, link, rtt)
	// Environments start small and grow with their demand (the envlet
	// shim, with the node arbiter); the report shows the quota changes.
	// The daemon runs as shipped, with background fill: the first
	// environment reads what it needs on demand while the rest of its
	// layers follow, and later ones find the shared groups on the node
	// (native lowers once a layer is complete), as in an iteration.
	// "fetched when ready" is what the first one needed before it could
	// answer.
	env, err := devenv.Start(ctx, devenv.WithEnvsnap(), devenv.WithDefaultLazyMinSize(), devenv.WithDirPrefix("envsnap-demo-"), devenv.WithRegistryNetwork(regNet),
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
	lazyBytes := env.Registry.BlobBytesServed()
	step("the same %d environments the usual way (full pull + unpack on overlayfs)", n)
	env.Registry.ResetCounters()
	var fulls []episode.Result
	fullQuotas := map[string]string{}
	for i, t := range w.Tasks[:n] {
		r := episode.Run(ctx, env, refs[i], t, full, 10*time.Minute)
		r.ImageBytes = sizes[i]
		fulls = append(fulls, r)
		if r.Error != "" {
			fmt.Printf("    %s: FAILED: %s\n", t.ID, r.Error)
		}
		fullQuotas[t.ID] = quotaChanges(env, r.Container)
	}
	fullBytes := env.Registry.BlobBytesServed()

	fmt.Println()
	tw = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "environment\tsystem\tready\tepisode\treward\tfetched when ready\tfetched by the end\timage\tquota")
	for _, r := range append(results, fulls...) {
		q := quotas[r.Task]
		if r.System != lazy.Name {
			q = fullQuotas[r.Task]
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s (%.1f%%)\t%s\t%s\t%s\n", r.Task, r.System, dur(r.Ready), dur(r.Episode), reward(r),
			mib(r.ReadyRegistryBytes), 100*float64(r.ReadyRegistryBytes)/float64(max(r.ImageBytes, 1)), mib(r.RegistryBytes), mib(r.ImageBytes), q)
	}
	tw.Flush()
	lazyTotal, lazyOK := total(results)
	fullTotal, fullOK := total(fulls)
	if lazyOK && fullOK {
		fmt.Printf("\niteration of %d environments one after another: envsnap %.1f s, overlayfs %.1f s (%.2fx); registry %s vs %s (%.2fx); first environment's episode %.2fx of overlayfs\n",
			n, lazyTotal.Seconds(), fullTotal.Seconds(), lazyTotal.Seconds()/fullTotal.Seconds(),
			mib(lazyBytes), mib(fullBytes), float64(lazyBytes)/float64(max(fullBytes, 1)),
			results[0].Episode.Seconds()/fulls[0].Episode.Seconds())
	}
	return nil
}

// total sums the episodes (pull to evaluator) of rs, which ran one after
// another; false when one failed.
func total(rs []episode.Result) (time.Duration, bool) {
	var d time.Duration
	for _, r := range rs {
		if r.Error != "" {
			return 0, false
		}
		d += r.Episode
	}
	return d, len(rs) > 0
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
