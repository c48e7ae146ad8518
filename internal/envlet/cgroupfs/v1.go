package cgroupfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// unlimitedV1 is what v1 reports for "no limit" (PAGE_COUNTER_MAX pages);
// anything at or above 2^62 is treated as unlimited.
const unlimitedV1 = int64(1) << 62

// statEvery is how often memory.stat (the expensive file) and the
// pressure counters are read when usage is below half of the limit, and
// statSteadyEvery how often while usage has not moved since the last
// read (an idle environment: these were half of its sample's reads):
// with usage still, the working set moves only as pages age between the
// active and inactive lists, and pressure shows in usage first (at the
// limit, which is always read, or an OOM kill that drops it). Kernel
// events still ask for a read at once.
const (
	statEvery       = time.Second
	statSteadyEvery = 10 * time.Second
)

// statDue says whether a sample that read usage at now reads memory.stat
// and the pressure counters, last read at last with usage at lastUsage,
// under the memory limit limit (0: none applied).
func statDue(now, last time.Time, usage, lastUsage, limit int64) bool {
	since := now.Sub(last)
	switch {
	case limit > 0 && 2*usage >= limit:
		return true
	case since < statEvery:
		return false
	}
	return usage != lastUsage || since >= statSteadyEvery
}

// V1 is a cgroup v1 container cgroup spread over the cpu, cpuacct and
// memory hierarchies.
type V1 struct {
	cpuStat, acctUsage, memUsage, memStat, oomCtl, failcnt cfile
	quota, period, burst, memLimit, memsw, eventCtl        cfile

	buf []byte

	periodUs  int64
	cur       Limits
	swapDelta int64 // memsw - limit when the runtime set a memsw limit; -1 when memsw is unmanaged

	thresholds []float64
	evfds      []*os.File
	events     chan Event
	pending    atomic.Bool // an event arrived: read memory.stat on the next sample
	lastStat   time.Time
	statUsage  int64 // usage at lastStat
	underOOM   bool  // the last read of oom_control saw tasks paused
	closed     bool

	demand *demandMeter // read only while the environment starts
}

