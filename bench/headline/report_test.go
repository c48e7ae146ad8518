package headline

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

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
