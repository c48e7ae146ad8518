// Package groups_test publishes layer groups and composes environments with
// the containerd-envsnap CLI against the harness registry, then runs them
// lazily with the envsnap snapshotter on a real containerd.
package groups_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// calc is the task repository: a tiny shell "project" with its own tests.
const calcSh = `#!/bin/sh
add() { echo $(( $1 + $2 )); }
mul() { echo $(( $1 * $2 )); }
`

const calcTestSh = `#!/bin/sh
. "$(dirname "$0")/calc.sh"
fail=0
[ "$(add 2 3)" = 5 ] || { echo "FAIL add"; fail=1; }
[ "$(mul 2 3)" = 6 ] || { echo "FAIL mul"; fail=1; }
[ $fail = 0 ] && echo PASS
exit $fail
`

// breakAdd injects a bug the repository's tests catch.
const breakAdd = `diff --git a/calc.sh b/calc.sh
--- a/calc.sh
+++ b/calc.sh
@@ -1,3 +1,3 @@
 #!/bin/sh
-add() { echo $(( $1 + $2 )); }
+add() { echo $(( $1 - $2 )); }
 mul() { echo $(( $1 * $2 )); }
`

// addComment changes the repository without breaking it.
const addComment = `diff --git a/calc.sh b/calc.sh
--- a/calc.sh
+++ b/calc.sh
@@ -1,3 +1,4 @@
 #!/bin/sh
+# harmless task mutation
 add() { echo $(( $1 + $2 )); }
 mul() { echo $(( $1 * $2 )); }
`

const evaluatorSh = `#!/bin/sh
# Runs the task's tests and prints the reward.
if sh /workspace/calc/test.sh; then echo reward=1; exit 0; fi
echo reward=0
exit 1
`

type fixture struct {
	env  *testenv.Env
	dir  string
	bin  string
	base string
	task string
	harn string
	eval string
}

