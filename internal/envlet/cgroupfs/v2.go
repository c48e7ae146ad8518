package cgroupfs

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// V2 is a cgroup v2 container cgroup. Memory is driven through memory.high
// (the grant: throttles and reclaims, never OOM-kills) with memory.max as
// the safety net at 1.25 x the grant (bounded by the cap), because lowering
// memory.max below usage OOM-kills on v2.
//
// Between samples the controller is woken by memory.events changes
// (inotify) and by PSI triggers on cpu.pressure and memory.pressure, which
// fire as soon as the group stalls for longer than the trigger's threshold
// within its window instead of at the next tick.
type V2 struct {
	cpuStat, cpuMax, cpuBurst, memCurrent, memStat, memEvents, memHigh, memMax cfile
	oomGroup, freeze, cpuPressure, memPressure                                 cfile

	dir string
	psi *os.File // epoll instance over the PSI trigger fds, nil without PSI

	buf      []byte
	periodUs int64
	cur      Limits
	curMax   int64 // memory.max as written (-1 unlimited)
	memCap   int64
	oomGrp   []byte // memory.oom.group as written, nil if never

	inotify   *os.File
	events    chan Event
	pending   atomic.Bool
	lastStat  time.Time
	statUsage int64 // usage at lastStat

	demand *demandMeter // read only while the environment starts
}

// PSI triggers armed on cpu.pressure and memory.pressure: wake the
// controller when some task of the group stalled for this long within the
// window (the kernel's minimum window is 500 ms).
var (
	CPUPressureTrigger = []byte("some 150000 1000000")
	MemPressureTrigger = []byte("some 50000 1000000")
)

// OpenV2 opens the cgroup directory dir (see ResolveV2). The cgroup must
// have the cpu and memory controllers: without them a container would run
// unlimited while envlet believed it controlled it.
func OpenV2(dir string) (_ *V2, retErr error) {
	c := &V2{dir: dir, buf: make([]byte, 16<<10), events: make(chan Event, 1), periodUs: 100000, curMax: -1}
	for _, f := range c.files() {
		f.fd = -1
	}
	if err := checkControllers(dir); err != nil {
		return nil, err
	}
	defer func() {
		if retErr != nil {
			c.Close()
		}
	}()
	var err error
	open := func(dst *cfile, name string, flag int, optional bool) {
		if err != nil {
			return
		}
		if optional {
			*dst, err = openOptional(filepath.Join(dir, name), flag)
		} else {
			*dst, err = openFile(filepath.Join(dir, name), flag)
		}
	}
	open(&c.cpuStat, "cpu.stat", unix.O_RDONLY, false)
	open(&c.cpuMax, "cpu.max", unix.O_RDWR, false)
	open(&c.cpuBurst, "cpu.max.burst", unix.O_RDWR, true)
	open(&c.memCurrent, "memory.current", unix.O_RDONLY, false)
	open(&c.memStat, "memory.stat", unix.O_RDONLY, false)
	open(&c.memEvents, "memory.events", unix.O_RDONLY, false)
	open(&c.memHigh, "memory.high", unix.O_RDWR, false)
	open(&c.memMax, "memory.max", unix.O_RDWR, false)
	open(&c.oomGroup, "memory.oom.group", unix.O_RDWR, true)
	open(&c.freeze, "cgroup.freeze", unix.O_RDWR, true)
	// PSI files exist unless the kernel runs with psi=0; a trigger is armed
	// by writing it to a file descriptor of their own.
	open(&c.cpuPressure, "cpu.pressure", unix.O_RDWR|unix.O_NONBLOCK, true)
	open(&c.memPressure, "memory.pressure", unix.O_RDWR|unix.O_NONBLOCK, true)
	if err != nil {
		return nil, fmt.Errorf("open cgroup v2 %s: %w", dir, err)
	}
	// cpu.max is "max 100000" or "25000 100000".
	b, err := c.cpuMax.read(c.buf)
	if err != nil {
		return nil, err
	}
	q, _ := parseLimit(b)
	for i := 0; i < len(b); i++ {
		if b[i] == ' ' {
			if p, ok := parseUint(b[i+1:]); ok && p > 0 {
				c.periodUs = int64(p)
			}
			break
		}
	}
	if q > 0 {
		c.cur.CPU = float64(q) / float64(c.periodUs)
	}
	if b, err = c.memHigh.read(c.buf); err != nil {
		return nil, err
	}
	if h, _ := parseLimit(b); h > 0 {
		c.cur.Memory = h
	}
	if b, err = c.memMax.read(c.buf); err != nil {
		return nil, err
	}
	c.curMax, _ = parseLimit(b)
	if c.cur.Memory == 0 && c.curMax > 0 {
		c.cur.Memory = c.curMax
	}

	ifd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify: %w", err)
	}
	if _, err := unix.InotifyAddWatch(ifd, c.memEvents.path, unix.IN_MODIFY); err != nil {
		unix.Close(ifd)
		return nil, fmt.Errorf("watch %s: %w", c.memEvents.path, err)
	}
	c.inotify = os.NewFile(uintptr(ifd), "memory.events-inotify")
	go c.watch(c.inotify)
	if err := c.armPSI(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *V2) files() []*cfile {
	return []*cfile{&c.cpuStat, &c.cpuMax, &c.cpuBurst, &c.memCurrent, &c.memStat, &c.memEvents, &c.memHigh, &c.memMax,
		&c.oomGroup, &c.freeze, &c.cpuPressure, &c.memPressure}
}

