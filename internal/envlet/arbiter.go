package envlet

import (
	"context"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/prometheus/procfs"
)

// Arbiter divides a node between environments. Every method is keyed by
// the environment id; the shim side holds the truth and re-registers
// (Admit, then Grow to its current limits) when Report says ErrNotFound,
// e.g. after an arbiter restart.
type Arbiter interface {
	// Admit admits a new environment starting at base, or fails with
	// errdefs.ErrResourceExhausted. base is a starting limit, not a
	// reservation (NodeArbiter admits by use).
	Admit(ctx context.Context, env string, base Resources, opts ...AdmitOpt) error
	// Grow asks for want in total and returns the granted total, which may
	// be partial. A field at or below the current grant (0 for "this
	// resource is not growing") leaves that grant unchanged: burst is given
	// back through Report, so a grow of one resource cannot undo a pending
	// reclaim of the other.
	Grow(ctx context.Context, env string, want Resources) (Resources, error)
	// Report tells the arbiter the applied limits and the usage (CPU cores
	// used, memory working set), about once a second. A returned limit
	// below current means "shrink to this": burst reclaimed for an
	// admission. An *EvictionError means the node's victim policy chose
	// this environment to fail.
	Report(ctx context.Context, env string, current, used Resources) (Resources, error)
	// Release returns everything the environment holds.
	Release(ctx context.Context, env string) error
}

// Admission is what Admit knows about an environment besides its base.
type Admission struct {
	// Priority orders environments for the victim policy (higher is
	// kept longer).
	Priority int
	// Tier is the environment's CPU class: best-effort use does not count
	// against admission, and a grow takes CPU burst from lower tiers.
	Tier Tier
}

// AdmitOpt sets a field of the Admission.
type AdmitOpt func(*Admission)

// WithPriority sets the environment's priority.
func WithPriority(p int) AdmitOpt { return func(a *Admission) { a.Priority = p } }

// WithTier sets the environment's CPU tier.
func WithTier(t Tier) AdmitOpt { return func(a *Admission) { a.Tier = t } }

// EvictionError is Report's answer to an environment the node's victim
// policy chose to fail.
type EvictionError struct {
	Message string
}

func (e *EvictionError) Error() string { return "evicted: " + e.Message }

// NodeSizer is implemented by arbiters that know the node they divide
// (NodeArbiter, the node arbiter's client): failures report the node's
// size as the arbiter sees it, not the host's.
type NodeSizer interface {
	Capacity() (Resources, float64)
}

// DefaultReserve is the node share kept free of measured use: the room
// in which new environments start and running ones burst before the next
// report.
const DefaultReserve = 0.15

// DefaultOvercommit is no bound on the sum of admitted bases (initial
// quotas): admission is by measured use, and the base is a starting
// limit, not a reservation. With the former bound of 20x the CPU, the
// 21st idle environment (default 2-core base) was refused on an idle
// 2-core node with 20 GiB free. Operators may still set one
// (WithOvercommit, [node.overcommit]).
var DefaultOvercommit = Overcommit{}

// DefaultCPUWindow is the time constant over which the node's measured
// CPU use is averaged for admission. A node saturated for tens of
// seconds has no CPU for a newcomer; one that was busy for a second
// (environments starting: about 1.5 CPU-seconds each for the agent CLI)
// has.
const DefaultCPUWindow = 10 * time.Second

// Overcommit is a ratio of promised (sum of bases) to node capacity; 0
// leaves a resource unbounded.
type Overcommit struct {
	CPU, Memory float64
}

// NodeOpt configures a NodeArbiter.
type NodeOpt func(*NodeArbiter)

// WithOvercommit bounds the sum of bases (DefaultOvercommit: none); a
// ratio of 1 admits by request, like fixed quotas.
func WithOvercommit(o Overcommit) NodeOpt { return func(a *NodeArbiter) { a.overcommit = o } }

// WithVictimPolicy sets whom the node fails first (DefaultVictimPolicy).
func WithVictimPolicy(p VictimPolicy) NodeOpt { return func(a *NodeArbiter) { a.victims = p } }

