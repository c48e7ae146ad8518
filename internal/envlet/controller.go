// Package envlet is the per-environment elastic quota controller of the
// envlet shim: it samples a container's cgroup every 200 ms (and on kernel
// memory events in between), grows CPU and memory fast when the workload
// is starved, shrinks them slowly when it is not, asks a node Arbiter for
// every grow, and fails the environment loudly when memory it needs cannot
// be granted. The decisions are made by Policy, a pure function of
// (state, observation) so traces replay on a fake clock; Controller does
// the I/O around it.
package envlet

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
)

// TimelinePoint is one tick of quota history, for plots and tests.
type TimelinePoint struct {
	T         time.Time
	Limit     Resources // after this tick's actions
	CPUUsed   float64   // cores
	Throttled float64   // share of the tick
	WS        int64
	MemUsage  int64
	// Wake is "tick" or "event"; Actions lists what changed ("cpu x4",
	// "mem /2", "mem busy", "reclaim to ...", "reclaim busy", "mem denied"),
	// empty when nothing.
	Wake    string
	Actions string
}

// Status is a snapshot of a controller.
type Status struct {
	Env        string
	Limit      Resources
	Sampled    time.Time
	CPUUsed    float64 // cores over the last tick
	CPUUtil    float64 // CPUUsed / CPU limit
	Throttled  float64
	WorkingSet int64
	MemUsage   int64
	Idle       bool

	CPUGrows, CPUShrinks, MemGrows, MemShrinks int
	Reclaims, Busy, Denied, OOMs, Failures     int
	Failure                                    *Failure
	// EgressDenied counts the packets the environment's egress policy
	// rejected. The shim fills it in (the controller does not see the
	// network).
	EgressDenied int `json:",omitempty"`
	// LSMDenied counts the connects and opens the environment's BPF LSM
	// rules refused; LSMUnavailable says it runs without them (the
	// kernel does not run BPF LSM programs). The shim fills both in.
	LSMDenied      int  `json:",omitempty"`
	LSMUnavailable bool `json:",omitempty"`
	// Starting: the environment's start is in the node's start queue,
	// StartRank places behind its head (Config.StartOrder).
	Starting  bool `json:",omitempty"`
	StartRank int  `json:",omitempty"`
	// Paused: the environment is paused through the task API; PushedOut
	// is the memory its last pause pushed out of RAM, in bytes. The shim
	// fills both in.
	Paused    bool  `json:",omitempty"`
	PushedOut int64 `json:",omitempty"`
}

// Option configures a Controller.
type Option func(*Controller)

// WithClock replaces the wall clock (tests).
func WithClock(c Clock) Option { return func(ctl *Controller) { ctl.clock = c } }

// WithLogger sets the logger (default: log.G(ctx) of Run, with the env id).
func WithLogger(l *log.Entry) Option { return func(ctl *Controller) { ctl.log = l } }

// WithTimeline keeps the last n ticks of history (default 3000: 10 min at
// 200 ms); 0 disables it.
func WithTimeline(n int) Option { return func(ctl *Controller) { ctl.tlCap = n } }

// Controller runs the elastic policy for one environment.
type Controller struct {
	env   string
	cg    Cgroup
	cfg   Config
	pol   Policy
	arb   Arbiter
	clock Clock
	log   *log.Entry
	ncpu  int

	admitted   bool
	st         State
	prev, cur  Sample
	prevAt     time.Time
	havePrev   bool
	lastReport time.Time
	reported   Resources // the limits the last report carried
	reportedWS int64     // and the working set

	wake chan struct{}

	// Arbiter outage bookkeeping: logged once when it starts and ends,
	// then at most every arbiterLogEvery with the count of failed calls.
	arbDown       bool
	arbDownLogged time.Time
	arbDownCalls  int
	frozen        bool

	start *startOrder // while the environment starts (Config.StartOrder)

	// Limits written by others are put back (checkLimits): at least
	// every LimitCheckPeriod, and at every tick until checkUntil.
	lastCheck, checkUntil time.Time

	mu         sync.Mutex // guards status, timeline, pendingCap and recheck
	pendingCap *Resources
	recheck    bool
	status     Status
	tl         []TimelinePoint
	tlCap      int
	tlNext     int
	tlFilled   bool
	tlSeq      uint64 // points recorded so far (TimelineSince)
}

