package headline

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/envsnap/envsnap/internal/devenv"
)

// sampler records, while a batch runs, how many environments the node
// holds, the node's used memory, and each container's working set.
type sampler struct {
	env     *devenv.Env
	running *gauge
	base    int64

	mu     sync.Mutex
	points []sample
	ws     map[string][]int64 // container -> working set samples, bytes
}

type sample struct {
	at      time.Time
	running int
	used    int64
}

func newSampler(env *devenv.Env, running *gauge, base int64) *sampler {
	return &sampler{env: env, running: running, base: base, ws: map[string][]int64{}}
}

func (s *sampler) run(ctx context.Context, period time.Duration) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		s.once(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *sampler) once(ctx context.Context) {
	p := sample{at: time.Now(), running: int(s.running.n.Load())}
	if used, err := nodeMemoryUsed(); err == nil {
		p.used = used
	}
	ws := containerWorkingSets(s.env)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.points = append(s.points, p)
	for id, v := range ws {
		s.ws[id] = append(s.ws[id], v)
	}
}

// containerWorkingSets is each running container's working set (usage
// less inactive file: what the kernel cannot drop without writing).
func containerWorkingSets(env *devenv.Env) map[string]int64 {
	out := map[string]int64{}
	for id, m := range containerStats(env) {
		out[id] = m.workingSet
	}
	return out
}

// timeline returns the samples relative to start (memory above the
// base), the peak number of environments and the peak memory above base.
func (s *sampler) timeline(start time.Time) ([]TimelinePoint, int, int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []TimelinePoint
	peak, peakMem := 0, int64(0)
	for _, p := range s.points {
		out = append(out, TimelinePoint{T: p.at.Sub(start).Seconds(), Concurrent: p.running, MemoryMiB: float64(p.used-s.base) / (1 << 20)})
		peak, peakMem = max(peak, p.running), max(peakMem, p.used-s.base)
	}
	return out, peak, peakMem
}

// memory is the median and largest working set sampled for container,
// in MiB.
func (s *sampler) memory(container string) (median, peak float64) {
	s.mu.Lock()
	vs := append([]int64(nil), s.ws[container]...)
	s.mu.Unlock()
	if len(vs) == 0 {
		return 0, 0
	}
	sort.Slice(vs, func(i, j int) bool { return vs[i] < vs[j] })
	return float64(vs[len(vs)/2]) / (1 << 20), float64(vs[len(vs)-1]) / (1 << 20)
}

// gauge counts the environments a node holds and remembers the most.
type gauge struct {
	n, peak atomic.Int64
}

func (g *gauge) add(d int64) {
	n := g.n.Add(d)
	for {
		p := g.peak.Load()
		if n <= p || g.peak.CompareAndSwap(p, n) {
			return
		}
	}
}
