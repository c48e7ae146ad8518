package envlet

import (
	"math"
	"time"
)

// Observation is what the policy sees at one tick: rates derived from two
// consecutive samples, plus what the kernel reported in between.
type Observation struct {
	Now time.Time
	// CPUValid is false on the first sample (no rate yet).
	CPUValid bool
	// CPUUsed is cores used over the interval; Throttled the share (0..1)
	// of the interval the group spent throttled, from the rate of
	// throttled_time normalised by the CPUs the quota can occupy. (The
	// nr_throttled/nr_periods ratio only takes 0/50/100% over two 100 ms
	// periods and is not used.)
	CPUUsed, Throttled float64
	// WS is usage minus inactive file cache.
	WS, MemUsage int64
	// NewOOMs counts OOM events since the previous observation.
	NewOOMs int
	// LimitHits: the kernel hit the memory limit since the previous
	// observation (v1 failcnt, v2 memory.events high/max).
	LimitHits bool
	// UnderOOM: v1 tasks are paused at the limit.
	UnderOOM bool
	// ArbiterDown: this tick's grow got no answer from the arbiter
	// (unreachable or timed out), as opposed to an answer that denied it.
	// The controller sets it between Decide and Resolve.
	ArbiterDown bool
}

// ChangeKind is what the policy wants done to one resource.
type ChangeKind int

const (
	Keep ChangeKind = iota
	Grow
	Shrink
)

func (k ChangeKind) String() string {
	return [...]string{"keep", "grow", "shrink"}[k]
}

// CPUChange and MemChange are the policy's wish for one resource. For a
// grow, Want is the uncapped wish and To the wish bounded by the cap; a
// grow whose To does not exceed the current limit is already denied by
// the cap.
type CPUChange struct {
	Kind     ChangeKind
	Factor   int
	To, Want float64
}

type MemChange struct {
	Kind     ChangeKind
	Factor   int
	To, Want int64
	// Idle: a shrink of an idle environment towards its working set,
	// below the base if need be (Config.IdleReclaimAfter).
	Idle bool
}

// Decision is the outcome of Decide.
type Decision struct {
	CPU CPUChange
	Mem MemChange
}

// State is the per-environment policy state. It is a plain value: Decide,
// Resolve and Reclaim take one and return the next, so traces replay
// deterministically on a fake clock.
type State struct {
	Limit Resources // what is applied to the cgroup
	Base  Resources // admitted base: no shrink goes below it

	cpuLowSince, cpuLastGrow time.Time
	memLowSince              time.Time
	memPeakWS                int64 // peak WS in the current low window

	atLimitSince time.Time // memory pressure at the limit, continuously since
	ooms         [16]time.Time
	oomNext      int

	idleSince time.Time
	Idle      bool // sampled at the idle period

	cpuIdleSince time.Time // CPU under IdleUtil continuously since

	// waitSince: memory denied for want of an arbiter answer while the
	// group is under pressure at its limit, continuously since. Waiting
	// tells the controller to hold the task paused (v2: frozen).
	waitSince time.Time
	Waiting   bool
}

// NewState starts at the initial quota.
func NewState(cfg *Config) State {
	return State{Limit: cfg.Initial, Base: cfg.Initial}
}

// Policy holds the configuration the pure policy functions consult.
type Policy struct {
	Cfg Config
}

