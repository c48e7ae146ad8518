package envlet

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Resources is a CPU (cores) and memory (bytes) amount: a quota, a grant,
// a cap or a usage.
type Resources struct {
	CPU    float64 // cores
	Memory int64   // bytes
}

func (r Resources) String() string {
	return fmt.Sprintf("cpu=%.3g mem=%s", r.CPU, FormatBytes(r.Memory))
}

const (
	KiB = int64(1) << 10
	MiB = int64(1) << 20
	GiB = int64(1) << 30
)

// Config holds every policy knob. DefaultConfig gives the published
// defaults (docs/envlet.md, "Defaults"); ApplyAnnotations overrides
// them per container.
type Config struct {
	// Initial is the quota a container starts with and the floor no shrink
	// goes below (the admitted base). Cap is the per-environment ceiling.
	Initial, Cap Resources

	// SamplePeriod is the active tick; IdlePeriod the tick once the
	// environment has been idle (CPU util < IdleUtil and WS < MemShrinkWS of
	// the limit) for IdleAfter. Kernel events wake the loop in between.
	SamplePeriod, IdlePeriod, IdleAfter time.Duration
	IdleUtil                            float64
	// IdleReclaimAfter: once idle for this long (after IdleAfter), the
	// memory limit is halved every idle period towards MemMinHeadroom x
	// the working set, below the base if need be (v2 also writes
	// memory.reclaim first), so idle environments give memory back to the
	// node. 0 disables it.
	IdleReclaimAfter time.Duration

	// CPU grows x2 when usage >= CPUGrowUtil of the quota or the throttled
	// share of the tick >= CPUGrowThrottled, x4 when throttled >=
	// CPUGrow4Throttled; it halves when usage < CPUShrinkUtil for
	// CPUShrinkAfter, never within CPUCooldown of a grow.
	CPUGrowUtil, CPUGrowThrottled, CPUGrow4Throttled, CPUShrinkUtil float64
	CPUShrinkAfter, CPUCooldown                                     time.Duration
	// CPUBurst sets the CFS burst (cfs_burst_us / cpu.max.burst) to the
	// quota, absorbing a spike before the next tick.
	CPUBurst bool

	// Memory grows x2 when the working set >= MemGrowWS of the limit, x4
	// when >= MemGrow4WS or the kernel reports pressure at the limit
	// (failcnt, memory.high/max events, OOM); it halves when WS <
	// MemShrinkWS for MemShrinkAfter, to no less than MemShrinkFloor x peak
	// WS of that window nor the base, and never to less than MemMinHeadroom
	// x the current WS.
	MemGrowWS, MemGrow4WS, MemShrinkWS float64
	MemShrinkAfter                     time.Duration
	MemShrinkFloor, MemMinHeadroom     float64

	// PauseOnOOM (v1) sets oom_kill_disable while the controller runs, so
	// a task at its memory limit sleeps instead of being OOM-killed until
	// the controller grows the limit or fails the environment with its
	// reason (without it, a single-process task is killed by the kernel
	// before the failure can be reported). Reset when Run returns. On v2,
	// which has no such pause, it sets memory.oom.group=0 instead: a kernel
	// OOM at the memory.max safety net takes one task, not the whole
	// environment, and the controller decides what follows.
	PauseOnOOM bool

	// ArbiterTimeout bounds each arbiter call; on timeout CPU fails open up
	// to 2 x Initial and memory fails closed. 3 s: an answer is almost
	// always worth waiting for. On a 2-core node starting 48 environments
	// at once the shims and the arbiter woke up to 1.5 s late, and 1 s
	// lost the arbiter 0-7 times per batch (100 ms did 3-4 times with 12
	// environments). A dead arbiter costs nothing extra: its socket
	// refuses at once. ReportPeriod is how often
	// usage is reported (and admission reclaim picked up).
	ArbiterTimeout, ReportPeriod time.Duration
	// ArbiterWait bounds how long a task stuck at its memory limit waits,
	// paused, for an arbiter that does not answer (restarting, overloaded)
	// before it fails with ARBITER_UNREACHABLE. Meanwhile CPU still fails
	// open and nothing else changes.
	ArbiterWait time.Duration

	// The environment is failed when memory growth is denied and either
	// FailOOMs OOM events happened within FailWindow or it has been stuck
	// at its limit for FailPaused.
	FailOOMs               int
	FailWindow, FailPaused time.Duration

	// Tier is the CPU class (standard, latency, besteffort): the
	// scheduler weight under contention (Tier.Weights).
	Tier Tier

	// StartOrder runs the environment's start in the node's start queue
	// (StartQueue, standard tier only): its CPU weight is StartWeight of
	// its rank, so a crowd of starts is served oldest first instead of all
	// finishing late together. The start ends at the head of the queue,
	// when the CPU demand (run + run-queue wait) of two samples falls
	// under IdleUtil of the limit, or after StartMax there without going
	// idle: a busy job, not a start, which must not hold the ones behind
	// it back.
	StartOrder bool
	StartMax   time.Duration

	// PausePushOutAfter: a container paused through containerd (task
	// Pause: `ctr task pause`, `nerdctl pause`) for this long has its
	// memory pushed out of RAM, to the node's swap where there is one
	// (internal/pause.PushOut); it comes back as the tasks touch it after
	// the resume. The delay spares a short pause the cost of faulting
	// everything back (envsnap's own snapshots freeze the cgroup
	// directly, not through Pause). 0 turns it off.
	PausePushOutAfter time.Duration

	// Priority orders environments for the node's victim policy: when
	// promised memory is really needed and the node cannot supply it, lower
	// priorities fail first (NodeArbiter). Default 0.
	Priority int
}