// WithNodeMemory bounds the leases' memory by what the machine really has
// as well as by the capacity (the arbiter daemon sets it when the node's
// memory is not configured, config.NodeOpts): meminfo reads the machine's
// MemTotal and MemAvailable (ReadMeminfo). Memory in use outside the
// leases (the kernel, the node's daemons, kubelet, containers envlet does
// not run) is then left out of what admission and growth hand out: on a
// 4 GiB Kubernetes node the shipped budget (the whole machine less 15%)
// granted a pod 3.3 GiB and the kernel's OOM killer, not envlet, stopped
// it. Failing a victim still goes by the configured capacity only.
func WithNodeMemory(meminfo func() (total, available int64, err error)) NodeOpt {
	return func(a *NodeArbiter) { a.meminfo = meminfo }
}

// ReadMeminfo returns the machine's MemTotal and MemAvailable in bytes.
func ReadMeminfo() (total, available int64, err error) {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return 0, 0, fmt.Errorf("read node memory: %w", err)
	}
	mi, err := fs.Meminfo()
	if err != nil {
		return 0, 0, fmt.Errorf("read node memory: %w", err)
	}
	if mi.MemTotalBytes == nil || mi.MemAvailableBytes == nil {
		return 0, 0, fmt.Errorf("read node memory: /proc/meminfo has no MemTotal or MemAvailable")
	}
	return int64(*mi.MemTotalBytes), int64(*mi.MemAvailableBytes), nil
}

// meminfoEvery is how often the arbiter reads the machine's memory
// (WithNodeMemory): calls come with every report.
const meminfoEvery = 500 * time.Millisecond

// WithNodeClock replaces the wall clock that stamps admissions (tests).
func WithNodeClock(now func() time.Time) NodeOpt { return func(a *NodeArbiter) { a.now = now } }

// NodeArbiter is the in-memory Arbiter: a shim without a daemon uses it
// in-process, and the node daemon wraps it behind ttrpc.
//
// Admission by use. A lease's base (the initial quota) is a starting
// limit, not a reservation: what counts against the node is its use,
// min(used, base), plus its burst (grant - base), which was granted
// because it was needed. Per resource:
//
//   - Admit succeeds while the measured use leaves the reserve free,
//     per resource: the counted memory use of all leases (sum <=
//     capacity x (1 - reserve)), and their reported CPU use averaged over
//     DefaultCPUWindow. A new lease counts nothing until it reports. The
//     average keeps a busy second (environments starting) from refusing
//     anyone while a node saturated for tens of seconds refuses: its
//     newcomers would only slow everyone. An operator's overcommit bound
//     on the sum of bases applies too (none by default). A refusal names
//     the resource that is short and by how much.
//   - Grow draws only on capacity x (1 - reserve) minus the others' counted
//     use and the asker's whole grant, and may be partial. What it lacks
//     is first reclaimed from idle burst (below), except from leases that
//     grew since their last report (ramping): a grant far above its
//     holder's working set is not what denies, and fails, a neighbour.
//   - Admit then reclaims idle burst (largest grant - usage first, never
//     below the base, 1.5 x CPU usage, nor a memory limit at which the
//     working set would reach the grow threshold) while the counted use,
//     with unreported leases at their base, is above capacity x (1 -
//     reserve).
//   - Report: when the counted memory use passes capacity x (1 - reserve
//     / 2), idle burst is reclaimed first; if that is not enough,
//     promised memory is really needed and the node cannot supply it:
//     the victim policy chooses whom to fail until it is back under, and
//     their next Report answers *EvictionError. A victim not told yet is
//     spared when the excess goes away first.
type NodeArbiter struct {
	mu         sync.Mutex
	capacity   Resources
	reserve    float64
	overcommit Overcommit
	victims    VictimPolicy
	now        func() time.Time
	leases     map[string]*Lease
	evict      map[string]string // env -> why
	told       map[string]bool   // evicted envs whose Report said so

	// cpuAvg is the reported CPU use of all leases, averaged over
	// DefaultCPUWindow, as of cpuAt.
	cpuAvg float64
	cpuAt  time.Time

	// meminfo reads the machine's memory (WithNodeMemory); as of memAt,
	// memTotal was its MemTotal and memOutside what was in use outside
	// the leases.
	meminfo              func() (total, available int64, err error)
	memAt                time.Time
	memTotal, memOutside int64
}

