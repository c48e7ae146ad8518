package cgroupfs

import (
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// V2 is a cgroup v2 container cgroup. Memory is driven through memory.high
// (the grant: throttles and reclaims, never OOM-kills) with memory.max as
// the safety net at 1.25 x the grant (bounded by the cap), because lowering
// memory.max below usage OOM-kills on v2.
type V2 struct {
	cpuStat, cpuMax, cpuBurst, memCurrent, memStat, memEvents, memHigh, memMax cfile

	buf      []byte
	periodUs int64
	cur      Limits
	curMax   int64 // memory.max as written (-1 unlimited)
	memCap   int64

	inotify  *os.File
	events   chan Event
	pending  atomic.Bool
	lastStat time.Time
}

// OpenV2 opens the cgroup at root/path (root is the unified mount:
// /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts).
func OpenV2(root, path string) (_ *V2, retErr error) {
	dir := filepath.Join(root, path)
	c := &V2{buf: make([]byte, 16<<10), events: make(chan Event, 1), periodUs: 100000, curMax: -1}
	files := []*cfile{&c.cpuStat, &c.cpuMax, &c.cpuBurst, &c.memCurrent, &c.memStat, &c.memEvents, &c.memHigh, &c.memMax}
	for _, f := range files {
		f.fd = -1
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
	if err != nil {
		return nil, fmt.Errorf("open cgroup v2 %s (are the cpu and memory controllers enabled?): %w", dir, err)
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
	return c, nil
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
// memory.events once a second, when usage is at or above half the grant,
// or after memory.events changed.
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
	if c.pending.Swap(false) || now.Sub(c.lastStat) >= statEvery || (c.cur.Memory > 0 && 2*s.MemUsage >= c.cur.Memory) {
		c.lastStat = now
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

func (c *V2) applyCPU(cores float64) error {
	var qb, bb [48]byte
	quota := int64(-1)
	q := append(qb[:0], "max "...)
	if cores > 0 {
		quota = max(int64(cores*float64(c.periodUs)), 1000)
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

// Events delivers memory.events changes; it is never closed.
func (c *V2) Events() <-chan Event { return c.events }

// Close releases every fd and stops the inotify watch.
func (c *V2) Close() error {
	if c.inotify != nil {
		c.inotify.Close()
		c.inotify = nil
	}
	for _, f := range []*cfile{&c.cpuStat, &c.cpuMax, &c.cpuBurst, &c.memCurrent, &c.memStat, &c.memEvents, &c.memHigh, &c.memMax} {
		f.close()
	}
	return nil
}

// RequestStat makes the next Sample read memory.stat and memory.events as
// well.
func (c *V2) RequestStat() { c.pending.Store(true) }
