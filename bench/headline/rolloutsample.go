package headline

import (
	"context"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// sampler records, while a batch runs, how many environments the node
// holds, the node's used memory, each container's working set, and where
// the node's CPU went.
type sampler struct {
	b       *bench
	running *gauge
	base    int64

	mu       sync.Mutex
	points   []sample
	ws       map[string][]int64 // container -> working set samples, bytes
	envCPU   map[string]float64 // container -> CPU seconds at its last sample
	shimCPU  map[int]float64    // shim pid -> CPU seconds at its last sample
	shimBase map[int]float64    // shims alive at the first sample: their CPU then
}

type sample struct {
	at      time.Time
	running int
	used    int64
	cpu     cpuSample
	// envCPU is the CPU seconds every container seen so far has used
	// (one that ended counts what it had used at its last sample);
	// shimCPU what the shims used since the first sample.
	envCPU, shimCPU float64
}

func newSampler(b *bench, running *gauge, base int64) *sampler {
	return &sampler{b: b, running: running, base: base, ws: map[string][]int64{},
		envCPU: map[string]float64{}, shimCPU: map[int]float64{}}
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
	p := sample{at: time.Now(), running: int(s.running.n.Load()), cpu: s.b.sampleCPU()}
	if used, err := nodeMemoryUsed(); err == nil {
		p.used = used
	}
	shims := s.b.shims()
	stats := containerStats(s.b.env)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shimBase == nil {
		s.shimBase = shims.cpu
	}
	for pid, t := range shims.cpu {
		s.shimCPU[pid] = t
	}
	for id, m := range stats {
		// The working set: usage less inactive file, what the kernel
		// cannot drop without writing.
		s.ws[id] = append(s.ws[id], m.workingSet)
		s.envCPU[id] = m.cpu
	}
	for _, t := range s.envCPU {
		p.envCPU += t
	}
	for pid, t := range s.shimCPU {
		p.shimCPU += t - s.shimBase[pid]
	}
	s.points = append(s.points, p)
}

// startCPU is where the node's CPU went from the first sample to the
// first one at or after until (the batch's last ready): CPU seconds of
// the node, the environments' cgroups split at their ready (starts: what
// they had used then, summed; every environment is ready inside the
// window), the shims, each daemon and "other" (the rest of the node: the
// kernel's threads, other processes), and the window's length.
func (s *sampler) startCPU(start time.Time, until time.Duration, starts float64) (map[string]float64, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.points) < 2 {
		return nil, 0
	}
	first, last := s.points[0], s.points[len(s.points)-1]
	for _, p := range s.points[1:] {
		if p.at.Sub(start) >= until {
			last = p
			break
		}
	}
	out := last.cpu.since(first.cpu)
	envs := last.envCPU - first.envCPU
	out["envs before ready"], out["envs after ready"] = starts, max(envs-starts, 0)
	out["shims"] = last.shimCPU
	other := out["node"]
	for name, v := range out {
		if name != "node" {
			other -= v
		}
	}
	out["other"] = max(other, 0)
	return out, last.at.Sub(start)
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
