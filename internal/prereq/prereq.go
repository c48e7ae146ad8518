// Package prereq decides what a test does when something it needs is
// missing. On a developer's machine it skips, saying what is missing. Under
// CI=true (what CI sets) it fails instead: a run that skipped half of the
// suite must not look green. The only skips CI accepts are the ones in
// allowed below, each with its reason; every test of the project goes
// through this package instead of calling t.Skip itself.
package prereq

import (
	"fmt"
	"os"
	"testing"

	"github.com/envsnap/envsnap/internal/mounttest"
)

// Reason is a skip CI accepts. The list is closed: a new one is added
// here, with its reason, or the test must fail under CI.
type Reason int

const (
	// Bench: benchmarks and long runs gated by ENVSNAP_BENCH=1 are opt-in
	// (`make bench`), not prerequisites.
	Bench Reason = iota
	// Short: tests that do heavy work leave it out under `go test -short`,
	// which only a person asks for; `make test` does not.
	Short
	// HelperProcess: a test binary re-executed as a helper child runs
	// only when its parent test asks (an environment variable); as a
	// test of its own it has nothing to do.
	HelperProcess
	// NoCgroupV1: the cgroup v1 controller tests need the v1 cpu, cpuacct
	// and memory hierarchies, which a cgroup v2 (unified) host does not
	// have and cannot be given.
	NoCgroupV1
	// NoFUSEPassthrough: FUSE passthrough needs Linux 6.9 or newer.
	NoFUSEPassthrough
	// HostSaturated: the test measures how the controller follows a
	// workload's demand; when other work saturates the host the workload
	// shows no demand and the run cannot tell either way.
	HostSaturated
	// PageCacheKept: the test needs a file system that drops clean pages
	// on FADV_DONTNEED; some (overlay upper on tmpfs) keep them.
	PageCacheKept
	// WorkloadNotBuilt: the benchmark workload is built by `make demo` and
	// `make bench` (gigabytes from Debian, the Go module proxy and npm),
	// never by `make test`; its checks run only once it exists.
	WorkloadNotBuilt
)

// allowed is the one list of skips CI accepts, with why each is not a
// missing prerequisite.
var allowed = map[Reason]string{
	Bench:             "opt-in benchmark (ENVSNAP_BENCH=1, make bench)",
	Short:             "go test -short",
	HelperProcess:     "helper process, run by its parent test",
	NoCgroupV1:        "no cgroup v1 hierarchies on this host (unified cgroup v2)",
	NoFUSEPassthrough: "kernel without FUSE passthrough (Linux < 6.9)",
	HostSaturated:     "host saturated by other work: the measurement cannot decide",
	PageCacheKept:     "file system keeps pages after FADV_DONTNEED",
	WorkloadNotBuilt:  "benchmark workload not built (make demo or make bench builds it)",
}

// CI reports whether missing prerequisites fail the run.
func CI() bool { return os.Getenv("CI") == "true" }

// Missing stops t because something it needs is missing: a skip, or under
// CI=true a failure.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if CI() {
		t.Fatalf("missing test prerequisite (CI=true fails instead of skipping): %s", msg)
	}
	t.Skipf("missing prerequisite: %s", msg)
}

// Skip skips t for an allowed reason, also under CI.
func Skip(t testing.TB, r Reason, format string, args ...any) {
	t.Helper()
	why, ok := allowed[r]
	if !ok {
		t.Fatalf("prereq: skip reason %d is not in the allowed list", r)
	}
	if format != "" {
		why += ": " + fmt.Sprintf(format, args...)
	}
	t.Skip(why)
}

// BenchEnabled reports whether the opt-in benchmarks run.
func BenchEnabled() bool { return os.Getenv("ENVSNAP_BENCH") == "1" }

// RequireBench skips t unless ENVSNAP_BENCH=1.
func RequireBench(t testing.TB) {
	t.Helper()
	if !BenchEnabled() {
		Skip(t, Bench, "")
	}
}

// RequireRoot stops t unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "needs root")
	}
}

// RequireFUSE stops t unless it runs as root with /dev/fuse, and fails t
// if it leaves a mount below its temporary directories
// (mounttest.NoLeaks): call it before t mounts anything.
func RequireFUSE(t testing.TB) {
	t.Helper()
	RequireRoot(t)
	if _, err := os.Stat("/dev/fuse"); err != nil {
		Missing(t, "needs /dev/fuse: %v", err)
	}
	mounttest.NoLeaks(t)
}
