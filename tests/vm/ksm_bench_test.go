package vm_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestBenchKSMAgents measures KSM across identical agent CLIs in the
// guest, the node whose KSM settings are ours (this machine's are not):
// internal/ksm's TestBenchAgents runs the benchmark workload's agent CLI
// (its harness group, extracted here and shared read-only with the guest
// at /opt/harness) four times unmarked, then four times marked, and logs
// what ksmd saved and what it cost. ENVSNAP_BENCH=1 (make bench); needs
// the workload (ENVSNAP_BENCH_CACHE, default .cache/bench).
func TestBenchKSMAgents(t *testing.T) {
	prereq.RequireBench(t)
	require(t, os.Geteuid() == 0, "needs root (builds the guest image, runs qemu)")
	root := testenv.RepoRoot(t)
	cache := os.Getenv("ENVSNAP_BENCH_CACHE")
	if cache == "" {
		cache = filepath.Join(root, ".cache", "bench")
	}
	harnessTar := filepath.Join(cache, "workload", "small", "harness.tar")
	if _, err := os.Stat(harnessTar); err != nil {
		prereq.Skip(t, prereq.WorkloadNotBuilt, "%v", err)
	}
	img := buildImage(t, root)

	harness := t.TempDir()
	if out, err := exec.Command("tar", "-C", harness, "-xf", harnessTar).CombinedOutput(); err != nil {
		t.Fatalf("extract %s: %v\n%s", harnessTar, err, out)
	}
	share := t.TempDir()
	bin := filepath.Join(share, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", "test", "-c", "-o", filepath.Join(bin, "ksm.test"), "./internal/ksm")
	build.Dir = root
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build internal/ksm tests: %v\n%s", err, out)
	}
	copyFile(t, filepath.Join("testdata", "ksm-agents.sh"), filepath.Join(share, "guest.sh"))
	start := time.Now()
	// -cpu max: the agent CLI's native build uses AVX2, which TCG's
	// default CPU model lacks (the agents die of SIGILL).
	runGuest(t, img, share, 50*time.Minute, "-cpu", "max",
		"-virtfs", "local,path="+filepath.Join(harness, "opt", "harness")+",mount_tag=harness,security_model=none,id=harness,readonly=on")
	t.Logf("guest run %s", time.Since(start).Round(time.Second))
}