// Lease is what the arbiter holds for one environment.
type Lease struct {
	Base, Grant, Used Resources
	// Reported: Used has been reported at least once.
	Reported bool
	// Priority and Admitted order the environments when the node must
	// fail one (VictimPolicy).
	Priority int
	Admitted time.Time
	// Tier is the CPU class (Admission.Tier).
	Tier Tier
	// Ramping: the grant grew since the last report, so Used predates it
	// and says nothing of what the new grant is for. A ramping lease's
	// burst is not reclaimed.
	Ramping bool
	// Starting: the environment's start is under way and waits its turn
	// in the node's start order (StartQueue); StartDone: it ended.
	// StartAsked: when the start last asked its rank.
	Starting, StartDone bool
	StartAsked          time.Time
}

// NewNodeArbiter returns an arbiter for a node of the given capacity
// keeping reserve (0..1, DefaultReserve) free of use.
func NewNodeArbiter(capacity Resources, reserve float64, opts ...NodeOpt) *NodeArbiter {
	a := &NodeArbiter{capacity: capacity, reserve: min(max(reserve, 0), 1), overcommit: DefaultOvercommit,
		victims: DefaultVictimPolicy, now: time.Now, leases: map[string]*Lease{}, evict: map[string]string{}, told: map[string]bool{}}
	for _, o := range opts {
		o(a)
	}
	return a
}

// Capacity returns the node capacity and reserve.
func (a *NodeArbiter) Capacity() (Resources, float64) { return a.capacity, a.reserve }

func (a *NodeArbiter) growLimit() Resources {
	return Resources{
		CPU:    a.capacity.CPU * (1 - a.reserve),
		Memory: int64(float64(a.memCapacity()) * (1 - a.reserve)),
	}
}

// memCapacity is the memory the leases may count against: the configured
// capacity, or less when the machine's memory is known (WithNodeMemory)
// and what is in use outside the leases leaves less. Outside is what the
// machine has in use less the leases' reported working sets: a lease's
// growth since its last report (one tick for a busy environment) counts
// as outside until it reports, which errs towards granting less. Counting
// grants instead made outside vanish as soon as a grant ran ahead of its
// use (the 4 GiB node's pod was granted the whole machine again).
func (a *NodeArbiter) memCapacity() int64 {
	if a.meminfo == nil {
		return a.capacity.Memory
	}
	if now := a.now(); a.memAt.IsZero() || now.Sub(a.memAt) >= meminfoEvery || now.Before(a.memAt) {
		a.memAt = now
		total, avail, err := a.meminfo()
		if err != nil {
			a.memTotal = 0 // unknown: the configured capacity alone
		} else {
			var leases int64
			for _, l := range a.leases {
				leases += l.Used.Memory
			}
			outside := max(total-avail-leases, 0)
			if bounded := total-outside < a.capacity.Memory; bounded && (a.memOutside == 0 || outside > a.memOutside*9/8 || outside < a.memOutside*7/8) {
				log.L.WithField("total", FormatBytes(total)).WithField("available", FormatBytes(avail)).
					WithField("leases", FormatBytes(leases)).WithField("outside", FormatBytes(outside)).
					Info("arbiter: memory in use outside the environments bounds the grants")
			}
			a.memTotal, a.memOutside = total, outside
		}
	}
	if a.memTotal == 0 {
		return a.capacity.Memory
	}
	return min(a.capacity.Memory, a.memTotal-a.memOutside)
}

