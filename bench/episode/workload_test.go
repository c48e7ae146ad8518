package episode

import (
	"os"
	"path/filepath"
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
