package headline

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/internal/devenv"
)

// The committed report must not carry the absolute paths of the machine
// that ran it.
func TestReportPath(t *testing.T) {
	root, err := devenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ in, want string }{
		{filepath.Join(root, ".cache/bench/workload/full/tasks.jsonl"), ".cache/bench/workload/full/tasks.jsonl"},
		{"/elsewhere/workload/tasks.jsonl", "tasks.jsonl"},
		{filepath.Join(root, "..", "tasks.jsonl"), "tasks.jsonl"},
	} {
		if got := reportPath(tc.in); got != tc.want {
			t.Errorf("reportPath(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestWriteMarkdownKeepsOtherSections: sections other benchmarks wrote
// below KeptMarker survive a regenerated headline.
func TestWriteMarkdownKeepsOtherSections(t *testing.T) {
	path := filepath.Join(t.TempDir(), "benchmarks.md")
	kept := KeptMarker + "\n\n## Snapshots\n\n| a | b |\n"
	if err := os.WriteFile(path, []byte("# Benchmarks\n\nold headline\n\n"+kept), 0o644); err != nil {
		t.Fatal(err)
	}
	rep := &Report{}
	if err := rep.WriteMarkdown(path, "benchmarks.json", nil); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(got), "old headline") {
		t.Errorf("the old headline was kept")
	}
	if !strings.HasSuffix(string(got), kept) {
		t.Errorf("the kept sections are gone:\n%s", got)
	}
}

// TestReportRatios: the headline ratios come from the runs of the report
// (iteration makespans and bytes, warm medians), and a report cut short
// after the iteration prints no ratio it has no runs for.
func TestReportRatios(t *testing.T) {
	rep := &Report{Summary: map[string]map[string]Summary{}, Iterations: map[string][]Iteration{
		Overlayfs: {{Envs: 4, Concurrent: 2, Makespan: 100 * time.Second, RegistryBytes: 400}, {Envs: 4, Concurrent: 2, Makespan: 100 * time.Second, RegistryBytes: 400}},
		Envsnap:   {{Envs: 4, Concurrent: 2, Makespan: 40 * time.Second, RegistryBytes: 100}, {Envs: 4, Concurrent: 2, Makespan: 60 * time.Second, RegistryBytes: 100}},
	}}
	path := filepath.Join(t.TempDir(), "benchmarks.md")
	rep.summarize()
	if err := rep.WriteMarkdown(path, "benchmarks.json", nil); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	// Two rounds: the headline is the mean of their ratios, not the
	// lower one.
	if !strings.Contains(string(got), "envsnap / overlayfs: 0.500x** (median of the rounds' ratios: 0.400x, 0.600x; target <= 0.6x); registry bytes 0.25x") {
		t.Errorf("iteration ratios missing:\n%s", got)
	}
	if strings.Contains(string(got), "Floor on this node") {
		t.Errorf("a floor printed without CPU records:\n%s", got)
	}
	// The floor: overlayfs's own work over its cores and makespan.
	rep.Iterations[Overlayfs][0].CPU = map[string]float64{"node": 190, "containerd": 20, "bench": 5, "registry": 3, "envsnap": 1, "arbiter": 1}
	rep.Iterations[Overlayfs][1].CPU = map[string]float64{"node": 150, "containerd": 30}
	for i := range rep.Iterations[Overlayfs] {
		rep.Iterations[Overlayfs][i].Cores = 2
	}
	rep.summarize()
	if err := rep.WriteMarkdown(path, "benchmarks.json", nil); err != nil {
		t.Fatal(err)
	}
	got, _ = os.ReadFile(path)
	// Rounds: (190-30)/2/100 = 0.8 and (150-30)/2/100 = 0.6; the median
	// of two is their mean.
	if !strings.Contains(string(got), "**Floor on this node: 0.700x.**") {
		t.Errorf("floor missing or wrong:\n%s", got)
	}
	if !strings.Contains(string(got), "- overlayfs, round 1: node 190.0, arbiter 1.0, bench 5.0, containerd 20.0, envsnap 1.0, registry 3.0; the environments' own work 160.0, which fills 2 cores for 0.800 of the makespan.") {
		t.Errorf("round's own work missing:\n%s", got)
	}
	if strings.Contains(string(got), "one at a time, cold and warm") {
		t.Errorf("ratios printed without runs one at a time:\n%s", got)
	}

	for _, r := range []Run{
		{Result: episode.Result{System: Overlayfs, Phase: "warm", Ready: 2 * time.Second, Episode: 10 * time.Second, Output: "2.1.332 (Claude Code)\n" + episode.ReadyMarker + "\n"}},
		{Result: episode.Result{System: Envsnap, Phase: "warm", Ready: time.Second, Episode: 8 * time.Second}},
		{Result: episode.Result{System: Envsnap, Phase: "warm", Episode: time.Hour, Error: "failed"}},
		{Result: episode.Result{System: Overlayfs, Phase: "first", Ready: 20 * time.Second, Episode: 30 * time.Second}},
		{Result: episode.Result{System: Overlayfs, Phase: "second", Ready: 4 * time.Second, Episode: 16 * time.Second}},
		{Result: episode.Result{System: Envsnap, Phase: "first", Ready: time.Second, Episode: 20 * time.Second}},
		{Result: episode.Result{System: Envsnap, Phase: "second", Ready: 3 * time.Second, Episode: 24 * time.Second}},
	} {
		rep.Runs = append(rep.Runs, r)
	}
	rep.summarize()
	if h := rep.Headline; h.WarmInitRatio != 0.5 || h.WarmEpisodeRatio != 0.8 {
		t.Errorf("warm ratios %v, %v; want 0.5, 0.8 (a failed run does not count)", h.WarmInitRatio, h.WarmEpisodeRatio)
	}
	// The second of a pair against the second; the first of a pair is
	// not a cold run one at a time.
	if h := rep.Headline; h.SecondInitRatio != 0.75 || h.SecondEpisodeRatio != 1.5 || h.InitRatio != 0 {
		t.Errorf("second ratios %v, %v (cold %v); want 0.75, 1.5 (and no cold ratio)", h.SecondInitRatio, h.SecondEpisodeRatio, h.InitRatio)
	}
	rep.SecondAfter = 5
	if err := rep.WriteMarkdown(path, "benchmarks.json", nil); err != nil {
		t.Fatal(err)
	}
	got, _ = os.ReadFile(path)
	if !strings.Contains(string(got), "| warm: whole episode, envsnap / overlayfs | **0.800x** | <= 1.0x |") {
		t.Errorf("warm row missing:\n%s", got)
	}
	for _, want := range []string{
		"| second environment while the first runs: time to ready, envsnap / overlayfs | 0.750x | |",
		"| second environment while the first runs: whole episode, envsnap / overlayfs | **1.500x** | <= 1.0x |",
		"another of the same groups 5 s later, while the first runs",
	} {
		if !strings.Contains(string(got), want) {
			t.Errorf("%q missing:\n%s", want, got)
		}
	}
	if !strings.Contains(string(got), "`agent --version` printed `2.1.332 (Claude Code)`") {
		t.Errorf("agent release missing:\n%s", got)
	}
}

// TestReportSteps: the episode steps table has the median of each step per
// system and phase, in the script's order, and a blank for a step a group
// has no time for.
func TestReportSteps(t *testing.T) {
	rep := &Report{Summary: map[string]map[string]Summary{}}
	for _, r := range []Run{
		{Result: episode.Result{System: Overlayfs, Phase: "cold", Ready: time.Second, Episode: 5 * time.Second, Steps: map[string]float64{"test-before": 2, "git-status": 0.5}}},
		{Result: episode.Result{System: Envsnap, Phase: "cold", Ready: time.Second, Episode: 5 * time.Second, Steps: map[string]float64{"test-before": 3}}},
		{Result: episode.Result{System: Envsnap, Phase: "cold", Ready: time.Second, Episode: 5 * time.Second, Steps: map[string]float64{"test-before": 5}}},
		{Result: episode.Result{System: Envsnap, Phase: "cold", Ready: time.Second, Episode: 5 * time.Second, Steps: map[string]float64{"test-before": 4}}},
	} {
		rep.Runs = append(rep.Runs, r)
	}
	rep.summarize()
	path := filepath.Join(t.TempDir(), "benchmarks.md")
	if err := rep.WriteMarkdown(path, "benchmarks.json", nil); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(path)
	for _, want := range []string{"| system / phase | git-status | test-before |", "| envsnap/cold | | 4.00 |", "| overlayfs/cold | 0.50 | 2.00 |"} {
		if !strings.Contains(string(got), want) {
			t.Errorf("steps table lacks %q:\n%s", want, got)
		}
	}
}
