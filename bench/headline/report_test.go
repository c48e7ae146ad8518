package headline

import (
	"path/filepath"
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
