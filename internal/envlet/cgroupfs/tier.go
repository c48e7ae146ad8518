package cgroupfs

import (
	"path/filepath"
	"strconv"
)

// SetShares writes cpu.shares (v1).
func (c *V1) SetShares(shares uint64) error {
	return writeControl(filepath.Join(filepath.Dir(c.quota.path), "cpu.shares"), strconv.FormatUint(shares, 10))
}

// SetWeight writes cpu.weight (v2).
func (c *V2) SetWeight(weight uint64) error {
	return writeControl(filepath.Join(c.dir, "cpu.weight"), strconv.FormatUint(weight, 10))
}

// SetIdle writes cpu.idle (v2, kernel >= 5.15): an idle group's tasks run
// as SCHED_IDLE against the rest of the system.
func (c *V2) SetIdle(idle bool) error {
	v := "0"
	if idle {
		v = "1"
	}
	return writeControl(filepath.Join(c.dir, "cpu.idle"), v)
}