// DefaultConfig returns the published defaults.
func DefaultConfig() Config {
	return Config{
		Initial:           Resources{CPU: 2, Memory: 8 * GiB},
		Cap:               Resources{CPU: 64, Memory: 32 * GiB},
		SamplePeriod:      200 * time.Millisecond,
		IdlePeriod:        time.Second,
		IdleAfter:         5 * time.Second,
		IdleUtil:          0.05,
		IdleReclaimAfter:  30 * time.Second,
		CPUGrowUtil:       0.85,
		CPUGrowThrottled:  0.10,
		CPUGrow4Throttled: 0.80,
		CPUShrinkUtil:     0.30,
		CPUShrinkAfter:    10 * time.Second,
		CPUCooldown:       10 * time.Second,
		CPUBurst:          true,
		MemGrowWS:         0.60,
		MemGrow4WS:        0.90,
		MemShrinkWS:       0.20,
		MemShrinkAfter:    60 * time.Second,
		MemShrinkFloor:    1.5,
		MemMinHeadroom:    1.25,
		PauseOnOOM:        true,
		ArbiterTimeout:    3 * time.Second,
		ReportPeriod:      time.Second,
		ArbiterWait:       30 * time.Second,
		FailOOMs:          2,
		FailWindow:        5 * time.Second,
		FailPaused:        2 * time.Second,
		Tier:              TierStandard,
		StartOrder:        true,
		StartMax:          30 * time.Second,
		PausePushOutAfter: 2 * time.Second,
	}
}

// Validate rejects knob combinations the policy cannot honour, notably
// missing hysteresis: a halving must not be able to trigger a grow on the
// next tick (shrink threshold x 2 < grow threshold).
func (c *Config) Validate() error {
	switch {
	case c.Initial.CPU <= 0 || c.Initial.Memory <= 0:
		return fmt.Errorf("envlet: initial quota must be positive (%v)", c.Initial)
	case c.Cap.CPU < c.Initial.CPU || c.Cap.Memory < c.Initial.Memory:
		return fmt.Errorf("envlet: cap %v below initial %v", c.Cap, c.Initial)
	case c.SamplePeriod <= 0 || c.IdlePeriod < c.SamplePeriod:
		return fmt.Errorf("envlet: sample period %v / idle period %v invalid", c.SamplePeriod, c.IdlePeriod)
	case c.CPUShrinkUtil*2 >= c.CPUGrowUtil:
		return fmt.Errorf("envlet: cpu shrink util %.2f x 2 must be below grow util %.2f (hysteresis)", c.CPUShrinkUtil, c.CPUGrowUtil)
	case c.MemShrinkWS*2 >= c.MemGrowWS:
		return fmt.Errorf("envlet: memory shrink ws %.2f x 2 must be below grow ws %.2f (hysteresis)", c.MemShrinkWS, c.MemGrowWS)
	case c.MemGrowWS > c.MemGrow4WS || c.MemGrow4WS > 1 || c.MemGrowWS <= 0:
		return fmt.Errorf("envlet: memory grow thresholds %.2f/%.2f invalid", c.MemGrowWS, c.MemGrow4WS)
	case c.CPUGrowThrottled > c.CPUGrow4Throttled || c.CPUGrowThrottled <= 0:
		return fmt.Errorf("envlet: cpu throttle thresholds %.2f/%.2f invalid", c.CPUGrowThrottled, c.CPUGrow4Throttled)
	case c.MemMinHeadroom < 1 || c.MemShrinkFloor < c.MemMinHeadroom:
		return fmt.Errorf("envlet: memory floors %.2f/%.2f invalid", c.MemMinHeadroom, c.MemShrinkFloor)
	case c.FailOOMs < 1 || c.FailWindow <= 0 || c.FailPaused <= 0:
		return fmt.Errorf("envlet: failure knobs invalid")
	case c.StartOrder && c.StartMax <= 0:
		return fmt.Errorf("envlet: start max %v must be positive", c.StartMax)
	case c.ArbiterTimeout <= 0 || c.ReportPeriod <= 0 || c.ArbiterWait <= 0:
		return fmt.Errorf("envlet: arbiter timeout / report period / arbiter wait must be positive")
	}
	return nil
}

