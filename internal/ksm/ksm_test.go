package ksm

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/envsnap/envsnap/internal/prereq"
)

// helperEnv makes the test binary a helper process: "merge" marks itself
// and runs the binary again as "report"; "start" runs it as "report"
// unmarked; "report" prints whether it is marked and its ksm_stat;
// "merge-exec" and "exec" become TestBenchAgents' agent CLI, marked or
// not.
const helperEnv = "ENVSNAP_KSM_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "":
		os.Exit(m.Run())
	case "merge":
		if err := MergeSelf(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		fallthrough
	case "start":
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), helperEnv+"=report")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			os.Exit(2)
		}
	case "merge-exec":
		if err := MergeSelf(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		fallthrough
	case "exec":
		// TestBenchAgents: become the agent CLI, marked or not.
		agent := os.Getenv(agentEnv)
		err := syscall.Exec(agent, append([]string{agent}, os.Args[1:]...), os.Environ())
		fmt.Fprintf(os.Stderr, "exec %s: %v\n", agent, err)
		os.Exit(2)
	case "report":
		on, err := Merging()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		p, err := ReadProcess(os.Getpid())
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		fmt.Printf("merging=%v merge_any=%v\n", on, p.MergeAny)
	}
	os.Exit(0)
}

func helper(t *testing.T, mode string) string {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	out, err := cmd.CombinedOutput()
	if err != nil {
		if strings.Contains(string(out), ErrUnsupported.Error()) {
			prereq.Missing(t, "%s", ErrUnsupported)
		}
		t.Fatalf("helper %s: %v\n%s", mode, err, out)
	}
	return strings.TrimSpace(string(out))
}

// The mark reaches a process started after it (fork, then execve), which
// is how a shim's mark reaches the containers runc starts; a process
// started without it stays unmarked.
func TestMergeSelfReachesChildren(t *testing.T) {
	if _, err := Merging(); errors.Is(err, ErrUnsupported) {
		prereq.Missing(t, "%s", err)
	}
	if got := helper(t, "merge"); !strings.HasPrefix(got, "merging=true") {
		t.Errorf("child of a marked process: %q, want merging=true", got)
	}
	if got := helper(t, "start"); !strings.HasPrefix(got, "merging=false") {
		t.Errorf("child of an unmarked process: %q, want merging=false", got)
	}
}

func TestReadNode(t *testing.T) {
	n, err := ReadNode()
	if errors.Is(err, ErrUnsupported) {
		prereq.Missing(t, "%v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if n.Run < 0 || n.Run > 2 || n.Shared < 0 || n.Sharing < 0 {
		t.Errorf("implausible counters %+v", n)
	}
	cpu, err := DaemonCPU()
	if err != nil {
		t.Fatal(err)
	}
	if cpu < 0 {
		t.Errorf("ksmd CPU %v s", cpu)
	}
}

func TestParseProcess(t *testing.T) {
	// Linux 6.12's /proc/PID/ksm_stat.
	p, err := parseProcess(strings.NewReader("ksm_rmap_items 40\nksm_zero_pages 0\nksm_merging_pages 37\nksm_process_profit 143360\nksm_merge_any: yes\nksm_mergeable: yes\n"))
	if err != nil {
		t.Fatal(err)
	}
	if want := (Process{MergingPages: 37, Profit: 143360, MergeAny: true}); p != want {
		t.Errorf("got %+v, want %+v", p, want)
	}
	if _, err := parseProcess(strings.NewReader("ksm_merging_pages many\n")); err == nil {
		t.Error("no error for a malformed count")
	}
}

func TestReadProcess(t *testing.T) {
	p, err := ReadProcess(os.Getpid())
	if errors.Is(err, os.ErrNotExist) {
		prereq.Missing(t, "no /proc/PID/ksm_stat (Linux >= 6.1): %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if p.MergingPages < 0 {
		t.Errorf("implausible %+v", p)
	}
	if _, err := ReadProcess(-1); err == nil {
		t.Error("no error for a process that cannot exist")
	}
}