// NewController validates cfg and prepares a controller; nothing is
// applied until Run.
func NewController(env string, cg Cgroup, cfg Config, arb Arbiter, opts ...Option) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		env: env, cg: cg, cfg: cfg, pol: Policy{Cfg: cfg}, arb: arb,
		clock: realClock{}, ncpu: runtime.NumCPU(), tlCap: 3000,
		st: NewState(&cfg), wake: make(chan struct{}, 1),
	}
	c.status.Env = env
	for _, o := range opts {
		o(c)
	}
	if c.tlCap > 0 {
		c.tl = make([]TimelinePoint, 0, min(c.tlCap, 256))
	}
	if ts, ok := cg.(thresholdSetter); ok {
		if err := ts.SetThresholds(cfg.MemGrowWS, cfg.MemGrow4WS); err != nil {
			return nil, fmt.Errorf("arm memory thresholds for %s: %w", env, err)
		}
	}
	if mc, ok := cg.(memoryCapper); ok {
		mc.SetMemoryCap(cfg.Cap.Memory)
	}
	return c, nil
}

func (c *Controller) logger(ctx context.Context) *log.Entry {
	if c.log == nil {
		c.log = log.G(ctx).WithField("env", c.env)
	}
	return c.log
}

// Admit reserves the initial quota with the arbiter. The shim calls it at
// Create so a full node rejects the container before it starts (the error
// wraps errdefs.ErrResourceExhausted); Run calls it if the shim did not.
func (c *Controller) Admit(ctx context.Context) error {
	if c.admitted {
		return nil
	}
	actx, cancel := context.WithTimeout(ctx, c.cfg.ArbiterTimeout*10)
	defer cancel()
	if err := c.arb.Admit(actx, c.env, c.cfg.Initial, WithPriority(c.cfg.Priority), WithTier(c.cfg.Tier)); err != nil {
		f := Failure{Env: c.env, Reason: ReasonAdmissionRejected, Requested: c.cfg.Initial.Memory, Cap: c.cfg.Cap.Memory,
			Message: fmt.Sprintf("node cannot admit %v: %v", c.cfg.Initial, err)}
		c.mu.Lock()
		c.status.Failures++
		c.status.Failure = &f
		c.mu.Unlock()
		return &FailureError{Failure: f, Err: err}
	}
	c.admitted = true
	return nil
}