// checkControllers fails unless dir's cgroup.controllers lists cpu and
// memory: a delegated subtree whose parent does not enable them has no
// cpu.max or memory.high to write.
func checkControllers(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	if err != nil {
		return fmt.Errorf("open cgroup v2 %s: %w", dir, classify(err))
	}
	have := map[string]bool{}
	for _, f := range bytes.Fields(b) {
		have[string(f)] = true
	}
	var missing []string
	for _, want := range []string{"cpu", "memory"} {
		if !have[want] {
			missing = append(missing, want)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("cgroup v2 %s lacks the %v controller(s) (cgroup.controllers: %q): enable them in the parent's cgroup.subtree_control (systemd: Delegate=yes on the runtime's unit) or envlet cannot limit it",
			dir, missing, bytes.TrimSpace(b))
	}
	return nil
}

// armPSI writes the triggers and watches them through one epoll instance.
// PSI triggers signal POLLPRI, which Go's poller does not wait for; the
// epoll fd itself turns readable when a trigger fires, and that the poller
// does wait for, so no thread blocks per cgroup.
func (c *V2) armPSI() error {
	if !c.cpuPressure.ok() && !c.memPressure.ok() {
		return nil
	}
	efd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return fmt.Errorf("epoll: %w", err)
	}
	armed := 0
	for _, t := range []struct {
		f    *cfile
		trig []byte
	}{{&c.cpuPressure, CPUPressureTrigger}, {&c.memPressure, MemPressureTrigger}} {
		if !t.f.ok() {
			continue
		}
		if _, err := unix.Write(t.f.fd, t.trig); err != nil {
			if errors.Is(err, syscall.EOPNOTSUPP) {
				// psi=0 on the kernel command line: the files exist but
				// refuse triggers.
				continue
			}
			unix.Close(efd)
			return fmt.Errorf("arm PSI trigger %q on %s: %w", t.trig, t.f.path, classify(err))
		}
		ev := unix.EpollEvent{Events: unix.EPOLLPRI, Fd: int32(t.f.fd)}
		if err := unix.EpollCtl(efd, unix.EPOLL_CTL_ADD, t.f.fd, &ev); err != nil {
			if errors.Is(err, syscall.EPERM) {
				continue // a regular file (test trees): nothing to wait for
			}
			unix.Close(efd)
			return fmt.Errorf("watch %s: %w", t.f.path, err)
		}
		armed++
	}
	if armed == 0 {
		unix.Close(efd)
		return nil
	}
	if err := unix.SetNonblock(efd, true); err != nil {
		unix.Close(efd)
		return fmt.Errorf("epoll: %w", err)
	}
	c.psi = os.NewFile(uintptr(efd), "psi-epoll")
	go c.watchPSI(c.psi)
	return nil
}

func (c *V2) watchPSI(f *os.File) {
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	var evs [2]unix.EpollEvent
	for {
		var n int
		var werr error
		err := rc.Read(func(fd uintptr) bool {
			n, werr = unix.EpollWait(int(fd), evs[:], 0)
			return n != 0 || (werr != nil && werr != unix.EINTR)
		})
		if err != nil || werr != nil {
			return // closed
		}
		for _, ev := range evs[:n] {
			kind := EventCPUPressure
			if int(ev.Fd) == c.memPressure.fd {
				kind = EventMemPressure
				c.pending.Store(true)
			}
			select {
			case c.events <- Event{Kind: kind}:
			default:
			}
		}
	}
}

func (c *V2) watch(f *os.File) {
	buf := make([]byte, 4096)
	for {
		if _, err := f.Read(buf); err != nil {
			return
		}
		c.pending.Store(true)
		select {
		case c.events <- Event{Kind: EventMemEvents}:
		default:
		}
	}
}

