package envlet

import (
	"context"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"

	"github.com/containerd/errdefs"
)

// Arbiter divides a node between environments. Every method is keyed by
// the environment id; the shim side holds the truth and re-registers
// (Admit, then Grow to its current limits) when Report says ErrNotFound,
// e.g. after an arbiter restart.
type Arbiter interface {
	// Admit reserves base for a new environment, or fails with
	// errdefs.ErrResourceExhausted.
	Admit(ctx context.Context, env string, base Resources) error
	// Grow asks for want in total and returns the granted total, which may
	// be partial. A field at or below the current grant (0 for "this
	// resource is not growing") leaves that grant unchanged: burst is given
	// back through Report, so a grow of one resource cannot undo a pending
	// reclaim of the other.
	Grow(ctx context.Context, env string, want Resources) (Resources, error)
	// Report tells the arbiter the applied limits and the usage (CPU cores
	// used, memory working set), about once a second. A returned limit
	// below current means "shrink to this": burst reclaimed for an
	// admission.
	Report(ctx context.Context, env string, current, used Resources) (Resources, error)
	// Release returns everything the environment holds.
	Release(ctx context.Context, env string) error
}

// NodeSizer is implemented by arbiters that know the node they divide
// (NodeArbiter, the node arbiter's client): failures report the node's
// size as the arbiter sees it, not the host's.
type NodeSizer interface {
	Capacity() (Resources, float64)
}

// DefaultReserve is the node share kept for admitting new environments.
const DefaultReserve = 0.15

// NodeArbiter is the in-memory Arbiter: a shim without a daemon uses it
// in-process, and the node daemon wraps it behind ttrpc.
//
// Accounting: node capacity = admission reserve + sum of grants. A grant is
// the admitted base plus burst. Grow only draws on capacity x (1 -
// reserve), so bursting environments can never eat the reserve; Admit may
// use the reserve (that is what makes admission immediate on a node full
// of burst) and then reclaims idle burst, largest (grant - usage) first and
// never below max(1.5 x usage, base), to restore it. Grants never sum above
// capacity.
type NodeArbiter struct {
	mu       sync.Mutex
	capacity Resources
	reserve  float64
	leases   map[string]*Lease
}

// Lease is what the arbiter holds for one environment.
type Lease struct {
	Base, Grant, Used Resources
	// Priority and Admitted order the environments when the node must
	// fail one (VictimPolicy).
	Priority int
	Admitted time.Time
}

// NewNodeArbiter returns an arbiter for a node of the given capacity
// keeping reserve (0..1, DefaultReserve) for admissions.
func NewNodeArbiter(capacity Resources, reserve float64) *NodeArbiter {
	return &NodeArbiter{capacity: capacity, reserve: min(max(reserve, 0), 1), leases: map[string]*Lease{}}
}

// Capacity returns the node capacity and reserve.
func (a *NodeArbiter) Capacity() (Resources, float64) { return a.capacity, a.reserve }

func (a *NodeArbiter) growLimit() Resources {
	return Resources{
		CPU:    a.capacity.CPU * (1 - a.reserve),
		Memory: int64(float64(a.capacity.Memory) * (1 - a.reserve)),
	}
}

func (a *NodeArbiter) granted() Resources {
	var s Resources
	for _, l := range a.leases {
		s.CPU += l.Grant.CPU
		s.Memory += l.Grant.Memory
	}
	return s
}

// Granted returns the sum of all grants.
func (a *NodeArbiter) Granted() Resources {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.granted()
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

func (a *NodeArbiter) Admit(ctx context.Context, env string, base Resources) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	// Re-admission (a shim re-registering after an arbiter restart, or a
	// new base) only needs room for what it adds.
	extra := base
	l, exists := a.leases[env]
	if exists {
		extra = Resources{CPU: math.Max(base.CPU-l.Grant.CPU, 0), Memory: max(base.Memory-l.Grant.Memory, 0)}
	}
	sum := a.granted()
	needCPU := sum.CPU + extra.CPU - a.capacity.CPU
	needMem := sum.Memory + extra.Memory - a.capacity.Memory
	// The admitted environment's own burst is no room for it: a new base
	// at or above its grant turns that burst into base.
	if needCPU > 1e-9 && a.reclaimableCPU(env) < needCPU || needMem > 0 && a.reclaimableMem(env) < needMem {
		return fmt.Errorf("node %v has %v granted and too little idle burst to reclaim: %w",
			a.capacity, sum, errdefs.ErrResourceExhausted)
	}
	if exists {
		l.Base = base
		l.Grant = Resources{CPU: l.Grant.CPU + extra.CPU, Memory: l.Grant.Memory + extra.Memory}
	} else {
		a.leases[env] = &Lease{Base: base, Grant: base}
	}
	// Restore the reserve from idle burst (best effort; the admission
	// itself only needed the capacity).
	lim := a.growLimit()
	sum = a.granted()
	if over := sum.CPU - lim.CPU; over > 1e-9 {
		a.reclaimCPU(over)
	}
	if over := sum.Memory - lim.Memory; over > 0 {
		a.reclaimMem(over)
	}
	return nil
}

func cpuFloor(l *Lease) float64 { return math.Max(1.5*l.Used.CPU, l.Base.CPU) }
func memFloor(l *Lease) int64 {
	return max(int64(math.Ceil(1.5*float64(l.Used.Memory))), l.Base.Memory)
}

// reclaimableCPU is the burst above the floors of every lease but skip's.
func (a *NodeArbiter) reclaimableCPU(skip string) float64 {
	var s float64
	for id, l := range a.leases {
		if id == skip {
			continue
		}
		s += math.Max(l.Grant.CPU-cpuFloor(l), 0)
	}
	return s
}

// reclaimableMem is the memory counterpart of reclaimableCPU.
func (a *NodeArbiter) reclaimableMem(skip string) int64 {
	var s int64
	for id, l := range a.leases {
		if id == skip {
			continue
		}
		s += max(l.Grant.Memory-memFloor(l), 0)
	}
	return s
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

func (a *NodeArbiter) reclaimCPU(need float64) {
	for _, l := range a.byIdle(func(l *Lease) float64 { return l.Grant.CPU - l.Used.CPU }) {
		if need <= 1e-9 {
			return
		}
		take := math.Min(math.Max(l.Grant.CPU-cpuFloor(l), 0), need)
		l.Grant.CPU -= take
		need -= take
	}
}

func (a *NodeArbiter) reclaimMem(need int64) {
	for _, l := range a.byIdle(func(l *Lease) float64 { return float64(l.Grant.Memory - l.Used.Memory) }) {
		if need <= 0 {
			return
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
	lim, sum := a.growLimit(), a.granted()
	if want.CPU > l.Grant.CPU {
		l.Grant.CPU += math.Max(math.Min(want.CPU-l.Grant.CPU, lim.CPU-sum.CPU), 0)
	}
	if want.Memory > l.Grant.Memory {
		l.Grant.Memory += max(min(want.Memory-l.Grant.Memory, lim.Memory-sum.Memory), 0)
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
	l.Used = used
	// An environment that shrank on its own frees its burst.
	if current.CPU < l.Grant.CPU {
		l.Grant.CPU = math.Max(current.CPU, l.Base.CPU)
	}
	if current.Memory < l.Grant.Memory {
		l.Grant.Memory = max(current.Memory, l.Base.Memory)
	}
	return l.Grant, nil
}

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
	delete(a.leases, env)
	return nil
}