// AnnotationPrefix prefixes every per-container override key.
const AnnotationPrefix = "io.envsnap.envlet."

type knob struct {
	name string
	set  func(c *Config, v string) error
}

func cpuKnob(dst func(*Config) *float64) func(*Config, string) error {
	return func(c *Config, v string) error {
		q, err := ParseCPU(v)
		*dst(c) = q
		return err
	}
}

func memKnob(dst func(*Config) *int64) func(*Config, string) error {
	return func(c *Config, v string) error {
		q, err := ParseBytes(v)
		*dst(c) = q
		return err
	}
}

func durKnob(dst func(*Config) *time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err == nil && d <= 0 {
			err = fmt.Errorf("must be positive")
		}
		*dst(c) = d
		return err
	}
}

// offDurKnob is a duration where 0 turns the feature off.
func offDurKnob(dst func(*Config) *time.Duration) func(*Config, string) error {
	return func(c *Config, v string) error {
		d, err := time.ParseDuration(v)
		if err == nil && d < 0 {
			err = fmt.Errorf("must not be negative")
		}
		*dst(c) = d
		return err
	}
}

func fracKnob(dst func(*Config) *float64) func(*Config, string) error {
	return func(c *Config, v string) error {
		f, err := strconv.ParseFloat(v, 64)
		if err == nil && (f < 0 || math.IsNaN(f) || math.IsInf(f, 0)) {
			err = fmt.Errorf("must be a non-negative number")
		}
		*dst(c) = f
		return err
	}
}

var knobs = []knob{
	{"initial-cpu", cpuKnob(func(c *Config) *float64 { return &c.Initial.CPU })},
	{"initial-memory", memKnob(func(c *Config) *int64 { return &c.Initial.Memory })},
	{"cap-cpu", cpuKnob(func(c *Config) *float64 { return &c.Cap.CPU })},
	{"cap-memory", memKnob(func(c *Config) *int64 { return &c.Cap.Memory })},
	{"sample-period", durKnob(func(c *Config) *time.Duration { return &c.SamplePeriod })},
	{"idle-period", durKnob(func(c *Config) *time.Duration { return &c.IdlePeriod })},
	{"idle-after", durKnob(func(c *Config) *time.Duration { return &c.IdleAfter })},
	{"idle-util", fracKnob(func(c *Config) *float64 { return &c.IdleUtil })},
	{"idle-reclaim-after", offDurKnob(func(c *Config) *time.Duration { return &c.IdleReclaimAfter })},
	{"cpu-grow-util", fracKnob(func(c *Config) *float64 { return &c.CPUGrowUtil })},
	{"cpu-grow-throttled", fracKnob(func(c *Config) *float64 { return &c.CPUGrowThrottled })},
	{"cpu-grow4-throttled", fracKnob(func(c *Config) *float64 { return &c.CPUGrow4Throttled })},
	{"cpu-shrink-util", fracKnob(func(c *Config) *float64 { return &c.CPUShrinkUtil })},
	{"cpu-shrink-after", durKnob(func(c *Config) *time.Duration { return &c.CPUShrinkAfter })},
	{"cpu-cooldown", durKnob(func(c *Config) *time.Duration { return &c.CPUCooldown })},
	{"cpu-burst", func(c *Config, v string) (err error) { c.CPUBurst, err = strconv.ParseBool(v); return err }},
	{"mem-grow-ws", fracKnob(func(c *Config) *float64 { return &c.MemGrowWS })},
	{"mem-grow4-ws", fracKnob(func(c *Config) *float64 { return &c.MemGrow4WS })},
	{"mem-shrink-ws", fracKnob(func(c *Config) *float64 { return &c.MemShrinkWS })},
	{"mem-shrink-after", durKnob(func(c *Config) *time.Duration { return &c.MemShrinkAfter })},
	{"mem-shrink-floor", fracKnob(func(c *Config) *float64 { return &c.MemShrinkFloor })},
	{"mem-min-headroom", fracKnob(func(c *Config) *float64 { return &c.MemMinHeadroom })},
	{"pause-on-oom", func(c *Config, v string) (err error) { c.PauseOnOOM, err = strconv.ParseBool(v); return err }},
	{"arbiter-timeout", durKnob(func(c *Config) *time.Duration { return &c.ArbiterTimeout })},
	{"report-period", durKnob(func(c *Config) *time.Duration { return &c.ReportPeriod })},
	{"arbiter-wait", durKnob(func(c *Config) *time.Duration { return &c.ArbiterWait })},
	{"fail-ooms", func(c *Config, v string) (err error) { c.FailOOMs, err = strconv.Atoi(v); return err }},
	{"fail-window", durKnob(func(c *Config) *time.Duration { return &c.FailWindow })},
	{"fail-paused", durKnob(func(c *Config) *time.Duration { return &c.FailPaused })},
	{"priority", func(c *Config, v string) (err error) { c.Priority, err = strconv.Atoi(v); return err }},
	{"tier", func(c *Config, v string) (err error) { c.Tier, err = ParseTier(v); return err }},
	{"start-order", func(c *Config, v string) (err error) { c.StartOrder, err = strconv.ParseBool(v); return err }},
	{"start-max", durKnob(func(c *Config) *time.Duration { return &c.StartMax })},
	{"pause-push-out-after", offDurKnob(func(c *Config) *time.Duration { return &c.PausePushOutAfter })},
}