// Run applies the initial quota and controls the cgroup until ctx is
// cancelled (nil), the cgroup vanishes (nil: the task is gone), or the
// environment must die (*FailureError: the caller kills the task and
// reports the failure). It releases the arbiter lease on return.
func (c *Controller) Run(ctx context.Context) (retErr error) {
	l := c.logger(ctx)
	if err := c.Admit(ctx); err != nil {
		return err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.ArbiterTimeout*10)
		defer cancel()
		if err := c.arb.Release(rctx, c.env); err != nil {
			l.WithError(err).Warn("envlet: release arbiter lease")
		}
	}()
	if op, ok := c.cg.(oomPauser); ok && c.cfg.PauseOnOOM {
		if err := op.SetPauseOnOOM(true); err != nil {
			if errors.Is(err, ErrVanished) {
				return nil
			}
			l.WithError(err).Warn("envlet: cannot pause tasks at the memory limit; the kernel will OOM-kill instead")
		} else {
			// Never leave tasks sleeping at the limit without a controller,
			// except after a failure: the caller kills the task then, and
			// re-enabling the OOM killer first would race it with a kernel
			// kill of the paused task.
			defer func() {
				var fe *FailureError
				if errors.As(retErr, &fe) {
					return
				}
				if err := op.SetPauseOnOOM(false); err != nil && !errors.Is(err, ErrVanished) {
					l.WithError(err).Warn("envlet: re-enable the OOM killer")
				}
			}()
		}
	}
	if ts, ok := c.cg.(tierSetter); ok && c.cfg.Tier != TierStandard && c.cfg.Tier != "" {
		if err := ts.SetTier(c.cfg.Tier.Weights()); err != nil {
			if errors.Is(err, ErrVanished) {
				return nil
			}
			l.WithError(err).WithField("tier", c.cfg.Tier).Warn("envlet: set the CPU tier")
		}
	}
	if og, ok := c.cg.(oomGrouper); ok && c.cfg.PauseOnOOM {
		// v2 cannot pause tasks at the limit; memory.high squeezes them
		// instead while the controller decides. A group OOM kill (kubelet
		// asks for memory.oom.group=1) would end the environment silently
		// at the 1.25x safety net; with 0 the kernel takes one task, the
		// controller sees it in memory.events and grows or fails loudly.
		if err := og.SetOOMGroup(false); err != nil {
			if errors.Is(err, ErrVanished) {
				return nil
			}
			l.WithError(err).Warn("envlet: cannot set memory.oom.group")
		}
	}
	if err := c.cg.Apply(c.cfg.Initial); err != nil {
		if errors.Is(err, ErrVanished) {
			return nil
		}
		if !errors.Is(err, ErrBusy) {
			return fmt.Errorf("apply initial quota %v to %s: %w", c.cfg.Initial, c.env, err)
		}
		// The container already uses more than the initial memory (v1):
		// start from the limit in force; the policy shrinks it later.
		l.WithError(err).Info("envlet: initial memory below usage, keeping the current limit")
	}
	c.st = NewState(&c.cfg)
	if lr, ok := c.cg.(limitsReader); ok {
		if cur := lr.Current(); cur.Memory > c.st.Limit.Memory {
			c.st.Limit.Memory = cur.Memory
		}
	}
	c.lastReport = c.clock.Now()
	c.beginStart(ctx, c.lastReport)
	defer func() {
		if c.start != nil {
			c.endStart(context.WithoutCancel(ctx), c.clock.Now(), "controller stopped")
		}
	}()
	defer func() {
		// A failed environment stays frozen: the caller kills it (a
		// fatal signal reaches frozen v2 tasks), and thawing first would
		// let it run into memory.max.
		var fe *FailureError
		if c.frozen && !errors.As(retErr, &fe) {
			c.hold(ctx, false)
		}
	}()
	wake := "tick"
	for {
		if err := c.step(ctx, wake); err != nil {
			if errors.Is(err, ErrVanished) {
				l.Debug("envlet: cgroup vanished, stopping")
				return nil
			}
			var fe *FailureError
			if fz, ok := c.cg.(freezer); ok && errors.As(err, &fe) {
				// Stop the environment where it is while the caller
				// reports and kills it (SIGKILL ends frozen tasks).
				if ferr := fz.Freeze(true); ferr != nil && !errors.Is(ferr, ErrVanished) {
					l.WithError(ferr).Warn("envlet: freeze failed environment")
				} else if ferr == nil {
					l.Info("envlet: froze failed environment")
				}
			}
			return err
		}
		period := c.cfg.SamplePeriod
		if c.st.Idle && !c.checking(c.clock.Now()) {
			period = c.cfg.IdlePeriod
		}
		if _, real := c.clock.(realClock); real {
			// Every controller of a shim samples on the same instants:
			// one wake-up of the process serves them all. Steady
			// sampling stays a period apart; kernel events still wake
			// it at once.
			period = UntilTick(time.Now(), period)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-c.clock.After(period):
			wake = "tick"
		case <-c.cg.Events():
			wake = "event"
		case <-c.wake:
			wake = "cap"
		}
	}
}

func sub(a, b uint64) uint64 {
	if a < b {
		return 0
	}
	return a - b
}

func (c *Controller) observe(now time.Time) Observation {
	o := Observation{Now: now, WS: c.cur.WorkingSet(), MemUsage: c.cur.MemUsage, UnderOOM: c.cur.UnderOOM}
	if c.havePrev {
		if dt := now.Sub(c.prevAt).Seconds(); dt > 0 {
			o.CPUValid = true
			o.CPUUsed = float64(sub(c.cur.CPUUsageNs, c.prev.CPUUsageNs)) / 1e9 / dt
			// throttled_time is summed over the per-CPU run queues; divide by
			// the CPUs the quota can keep busy so the share stays in 0..1.
			n := min(max(math.Ceil(c.st.Limit.CPU), 1), float64(max(c.ncpu, 1)))
			o.Throttled = math.Min(float64(sub(c.cur.ThrottledNs, c.prev.ThrottledNs))/1e9/dt/n, 1)
		}
		if c.cur.MemStat {
			o.NewOOMs = int(max(sub(c.cur.OOM, c.prev.OOM), sub(c.cur.OOMKill, c.prev.OOMKill)))
			o.LimitHits = c.cur.Failcnt > c.prev.Failcnt || c.cur.High > c.prev.High
		}
	}
	return o
}

// SetCap moves the per-environment cap while the controller runs (kubelet
// in-place resize arriving as a task Update). It takes effect at the next
// tick, which it triggers: limits above the new cap are lowered to it (on
// v1 a memory cap below usage is refused with EBUSY and retried every
// tick), and the base follows the cap down.
func (c *Controller) SetCap(r Resources) error {
	if r.CPU <= 0 || r.Memory <= 0 {
		return fmt.Errorf("envlet: cap %v must be positive: %w", r, errdefs.ErrInvalidArgument)
	}
	c.mu.Lock()
	c.pendingCap = &r
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
	return nil
}