// OpenV1 opens the cgroup at path (relative to each hierarchy's mount, as
// in the OCI cgroupsPath "/ns/id") and reads its current limits.
func OpenV1(m V1Mounts, path string) (_ *V1, retErr error) {
	cpu := filepath.Join(m.CPU, path)
	acct := filepath.Join(m.CPUAcct, path)
	mem := filepath.Join(m.Memory, path)
	c := &V1{
		buf:        make([]byte, 16<<10),
		events:     make(chan Event, 1),
		thresholds: []float64{0.6, 0.9},
		swapDelta:  -1,
	}
	for _, f := range []*cfile{&c.cpuStat, &c.acctUsage, &c.memUsage, &c.memStat, &c.oomCtl, &c.failcnt, &c.quota, &c.period, &c.burst, &c.memLimit, &c.memsw, &c.eventCtl} {
		f.fd = -1
	}
	defer func() {
		if retErr != nil {
			c.Close()
		}
	}()
	var err error
	open := func(dst *cfile, dir, name string, flag int, optional bool) {
		if err != nil {
			return
		}
		if optional {
			*dst, err = openOptional(filepath.Join(dir, name), flag)
		} else {
			*dst, err = openFile(filepath.Join(dir, name), flag)
		}
	}
	open(&c.cpuStat, cpu, "cpu.stat", unix.O_RDONLY, false)
	open(&c.quota, cpu, "cpu.cfs_quota_us", unix.O_RDWR, false)
	open(&c.period, cpu, "cpu.cfs_period_us", unix.O_RDONLY, false)
	open(&c.burst, cpu, "cpu.cfs_burst_us", unix.O_RDWR, true)
	open(&c.acctUsage, acct, "cpuacct.usage", unix.O_RDONLY, false)
	open(&c.memUsage, mem, "memory.usage_in_bytes", unix.O_RDONLY, false)
	open(&c.memStat, mem, "memory.stat", unix.O_RDONLY, false)
	open(&c.oomCtl, mem, "memory.oom_control", unix.O_RDWR, false)
	open(&c.failcnt, mem, "memory.failcnt", unix.O_RDONLY, false)
	open(&c.memLimit, mem, "memory.limit_in_bytes", unix.O_RDWR, false)
	open(&c.memsw, mem, "memory.memsw.limit_in_bytes", unix.O_RDWR, true)
	open(&c.eventCtl, mem, "cgroup.event_control", unix.O_WRONLY, true)
	if err != nil {
		return nil, fmt.Errorf("open cgroup v1 %s: %w", path, err)
	}
	if c.periodUs, err = c.readInt(c.period); err != nil {
		return nil, err
	}
	q, err := c.readInt(c.quota)
	if err != nil {
		return nil, err
	}
	if q > 0 && c.periodUs > 0 {
		c.cur.CPU = float64(q) / float64(c.periodUs)
	}
	lim, err := c.readInt(c.memLimit)
	if err != nil {
		return nil, err
	}
	if lim > 0 && lim < unlimitedV1 {
		c.cur.Memory = lim
	}
	if c.memsw.ok() {
		sw, err := c.readInt(c.memsw)
		if err != nil {
			return nil, err
		}
		// Only manage memsw when the runtime limited it: then limit <= memsw
		// must hold across every write, and the swap allowance is kept.
		if sw > 0 && sw < unlimitedV1 && c.cur.Memory > 0 {
			c.swapDelta = max(sw-c.cur.Memory, 0)
		}
	}
	if err := c.arm(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *V1) readInt(f cfile) (int64, error) {
	b, err := f.read(c.buf)
	if err != nil {
		return 0, err
	}
	v, ok := parseLimit(b)
	if !ok {
		return 0, fmt.Errorf("parse %s: %q", f.path, b)
	}
	return v, nil
}

// Limits returns the limits last applied (or found at open).
func (c *V1) Limits() Limits { return c.cur }

// SetThresholds sets the memory usage fractions of the limit at which the
// kernel wakes the controller (default 0.6 and 0.9) and re-arms them.
func (c *V1) SetThresholds(fracs ...float64) error {
	c.thresholds = append(c.thresholds[:0], fracs...)
	return c.arm()
}

// Sample reads cpu.stat, cpuacct.usage and memory.usage_in_bytes, plus
// memory.stat, oom_control and failcnt once a second, when usage is at or
// above half of the limit, or after a kernel event.
func (c *V1) Sample(s *Sample) error {
	b, err := c.cpuStat.read(c.buf)
	if err != nil {
		return err
	}
	s.ThrottledNs, _ = field(b, "throttled_time")
	s.Periods, _ = field(b, "nr_periods")
	s.ThrottledPeriods, _ = field(b, "nr_throttled")
	s.BurstNs, _ = field(b, "burst_time")
	if s.CPUUsageNs, err = c.acctUsage.readUint(c.buf); err != nil {
		return err
	}
	u, err := c.memUsage.readUint(c.buf)
	if err != nil {
		return err
	}
	s.MemUsage = int64(u)
	now := time.Now()
	s.MemStat = false
	// under_oom is a level, not a counter: once seen it is read again
	// every sample until it clears, or a grow would be answered by the
	// pause it just ended.
	if c.pending.Swap(false) || c.underOOM || statDue(now, c.lastStat, s.MemUsage, c.statUsage, c.cur.Memory) {
		c.lastStat, c.statUsage = now, s.MemUsage
		s.MemStat = true
		if b, err = c.memStat.read(c.buf); err != nil {
			return err
		}
		v, _ := field(b, "total_inactive_file")
		s.InactiveFile = int64(v)
		if b, err = c.oomCtl.read(c.buf); err != nil {
			return err
		}
		s.OOMKill, _ = field(b, "oom_kill")
		uo, _ := field(b, "under_oom")
		s.UnderOOM = uo != 0
		c.underOOM = s.UnderOOM
		if s.Failcnt, err = c.failcnt.readUint(c.buf); err != nil {
			return err
		}
	}
	return nil
}

// Apply writes the CPU quota (and CFS burst = quota, so a spike is absorbed
// before the next sample) and the memory limit. Lowering memory below usage
// returns ErrBusy (v1 refuses; nothing is killed) with the CPU part applied.
func (c *V1) Apply(l Limits) error {
	if l.CPU != c.cur.CPU {
		if err := c.applyCPU(l.CPU); err != nil {
			return err
		}
	}
	if l.Memory != c.cur.Memory {
		if err := c.applyMemory(l.Memory); err != nil {
			return err
		}
	}
	return nil
}

// quotaUs is cpu.cfs_quota_us for cores (-1 for unlimited).
func (c *V1) quotaUs(cores float64) int64 {
	if cores <= 0 {
		return -1
	}
	return max(int64(cores*float64(c.periodUs)), 1000)
}

// Restore rewrites the limits Apply last wrote wherever the files no
// longer hold them, and reports whether it had to: systemd rewrites a
// scope's cgroup from the unit's properties whenever it applies any of
// them (runc update through the systemd driver, daemon-reload).
func (c *V1) Restore() (bool, error) {
	restored, err := restoreQuota(&c.quota, c.buf, c.quotaUs(c.cur.CPU), func() error { return c.applyCPU(c.cur.CPU) })
	if err != nil {
		return false, err
	}
	b, err := c.memLimit.read(c.buf)
	if err != nil {
		return false, err
	}
	lim, _ := parseLimit(b)
	if lim >= unlimitedV1 {
		lim = -1
	}
	want := c.cur.Memory
	if want <= 0 {
		want = -1
	}
	if !samePages(lim, want) {
		// applyMemory orders the memsw write by the limit it believes in
		// force: make that the one really there.
		c.cur.Memory = max(lim, 0)
		if err := c.applyMemory(want); err != nil {
			c.cur.Memory = max(want, 0)
			return false, err
		}
		restored = true
	}
	return restored, nil
}

func (c *V1) applyCPU(cores float64) error {
	quota := c.quotaUs(cores)
	var qb, bb [24]byte
	q := appendInt(qb[:0], quota)
	burst := appendInt(bb[:0], max(quota, 0))
	raising := quota < 0 || (c.cur.CPU > 0 && cores > c.cur.CPU)
	// The kernel rejects burst > quota, so burst follows the quota up and
	// leads it down.
	if !raising && c.burst.ok() {
		c.writeBurst(burst)
	}
	if err := c.quota.write(q); err != nil {
		return fmt.Errorf("set cpu quota %dus: %w", quota, err)
	}
	if raising && c.burst.ok() {
		c.writeBurst(burst)
	}
	c.cur.CPU = max(cores, 0)
	return nil
}

func (c *V1) writeBurst(b []byte) {
	if err := c.burst.write(b); err != nil && !errors.Is(err, ErrVanished) {
		// Burst is an optimisation; a kernel that rejects it keeps working.
		c.burst.close()
	}
}

func (c *V1) applyMemory(bytes int64) error {
	limit := int64(-1)
	if bytes > 0 {
		limit = bytes
	}
	var lb, sb [24]byte
	lv := appendInt(lb[:0], limit)
	sv := lv
	if c.swapDelta >= 0 && limit > 0 {
		sv = appendInt(sb[:0], limit+c.swapDelta)
	}
	manageSw := c.swapDelta >= 0 && c.memsw.ok()
	raising := limit < 0 || (c.cur.Memory > 0 && limit > c.cur.Memory)
	// limit <= memsw must hold after each write: memsw goes first when
	// raising, last when lowering (containerd/cgroups v3.1.3 writes them in
	// one order and gets EINVAL when raising).
	if raising && manageSw {
		if err := c.memsw.write(sv); err != nil {
			return fmt.Errorf("raise memsw limit to %d: %w", limit, err)
		}
	}
	if err := c.memLimit.write(lv); err != nil {
		return fmt.Errorf("set memory limit %d: %w", limit, err)
	}
	if !raising && manageSw {
		if err := c.memsw.write(sv); err != nil {
			return fmt.Errorf("lower memsw limit to %d: %w", limit, err)
		}
	}
	c.cur.Memory = max(bytes, 0)
	return c.arm()
}

// arm replaces the usage-threshold eventfds with ones at the configured
// fractions of the current limit. Closing an eventfd unregisters it.
func (c *V1) arm() error {
	for _, f := range c.evfds {
		f.Close()
	}
	c.evfds = c.evfds[:0]
	if c.closed || c.cur.Memory <= 0 || !c.eventCtl.ok() {
		return nil
	}
	for _, frac := range c.thresholds {
		thr := int64(frac * float64(c.cur.Memory))
		efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			return fmt.Errorf("eventfd: %w", err)
		}
		if err := c.eventCtl.write(fmt.Appendf(nil, "%d %d %d", efd, c.memUsage.fd, thr)); err != nil {
			unix.Close(efd)
			return fmt.Errorf("arm memory threshold %d: %w", thr, err)
		}
		// A non-blocking fd handed to os.NewFile is served by the runtime
		// poller: no thread per cgroup blocks on it.
		f := os.NewFile(uintptr(efd), "memory-threshold")
		c.evfds = append(c.evfds, f)
		go c.watch(f)
	}
	return nil
}