// Limits returns the limits last applied (or found at open); Memory is
// memory.high.
func (c *V2) Limits() Limits { return c.cur }

// MemoryMax returns memory.max as last written or read (-1 unlimited).
func (c *V2) MemoryMax() int64 { return c.curMax }

// SetMemoryCap bounds memory.max (the per-environment cap).
func (c *V2) SetMemoryCap(b int64) { c.memCap = b }

// SetThresholds is a no-op on v2: memory.events reports pressure itself.
func (c *V2) SetThresholds(...float64) error { return nil }

// Sample reads cpu.stat and memory.current every time, and memory.stat and
// memory.events once a second (every 10 s while usage stands still), when
// usage is at or above half the grant, or after memory.events changed.
func (c *V2) Sample(s *Sample) error {
	b, err := c.cpuStat.read(c.buf)
	if err != nil {
		return err
	}
	v, _ := field(b, "usage_usec")
	s.CPUUsageNs = v * 1000
	v, _ = field(b, "throttled_usec")
	s.ThrottledNs = v * 1000
	v, _ = field(b, "burst_usec")
	s.BurstNs = v * 1000
	s.Periods, _ = field(b, "nr_periods")
	s.ThrottledPeriods, _ = field(b, "nr_throttled")
	u, err := c.memCurrent.readUint(c.buf)
	if err != nil {
		return err
	}
	s.MemUsage = int64(u)
	now := time.Now()
	s.MemStat = false
	if c.pending.Swap(false) || statDue(now, c.lastStat, s.MemUsage, c.statUsage, c.cur.Memory) {
		c.lastStat, c.statUsage = now, s.MemUsage
		s.MemStat = true
		if b, err = c.memStat.read(c.buf); err != nil {
			return err
		}
		v, _ = field(b, "inactive_file")
		s.InactiveFile = int64(v)
		if b, err = c.memEvents.read(c.buf); err != nil {
			return err
		}
		s.High, _ = field(b, "high")
		s.Failcnt, _ = field(b, "max")
		s.OOM, _ = field(b, "oom")
		s.OOMKill, _ = field(b, "oom_kill")
	}
	return nil
}

