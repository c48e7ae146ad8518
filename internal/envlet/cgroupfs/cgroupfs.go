// Package cgroupfs samples and actuates one container cgroup for the envlet
// quota controller, on cgroup v1 (cpu, cpuacct, memory hierarchies) and on
// cgroup v2.
//
// The sampler runs every 200 ms for every environment on a node, so it is
// built to be cheap: every file is opened once, read with pread into a
// per-cgroup buffer and parsed without allocating (containerd/cgroups'
// Stat() costs 220-380 us of CPU per call, this costs ~10 us). Writes go
// straight to the pre-opened control files because the order of the writes
// matters (v1 memsw vs limit, CFS burst vs quota) and the library's v1
// Update gets the memsw order wrong when raising (EINVAL).
//
// Between samples the kernel wakes the controller through Events: v1
// memory usage-threshold eventfds re-armed on every limit change, v2
// inotify on memory.events and PSI triggers on cpu.pressure and
// memory.pressure.
package cgroupfs

import (
	"errors"
	"syscall"
)

// Limits is what Apply writes: CPU in cores (<= 0 means unlimited) and
// memory in bytes (<= 0 means unlimited).
type Limits struct {
	CPU    float64
	Memory int64
}

// Sample is one reading of a cgroup's counters. Counters are cumulative
// since the cgroup was created; the caller computes rates between samples.
type Sample struct {
	CPUUsageNs       uint64 // v1 cpuacct.usage, v2 cpu.stat usage_usec*1000
	ThrottledNs      uint64 // cpu.stat throttled_time (v1) / throttled_usec*1000 (v2)
	Periods          uint64 // cpu.stat nr_periods
	ThrottledPeriods uint64 // cpu.stat nr_throttled
	BurstNs          uint64 // cpu.stat burst_time / burst_usec*1000

	MemUsage int64 // memory.usage_in_bytes / memory.current
	// InactiveFile is total_inactive_file (v1) / inactive_file (v2). It is
	// refreshed only when MemStat is true (memory.stat is the expensive read);
	// otherwise it holds the previous value.
	InactiveFile int64
	// MemStat reports that InactiveFile and the event counters below were
	// read in this sample.
	MemStat bool

	Failcnt  uint64 // v1 memory.failcnt; v2 memory.events max
	High     uint64 // v2 memory.events high (memory.high throttling)
	OOM      uint64 // v2 memory.events oom; v1 has no counter (0)
	OOMKill  uint64 // v1 memory.oom_control oom_kill; v2 memory.events oom_kill
	UnderOOM bool   // v1 memory.oom_control under_oom (tasks paused at the limit)
}

// WorkingSet is usage minus inactive file cache: the kubelet/cAdvisor
// definition, the memory the workload cannot give back cheaply.
func (s *Sample) WorkingSet() int64 {
	ws := s.MemUsage - s.InactiveFile
	if ws < 0 {
		return 0
	}
	return ws
}

// EventKind says which kernel notification woke the controller.
type EventKind int

const (
	// EventMemThreshold: v1 memory usage crossed an armed threshold.
	EventMemThreshold EventKind = iota + 1
	// EventMemEvents: v2 memory.events changed (high, max, oom or oom_kill).
	EventMemEvents
	// EventCPUPressure, EventMemPressure: a v2 PSI trigger fired.
	EventCPUPressure
	EventMemPressure
)

func (k EventKind) String() string {
	switch k {
	case EventMemThreshold:
		return "mem-threshold"
	case EventMemEvents:
		return "mem-events"
	case EventCPUPressure:
		return "cpu-pressure"
	case EventMemPressure:
		return "mem-pressure"
	}
	return "unknown"
}

// Event is a kernel notification delivered between samples.
type Event struct {
	Kind EventKind
}

var (
	// ErrVanished means the cgroup was removed (the task exited and its
	// cgroup was deleted); nothing more can be read or written.
	ErrVanished = errors.New("cgroup vanished")
	// ErrBusy means the kernel refused to lower the memory limit below
	// current usage (v1 EBUSY). Nothing was killed; retry later.
	ErrBusy = errors.New("memory limit below usage refused")
	// ErrUnsupported means the kernel lacks the control file.
	ErrUnsupported = errors.New("not supported by this kernel")
)

// classify maps the errnos of a removed cgroup to ErrVanished and v1's
// refusal to shrink to ErrBusy, keeping the original error in the chain.
func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, syscall.ENODEV), errors.Is(err, syscall.ENOENT):
		return errors.Join(ErrVanished, err)
	case errors.Is(err, syscall.EBUSY):
		return errors.Join(ErrBusy, err)
	}
	return err
}
