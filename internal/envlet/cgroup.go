package envlet

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/containerd/cgroups/v3"

	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
)

// Sample and Event are the sampler's types (see package cgroupfs).
type (
	Sample = cgroupfs.Sample
	Event  = cgroupfs.Event
)

// Errors a Cgroup returns.
var (
	ErrVanished = cgroupfs.ErrVanished
	ErrBusy     = cgroupfs.ErrBusy
)

// Cgroup is one container's cgroup as the controller sees it. Sample must
// be cheap (it runs every tick for every environment); Apply returns an
// error wrapping ErrBusy when the kernel refuses to lower memory below
// usage (v1) and ErrVanished once the cgroup is gone. Events wakes the
// controller between ticks.
type Cgroup interface {
	Sample(*Sample) error
	Apply(Resources) error
	Events() <-chan Event
	Close() error
}

// thresholdSetter is implemented by cgroups that arm kernel usage
// thresholds (v1 eventfds).
type thresholdSetter interface {
	SetThresholds(fracs ...float64) error
}

// memoryCapper is implemented by cgroups with a hard limit above the grant
// (v2 memory.max).
type memoryCapper interface {
	SetMemoryCap(int64)
}

// OpenCgroup opens the container cgroup of the OCI cgroupsPath path, in
// any of the forms runc accepts (systemd "slice:prefix:name", absolute or
// relative; cgroupfs.ResolveV2), on v2 or on v1 (cpu, cpuacct, memory
// hierarchies; also on hybrid hosts, whose unified mount has no
// controllers).
func OpenCgroup(path string) (Cgroup, error) {
	switch cgroups.Mode() {
	case cgroups.Unified:
		dir, err := cgroupfs.ResolveV2(path)
		if err != nil {
			return nil, err
		}
		c, err := cgroupfs.OpenV2(dir)
		if err != nil {
			return nil, err
		}
		return &v2Cgroup{c}, nil
	case cgroups.Legacy, cgroups.Hybrid:
		m, err := cgroupfs.FindV1Mounts()
		if err != nil {
			return nil, err
		}
		rel, err := cgroupfs.ResolveV1(path)
		if err != nil {
			return nil, err
		}
		c, err := cgroupfs.OpenV1(m, rel)
		if err != nil {
			return nil, err
		}
		return &v1Cgroup{c}, nil
	}
	return nil, fmt.Errorf("open cgroup %s: no cgroup hierarchy mounted", path)
}

// CheckCgroup fails unless envlet can limit the cgroup of cgroupsPath:
// it exists and has the cpu and memory controllers (on v2 a delegated
// subtree may lack them, and the container would then run unlimited). The
// error names the cgroup. The shim calls it at Create, once runc has made
// the cgroup, so such a container never starts.
func CheckCgroup(cgroupsPath string) error {
	cg, err := OpenCgroup(cgroupsPath)
	if err != nil {
		return err
	}
	return cg.Close()
}

// oomPauser is implemented by cgroups that can pause tasks at the memory
// limit instead of OOM-killing them (v1 oom_kill_disable).
type oomPauser interface {
	SetPauseOnOOM(bool) error
}

// tierSetter is implemented by cgroups that apply a CPU tier.
type tierSetter interface {
	SetTier(CPUWeights) error
}

func (c *v1Cgroup) SetTier(w CPUWeights) error {
	if w.Shares == 0 {
		return nil
	}
	return c.V1.SetShares(w.Shares)
}

func (c *v2Cgroup) SetTier(w CPUWeights) error {
	if w.Weight != 0 {
		if err := c.V2.SetWeight(w.Weight); err != nil {
			return err
		}
	}
	if w.Idle {
		return c.V2.SetIdle(true)
	}
	return nil
}

// startWeighter is implemented by cgroups whose CPU weight the controller
// moves while the environment starts (StartQueue): the weight in native
// units (v1 cpu.shares, v2 cpu.weight) with the least the kernel takes,
// and the group's CPU demand (run + run-queue wait, ns) since the last
// read.
type startWeighter interface {
	CPUWeight() (cur, least uint64, err error)
	SetCPUWeight(uint64) error
	Demand() (uint64, error)
}

func (c *v1Cgroup) CPUWeight() (uint64, uint64, error) {
	w, err := c.V1.Shares()
	return w, cgroupfs.LeastShares, err
}

