package cgroupfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// writeControl writes one value to a control file that is written rarely
// (tiers, freezing, reclaim), so it is opened per write rather than kept
// open like the files of the sampling and actuation path.
//
// Raw system calls, not os.WriteFile: cgroup files are kernfs files, which
// epoll accepts, so the os package would register the descriptor with the
// runtime poller and take an EAGAIN (memory.reclaim's "reclaimed less than
// asked") for "would block", waiting for a writability edge that never
// comes. A reclaim hung exactly so in the cgroup v2 guest.
func writeControl(path, v string) error {
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", v, path, classify(&os.PathError{Op: "open", Path: path, Err: err}))
	}
	defer unix.Close(fd)
	for {
		_, err = unix.Write(fd, []byte(v))
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", v, path, classify(&os.PathError{Op: "write", Path: path, Err: err}))
	}
	return nil
}

// ReclaimDir asks the kernel to reclaim bytes from the v2 cgroup at dir
// (memory.reclaim, kernel >= 5.19). The kernel answers EAGAIN when it
// could not reclaim that much; that is reported as ErrBusy (and EAGAIN):
// not now.
func ReclaimDir(dir string, bytes int64) error {
	err := writeControl(filepath.Join(dir, "memory.reclaim"), strconv.FormatInt(bytes, 10))
	if errors.Is(err, unix.EAGAIN) {
		return errors.Join(ErrBusy, err)
	}
	return err
}

// ForceEmptyDir asks the kernel to reclaim all it can from the v1 memory
// cgroup at dir (memory.force_empty): it returns once the group holds
// nothing or reclaim stopped making progress, so with tasks inside it
// leaves what has nowhere to go (anonymous memory on a node without
// swap).
func ForceEmptyDir(dir string) error {
	return writeControl(filepath.Join(dir, "memory.force_empty"), "0")
}