// Decide turns one observation into wishes. Grow fast (x2, x4 under heavy
// throttling or memory pressure), shrink slow (halve after a sustained low
// window, at most once per window), with thresholds chosen so that a
// halving cannot trigger a grow on the next tick (Config.Validate).
func (p *Policy) Decide(s State, o Observation) (State, Decision) {
	cfg := &p.Cfg
	var d Decision
	now := o.Now

	// CPU.
	if o.CPUValid && s.Limit.CPU > 0 {
		util := o.CPUUsed / s.Limit.CPU
		factor := 0
		switch {
		case o.Throttled >= cfg.CPUGrow4Throttled:
			factor = 4
		case util >= cfg.CPUGrowUtil || o.Throttled >= cfg.CPUGrowThrottled:
			factor = 2
		}
		switch {
		case factor > 0:
			want := s.Limit.CPU * float64(factor)
			d.CPU = CPUChange{Kind: Grow, Factor: factor, Want: want, To: math.Min(want, cfg.Cap.CPU)}
			if d.CPU.To <= s.Limit.CPU {
				d.CPU = CPUChange{} // at the cap: CPU starvation slows, never kills
			}
			s.cpuLowSince = time.Time{}
		case util < cfg.CPUShrinkUtil && o.Throttled < cfg.CPUGrowThrottled/2:
			if s.cpuLowSince.IsZero() {
				s.cpuLowSince = now
			}
			if now.Sub(s.cpuLowSince) >= cfg.CPUShrinkAfter && now.Sub(s.cpuLastGrow) >= cfg.CPUCooldown && s.Limit.CPU > s.Base.CPU {
				to := math.Max(s.Limit.CPU/2, s.Base.CPU)
				d.CPU = CPUChange{Kind: Shrink, To: to, Want: to}
				s.cpuLowSince = now // one shrink per window
			}
		default:
			s.cpuLowSince = time.Time{}
		}
	}

	// Memory.
	lim := s.Limit.Memory
	if lim > 0 {
		frac := float64(o.WS) / float64(lim)
		// A working set above the limit: only cgroup v2's memory.high lets
		// one pass it, and every further charge is throttled. The group is
		// squeezed whether or not it charged this tick: a task that got its
		// memory through the throttling and then blocks (on a pipe, a
		// lock) charges nothing, so memory.events high stops counting
		// while it runs on memory the node never granted.
		over := o.WS > lim
		// Tasks paused at the limit (v1 under_oom) have their working set
		// at the limit: the kernel drops file cache before it pauses
		// anyone. A pause reported with the working set far below the limit
		// predates the last grow (the flag is a level, read with
		// memory.stat, not every tick), and growing on it again compounds:
		// an environment back from an arbiter outage went 1 -> 4 -> 16 ->
		// 20 GiB with a working set of 1 GiB.
		underOOM := o.UnderOOM && frac >= cfg.MemGrowWS
		pressure := o.NewOOMs > 0 || underOOM || over || (o.LimitHits && frac >= cfg.MemGrowWS)
		for range o.NewOOMs {
			s.ooms[s.oomNext%len(s.ooms)] = now
			s.oomNext++
		}
		// Stuck: the kernel is killing, pausing, or squeezing the group at
		// its limit. A high working set alone is not stuck.
		if o.NewOOMs > 0 || underOOM || over || (o.LimitHits && frac >= cfg.MemGrow4WS) {
			if s.atLimitSince.IsZero() {
				s.atLimitSince = now
			}
		} else {
			s.atLimitSince = time.Time{}
		}
		factor := 0
		switch {
		case pressure || frac >= cfg.MemGrow4WS:
			factor = 4
		case frac >= cfg.MemGrowWS:
			factor = 2
		}
		switch {
		case factor > 0:
			want := max(lim*int64(factor), 2*o.WS)
			d.Mem = MemChange{Kind: Grow, Factor: factor, Want: want, To: min(want, cfg.Cap.Memory)}
			s.memLowSince, s.memPeakWS = time.Time{}, 0
		case frac < cfg.MemShrinkWS:
			if s.memLowSince.IsZero() {
				s.memLowSince = now
			}
			s.memPeakWS = max(s.memPeakWS, o.WS)
			if now.Sub(s.memLowSince) >= cfg.MemShrinkAfter && lim > s.Base.Memory {
				to := max(lim/2, s.Base.Memory, int64(float64(s.memPeakWS)*cfg.MemShrinkFloor), p.memFloor(o.WS))
				if to < lim {
					d.Mem = MemChange{Kind: Shrink, To: to, Want: to}
				}
				s.memLowSince, s.memPeakWS = now, o.WS // one shrink per window
			}
		default:
			s.memLowSince, s.memPeakWS = time.Time{}, 0
		}
	}

	// Idle environments are sampled less often; kernel events still wake
	// them (v1: the memory thresholds at the grow fractions; v2:
	// memory.events at memory.high). Idle is CPU under IdleUtil with the
	// working set below the grow threshold: idle reclaim leaves it at 54%
	// of the limit (belowGrow), and an environment it reclaimed must stay
	// idle, else every sleeping agent is sampled every SamplePeriod.
	if o.CPUValid && s.Limit.CPU > 0 && o.CPUUsed/s.Limit.CPU < cfg.IdleUtil && lim > 0 && float64(o.WS) < cfg.MemGrowWS*float64(lim) {
		if s.idleSince.IsZero() {
			s.idleSince = now
		}
		s.Idle = now.Sub(s.idleSince) >= cfg.IdleAfter
	} else {
		s.idleSince, s.Idle = time.Time{}, false
	}

	// Idle memory back to the node: an environment whose CPU has been
	// idle for IdleAfter + IdleReclaimAfter gives back what its working
	// set does not use, in halvings (one per tick, i.e. per idle period),
	// below its base if need be, but never so far that the working set
	// reaches 90% of the grow threshold: a reclaim must not trigger a grow.
	// The grow path brings it back: the arbiter grants up to the base at
	// once.
	if o.CPUValid && s.Limit.CPU > 0 && o.CPUUsed/s.Limit.CPU < cfg.IdleUtil {
		if s.cpuIdleSince.IsZero() {
			s.cpuIdleSince = now
		}
	} else {
		s.cpuIdleSince = time.Time{}
	}
	if cfg.IdleReclaimAfter > 0 && !s.cpuIdleSince.IsZero() && d.Mem.Kind == Keep && lim > 0 &&
		now.Sub(s.cpuIdleSince) >= cfg.IdleAfter+cfg.IdleReclaimAfter {
		to := max(lim/2, belowGrow(o.WS, cfg.MemGrowWS), p.memFloor(o.WS), IdleReclaimFloor)
		if to < lim {
			d.Mem = MemChange{Kind: Shrink, To: to, Want: to, Idle: true}
		}
	}
	return s, d
}

