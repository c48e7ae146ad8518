package peersim

import (
	"math"
	"slices"
)

// Stats are the counters of one run.
type Stats struct {
	RegistryBytes    int64
	RegistryRequests int64
	PeerRequests     int64
	PeerBytes        int64
	// Hedges: reads that asked the registry because the owner had not
	// accepted within HedgeAfter. Timeouts: requests given up after
	// Timeout. Refused: requests a dead daemon's kernel refused. Unknown:
	// 404s from owners without the layer open. Busy: requests an owner
	// refused because it answered MaxServing already. Failovers:
	// requests to a stripe's next owner after the first failed.
	Hedges, Timeouts, Refused, Unknown, Busy, Failovers int64
	BadMarks                                            int64
	FailedNodes                                         int
	// MaxFanIn is the most requests one owner received for one piece;
	// PeakOwnerTransfers the most answers one owner sent at once.
	MaxFanIn           int32
	PeakOwnerTransfers int

	registryPerSec []int32
	fanins         map[int64]int32
}

func (st *Stats) fanIn(owner, p int32) {
	k := int64(owner)<<32 | int64(p)
	st.fanins[k]++
	st.MaxFanIn = max(st.MaxFanIn, st.fanins[k])
}

// bump counts one event in the one-second bucket of t.
func bump(b []int32, t float64) []int32 {
	i := int(t)
	for len(b) <= i {
		b = append(b, 0)
	}
	b[i]++
	return b
}

// Result is what one iteration produced.
type Result struct {
	Config Config
	Stats
	// UnionBytes is what the cluster reads, each piece counted once;
	// NodeBytes what the nodes read, each piece once per node (what the
	// registry sends without peers).
	UnionBytes, NodeBytes int64
	// RegistryPeakRPS is the busiest second's requests at the registry;
	// RegistryMeanRPS the mean over the seconds it was asked anything.
	RegistryPeakRPS int32
	RegistryMeanRPS float64
	// HottestOwnerPeakRPS is the busiest second's peer requests at the
	// busiest node; HottestOwnerBytes the most one node served.
	HottestOwnerPeakRPS int32
	HottestOwnerBytes   int64
	// Environments on nodes that did not fail, and how many of them
	// never finished their reads (a read that failed); ready and reads
	// done percentiles over them, seconds from their node's start.
	Envs, Stuck                int
	ReadyP50, ReadyP99         float64
	ReadsDoneP50, ReadsDoneP99 float64
	// End is when the last event happened.
	End float64
}

func (s *sim) result() Result {
	r := Result{Config: s.cfg, Stats: s.st, End: s.now}
	seen := make([]int32, len(s.pieces)) // node id + 1 that counted it
	union := make([]bool, len(s.pieces))
	count := func(n *node, p int32) {
		if seen[p] != n.id+1 {
			seen[p] = n.id + 1
			r.NodeBytes += s.pieces[p].size
		}
		if !union[p] {
			union[p] = true
			r.UnionBytes += s.pieces[p].size
		}
	}
	var ready, done []float64
	for _, n := range s.nodes {
		for _, p := range s.readySet {
			count(n, p)
		}
		for _, e := range n.envs {
			for _, p := range e.reads {
				count(n, p)
			}
			if n.dead {
				continue
			}
			r.Envs++
			if e.doneAt < 0 {
				r.Stuck++
				continue
			}
			ready = append(ready, e.readyAt-n.start)
			done = append(done, e.doneAt-n.start)
		}
		for _, c := range n.received {
			r.HottestOwnerPeakRPS = max(r.HottestOwnerPeakRPS, c)
		}
		r.HottestOwnerBytes = max(r.HottestOwnerBytes, n.served)
	}
	var busy int
	for _, c := range s.st.registryPerSec {
		r.RegistryPeakRPS = max(r.RegistryPeakRPS, c)
		if c > 0 {
			busy++
		}
	}
	if busy > 0 {
		r.RegistryMeanRPS = float64(r.RegistryRequests) / float64(busy)
	}
	r.ReadyP50, r.ReadyP99 = percentile(ready, 50), percentile(ready, 99)
	r.ReadsDoneP50, r.ReadsDoneP99 = percentile(done, 50), percentile(done, 99)
	return r
}

// percentile is nearest-rank, as docs/benchmarks.md reports.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	xs = slices.Clone(xs)
	slices.Sort(xs)
	i := int(math.Ceil(p/100*float64(len(xs)))) - 1
	return xs[max(0, min(i, len(xs)-1))]
}