// statRequester is implemented by cgroups whose Sample reads the memory
// counters only at times; RequestStat makes the next one read them.
type statRequester interface {
	RequestStat()
}

// KilledByKernel tells, after Run has returned, whether the kernel
// OOM-killed a task of the environment while the controller ran, and
// returns the failure to report if so; nil otherwise. The environment
// then usually ends by itself (its shell exits with the killed task's
// status) and would carry no reason.
//
// At the cap, memory.high and memory.max are both the cap (v2; v1 has one
// limit), so the kernel kills at the first allocation past it, before a
// tick can see the task stuck: MEM_CAP_EXCEEDED. Below the cap the kill
// was at the controller's own limit (v2 memory.max, 1.25 x the grant; v1
// without pause-on-oom): an allocation outran the tick that would have
// grown it (one system call filling a large buffer can: the kernel's
// memory.high throttling applies on the way back to user space). That is
// envlet failing to serve, not the task's fault, and it must not pass as
// a bare OOMKilled: MEM_KILLED_BEFORE_GROW.
//
// seen is the count of OOM kills the caller saw reported elsewhere (the
// runc task service's events): with the systemd cgroup driver the cgroup
// may be gone, and its counters with it, by the time the task's exit is
// known.
func (c *Controller) KilledByKernel(seen int) *Failure {
	if c.cfg.Cap.Memory <= 0 {
		return nil
	}
	if sr, ok := c.cg.(statRequester); ok {
		sr.RequestStat()
	}
	last := c.cur
	var s Sample
	if err := c.cg.Sample(&s); err == nil && s.MemStat {
		last = s
	}
	c.mu.Lock()
	kills := c.status.OOMs
	c.mu.Unlock()
	kills += int(max(sub(last.OOM, c.cur.OOM), sub(last.OOMKill, c.cur.OOMKill)))
	kills = max(kills, seen)
	if kills == 0 {
		return nil
	}
	f := &Failure{Env: c.env, Reason: ReasonCapExceeded, Granted: c.st.Limit.Memory, Cap: c.cfg.Cap.Memory,
		WorkingSet: max(last.WorkingSet(), c.cur.WorkingSet()), OOMs: kills}
	// The working set after the kill says little (the killed task's
	// memory is gone); it stays in the failure's fields.
	if c.st.Limit.Memory >= c.cfg.Cap.Memory {
		f.Message = fmt.Sprintf("the kernel OOM-killed a task at the per-environment memory cap %s (%d OOM kills)",
			FormatBytes(f.Cap), kills)
		return f
	}
	f.Reason = ReasonKilledBeforeGrow
	f.Message = fmt.Sprintf("the kernel OOM-killed a task at envlet's memory limit %s before the controller grew it (cap %s; %d OOM kills): an allocation faster than a tick",
		FormatBytes(c.st.Limit.Memory), FormatBytes(f.Cap), kills)
	return f
}

// LimitCheckPeriod is how often the controller checks that the limits it
// wrote are still in force (Controller.Recheck).
const LimitCheckPeriod = 5 * time.Second

// recheckFor is how long after Recheck every tick checks the limits:
// systemd applies a unit's properties to its cgroup shortly after it
// answered the call that set them, not before.
const recheckFor = time.Second

