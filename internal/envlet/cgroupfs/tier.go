package cgroupfs

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// The least CPU weight each version accepts.
const (
	LeastShares = 2 // v1 cpu.shares
	LeastWeight = 1 // v2 cpu.weight
)

// Shares reads cpu.shares (v1).
func (c *V1) Shares() (uint64, error) {
	return readControlUint(filepath.Join(filepath.Dir(c.quota.path), "cpu.shares"))
}

// Weight reads cpu.weight (v2).
func (c *V2) Weight() (uint64, error) {
	return readControlUint(filepath.Join(c.dir, "cpu.weight"))
}

// Demand returns the CPU nanoseconds the cgroup's threads ran or waited to
// run since the previous call (see demandMeter).
func (c *V1) Demand() (uint64, error) {
	if c.demand == nil {
		c.demand = newDemandMeter(filepath.Join(filepath.Dir(c.quota.path), "tasks"))
	}
	return c.demand.read()
}

// Demand returns the CPU nanoseconds the cgroup's threads ran or waited to
// run since the previous call (see demandMeter).
func (c *V2) Demand() (uint64, error) {
	if c.demand == nil {
		c.demand = newDemandMeter(filepath.Join(c.dir, "cgroup.threads"))
	}
	return c.demand.read()
}

func readControlUint(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, classify(err))
	}
	v, err := strconv.ParseUint(string(bytes.TrimSpace(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	return v, nil
}

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
