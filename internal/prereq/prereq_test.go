package prereq

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestMissingFailsUnderCI runs this test binary again as a child with and
// without CI=true and reads what go test reported for a test that calls
// Missing and one that calls Skip with an allowed reason.
func TestMissingFailsUnderCI(t *testing.T) {
	if os.Getenv("PREREQ_CHILD") == "1" {
		return
	}
	for _, tc := range []struct {
		ci          string
		wantMissing string // what the child reports for TestChildMissing
	}{
		{"", "--- SKIP: TestChildMissing"},
		{"true", "--- FAIL: TestChildMissing"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestChild", "-test.v")
		cmd.Env = append(os.Environ(), "PREREQ_CHILD=1", "CI="+tc.ci)
		out, _ := cmd.CombinedOutput()
		if !strings.Contains(string(out), tc.wantMissing) {
			t.Errorf("CI=%q: want %q in\n%s", tc.ci, tc.wantMissing, out)
		}
		if !strings.Contains(string(out), "--- SKIP: TestChildAllowed") {
			t.Errorf("CI=%q: an allowed skip did not skip:\n%s", tc.ci, out)
		}
	}
}

func TestChildMissing(t *testing.T) {
	if os.Getenv("PREREQ_CHILD") != "1" {
		Skip(t, HelperProcess, "")
	}
	Missing(t, "a tool this test needs")
}

func TestChildAllowed(t *testing.T) {
	if os.Getenv("PREREQ_CHILD") != "1" {
		Skip(t, HelperProcess, "")
	}
	Skip(t, PageCacheKept, "")
}

// Every reason has its entry in the allowed list.
func TestEveryReasonListed(t *testing.T) {
	for r := Bench; r <= WorkloadNotBuilt; r++ {
		if allowed[r] == "" {
			t.Errorf("reason %d has no entry in allowed", r)
		}
	}
}
