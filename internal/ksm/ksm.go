// Package ksm marks a process's memory mergeable by the kernel's
// same-page merging (KSM) and reads what merging saves and costs.
//
// Linux >= 6.4 lets a process mark all of its anonymous memory mergeable
// with one prctl (PR_SET_MEMORY_MERGE); the mark is kept by the processes
// it forks and across execve (shown here on 6.12 and 6.18).
// A shim that marks itself before it starts runc therefore marks every
// container process it starts, without touching the container's image
// or command. Whether anything is merged is the node's choice:
// /sys/kernel/mm/ksm/run must be 1 (ksmd scanning); this package never
// writes it.
package ksm

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
)

// sysDir is the node's KSM control and counters.
const sysDir = "/sys/kernel/mm/ksm"

// ErrUnsupported is returned when the kernel has no KSM or no
// whole-process merging (Linux < 6.4).
var ErrUnsupported = errors.New("kernel without whole-process KSM merging (PR_SET_MEMORY_MERGE, Linux >= 6.4)")

// MergeSelf marks the calling process's memory mergeable, now and for
// every process it starts from now on.
func MergeSelf() error {
	if err := unix.Prctl(unix.PR_SET_MEMORY_MERGE, 1, 0, 0, 0); err != nil {
		if errors.Is(err, unix.EINVAL) {
			return ErrUnsupported
		}
		return fmt.Errorf("prctl PR_SET_MEMORY_MERGE: %w", err)
	}
	return nil
}

// Merging reports whether the calling process's memory is marked.
func Merging() (bool, error) {
	r, _, errno := unix.Syscall6(unix.SYS_PRCTL, unix.PR_GET_MEMORY_MERGE, 0, 0, 0, 0, 0)
	if errno != 0 {
		if errno == unix.EINVAL {
			return false, ErrUnsupported
		}
		return false, fmt.Errorf("prctl PR_GET_MEMORY_MERGE: %w", errno)
	}
	return r == 1, nil
}

// Node is the node's KSM state and counters (/sys/kernel/mm/ksm), in
// pages of the kernel's page size.
type Node struct {
	// Run is 0 (stopped), 1 (ksmd scanning) or 2 (unmerging all).
	Run int64
	// Shared is the number of merged pages kept; Sharing how many page
	// mappings point at them (the pages saved).
	Shared, Sharing int64
	// FullScans counts ksmd's passes over all mergeable memory.
	FullScans int64
	// Profit is the kernel's estimate of the bytes merging saves,
	// net of its own bookkeeping (general_profit).
	Profit int64
}

// ReadNode reads the node's counters.
func ReadNode() (Node, error) {
	var n Node
	if _, err := os.Stat(sysDir); err != nil {
		return n, fmt.Errorf("read KSM counters: %w", ErrUnsupported)
	}
	for _, f := range []struct {
		name string
		dst  *int64
	}{
		{"run", &n.Run}, {"pages_shared", &n.Shared}, {"pages_sharing", &n.Sharing},
		{"full_scans", &n.FullScans}, {"general_profit", &n.Profit},
	} {
		b, err := os.ReadFile(filepath.Join(sysDir, f.name))
		if err != nil {
			return n, fmt.Errorf("read KSM counters: %w", err)
		}
		if *f.dst, err = strconv.ParseInt(string(bytes.TrimSpace(b)), 10, 64); err != nil {
			return n, fmt.Errorf("read KSM counter %s: %w", f.name, err)
		}
	}
	return n, nil
}

// Process is what merging does for one process (/proc/PID/ksm_stat).
type Process struct {
	// MergingPages is how many of its pages are merged.
	MergingPages int64
	// Profit is the bytes saved for it, net of bookkeeping.
	Profit int64
	// MergeAny is whether the whole process is marked
	// (PR_SET_MEMORY_MERGE); false where the kernel does not report it
	// (Linux 6.12 does not, 6.18 does).
	MergeAny bool
}

// ReadProcess reads pid's merging state.
func ReadProcess(pid int) (Process, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/ksm_stat", pid))
	if err != nil {
		return Process{}, fmt.Errorf("read KSM state of %d: %w", pid, err)
	}
	defer f.Close()
	p, err := parseProcess(f)
	if err != nil {
		return p, fmt.Errorf("read KSM state of %d: %w", pid, err)
	}
	return p, nil
}

func parseProcess(r io.Reader) (Process, error) {
	var p Process
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// "ksm_merging_pages 12", "ksm_merge_any: yes"
		key, val, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		key, val = strings.TrimSuffix(key, ":"), strings.TrimSpace(val)
		var err error
		switch key {
		case "ksm_merging_pages":
			p.MergingPages, err = strconv.ParseInt(val, 10, 64)
		case "ksm_process_profit":
			p.Profit, err = strconv.ParseInt(val, 10, 64)
		case "ksm_merge_any":
			p.MergeAny = val == "yes"
		}
		if err != nil {
			return p, fmt.Errorf("%s: %w", key, err)
		}
	}
	return p, sc.Err()
}

// DaemonCPU is the CPU time ksmd has used since boot, in seconds (user
// and system time of the kernel thread): what merging costs the node.
func DaemonCPU() (float64, error) {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return 0, fmt.Errorf("read ksmd's CPU time: %w", err)
	}
	procs, err := fs.AllProcs()
	if err != nil {
		return 0, fmt.Errorf("read ksmd's CPU time: %w", err)
	}
	for _, p := range procs {
		if comm, err := p.Comm(); err != nil || comm != "ksmd" {
			continue
		}
		st, err := p.Stat()
		if err != nil {
			return 0, fmt.Errorf("read ksmd's CPU time: %w", err)
		}
		return st.CPUTime(), nil
	}
	return 0, fmt.Errorf("read ksmd's CPU time: no ksmd thread: %w", ErrUnsupported)
}