// IdleReclaimFloor is the lowest memory limit idle reclaim sets: a few
// pages of a sleeping shell and its runtime, so waking up never starts
// from a limit the first page faults already exceed.
const IdleReclaimFloor = 32 * MiB

// belowGrow is the lowest memory limit at which working set ws stays
// under 90% of the grow threshold growWS: a limit lowered for reclaim
// (idle, or an admission's) must not make the next tick grow it back.
func belowGrow(ws int64, growWS float64) int64 {
	return int64(math.Ceil(float64(ws) / (0.9 * growWS)))
}

// memFloor is the lowest memory limit ever set for a working set.
func (p *Policy) memFloor(ws int64) int64 {
	return int64(math.Ceil(float64(ws) * p.Cfg.MemMinHeadroom))
}

// need is what a task stuck at its memory limit needs: more than the
// limit, and at least MemMinHeadroom x its working set. The grow step the
// policy asked for (x4) is a guess at the future, not a need.
func (p *Policy) need(s State, o Observation) int64 {
	return max(p.memFloor(o.WS), s.Limit.Memory)
}

// Failure reasons.
const (
	ReasonNodeExhausted = "MEM_NODE_EXHAUSTED"
	ReasonCapExceeded   = "MEM_CAP_EXCEEDED"
	// ReasonKilledBeforeGrow: the kernel OOM-killed a task at the
	// controller's own limit, below the cap, before a tick grew it
	// (Controller.KilledByKernel).
	ReasonKilledBeforeGrow  = "MEM_KILLED_BEFORE_GROW"
	ReasonAdmissionRejected = "ADMISSION_REJECTED"
	// ReasonArbiterUnreachable: memory was needed and the node arbiter
	// gave no answer for Config.ArbiterWait. Nothing is known about the
	// node: the failure is the arbiter's, not the node's nor the task's.
	ReasonArbiterUnreachable = "ARBITER_UNREACHABLE"
	// ReasonPidsExhausted: forks kept failing at the environment's pids
	// limit for the shim's grace period (a fork bomb).
	ReasonPidsExhausted = "PIDS_EXHAUSTED"
	// ReasonOutputCapExceeded: the environment's processes wrote more to
	// stdout and stderr than the shim's output cap.
	ReasonOutputCapExceeded = "OUTPUT_CAP_EXCEEDED"
	// ReasonDiskCapExceeded: the environment's writable layer grew above
	// the shim's disk or inode cap.
	ReasonDiskCapExceeded = "DISK_CAP_EXCEEDED"
)

