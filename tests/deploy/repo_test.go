package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// outsideRefs are references a file of the repository must not make: the
// repository stands alone, so nothing may point at notes kept next to it
// or at the paths of the machine a file was written or generated on.
// The patterns are built from pieces so that this file does not match
// itself.
var outsideRefs = []struct {
	re   *regexp.Regexp
	what string
}{
	{regexp.MustCompile(`\b` + "DESIGN" + `\.md\b`), "a design document outside the repository"},
	{regexp.MustCompile(`\.\./` + "shared" + `/|\b` + "shared" + `/research\b`), "a shared directory outside the repository"},
	{regexp.MustCompile(`(^|[^\w.$}/-])/` + "work" + `/`), "an absolute path of a build machine"},
}

// homePath finds absolute paths under root's home directory. Some are
// paths the files configure, on a node or inside the workload images;
// homeAllowed lists those.
var (
	homePath    = regexp.MustCompile(`(?:^|[^\w.$}/-])(/` + "root" + `/[\w./-]*)`)
	homeAllowed = []string{"/root/.docker", "/root/go", "/root/.cache/go-build"}
)

// outsideRef returns what line refers to outside the repository, or "".
func outsideRef(line string) string {
	for _, r := range outsideRefs {
		if r.re.MatchString(line) {
			return r.what
		}
	}
	for _, m := range homePath.FindAllStringSubmatch(line, -1) {
		ok := false
		for _, a := range homeAllowed {
			if m[1] == a || strings.HasPrefix(m[1], a+"/") {
				ok = true
			}
		}
		if !ok {
			return "an absolute path of a build machine"
		}
	}
	return ""
}

// TestNoReferencesOutsideTheRepository checks every file git tracks (or
// would track) for references to files outside the repository.
func TestNoReferencesOutsideTheRepository(t *testing.T) {
	root := testenv.RepoRoot(t)
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	checked := 0
	for _, rel := range strings.Split(strings.TrimRight(string(out), "\x00"), "\x00") {
		b, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			if os.IsNotExist(err) { // deleted in the work tree, not yet in the index
				continue
			}
			t.Fatal(err)
		}
		if bytes.IndexByte(b, 0) >= 0 {
			continue // binary (plots, fuzz corpora)
		}
		checked++
		for i, line := range strings.Split(string(b), "\n") {
			if what := outsideRef(line); what != "" {
				t.Errorf("%s:%d refers to %s: %s", rel, i+1, what, strings.TrimSpace(line))
			}
		}
	}
	if checked < 100 {
		t.Fatalf("checked only %d files: git ls-files did not list the repository", checked)
	}
}

// TestOutsideRefPatterns: the patterns catch what they are for and leave
// the paths files legitimately configure alone.
func TestOutsideRefPatterns(t *testing.T) {
	match := func(s string) bool { return outsideRef(s) != "" }
	for _, s := range []string{
		"see " + "DESIGN" + ".md",
		"`../" + "shared" + "/research/vm.md`",
		"  \"workload\": \"/" + "work/main/.cache/tasks.jsonl\",",
		"cp /" + "root/src/envsnap/bin/x .",
		"GOMODCACHE=/" + "root/gopath",
		"/" + "root/.dockerfile",
	} {
		if !match(s) {
			t.Errorf("not caught: %s", s)
		}
	}
	for _, s := range []string{
		`docker_config = "/root/.docker/config.json"`,
		"GOMODCACHE=/root/go/pkg/mod GOCACHE=/root/.cache/go-build",
		`work=$cache/work/$variant`,
		"under `.cache/bench/work/shared`",
		`mkdir -p "$frag/root/.cache"`,
		"the paths /root/go and /root/.docker",
	} {
		if match(s) {
			t.Errorf("caught wrongly: %s", s)
		}
	}
}