// outsideNote says, for a refusal, what the machine holds outside the
// leases when that is what made memory short.
func (a *NodeArbiter) outsideNote() string {
	if a.meminfo == nil || a.memTotal == 0 || a.memTotal-a.memOutside >= a.capacity.Memory {
		return ""
	}
	return fmt.Sprintf(" (the machine's %s less %s in use outside envlet's environments)", FormatBytes(a.memTotal), FormatBytes(a.memOutside))
}

// use is what a lease counts against the node: its burst, plus its
// measured use of the base. An unreported lease counts its base when
// startAtBase (for restoring the reserve), else nothing.
func use(l *Lease, startAtBase bool) Resources {
	used := l.Used
	if !l.Reported && startAtBase {
		used = l.Base
	}
	return Resources{
		CPU:    math.Max(l.Grant.CPU-l.Base.CPU, 0) + math.Min(used.CPU, l.Base.CPU),
		Memory: max(l.Grant.Memory-l.Base.Memory, 0) + min(used.Memory, l.Base.Memory),
	}
}

func (a *NodeArbiter) used(skip string, startAtBase bool) Resources {
	var s Resources
	for id, l := range a.leases {
		if id == skip {
			continue
		}
		u := use(l, startAtBase)
		s.CPU += u.CPU
		s.Memory += u.Memory
	}
	return s
}

func (a *NodeArbiter) promised() Resources {
	var s Resources
	for _, l := range a.leases {
		s.CPU += l.Base.CPU
		s.Memory += l.Base.Memory
	}
	return s
}

func (a *NodeArbiter) granted() Resources {
	var s Resources
	for _, l := range a.leases {
		s.CPU += l.Grant.CPU
		s.Memory += l.Grant.Memory
	}
	return s
}

// Granted returns the sum of all grants (limits in force).
func (a *NodeArbiter) Granted() Resources {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.granted()
}

// Used returns what the leases count against the node (see NodeArbiter).
func (a *NodeArbiter) Used() Resources {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.used("", false)
}

// Leases returns a copy of every lease.
func (a *NodeArbiter) Leases() map[string]Lease {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]Lease, len(a.leases))
	for k, l := range a.leases {
		out[k] = *l
	}
	return out
}

