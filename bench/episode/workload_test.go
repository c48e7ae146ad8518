package episode

import (
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestLoadWorkloadRelativePaths: paths in a task list are relative to the
// list's directory (a workload cache linked into another checkout keeps
// working); absolute ones are kept.
func TestLoadWorkloadRelativePaths(t *testing.T) {
	dir := t.TempDir()
	list := filepath.Join(dir, "tasks.jsonl")
	line := `{"id":"a","groups":{"base":"base.tar","task":"task-x.tar","harness":"/abs/harness.tar","evaluator":"evaluator.tar"},` +
		`"repo":"/workspace/x","patch":"tasks/x/a/bug.diff","fix":"tasks/x/a/fix.diff","fix_in_rootfs":"/opt/tasks/x/a/fix.diff"}` + "\n"
	if err := os.WriteFile(list, []byte(line), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := LoadWorkload(list)
	if err != nil {
		t.Fatal(err)
	}
	tk := w.Tasks[0]
	for got, want := range map[string]string{
		tk.Groups["base"]:    filepath.Join(dir, "base.tar"),
		tk.Groups["task"]:    filepath.Join(dir, "task-x.tar"),
		tk.Groups["harness"]: "/abs/harness.tar",
		tk.Patch:             filepath.Join(dir, "tasks/x/a/bug.diff"),
		tk.Fix:               filepath.Join(dir, "tasks/x/a/fix.diff"),
		tk.Repo:              "/workspace/x",
		tk.FixInRootfs:       "/opt/tasks/x/a/fix.diff",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
}

func TestParseSteps(t *testing.T) {
	out := "2.1.100 (Claude Code)\nepisode step=harness-version rc=0 seconds=64.314\nok  \tgithub.com/x\t(cached)\n" +
		"episode step=test-before rc=1 seconds=3.5\nepisode step=bogus rc=0 seconds=\n"
	want := map[string]float64{"harness-version": 64.314, "test-before": 3.5}
	if got := parseSteps(out); !maps.Equal(got, want) {
		t.Fatalf("parseSteps = %v, want %v", got, want)
	}
	if parseSteps("no steps here\n") != nil {
		t.Fatal("steps parsed from output without any")
	}
}

// TestStepOrderMatchesScript: StepOrder names the episode script's steps
// in its order.
func TestStepOrderMatchesScript(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "workload", "evaluator", "episode.sh"))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range regexp.MustCompile(`(?m)^step (\S+) `).FindAllStringSubmatch(string(b), -1) {
		got = append(got, m[1])
	}
	if want := StepOrder[:len(StepOrder)-1]; !slices.Equal(got, want) || !strings.Contains(string(b), "step=total-before-eval") {
		t.Fatalf("episode.sh runs steps %v (and total-before-eval: %v), StepOrder says %v", got, strings.Contains(string(b), "step=total-before-eval"), StepOrder)
	}
}
