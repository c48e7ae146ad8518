package cgroupfs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// demandMeter measures a cgroup's CPU demand: the time its threads ran
// plus the time they waited on a run queue, from /proc/<tid>/schedstat.
// Usage alone cannot tell a group with nothing to run from one the
// scheduler starves (a low CPU weight on a busy node); demand can. Only
// the cgroup's own threads are read, not those of its descendants.
type demandMeter struct {
	threads string            // v1 tasks, v2 cgroup.threads
	last    map[uint64]uint64 // per thread: run + wait ns at the previous read
}

func newDemandMeter(threadsFile string) *demandMeter {
	return &demandMeter{threads: threadsFile, last: map[uint64]uint64{}}
}

// read returns the run + wait nanoseconds the group's threads gained
// since the previous read (at the first, since each thread began).
// Threads that ended in between are not counted.
func (m *demandMeter) read() (uint64, error) {
	list, err := os.ReadFile(m.threads)
	if err != nil {
		return 0, fmt.Errorf("read cpu demand of %s: %w", filepath.Dir(m.threads), classify(err))
	}
	next := make(map[uint64]uint64, len(m.last))
	var sum uint64
	for line := range bytes.Lines(list) {
		tid, err := strconv.ParseUint(string(bytes.TrimSpace(line)), 10, 64)
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + strconv.FormatUint(tid, 10) + "/schedstat")
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ESRCH) {
			continue // ended since the list was read
		}
		if err != nil {
			return 0, fmt.Errorf("read cpu demand of thread %d: %w", tid, err)
		}
		// "run_ns wait_ns timeslices"
		f := bytes.Fields(b)
		if len(f) < 2 {
			return 0, fmt.Errorf("read cpu demand of thread %d: schedstat %q", tid, b)
		}
		run, err1 := strconv.ParseUint(string(f[0]), 10, 64)
		wait, err2 := strconv.ParseUint(string(f[1]), 10, 64)
		if err1 != nil || err2 != nil {
			return 0, fmt.Errorf("read cpu demand of thread %d: schedstat %q", tid, b)
		}
		next[tid] = run + wait
		sum += run + wait - min(m.last[tid], run+wait)
	}
	m.last = next
	return sum, nil
}
