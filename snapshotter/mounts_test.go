package snapshotter

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// A daemon in a mount namespace of its own (a Kubernetes pod) must see the
// mounts made in the host's after it started (containers' overlays): this
// test's child runs in a private copy of the host's namespace, and the
// test mounts a tmpfs in the host's once the child is there.
func TestContainerMountsSeesPID1Namespace(t *testing.T) {
	if target := os.Getenv("ENVSNAP_TEST_MOUNTS_TARGET"); target != "" {
		childCountMounts(target)
		return
	}
	prereq.RequireRoot(t)
	if _, err := exec.LookPath("unshare"); err != nil {
		prereq.Missing(t, "unshare (util-linux): %v", err)
	}
	target := filepath.Join(t.TempDir(), "container-rootfs")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	child := exec.Command("unshare", "--mount", "--propagation", "private",
		os.Args[0], "-test.run=^TestContainerMountsSeesPID1Namespace$")
	child.Env = append(os.Environ(), "ENVSNAP_TEST_MOUNTS_TARGET="+target)
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Wait()
	defer stdin.Close()
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "ready" {
		t.Fatalf("child: %q, want ready", lines.Text())
	}
	if err := unix.Mount("tmpfs", target, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(target, unix.MNT_DETACH)
	fmt.Fprintln(stdin, "counted")
	var got string
	for lines.Scan() {
		if strings.HasPrefix(lines.Text(), "own=") {
			got = lines.Text()
		}
	}
	if got != "own=0 containers=1" {
		t.Errorf("in a private mount namespace, the host's new tmpfs at %s: %q; want own=0 containers=1 (not in its own table, found through PID 1's)", target, got)
	}
}

// childCountMounts runs in the test's child: it says it is in its own
// namespace, waits for the parent's mount, and prints what each view finds.
func childCountMounts(target string) {
	fmt.Println("ready")
	bufio.NewScanner(os.Stdin).Scan()
	own, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(target))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	all, err := containerMounts(mountinfo.SingleEntryFilter(target))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("own=%d containers=%d\n", len(own), len(all))
	os.Exit(0)
}