// IsMemoryReason tells whether a failure reason is about memory (the
// kernel's or the controller's OOM), as opposed to the shim's guard.
func IsMemoryReason(r string) bool {
	switch r {
	case ReasonNodeExhausted, ReasonCapExceeded, ReasonKilledBeforeGrow, ReasonArbiterUnreachable:
		return true
	}
	return false
}

// Resolve combines the decision with what the arbiter granted (granted is
// the total; for a resource not asked to grow it equals the current limit)
// and returns the limits to apply. When memory was wanted but not granted
// and the environment is OOMing or stuck at its limit, it returns the
// failure instead: an environment is never left to run starved.
func (p *Policy) Resolve(s State, o Observation, d Decision, granted Resources) (State, Resources, *Failure) {
	cfg := &p.Cfg
	next := s.Limit
	if d.Mem.Kind != Grow || !o.ArbiterDown {
		s.waitSince, s.Waiting = time.Time{}, false
	}
	switch d.CPU.Kind {
	case Grow:
		if g := math.Min(granted.CPU, d.CPU.To); g > next.CPU {
			next.CPU = g
			s.cpuLastGrow = o.Now
		}
	case Shrink:
		next.CPU = d.CPU.To
	}
	switch d.Mem.Kind {
	case Grow:
		g := min(granted.Memory, d.Mem.To)
		if g > next.Memory {
			next.Memory = g
			s.atLimitSince = time.Time{}
			break
		}
		// Denied: by the cap (To not above the limit) or by the node.
		ooms := 0
		for _, t := range s.ooms {
			if !t.IsZero() && o.Now.Sub(t) < cfg.FailWindow {
				ooms++
			}
		}
		pressed := ooms > 0 || !s.atLimitSince.IsZero()
		if o.ArbiterDown && d.Mem.To > s.Limit.Memory && pressed {
			// No answer is not a denial: an arbiter restart must not look
			// like a full node. Wait, paused at the limit, for
			// ArbiterWait, then fail with the arbiter as the reason.
			if s.waitSince.IsZero() {
				s.waitSince = o.Now
			}
			if o.Now.Sub(s.waitSince) < cfg.ArbiterWait {
				s.Waiting = true
				return s, next, nil
			}
			s.waitSince, s.Waiting = time.Time{}, false
			return s, s.Limit, &Failure{
				Reason:     ReasonArbiterUnreachable,
				Requested:  p.need(s, o),
				Asked:      d.Mem.Want,
				Granted:    s.Limit.Memory,
				Cap:        cfg.Cap.Memory,
				WorkingSet: o.WS,
				OOMs:       ooms,
			}
		}
		s.waitSince, s.Waiting = time.Time{}, false
		stuck := !s.atLimitSince.IsZero() && o.Now.Sub(s.atLimitSince) >= cfg.FailPaused
		if ooms >= cfg.FailOOMs || stuck {
			reason := ReasonNodeExhausted
			if d.Mem.To <= s.Limit.Memory {
				reason = ReasonCapExceeded
			}
			return s, s.Limit, &Failure{
				Reason:     reason,
				Requested:  p.need(s, o),
				Asked:      d.Mem.Want,
				Granted:    max(granted.Memory, s.Limit.Memory),
				Cap:        cfg.Cap.Memory,
				WorkingSet: o.WS,
				OOMs:       ooms,
			}
		}
	case Shrink:
		next.Memory = d.Mem.To
	}
	return s, next, nil
}

// Reclaim lowers the limits to what the arbiter asks back for admissions,
// but never memory below MemMinHeadroom x the working set, nor so far that
// the working set reaches the grow threshold (belowGrow): a reclaimed
// burst would come straight back at the next tick.
func (p *Policy) Reclaim(s State, o Observation, limit Resources) Resources {
	next := s.Limit
	if limit.CPU > 0 && limit.CPU < next.CPU {
		next.CPU = limit.CPU
	}
	if limit.Memory > 0 && limit.Memory < next.Memory {
		next.Memory = min(next.Memory, max(limit.Memory, p.memFloor(o.WS), belowGrow(o.WS, p.Cfg.MemGrowWS)))
	}
	return next
}

// Applied records the limits the cgroup accepted.
func (s State) Applied(l Resources) State {
	s.Limit = l
	return s
}
