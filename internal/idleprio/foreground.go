//go:build linux

package idleprio

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// RaiseForeground sets the nice value of every thread of the process to
// nice (negative: ahead of the node's default-priority work). Threads the
// runtime starts later inherit it from the thread that starts them, and a
// job's lowered thread gets it back when it is raised (Boost, a floor
// turn, its end), as lower saved it.
//
// The daemon's foreground is the file-system requests of running
// environments: each FUSE request is a round trip through a daemon
// thread, which on a node whose cores the environments keep busy waits
// for a core behind them unless it outranks them, while overlayfs does
// the same work in the caller's context without a wait. Call it before
// the first Job runs; a job lowered earlier keeps the nice value it had.
//
// Where it counts: threads compete with the node's other work by nice
// value when they share a cgroup with it or sit at the top of a cgroup v1
// cpu hierarchy beside the containers' groups; inside a cgroup of their
// own (a systemd service on cgroup v2), the cgroup's weight decides
// instead, and nice only ranks the daemon's threads among themselves.
func RaiseForeground(nice int) error {
	tids, err := processThreads(os.Getpid())
	if err != nil {
		return err
	}
	var errs []error
	for _, tid := range tids {
		// PRIO_PROCESS with a thread id sets that thread alone on Linux.
		if err := unix.Setpriority(unix.PRIO_PROCESS, tid, nice); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("set nice %d on thread %d: %w", nice, tid, err))
		}
	}
	return errors.Join(errs...)
}
