package reliability_test

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/tests/testenv"
)

// interruptedChild makes TestInterruptedTestTearsDown, run again by
// itself in a child test binary, the test that is interrupted.
const interruptedChild = "ENVSNAP_INTERRUPTED_CHILD"

// interruptedTest is the child's test: it has a running lazy container
// when it is interrupted. It prints what it started, then waits for the
// signal.
func interruptedTest(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	img := pushLazy(t, env, "rel/interrupted:1", []testenv.File{testenv.RandomFile("/data/f.bin", 2<<20, 21)})
	image := env.Pull(t, img.Ref, "envsnap")
	rc := startContainer(t, env, image, "", "sh", "-c", "head -c 1 /data/f.bin >/dev/null; echo up; exec sleep 100000")
	rc.waitOutput(t, "up", 30*time.Second)
	pids := []string{strconv.Itoa(int(rc.task.Pid()))}
	for _, p := range env.Processes() {
		pids = append(pids, strconv.Itoa(p.PID()))
	}
	fmt.Printf("STARTED dir=%s pids=%s\n", env.Dir, strings.Join(pids, ","))
	time.Sleep(10 * time.Minute)
	t.Error("no signal came")
}

// TestInterruptedTestTearsDown stops a test binary with SIGTERM, as
// Ctrl-C or a killed `make test` does, while its test has daemons, a
// FUSE mount and a container running (all in process groups of their
// own, which the signal does not reach): the binary must stop them and
// remove its directory before it exits.
func TestInterruptedTestTearsDown(t *testing.T) {
	if os.Getenv(interruptedChild) == "1" {
		interruptedTest(t)
		return
	}
	testenv.RequireRoot(t)
	testenv.Binary(t, "containerd-envsnap")
	cmd := exec.Command(os.Args[0], "-test.run=^TestInterruptedTestTearsDown$", "-test.v", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), interruptedChild+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	var dir string
	var pids []int
	lines := bufio.NewScanner(out)
	var log strings.Builder
	for dir == "" && lines.Scan() {
		log.WriteString(lines.Text() + "\n")
		rest, ok := strings.CutPrefix(lines.Text(), "STARTED ")
		if !ok {
			continue
		}
		for _, f := range strings.Fields(rest) {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "dir":
				dir = v
			case "pids":
				for _, s := range strings.Split(v, ",") {
					pid, err := strconv.Atoi(s)
					if err != nil {
						t.Fatalf("child printed %q: %v", lines.Text(), err)
					}
					pids = append(pids, pid)
				}
			}
		}
	}
	if dir == "" {
		cmd.Wait()
		t.Fatalf("the child ended before starting its container:\n%s\nstderr:\n%s", log.String(), stderr.String())
	}
	go func() {
		for lines.Scan() {
		}
	}()
	if mounts := testenv.MountsBelow(dir); len(mounts) == 0 {
		t.Fatalf("the child's environment has no mounts below %s before the signal: nothing to check", dir)
	}

	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var exit *exec.ExitError
		if !errors.As(err, &exit) {
			t.Errorf("the child ended with %v, want a non-zero exit", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("the child did not exit within 2m of SIGTERM; stderr:\n%s", stderr.String())
	}
	t.Logf("the child tore down and exited %.1fs after SIGTERM; it said: %s", time.Since(start).Seconds(), strings.TrimSpace(stderr.String()))
	if !strings.Contains(stderr.String(), "tearing down 1 environments") {
		t.Errorf("the child's stderr does not say it tore down its environment:\n%s", stderr.String())
	}

	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s is still there after the child exited (%v)", dir, err)
	}
	if mounts := testenv.MountsBelow(dir); len(mounts) > 0 {
		t.Errorf("mounts left below %s: %v", dir, mounts)
	}
	for _, pid := range pids {
		// The container's process and the daemons are not the child's
		// children: poll for them to go.
		deadline := time.Now().Add(10 * time.Second)
		for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if err := syscall.Kill(pid, 0); err == nil {
			args, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			t.Errorf("process %d (%s) still runs after the child exited", pid, strings.ReplaceAll(string(args), "\x00", " "))
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if t.Failed() {
		// What the child left: its daemons' helpers, mounts, directory.
		devenv.RemoveLeftovers(t.Logf, dir)
	}
}
