// Package workload holds the builder of the benchmark workload
// (build.sh); this test checks what a build produced, when one exists.
package workload

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	"github.com/bluekeyes/go-gitdiff/gitdiff"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/internal/prereq"
)

// builtTaskLists finds tasks.jsonl files of earlier build.sh runs.
func builtTaskLists(t *testing.T) []string {
	t.Helper()
	cache := os.Getenv("ENVSNAP_BENCH_CACHE")
	if cache == "" {
		cache = filepath.Join("..", "..", ".cache", "bench")
	}
	lists, _ := filepath.Glob(filepath.Join(cache, "workload", "*", "tasks.jsonl"))
	if len(lists) == 0 {
		prereq.Skip(t, prereq.WorkloadNotBuilt, "run bench/workload/build.sh --small")
	}
	return lists
}

func readTasks(t *testing.T, list string) []episode.Task {
	t.Helper()
	w, err := episode.LoadWorkload(list)
	if err != nil {
		t.Fatal(err)
	}
	return w.Tasks
}

// filesFromTar returns the named files' contents from a group tarball,
// names relative to the rootfs without a leading slash.
func filesFromTar(t *testing.T, tarPath string, want map[string]bool) map[string][]byte {
	t.Helper()
	f, err := os.Open(tarPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", tarPath, err)
		}
		name := strings.TrimPrefix(path.Clean(h.Name), "./")
		if want[name] {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			got[name] = b
		}
	}
	return got
}

func parsePatch(t *testing.T, p string) []*gitdiff.File {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files, _, err := gitdiff.Parse(f)
	if err != nil {
		t.Fatalf("parse %s: %v", p, err)
	}
	if len(files) == 0 {
		t.Fatalf("%s: no file changes", p)
	}
	return files
}

func apply(t *testing.T, files map[string][]byte, root string, diff []*gitdiff.File) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for k, v := range files {
		out[k] = v
	}
	for _, fd := range diff {
		name := path.Join(root, fd.OldName)
		src, ok := out[name]
		if !ok {
			t.Fatalf("patch touches %s, not in the task group", name)
		}
		var dst bytes.Buffer
		if err := gitdiff.Apply(&dst, bytes.NewReader(src), fd); err != nil {
			t.Fatalf("apply to %s: %v", name, err)
		}
		out[name] = dst.Bytes()
	}
	return out
}

// TestBuiltPatchesApplyWithGoGitdiff checks that every task's bug patch
// applies to the repository shipped in its task group with a Go patch
// library (as a runtime applying mutations would), changes it, and that
// the fix restores the original bytes.
func TestBuiltPatchesApplyWithGoGitdiff(t *testing.T) {
	for _, list := range builtTaskLists(t) {
		tasks := readTasks(t, list)
		if len(tasks) == 0 {
			t.Errorf("%s: no tasks", list)
		}
		for _, tk := range tasks {
			t.Run(filepath.Base(filepath.Dir(list))+"/"+tk.ID, func(t *testing.T) {
				bug := parsePatch(t, tk.Patch)
				fix := parsePatch(t, tk.Fix)
				root := strings.TrimPrefix(tk.Repo, "/")
				want := map[string]bool{}
				for _, fd := range bug {
					want[path.Join(root, fd.OldName)] = true
				}
				orig := filesFromTar(t, tk.Groups["task"], want)
				buggy := apply(t, orig, root, bug)
				changed := false
				for k := range orig {
					if !bytes.Equal(orig[k], buggy[k]) {
						changed = true
					}
				}
				if !changed {
					t.Fatal("bug patch changes nothing")
				}
				fixed := apply(t, buggy, root, fix)
				for k := range orig {
					if !bytes.Equal(orig[k], fixed[k]) {
						t.Errorf("%s: fix does not restore the original", k)
					}
				}
			})
		}
	}
}