func (c *v1Cgroup) SetCPUWeight(w uint64) error { return c.V1.SetShares(w) }

func (c *v2Cgroup) CPUWeight() (uint64, uint64, error) {
	w, err := c.V2.Weight()
	return w, cgroupfs.LeastWeight, err
}

func (c *v2Cgroup) SetCPUWeight(w uint64) error { return c.V2.SetWeight(w) }

// reclaimer is implemented by cgroups that reclaim on request (v2
// memory.reclaim).
type reclaimer interface {
	Reclaim(bytes int64) error
}

// freezer is implemented by cgroups that can stop every task (v2
// cgroup.freeze).
type freezer interface {
	Freeze(bool) error
}

// oomGrouper is implemented by cgroups whose kernel OOM kill can take the
// whole group (v2 memory.oom.group).
type oomGrouper interface {
	SetOOMGroup(bool) error
}

// limitRestorer is implemented by cgroups that can tell whether the
// limits they last wrote are still there, and write them again if not.
type limitRestorer interface {
	Restore() (bool, error)
}

// limitsReader is implemented by cgroups that know the limits in force.
type limitsReader interface {
	Current() Resources
}

type v1Cgroup struct{ *cgroupfs.V1 }

func (c *v1Cgroup) Current() Resources {
	l := c.V1.Limits()
	return Resources{CPU: l.CPU, Memory: l.Memory}
}

func (c *v2Cgroup) Current() Resources {
	l := c.V2.Limits()
	return Resources{CPU: l.CPU, Memory: l.Memory}
}

func (c *v1Cgroup) Apply(r Resources) error {
	return c.V1.Apply(cgroupfs.Limits{CPU: r.CPU, Memory: r.Memory})
}

type v2Cgroup struct{ *cgroupfs.V2 }

func (c *v2Cgroup) Apply(r Resources) error {
	return c.V2.Apply(cgroupfs.Limits{CPU: r.CPU, Memory: r.Memory})
}

// Clock is time as the controller sees it; tests substitute a fake.
type Clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                         { return time.Now() }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// UntilTick is how long to wait for the next tick of a period-long grid
// of the wall clock, at least half a period away: slow periodic work that
// waits for it (idle controllers, the guard's watchers) falls on the same
// instants in every goroutine of the process, so one wake-up of a shim
// serving many environments does all of them instead of one wake-up each.
// Intervals stay between half and one and a half periods, a period on
// average.
func UntilTick(now time.Time, period time.Duration) time.Duration {
	if period <= 0 {
		return period
	}
	d := now.Truncate(period).Add(period).Sub(now)
	if d < period/2 {
		d += period
	}
	return d
}

// PidsDir returns the pids cgroup directory of the container cgroup of
// the OCI cgroupsPath path (v2, or the v1 pids hierarchy): pids.current,
// pids.max, and pids.events, whose "max" line counts the forks refused at
// the limit.
func PidsDir(path string) (string, error) {
	return controllerDir(path, "pids", func(m cgroupfs.V1Mounts) string { return m.Pids })
}

// MemoryDir returns the memory cgroup directory of the container cgroup
// of the OCI cgroupsPath path (v2, or the v1 memory hierarchy).
func MemoryDir(path string) (string, error) {
	return controllerDir(path, "memory", func(m cgroupfs.V1Mounts) string { return m.Memory })
}

// controllerDir is the directory of the container cgroup of path: the
// unified one on v2, the one in the v1 hierarchy of controller (whose
// mount point v1 picks) otherwise.
func controllerDir(path, controller string, v1 func(cgroupfs.V1Mounts) string) (string, error) {
	switch cgroups.Mode() {
	case cgroups.Unified:
		return cgroupfs.ResolveV2(path)
	case cgroups.Legacy, cgroups.Hybrid:
		m, err := cgroupfs.FindV1Mounts()
		if err != nil {
			return "", err
		}
		root := v1(m)
		if root == "" {
			return "", fmt.Errorf("%s cgroup of %s: no cgroup v1 %s hierarchy mounted", controller, path, controller)
		}
		rel, err := cgroupfs.ResolveV1(path)
		if err != nil {
			return "", err
		}
		return filepath.Join(root, rel), nil
	}
	return "", fmt.Errorf("%s cgroup of %s: no cgroup hierarchy mounted", controller, path)
}
