package cgroupfs

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"syscall"
)

// Freeze stops (true) or resumes every task of the cgroup through
// cgroup.freeze. The controller freezes a task stuck at its memory limit
// while the node arbiter does not answer, so it neither runs into
// memory.max nor burns CPU in reclaim; a fatal signal still kills frozen
// tasks (cgroup v2 freezer semantics).
func (c *V2) Freeze(on bool) error {
	v := "0"
	if on {
		v = "1"
	}
	if !c.freeze.ok() {
		return fmt.Errorf("freeze: %s: %w", c.freeze.path, ErrUnsupported)
	}
	if err := c.freeze.write([]byte(v)); err != nil {
		return fmt.Errorf("write %s to %s: %w", v, c.freeze.path, err)
	}
	return nil
}

// Reclaim asks the kernel to reclaim bytes from the cgroup
// (memory.reclaim, kernel >= 5.19). The kernel answers EAGAIN when it
// could not reclaim that much; that is reported as ErrBusy: not now.
func (c *V2) Reclaim(bytes int64) error {
	err := writeControl(filepath.Join(c.dir, "memory.reclaim"), strconv.FormatInt(bytes, 10))
	if errors.Is(err, syscall.EAGAIN) {
		return errors.Join(ErrBusy, err)
	}
	return err
}