// AnnotationKeys lists every accepted annotation key.
func AnnotationKeys() []string {
	keys := make([]string, len(knobs))
	for i, k := range knobs {
		keys[i] = AnnotationPrefix + k.name
	}
	return keys
}

// ApplyAnnotations overrides knobs from "io.envsnap.envlet.<knob>"
// annotations (e.g. initial-cpu=0.25, initial-memory=256Mi). An unknown
// envlet key or a bad value is an error, and so is a result that fails
// Validate: a typo must not silently run a container with the defaults.
// Keys outside the prefix are ignored.
func (c *Config) ApplyAnnotations(a map[string]string) error {
	next := *c
	for key, v := range a {
		name, ok := strings.CutPrefix(key, AnnotationPrefix)
		if !ok {
			continue
		}
		var k *knob
		for i := range knobs {
			if knobs[i].name == name {
				k = &knobs[i]
				break
			}
		}
		if k == nil {
			return fmt.Errorf("envlet: unknown annotation %s", key)
		}
		if err := k.set(&next, strings.TrimSpace(v)); err != nil {
			return fmt.Errorf("envlet: annotation %s=%q: %w", key, v, err)
		}
	}
	if err := next.Validate(); err != nil {
		return err
	}
	*c = next
	return nil
}

// ParseCPU parses cores as "0.25" or Kubernetes millicores "250m".
func ParseCPU(s string) (float64, error) {
	mult := 1.0
	if t, ok := strings.CutSuffix(s, "m"); ok {
		s, mult = t, 0.001
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f <= 0 || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, fmt.Errorf("invalid cpu quantity %q", s)
	}
	return f * mult, nil
}

var byteSuffixes = []struct {
	s string
	m float64
}{
	{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40},
	{"k", 1e3}, {"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12},
}

// ParseBytes parses a Kubernetes-style quantity: "268435456", "256Mi",
// "1.5Gi", "2G".
func ParseBytes(s string) (int64, error) {
	num, mult := s, 1.0
	for _, suf := range byteSuffixes {
		if t, ok := strings.CutSuffix(s, suf.s); ok {
			num, mult = t, suf.m
			break
		}
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f <= 0 || math.IsNaN(f) || f*mult > float64(math.MaxInt64/2) {
		return 0, fmt.Errorf("invalid memory quantity %q", s)
	}
	return int64(f * mult), nil
}

// FormatBytes renders b in binary units for logs and plots.
func FormatBytes(b int64) string {
	switch {
	case b >= GiB:
		return strconv.FormatFloat(float64(b)/float64(GiB), 'f', 2, 64) + "Gi"
	case b >= MiB:
		return strconv.FormatFloat(float64(b)/float64(MiB), 'f', 1, 64) + "Mi"
	}
	return strconv.FormatInt(b, 10)
}