// Recheck has the controller check at once, and at every tick for the
// next second, that the cgroup still holds the limits it wrote, and write
// them again where it does not. The shim calls it after forwarding a task
// Update: with runc's systemd driver the update makes systemd rewrite the
// scope's cgroup from the unit's properties (memory.high back to max,
// memory.max and the CPU quota to the container's creation values), and
// runc writes kubelet's memory.oom.group=1 again.
func (c *Controller) Recheck() {
	c.mu.Lock()
	c.recheck = true
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// checkLimits puts back limits someone else rewrote, when a check is due.
func (c *Controller) checkLimits(ctx context.Context, now time.Time, acts []string) ([]string, error) {
	lr, ok := c.cg.(limitRestorer)
	if !ok {
		return acts, nil
	}
	c.mu.Lock()
	if c.recheck {
		c.recheck = false
		c.checkUntil = now.Add(recheckFor)
	}
	c.mu.Unlock()
	if now.Sub(c.lastCheck) < LimitCheckPeriod && !now.Before(c.checkUntil) {
		return acts, nil
	}
	c.lastCheck = now
	restored, err := lr.Restore()
	switch {
	case errors.Is(err, ErrVanished):
		return acts, err
	case err != nil:
		c.logger(ctx).WithError(err).Warn("envlet: check the limits in force")
	case restored:
		c.logger(ctx).WithField("limit", c.st.Limit.String()).Warn("envlet: limits rewritten by someone else (systemd applying the unit's properties?); restored")
		acts = append(acts, "limits restored")
	}
	return acts, nil
}

// checking reports whether ticks must come at the sampling period to
// check the limits (Recheck).
func (c *Controller) checking(now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.recheck || now.Before(c.checkUntil)
}

// takeCap installs a cap set by SetCap and returns the limits it forces.
func (c *Controller) takeCap() (Resources, bool) {
	c.mu.Lock()
	r := c.pendingCap
	c.mu.Unlock()
	if r == nil {
		if c.st.Limit.CPU > c.cfg.Cap.CPU || c.st.Limit.Memory > c.cfg.Cap.Memory {
			// A previous lowering was refused (EBUSY): retry.
			return Resources{CPU: math.Min(c.st.Limit.CPU, c.cfg.Cap.CPU), Memory: min(c.st.Limit.Memory, c.cfg.Cap.Memory)}, true
		}
		return c.st.Limit, false
	}
	c.mu.Lock()
	c.pendingCap = nil
	c.mu.Unlock()
	c.cfg.Cap = *r
	c.cfg.Initial = Resources{CPU: math.Min(c.cfg.Initial.CPU, r.CPU), Memory: min(c.cfg.Initial.Memory, r.Memory)}
	c.pol.Cfg = c.cfg
	c.st.Base = Resources{CPU: math.Min(c.st.Base.CPU, r.CPU), Memory: min(c.st.Base.Memory, r.Memory)}
	if mc, ok := c.cg.(memoryCapper); ok {
		mc.SetMemoryCap(r.Memory)
	}
	next := Resources{CPU: math.Min(c.st.Limit.CPU, r.CPU), Memory: min(c.st.Limit.Memory, r.Memory)}
	return next, next != c.st.Limit
}

// step is one tick: sample, decide, ask, apply, report.
func (c *Controller) step(ctx context.Context, wake string) error {
	now := c.clock.Now()
	before := c.st.Limit
	var acts []string
	if next, ok := c.takeCap(); ok {
		var err error
		if acts, err = c.apply(ctx, next, nil, acts); err != nil {
			return err
		}
	}
	acts, err := c.checkLimits(ctx, now, acts)
	if err != nil {
		return err
	}
	c.prev = c.cur
	if err := c.cg.Sample(&c.cur); err != nil {
		if errors.Is(err, ErrVanished) {
			return err
		}
		c.cur = c.prev
		c.logger(ctx).WithError(err).Warn("envlet: sample cgroup")
		return nil
	}
	o := c.observe(now)
	c.prevAt, c.havePrev = now, true

	st, d := c.pol.Decide(c.st, o)
	granted := st.Limit
	memAsk := d.Mem.Kind == Grow && d.Mem.To > st.Limit.Memory
	if d.CPU.Kind == Grow || memAsk {
		var want Resources
		if d.CPU.Kind == Grow {
			want.CPU = d.CPU.To
		}
		if memAsk {
			want.Memory = d.Mem.To
		}
		gctx, cancel := context.WithTimeout(ctx, c.cfg.ArbiterTimeout)
		g, err := c.arb.Grow(gctx, c.env, want)
		cancel()
		c.noteArbiter(ctx, now, err)
		if err != nil {
			// Without an answer CPU fails open up to 2 x base (starving a
			// task of CPU only slows it, but so does waiting) and memory
			// fails closed (memory handed out cannot be taken back); a
			// task stuck at its memory limit waits paused for the
			// arbiter (Policy.Resolve, Config.ArbiterWait).
			o.ArbiterDown = true
			if d.CPU.Kind == Grow {
				granted.CPU = math.Max(st.Limit.CPU, math.Min(d.CPU.To, 2*st.Base.CPU))
			}
		} else {
			if d.CPU.Kind == Grow {
				granted.CPU = g.CPU
			}
			if memAsk {
				granted.Memory = g.Memory
			}
		}
	}
	st, next, fail := c.pol.Resolve(st, o, d, granted)
	if fail == nil {
		c.hold(ctx, st.Waiting)
	}
	denied := d.Mem.Kind == Grow && next.Memory <= st.Limit.Memory
	if denied {
		c.mu.Lock()
		c.status.Denied++
		c.mu.Unlock()
	}
	if fail != nil {
		acts = append(acts, "mem denied")
		fail.Env = c.env
		if ns, ok := c.arb.(NodeSizer); ok && fail.Reason != ReasonCapExceeded {
			// What this environment could ever get: its cap, or the node
			// as the arbiter divides it, whichever is smaller.
			if node, _ := ns.Capacity(); node.Memory > 0 {
				fail.Cap = min(fail.Cap, node.Memory)
			}
		}
		fail.Message = fail.describe()
		c.st = st
		c.record(o, wake, append(acts, "fail "+fail.Reason))
		c.mu.Lock()
		c.status.Failures++
		c.status.Failure = fail
		c.mu.Unlock()
		c.logger(ctx).WithField("reason", fail.Reason).Error("envlet: " + fail.Message)
		return &FailureError{Failure: *fail}
	}
	c.st = st
	if next != st.Limit {
		var err error
		if acts, err = c.apply(ctx, next, &d, acts); err != nil {
			return err
		}
	}
	if denied {
		if st.Waiting {
			acts = append(acts, "mem wait")
		} else {
			acts = append(acts, "mem denied")
		}
	}

	if c.start != nil {
		c.startTick(ctx, now)
	}
	if c.reportDue(now, o, c.st.Limit == before) {
		c.lastReport, c.reported, c.reportedWS = now, c.st.Limit, o.WS
		var err error
		if acts, err = c.report(ctx, o, acts); err != nil {
			return err
		}
	}
	c.record(o, wake, acts)
	return nil
}

// IdleReportPeriod is the heartbeat of an idle environment whose limits
// and working set are those it last reported. A report was the largest
// part of an idle shim's CPU (a ttrpc round trip with the status and the
// new timeline points, in the shim and in the arbiter), and such a report
// tells the arbiter nothing new: an idle environment's CPU use is under
// IdleUtil of its limit, which admission's 10 s average does not feel, and
// whatever wakes it makes it active, reporting every ReportPeriod again.
// The heartbeat only keeps the lease alive: at most a period and an idle
// tick apart, about half the arbiter's stale limit (a lease silent 30 s
// is returned). An arbiter restart does not wait for it: the client
// re-registers as soon as it loses the connection (arbiter.Client),
// within the ledger's 10 s grace.
const IdleReportPeriod = 15 * time.Second

// reportDue says whether this tick reports to the arbiter: every
// ReportPeriod, except for an idle environment whose limits are those it
// last reported and whose working set moved by less than a sixteenth of
// its memory limit since (an admission counts its use): that one reports
// when the wall clock passes a multiple of IdleReportPeriod, so the idle
// environments of a shim report in the same tick, one wake-up for all. A
// change of either is reported at the next idle tick, once the limits
// held for a tick (settled): idle reclaim halves them on consecutive
// ticks, and one report says where they ended.
func (c *Controller) reportDue(now time.Time, o Observation, settled bool) bool {
	if now.Sub(c.lastReport) < c.cfg.ReportPeriod {
		return false
	}
	switch {
	case !c.st.Idle:
		return true
	case c.st.Limit != c.reported:
		return settled
	}
	if moved := o.WS - c.reportedWS; moved > c.st.Limit.Memory/16 || -moved > c.st.Limit.Memory/16 {
		return true
	}
	return now.Truncate(IdleReportPeriod).After(c.lastReport)
}

// arbiterLogEvery rate-limits the warning about an arbiter that does not
// answer: at 5 ticks a second per environment, one line per failed call
// would bury everything else in the shim's log.
const arbiterLogEvery = 30 * time.Second

// noteArbiter logs transitions of the arbiter's reachability, as seen by
// a grow's outcome err.
func (c *Controller) noteArbiter(ctx context.Context, now time.Time, err error) {
	l := c.logger(ctx)
	switch {
	case err == nil && c.arbDown:
		l.WithField("failed_calls", c.arbDownCalls).Info("envlet: node arbiter answers again")
		c.arbDown, c.arbDownCalls = false, 0
	case err == nil:
	case !c.arbDown:
		l.WithError(err).Warn("envlet: arbiter grow failed; CPU fails open to 2 x base, memory waits for the arbiter")
		c.arbDown, c.arbDownLogged, c.arbDownCalls = true, now, 1
	default:
		c.arbDownCalls++
		if now.Sub(c.arbDownLogged) >= arbiterLogEvery {
			l.WithError(err).WithField("failed_calls", c.arbDownCalls).Warn("envlet: node arbiter still unreachable")
			c.arbDownLogged = now
		}
	}
}

// hold pauses the task while the policy waits for the arbiter, where the
// cgroup can (v2 cgroup.freeze; on v1 pause-on-oom already keeps a task at
// its limit asleep), and resumes it when the wait ends.
func (c *Controller) hold(ctx context.Context, on bool) {
	f, ok := c.cg.(freezer)
	if !ok || on == c.frozen {
		return
	}
	if err := f.Freeze(on); err != nil {
		c.logger(ctx).WithError(err).Warnf("envlet: freeze=%v while waiting for the arbiter", on)
		return
	}
	c.frozen = on
}

// apply writes next and records what happened: the policy's decision d,
// or a cap change when d is nil. A v1 EBUSY on a memory shrink leaves
// memory where it was ("not now"; the next low window retries).
func (c *Controller) apply(ctx context.Context, next Resources, d *Decision, acts []string) ([]string, error) {
	old := c.st.Limit
	if r, ok := c.cg.(reclaimer); ok && d != nil && d.Mem.Idle && c.cur.MemUsage > next.Memory {
		// Push the reclaimable memory out proactively rather than through
		// memory.high throttling.
		if err := r.Reclaim(c.cur.MemUsage - next.Memory); err != nil && !errors.Is(err, ErrBusy) {
			c.logger(ctx).WithError(err).Debug("envlet: memory.reclaim")
		}
	}
	err := c.cg.Apply(next)
	switch {
	case err == nil:
	case errors.Is(err, ErrBusy):
		next.Memory = old.Memory
		if d != nil && d.Mem.Idle {
			acts = append(acts, "mem idle busy")
		} else {
			acts = append(acts, "mem busy")
		}
		c.mu.Lock()
		c.status.Busy++
		c.mu.Unlock()
	case errors.Is(err, ErrVanished):
		return acts, err
	default:
		c.logger(ctx).WithError(err).Warnf("envlet: apply %v", next)
		return acts, nil
	}
	c.st = c.st.Applied(next)
	if d == nil {
		return append(acts, "cap to "+next.String()), nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case next.CPU > old.CPU:
		c.status.CPUGrows++
		acts = append(acts, fmt.Sprintf("cpu x%d", max(d.CPU.Factor, 1)))
	case next.CPU < old.CPU:
		c.status.CPUShrinks++
		acts = append(acts, "cpu /2")
	}
	switch {
	case next.Memory > old.Memory:
		c.status.MemGrows++
		acts = append(acts, fmt.Sprintf("mem x%d", max(d.Mem.Factor, 1)))
	case next.Memory < old.Memory && d.Mem.Idle:
		c.status.MemShrinks++
		acts = append(acts, "mem idle")
	case next.Memory < old.Memory:
		c.status.MemShrinks++
		acts = append(acts, "mem /2")
	}
	return acts, nil
}

// report sends usage to the arbiter and applies admission reclaim.
func (c *Controller) report(ctx context.Context, o Observation, acts []string) ([]string, error) {
	rctx, cancel := context.WithTimeout(ctx, c.cfg.ArbiterTimeout)
	defer cancel()
	lim, err := c.arb.Report(rctx, c.env, c.st.Limit, Resources{CPU: o.CPUUsed, Memory: o.WS})
	var ev *EvictionError
	switch {
	case errdefs.IsNotFound(err):
		// The arbiter lost us (restart): the shim holds the truth.
		if err := c.arb.Admit(rctx, c.env, c.st.Base, WithPriority(c.cfg.Priority), WithTier(c.cfg.Tier)); err == nil {
			_, err = c.arb.Grow(rctx, c.env, c.st.Limit)
			if err != nil {
				c.logger(ctx).WithError(err).Warn("envlet: re-register current limits")
			}
		} else {
			c.logger(ctx).WithError(err).Warn("envlet: re-admit after arbiter restart")
		}
		return acts, nil
	case errors.As(err, &ev):
		// The node's victim policy chose this environment: promised
		// memory is needed elsewhere and the node cannot supply it.
		f := Failure{Env: c.env, Reason: ReasonNodeExhausted, Requested: c.st.Limit.Memory, Granted: c.st.Limit.Memory,
			Cap: c.cfg.Cap.Memory, WorkingSet: o.WS, Message: ev.Message}
		if ns, ok := c.arb.(NodeSizer); ok {
			if node, _ := ns.Capacity(); node.Memory > 0 {
				f.Cap = min(f.Cap, node.Memory)
			}
		}
		c.mu.Lock()
		c.status.Failures++
		c.status.Failure = &f
		c.mu.Unlock()
		c.logger(ctx).WithField("reason", f.Reason).Error("envlet: " + f.Message)
		return append(acts, "evicted"), &FailureError{Failure: f, Err: err}
	case err != nil:
		c.logger(ctx).WithError(err).Debug("envlet: arbiter report failed")
		// Retry a ReportPeriod later, not a heartbeat later: the lease
		// must hear from us.
		c.reported = Resources{}
		return acts, nil
	}
	if lim.CPU >= c.st.Limit.CPU && lim.Memory >= c.st.Limit.Memory {
		return acts, nil
	}
	target := c.pol.Reclaim(c.st, o, lim)
	if target == c.st.Limit {
		return acts, nil
	}
	old := c.st.Limit
	err = c.cg.Apply(target)
	switch {
	case err == nil:
	case errors.Is(err, ErrBusy):
		// Not a policy shrink: the arbiter asks again at the next report.
		target.Memory = old.Memory
		acts = append(acts, "reclaim busy")
	case errors.Is(err, ErrVanished):
		return acts, err
	default:
		c.logger(ctx).WithError(err).Warnf("envlet: apply reclaim %v", target)
		return acts, nil
	}
	c.st = c.st.Applied(target)
	c.mu.Lock()
	c.status.Reclaims++
	c.mu.Unlock()
	return append(acts, fmt.Sprintf("reclaim to %v", target)), nil
}

func (c *Controller) record(o Observation, wake string, acts []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := &c.status
	s.Limit = c.st.Limit
	s.Sampled = o.Now
	s.CPUUsed, s.Throttled = o.CPUUsed, o.Throttled
	if c.st.Limit.CPU > 0 {
		s.CPUUtil = o.CPUUsed / c.st.Limit.CPU
	}
	s.WorkingSet, s.MemUsage = o.WS, o.MemUsage
	s.Idle = c.st.Idle
	s.OOMs += o.NewOOMs
	if c.tlCap <= 0 {
		return
	}
	p := TimelinePoint{T: o.Now, Limit: c.st.Limit, CPUUsed: o.CPUUsed, Throttled: o.Throttled,
		WS: o.WS, MemUsage: o.MemUsage, Wake: wake, Actions: strings.Join(acts, ",")}
	c.tlSeq++
	if len(c.tl) < c.tlCap {
		c.tl = append(c.tl, p)
		return
	}
	c.tl[c.tlNext] = p
	c.tlNext = (c.tlNext + 1) % c.tlCap
	c.tlFilled = true
}

// Status returns a snapshot.
func (c *Controller) Status() Status {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.status
	if s.Failure != nil {
		f := *s.Failure
		s.Failure = &f
	}
	return s
}

// Timeline returns the retained history, oldest first.
func (c *Controller) Timeline() []TimelinePoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]TimelinePoint, 0, len(c.tl))
	if c.tlFilled {
		out = append(out, c.tl[c.tlNext:]...)
		out = append(out, c.tl[:c.tlNext]...)
		return out
	}
	return append(out, c.tl...)
}

// TimelineSince returns the retained points from the seq-th recorded on
// (the first is 0), oldest first, and the number recorded so far: the seq
// of the next call. The arbiter client sends each report only the points
// since its last, without copying the whole history every time.
func (c *Controller) TimelineSince(seq uint64) ([]TimelinePoint, uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := uint64(len(c.tl))
	if seq < c.tlSeq-n {
		seq = c.tlSeq - n
	}
	if seq >= c.tlSeq {
		return nil, c.tlSeq
	}
	out := make([]TimelinePoint, 0, c.tlSeq-seq)
	// The oldest retained point is at tlNext once the ring is full.
	start := 0
	if c.tlFilled {
		start = c.tlNext
	}
	for i := seq - (c.tlSeq - n); i < n; i++ {
		out = append(out, c.tl[(start+int(i))%len(c.tl)])
	}
	return out, c.tlSeq
}

// last returns the newest timeline point.
func (c *Controller) last() (TimelinePoint, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.tl) == 0 {
		return TimelinePoint{}, false
	}
	i := len(c.tl) - 1
	if c.tlFilled {
		i = (c.tlNext + c.tlCap - 1) % c.tlCap
	}
	return c.tl[i], true
}