// Apply writes cpu.max (+ cpu.max.burst = quota) and memory.high = grant,
// memory.max = min(cap, 1.25 x grant) but never below current usage.
func (c *V2) Apply(l Limits) error {
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

// quotaUs is cpu.max's quota for cores (-1 for max).
func (c *V2) quotaUs(cores float64) int64 {
	if cores <= 0 {
		return -1
	}
	return max(int64(cores*float64(c.periodUs)), 1000)
}

func (c *V2) applyCPU(cores float64) error {
	var qb, bb [48]byte
	quota := c.quotaUs(cores)
	q := append(qb[:0], "max "...)
	if quota > 0 {
		q = appendInt(qb[:0], quota)
		q = append(q, ' ')
	}
	q = appendInt(q, c.periodUs)
	burst := appendInt(bb[:0], max(quota, 0))
	raising := quota < 0 || (c.cur.CPU > 0 && cores > c.cur.CPU)
	if !raising && c.cpuBurst.ok() {
		c.writeBurst(burst)
	}
	if err := c.cpuMax.write(q); err != nil {
		return fmt.Errorf("set cpu.max %s: %w", q, err)
	}
	if raising && c.cpuBurst.ok() {
		c.writeBurst(burst)
	}
	c.cur.CPU = max(cores, 0)
	return nil
}

func (c *V2) writeBurst(b []byte) {
	if err := c.cpuBurst.write(b); err != nil {
		c.cpuBurst.close()
	}
}

func (c *V2) applyMemory(grant int64) error {
	high, newMax := int64(-1), int64(-1)
	if grant > 0 {
		high = grant
		newMax = grant + grant/4
		if c.memCap > 0 {
			newMax = min(newMax, max(c.memCap, grant))
		}
	}
	if newMax > 0 && (c.curMax < 0 || newMax < c.curMax) {
		// Lowering memory.max below usage OOM-kills on v2: keep headroom
		// over what is in use and let memory.high do the squeezing.
		u, err := c.memCurrent.readUint(c.buf)
		if err != nil {
			return err
		}
		if floor := int64(u) + int64(u)/4; newMax < floor {
			newMax = floor
			if c.curMax > 0 {
				newMax = min(newMax, c.curMax)
			}
		}
	}
	var hb, mb [24]byte
	hv, mv := appendInt(hb[:0], high), appendInt(mb[:0], newMax)
	if high < 0 {
		hv = append(hb[:0], "max"...)
	}
	if newMax < 0 {
		mv = append(mb[:0], "max"...)
	}
	raising := newMax < 0 || (c.curMax > 0 && newMax > c.curMax)
	if raising {
		if err := c.memMax.write(mv); err != nil {
			return fmt.Errorf("set memory.max %s: %w", mv, err)
		}
	}
	if err := c.memHigh.write(hv); err != nil {
		return fmt.Errorf("set memory.high %s: %w", hv, err)
	}
	if !raising && newMax != c.curMax {
		if err := c.memMax.write(mv); err != nil {
			return fmt.Errorf("set memory.max %s: %w", mv, err)
		}
	}
	c.cur.Memory = max(grant, 0)
	c.curMax = newMax
	return nil
}

// Events delivers memory.events changes and PSI triggers; it is never
// closed.
func (c *V2) Events() <-chan Event { return c.events }

// Close releases every fd and stops the inotify and PSI watches.
func (c *V2) Close() error {
	if c.inotify != nil {
		c.inotify.Close()
		c.inotify = nil
	}
	if c.psi != nil {
		c.psi.Close()
		c.psi = nil
	}
	for _, f := range c.files() {
		f.close()
	}
	return nil
}

// Dir is the cgroup's directory.
func (c *V2) Dir() string { return c.dir }

// SetOOMGroup writes memory.oom.group: with 1 the kernel's OOM killer
// takes every task of the group at once, with 0 only the task it picks.
func (c *V2) SetOOMGroup(on bool) error {
	if !c.oomGroup.ok() {
		return fmt.Errorf("set memory.oom.group: %s: %w", c.oomGroup.path, ErrUnsupported)
	}
	v := []byte("0")
	if on {
		v = []byte("1")
	}
	if err := c.oomGroup.write(v); err != nil {
		return fmt.Errorf("set memory.oom.group=%s: %w", v, err)
	}
	c.oomGrp = v
	return nil
}

// Restore rewrites what Apply and SetOOMGroup last wrote wherever the
// files no longer hold it, and reports whether it had to. Someone else
// rewrites them: systemd rewrites a scope's cgroup from the unit's
// properties whenever it applies any of them (runc update through the
// systemd driver, daemon-reload), which sets memory.high back to max and
// memory.max and cpu.max to what the container was created with; runc
// writes kubelet's memory.oom.group=1 again with every update.
func (c *V2) Restore() (bool, error) {
	restored, err := restoreQuota(&c.cpuMax, c.buf, c.quotaUs(c.cur.CPU), func() error { return c.applyCPU(c.cur.CPU) })
	if err != nil {
		return false, err
	}
	b, err := c.memHigh.read(c.buf)
	if err != nil {
		return false, err
	}
	high, _ := parseLimit(b)
	if b, err = c.memMax.read(c.buf); err != nil {
		return false, err
	}
	actualMax, _ := parseLimit(b)
	wantHigh := c.cur.Memory
	if wantHigh <= 0 {
		wantHigh = -1
	}
	if !samePages(high, wantHigh) || !samePages(actualMax, c.curMax) {
		// applyMemory orders its writes by the memory.max in force and
		// never puts memory.max below usage.
		c.curMax = actualMax
		if err := c.applyMemory(c.cur.Memory); err != nil {
			return false, err
		}
		restored = true
	}
	if c.oomGrp != nil {
		if b, err = c.oomGroup.read(c.buf); err != nil {
			return false, err
		}
		if len(b) == 0 || b[0] != c.oomGrp[0] {
			if err := c.oomGroup.write(c.oomGrp); err != nil {
				return false, fmt.Errorf("set memory.oom.group=%s: %w", c.oomGrp, err)
			}
			restored = true
		}
	}
	return restored, nil
}

// restoreQuota reads the CPU quota in f (cpu.max or cpu.cfs_quota_us:
// the first field, -1 for max) and calls apply when it is not want.
func restoreQuota(f *cfile, buf []byte, want int64, apply func() error) (bool, error) {
	b, err := f.read(buf)
	if err != nil {
		return false, err
	}
	if q, _ := parseLimit(b); q == want {
		return false, nil
	}
	return true, apply()
}

// samePages compares memory limits as the kernel keeps them: in whole
// pages (-1 for max).
func samePages(a, b int64) bool {
	if a < 0 || b < 0 {
		return a < 0 && b < 0
	}
	page := int64(os.Getpagesize())
	return a/page == b/page
}

// RequestStat makes the next Sample read memory.stat and memory.events as
// well.
func (c *V2) RequestStat() { c.pending.Store(true) }