func (c *V1) watch(f *os.File) {
	var b [8]byte
	for {
		if _, err := f.Read(b[:]); err != nil {
			return
		}
		c.pending.Store(true)
		select {
		case c.events <- Event{Kind: EventMemThreshold}:
		default:
		}
	}
}

// Events delivers threshold crossings; it is never closed.
func (c *V1) Events() <-chan Event { return c.events }

// Close releases every fd and unregisters the thresholds.
func (c *V1) Close() error {
	c.closed = true
	for _, f := range c.evfds {
		f.Close()
	}
	c.evfds = nil
	for _, f := range []*cfile{&c.cpuStat, &c.acctUsage, &c.memUsage, &c.memStat, &c.oomCtl, &c.failcnt, &c.quota, &c.period, &c.burst, &c.memLimit, &c.memsw, &c.eventCtl} {
		f.close()
	}
	return nil
}

// RequestStat makes the next Sample read memory.stat, oom_control and
// failcnt as well.
func (c *V1) RequestStat() { c.pending.Store(true) }

// SetPauseOnOOM sets memory.oom_control oom_kill_disable: with it, tasks
// that hit the limit sleep (under_oom) instead of being OOM-killed until
// the limit is raised or they are killed, which turns an OOM into a
// decision of the controller: grow, or fail the environment with its
// reason. Kernels 6.x log once that this interface is deprecated.
func (c *V1) SetPauseOnOOM(on bool) error {
	v := []byte("0")
	if on {
		v = []byte("1")
	}
	if err := c.oomCtl.write(v); err != nil {
		return fmt.Errorf("set oom_kill_disable=%s: %w", v, err)
	}
	return nil
}