func (a *NodeArbiter) Admit(ctx context.Context, env string, base Resources, opts ...AdmitOpt) error {
	var ad Admission
	for _, o := range opts {
		o(&ad)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	l, exists := a.leases[env]
	if exists {
		// Re-admission (a shim re-registering after an arbiter restart,
		// or the controller after the shim) only moves the base.
		base = a.fit(base)
		l.Base, l.Priority, l.Tier = base, ad.Priority, ad.Tier
		l.Grant = Resources{CPU: math.Max(l.Grant.CPU, base.CPU), Memory: max(l.Grant.Memory, base.Memory)}
		return nil
	}
	if err := a.admissible(base); err != nil {
		return err
	}
	// A base larger than the node (the default 8 GiB initial quota on a
	// smaller node) is held as the whole node once admitted: no lease is
	// granted more than the node has, whatever a shim asks. The
	// overcommit bound above still sees what was asked.
	base = a.fit(base)
	a.leases[env] = &Lease{Base: base, Grant: base, Priority: ad.Priority, Tier: ad.Tier, Admitted: a.now()}
	// Restore the reserve from idle burst (best effort), counting the
	// newcomers at their base: they are about to use some of it.
	lim, used := a.growLimit(), a.used("", true)
	if over := used.CPU - lim.CPU; over > 1e-9 {
		a.reclaimCPU(over, nil)
	}
	if over := used.Memory - lim.Memory; over > 0 {
		a.reclaimMem(over, nil)
	}
	return nil
}

// admissible says why a new environment with base cannot be admitted:
// the resource that is short, and by how much.
func (a *NodeArbiter) admissible(base Resources) error {
	lim, used := a.growLimit(), a.used("", false)
	if over := used.Memory - lim.Memory; over > 0 {
		return fmt.Errorf("node %v: memory short by %s: %s in use of %s%s leaves less than the %.0f%% reserve: %w",
			a.capacity, FormatBytes(over), FormatBytes(used.Memory), FormatBytes(a.memCapacity()), a.outsideNote(), a.reserve*100, errdefs.ErrResourceExhausted)
	}
	if cpu := a.cpuUse(); cpu > lim.CPU+1e-9 {
		return fmt.Errorf("node %v: cpu short by %.2f cores: %.2f of %g cores in use (%v average) leaves less than the %.0f%% reserve: %w",
			a.capacity, cpu-lim.CPU, cpu, a.capacity.CPU, DefaultCPUWindow, a.reserve*100, errdefs.ErrResourceExhausted)
	}
	promised := a.promised()
	if b := a.capacity.CPU * a.overcommit.CPU; a.overcommit.CPU > 0 && promised.CPU+base.CPU > b+1e-9 {
		return fmt.Errorf("node %v: cpu short by %.2f cores of bases: %.4g promised, overcommit bound %gx: %w",
			a.capacity, promised.CPU+base.CPU-b, promised.CPU, a.overcommit.CPU, errdefs.ErrResourceExhausted)
	}
	if b := int64(float64(a.capacity.Memory) * a.overcommit.Memory); a.overcommit.Memory > 0 && promised.Memory+base.Memory > b {
		return fmt.Errorf("node %v: memory short by %s of bases: %s promised, overcommit bound %gx: %w",
			a.capacity, FormatBytes(promised.Memory+base.Memory-b), FormatBytes(promised.Memory), a.overcommit.Memory, errdefs.ErrResourceExhausted)
	}
	return nil
}

// cpuUse brings the node's averaged CPU use up to now and returns it:
// the reported use of every lease, seen through an exponential average
// with time constant DefaultCPUWindow.
func (a *NodeArbiter) cpuUse() float64 {
	now := a.now()
	var total float64
	for _, l := range a.leases {
		// Best-effort work runs on CPU nobody else wants: it yields
		// to a newcomer (Tier.Weights), so it leaves room.
		if l.Reported && l.Tier != TierBestEffort {
			total += l.Used.CPU
		}
	}
	if !a.cpuAt.IsZero() {
		if dt := now.Sub(a.cpuAt); dt > 0 {
			a.cpuAvg += (total - a.cpuAvg) * (1 - math.Exp(-dt.Seconds()/DefaultCPUWindow.Seconds()))
		}
	}
	a.cpuAt = now
	return a.cpuAvg
}

// fit caps r at the node's capacity.
func (a *NodeArbiter) fit(r Resources) Resources {
	return Resources{CPU: math.Min(r.CPU, a.capacity.CPU), Memory: min(r.Memory, a.capacity.Memory)}
}

func cpuFloor(l *Lease) float64 { return math.Max(1.5*l.Used.CPU, l.Base.CPU) }

// memFloor keeps the working set under the shims' default grow threshold
// (belowGrow), so a reclaimed burst stays reclaimed; at 1.5 x usage it sat
// at 67% of the limit, above the 60% threshold, and grew straight back.
func memFloor(l *Lease) int64 {
	return max(belowGrow(l.Used.Memory, DefaultConfig().MemGrowWS), l.Base.Memory)
}

// byIdle orders leases by idle grant (grant - usage), largest first, with
// the id as a tie-break so reclaim is deterministic.
func (a *NodeArbiter) byIdle(idle func(*Lease) float64) []*Lease {
	ids := make([]string, 0, len(a.leases))
	for id := range a.leases {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool {
		di, dj := idle(a.leases[ids[i]]), idle(a.leases[ids[j]])
		if di != dj {
			return di > dj
		}
		return ids[i] < ids[j]
	})
	out := make([]*Lease, len(ids))
	for i, id := range ids {
		out[i] = a.leases[id]
	}
	return out
}

// reclaimCPU and reclaimMem take up to need of idle burst, largest idle
// grant first, from every lease but skip's and the ramping ones.
func (a *NodeArbiter) reclaimCPU(need float64, skip *Lease) {
	for _, l := range a.byIdle(func(l *Lease) float64 { return l.Grant.CPU - l.Used.CPU }) {
		if need <= 1e-9 {
			return
		}
		if l == skip || l.Ramping {
			continue
		}
		take := math.Min(math.Max(l.Grant.CPU-cpuFloor(l), 0), need)
		l.Grant.CPU -= take
		need -= take
	}
}

// cpuRank orders the tiers: a grow's CPU budget leaves out the use of
// lower tiers.
func cpuRank(t Tier) int {
	switch t {
	case TierBestEffort:
		return 0
	case TierLatency:
		return 2
	}
	return 1
}

// othersCPU is the CPU the others' counted use leaves out of the asker's
// budget: only tiers at or above the asker's count. A lower tier's CPU,
// used or not, is the asker's for the taking: the scheduler weights give
// it to the higher tier under contention (Tier.Weights), and counting it
// let whoever grew first decide instead (a latency environment started
// after best-effort work got 68-74% of its CPU, 92-95% when it started
// first).
func (a *NodeArbiter) othersCPU(asker *Lease) float64 {
	var sum float64
	for _, l := range a.leases {
		if l != asker && cpuRank(l.Tier) >= cpuRank(asker.Tier) {
			sum += use(l, false).CPU
		}
	}
	return sum
}

func (a *NodeArbiter) reclaimMem(need int64, skip *Lease) {
	for _, l := range a.byIdle(func(l *Lease) float64 { return float64(l.Grant.Memory - l.Used.Memory) }) {
		if need <= 0 {
			return
		}
		if l == skip || l.Ramping {
			continue
		}
		take := min(max(l.Grant.Memory-memFloor(l), 0), need)
		l.Grant.Memory -= take
		need -= take
	}
}

func (a *NodeArbiter) Grow(ctx context.Context, env string, want Resources) (Resources, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	l, ok := a.leases[env]
	if !ok {
		return Resources{}, fmt.Errorf("grow %s: not admitted: %w", env, errdefs.ErrNotFound)
	}
	// The asker is at its limit: its whole grant is in use. What the
	// node lacks is first taken from grants far above their holders'
	// working sets (an environment that grew while nobody else asked):
	// a neighbour must not be denied, and failed, for memory that is
	// promised but not used.
	lim, others := a.growLimit(), a.used(env, false)
	old := l.Grant
	if want.CPU > l.Grant.CPU {
		othersCPU := a.othersCPU(l)
		if short := want.CPU - (lim.CPU - othersCPU); short > 1e-9 {
			a.reclaimCPU(short, l)
			othersCPU = a.othersCPU(l)
		}
		l.Grant.CPU += math.Max(math.Min(want.CPU-l.Grant.CPU, lim.CPU-othersCPU-l.Grant.CPU), 0)
	}
	if want.Memory > l.Grant.Memory {
		if short := want.Memory - (lim.Memory - others.Memory); short > 0 {
			a.reclaimMem(short, l)
			others = a.used(env, false)
		}
		l.Grant.Memory += max(min(want.Memory-l.Grant.Memory, lim.Memory-others.Memory-l.Grant.Memory), 0)
	}
	if l.Grant.CPU > old.CPU || l.Grant.Memory > old.Memory {
		l.Ramping = true
	}
	return l.Grant, nil
}

func (a *NodeArbiter) Report(ctx context.Context, env string, current, used Resources) (Resources, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	l, ok := a.leases[env]
	if !ok {
		return Resources{}, fmt.Errorf("report %s: not admitted: %w", env, errdefs.ErrNotFound)
	}
	a.cpuUse() // the average up to now, at the usage reported so far
	l.Used, l.Reported, l.Ramping = used, true, false
	// An environment that shrank on its own frees its burst.
	if current.CPU < l.Grant.CPU {
		l.Grant.CPU = math.Max(current.CPU, l.Base.CPU)
	}
	if current.Memory < l.Grant.Memory {
		l.Grant.Memory = max(current.Memory, l.Base.Memory)
	}
	a.chooseVictims()
	if why, ok := a.evict[env]; ok {
		a.told[env] = true
		return l.Grant, &EvictionError{Message: why}
	}
	return l.Grant, nil
}

// chooseVictims marks environments to fail when the counted memory use
// has eaten half the reserve: promised memory is really in use and the
// node cannot supply more. Marked ones still count until released.
func (a *NodeArbiter) chooseVictims() {
	line := int64(float64(a.capacity.Memory) * (1 - a.reserve/2))
	// A victim not told yet is chosen again from scratch: the excess may
	// have gone (a release, a lower report) and then nobody needs to fail.
	for id := range a.evict {
		if !a.told[id] {
			delete(a.evict, id)
		}
	}
	// Before anyone fails, grants far above their holders' working sets
	// go back: the node may be short of promises, not of memory.
	var counted int64
	for _, l := range a.leases {
		counted += use(l, false).Memory
	}
	if counted > line {
		a.reclaimMem(counted-line, nil)
	}
	var used, freeing int64
	cands := make([]Candidate, 0, len(a.leases))
	for id, l := range a.leases {
		u := use(l, false).Memory
		used += u
		if _, marked := a.evict[id]; marked {
			freeing += u
			continue
		}
		cands = append(cands, Candidate{Env: id, Priority: l.Priority, Admitted: l.Admitted, Frees: u})
	}
	excess := used - freeing - line
	if excess <= 0 {
		return
	}
	for _, id := range a.victims.ChooseVictims(cands, excess) {
		a.evict[id] = fmt.Sprintf("node memory %s in use of %s (%.0f%% reserve half gone); the victim policy (%s) chose this environment",
			FormatBytes(used), FormatBytes(a.capacity.Memory), a.reserve*100, a.victims)
	}
}

// StartQueue orders the starts of environments that land on a node
// together. A crowd of starts sharing the CPU equally finishes together,
// each as late as the last; served oldest first, the same work readies
// most of them far sooner and the last no later. The controllers turn a
// rank into a CPU weight (StartWeight).
type StartQueue interface {
	// StartRank returns how many environments admitted before env are
	// still starting, having asked within StartStaleAfter (0: env's
	// start goes first). done says env's start
	// has ended: it leaves the queue for good and the rank is 0.
	StartRank(ctx context.Context, env string, done bool) (int, error)
}

// StartRank implements StartQueue. An environment joins the queue with
// its first call, at its admission time, so a re-admission after an
// arbiter restart queues it again behind those still starting.
func (a *NodeArbiter) StartRank(ctx context.Context, env string, done bool) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	l, ok := a.leases[env]
	if !ok {
		return 0, fmt.Errorf("start rank %s: not admitted: %w", env, errdefs.ErrNotFound)
	}
	if done {
		l.Starting, l.StartDone = false, true
		return 0, nil
	}
	if l.StartDone {
		return 0, nil
	}
	now := a.now()
	l.Starting, l.StartAsked = true, now
	rank := 0
	for id, o := range a.leases {
		if o.Starting && now.Sub(o.StartAsked) < StartStaleAfter && id != env &&
			(o.Admitted.Before(l.Admitted) || o.Admitted.Equal(l.Admitted) && id < env) {
			rank++
		}
	}
	return rank, nil
}

// StartStaleAfter is how long a start that stopped asking its rank
// (every 400 ms with the default sample period) still holds the ones
// behind it. Its end may never come: the call saying so can be lost while
// the arbiter is away, and its shim can die. Without a bound every start
// admitted after it stayed behind it, at a fraction of its weight, until
// it was released (one 48-rollout batch: ready p95 138 s, about 40 s in
// the others).
const StartStaleAfter = 5 * time.Second

// Restore installs a lease as recorded by an earlier arbiter (its ledger)
// without admission checks: the node already carries it.
func (a *NodeArbiter) Restore(env string, l Lease) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.leases[env] = &l
}

func (a *NodeArbiter) Release(ctx context.Context, env string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.cpuUse() // the released lease's use counted up to now
	delete(a.leases, env)
	delete(a.evict, env)
	delete(a.told, env)
	return nil
}
