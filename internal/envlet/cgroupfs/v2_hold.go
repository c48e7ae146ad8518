package cgroupfs

import "fmt"

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

// Reclaim asks the kernel to reclaim bytes from the cgroup (ReclaimDir).
func (c *V2) Reclaim(bytes int64) error { return ReclaimDir(c.dir, bytes) }