func (f *fixture) cli(t *testing.T, args ...string) string {
	t.Helper()
	full := append(args, "--hosts-dir", f.env.HostsDir)
	cmd := exec.Command(f.bin, full...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("containerd-envsnap %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	// The tools are quiet by default: containerd's info lines and its
	// fs-verity warning read as failures to a new user. Nothing these
	// runs do deserves a warning, so no log line at all.
	if strings.Contains(string(out), "level=") {
		t.Errorf("containerd-envsnap %s logged without -v:\n%s", strings.Join(args, " "), out)
	}
	return string(out)
}

func writeTree(t *testing.T, root string, files map[string]string) string {
	t.Helper()
	for name, body := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		mode := os.FileMode(0o644)
		if strings.HasSuffix(name, ".sh") || strings.Contains(name, "bin/") {
			mode = 0o755
		}
		if err := os.WriteFile(p, []byte(body), mode); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// publishGroups publishes base (the busybox test userland), a task group
// holding the calc repository, a harness with an executable on its PATH and
// an evaluator script.
func publishGroups(t *testing.T, env *testenv.Env) *fixture {
	f := &fixture{env: env, dir: t.TempDir(), bin: testenv.Binary(t, "containerd-envsnap")}
	reg := env.Registry.Host
	bb, err := testenv.BusyboxFiles()
	if err != nil {
		t.Fatal(err)
	}
	baseTar, err := testenv.LayerTar(bb)
	if err != nil {
		t.Fatal(err)
	}
	baseTarPath := filepath.Join(f.dir, "base.tar")
	if err := os.WriteFile(baseTarPath, baseTar, 0o644); err != nil {
		t.Fatal(err)
	}
	f.base = reg + "/envsnap/base/busybox:1"
	f.cli(t, "group", "publish", "--kind", "base", "--from-tar", baseTarPath,
		"--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", f.base)

	repo := writeTree(t, filepath.Join(f.dir, "calc"), map[string]string{"calc.sh": calcSh, "test.sh": calcTestSh, "README": "calc\n"})
	f.task = reg + "/envsnap/task/calc:1"
	f.cli(t, "group", "publish", "--kind", "task", "--from-dir", repo, "--prefix", "/workspace/calc", "--owner", "0:0", "--mtime", "0",
		"--workdir", "/workspace/calc", f.task)

	harness := writeTree(t, filepath.Join(f.dir, "harness"), map[string]string{"bin/agent": "#!/bin/sh\n[ \"$1\" = --version ] && { echo agent 1.0; exit 0; }\necho working\n"})
	f.harn = reg + "/envsnap/harness/agent:1"
	f.cli(t, "group", "publish", "--kind", "harness", "--from-dir", harness, "--prefix", "/opt/harness", "--owner", "0:0", "--mtime", "0",
		"--env", "PATH=/opt/harness/bin", f.harn)

	eval := writeTree(t, filepath.Join(f.dir, "evaluator"), map[string]string{"run.sh": evaluatorSh})
	f.eval = reg + "/envsnap/evaluator/calc:1"
	f.cli(t, "group", "publish", "--kind", "evaluator", "--from-dir", eval, "--prefix", "/opt/evaluator", "--owner", "0:0", "--mtime", "0", f.eval)
	return f
}

func (f *fixture) writePlan(t *testing.T, name, patch string) string {
	t.Helper()
	patchPath := filepath.Join(f.dir, name+".diff")
	if err := os.WriteFile(patchPath, []byte(patch), 0o644); err != nil {
		t.Fatal(err)
	}
	plan := fmt.Sprintf(`name = %q
groups = [%q, %q, %q, %q]
[process]
cmd = ["/bin/sh"]
[mutation]
patch_file = %q
dir = "/workspace/calc"
`, name, f.base, f.task, f.harn, f.eval, name+".diff")
	p := filepath.Join(f.dir, name+".toml")
	if err := os.WriteFile(p, []byte(plan), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

const episode = "agent --version && pwd && grep -c add calc.sh && /opt/evaluator/run.sh"

func TestComposeAndRunLazily(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := publishGroups(t, env)

	// Registry mode: the broken task. Composition uploads no layer.
	env.Registry.ResetCounters()
	target := env.Registry.Host + "/envsnap/env/calc-broken:1"
	out := f.cli(t, "compose", "--target", target, f.writePlan(t, "calc-broken", breakAdd))
	t.Logf("compose: %s", out)
	assertNoLayerUploads(t, env, 1)

	img := env.Pull(t, target, "envsnap")
	res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", episode}})
	t.Logf("broken episode: exit %d\n%s%s", res.ExitCode, res.Stdout, res.Stderr)
	if !strings.Contains(res.Stdout, "agent 1.0") || !strings.Contains(res.Stdout, "/workspace/calc") {
		t.Errorf("harness did not run from its PATH in the group's working dir:\n%s", res.Stdout)
	}
	if res.ExitCode == 0 || !strings.Contains(res.Stdout, "FAIL add") || !strings.Contains(res.Stdout, "reward=0") {
		t.Errorf("breaking patch: exit %d, want non-zero with FAIL add and reward=0:\n%s", res.ExitCode, res.Stdout)
	}

	// Local mode: the harmless task, straight into containerd's stores.
	env.Registry.ResetCounters()
	name := "envsnap.local/calc-ok:1"
	out = f.cli(t, "compose", "--local", "--address", env.Address, "--namespace", env.Namespace, "--target", name, f.writePlan(t, "calc-ok", addComment))
	t.Logf("compose --local: %s", out)
	if n := env.Registry.UploadRequests(); n != 0 {
		t.Errorf("local composition sent %d upload requests to the registry, want 0", n)
	}
	limg, err := env.Client.GetImage(env.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	res = env.RunContainer(t, limg, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", "head -2 calc.sh && " + episode}})
	t.Logf("ok episode: exit %d\n%s%s", res.ExitCode, res.Stdout, res.Stderr)
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "# harmless task mutation") || !strings.Contains(res.Stdout, "reward=1") {
		t.Errorf("harmless patch: exit %d, want 0 with the patched line and reward=1:\n%s", res.ExitCode, res.Stdout)
	}
}

// assertNoLayerUploads checks that only manifests and configs (and the
// small mutation layers) were uploaded: no group layer crossed the wire.
func assertNoLayerUploads(t *testing.T, env *testenv.Env, plans int) {
	t.Helper()
	up := env.Registry.UploadedDigests()
	// Per plan: one config and, with a mutation, one small layer.
	if len(up) > 2*plans {
		t.Errorf("composition uploaded %d blobs for %d plans: %v", len(up), plans, up)
	}
	// Composition reads group configs and, for a mutation, the task
	// layer's TOC and the chunks of the patched files: a few KiB. The
	// busybox base layer alone is ~1 MiB, so any layer download shows.
	if n := env.Registry.BlobBytesServed(); n > 64<<10 {
		t.Errorf("composition downloaded %d blob bytes, want metadata only (< 64 KiB)", n)
	}
}

func countLines(s string) int {
	n := 0
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		n++
	}
	return n
}
