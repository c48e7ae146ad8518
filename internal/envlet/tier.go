package envlet

import "fmt"

// Tier is an environment's CPU class: how it shares a busy node's CPU
// with the others. Quotas (the elastic limits) are unchanged; the tier
// sets the scheduler weight under contention.
type Tier string

const (
	// TierStandard keeps the weight the runtime set (Kubernetes derives
	// it from the CPU request).
	TierStandard Tier = "standard"
	// TierLatency is for latency-sensitive episodes: they win contention
	// for the CPU against standard and best-effort work.
	TierLatency Tier = "latency"
	// TierBestEffort runs only on CPU nobody else wants: the lowest weight
	// and, on v2, SCHED_IDLE for the whole group (cpu.idle).
	TierBestEffort Tier = "besteffort"
)

// ParseTier parses a tier annotation value.
func ParseTier(s string) (Tier, error) {
	switch t := Tier(s); t {
	case TierStandard, TierLatency, TierBestEffort:
		return t, nil
	}
	return "", fmt.Errorf("tier %q: want latency, standard or besteffort", s)
}

// CPUWeights is what a tier writes: v1 cpu.shares, v2 cpu.weight and
// cpu.idle. Zero shares/weight mean "leave as is".
type CPUWeights struct {
	Shares uint64 // v1, 2..262144, default 1024
	Weight uint64 // v2, 1..10000, default 100
	Idle   bool   // v2 cpu.idle
}

// Weights maps a tier to scheduler weights. A latency-sensitive group
// gets 10x the default weight (CFS gives it ~91% of a contended CPU
// against one default-weight group, ~99.8% against a best-effort one);
// best-effort gets the minimum, and on v2 cpu.idle, which schedules the
// group as SCHED_IDLE: it yields to any non-idle task on the CPU at once
// instead of in proportion to weight, the closest cgroup knob to the core
// scheduling DSec needed to keep latency-sensitive slowdown low.
func (t Tier) Weights() CPUWeights {
	switch t {
	case TierLatency:
		return CPUWeights{Shares: 10240, Weight: 1000}
	case TierBestEffort:
		return CPUWeights{Shares: 2, Weight: 1, Idle: true}
	}
	return CPUWeights{}
}

// StartWeight is the CPU weight of an environment whose start has rank
// environments ahead of it in the node's start queue (StartQueue): its
// own weight base at the head, a quarter of it for each place behind,
// never below least. A quarter per place keeps the order close to first
// come, first served (the head gets four fifths of a CPU it shares with
// the next) while a start that waits on I/O leaves its CPU to the ones
// behind it.
func StartWeight(base, least uint64, rank int) uint64 {
	if rank <= 0 {
		return base
	}
	if rank >= 32 {
		return least
	}
	return max(base>>(2*rank), least)
}
