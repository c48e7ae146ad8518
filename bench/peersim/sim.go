// Package peersim is a discrete-event model of an RL iteration's start on
// a cluster, with and without the peer tier (internal/peer): every node
// starts its environments, each environment needs the stripes of its
// layer groups that it reads before it is ready, and a stripe comes from
// the node's cache, its owner (rendezvous hashing, as the daemon does) or
// the registry. It exists to say what happens past one machine, where the
// real tier cannot be run; its inputs are parameters (Params), with the
// values measured on one machine as defaults where there are any.
//
// The model is deliberately coarse: every link end (a node's ingress, a
// node's egress, the registry's egress) is a FIFO server at its rate; a
// transfer queues on both of its ends independently, after half a round
// trip (a full one for the registry), and completes when the later of the
// two has served it. That neither couples the two ends (a real transfer
// waiting on a busy sender does not hold the receiver) nor shares a link
// fairly among flows; there are no TCP dynamics, no CPU and no disk.
package peersim

import (
	"container/heap"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"time"
)

// Params describe the cluster, the workload and the costs.
type Params struct {
	Nodes, EnvsPerNode int
	// EnvRate is how many environments a node starts per second.
	EnvRate float64
	// StripeBytes is the ownership unit (peer.StripeSize).
	StripeBytes int64
	// BaseStripes of the shared base group and TaskStripes of one task
	// group are what an environment reads of them before it is ready;
	// TaskGroups is how many task groups there are, each environment
	// using one drawn uniformly.
	BaseStripes, TaskStripes, TaskGroups int
	// NodeRate is each node's link (bytes/s, each direction); LANRTT the
	// round trip between nodes.
	NodeRate float64
	LANRTT   time.Duration
	// RegistryRate is the registry's egress (bytes/s, all clients);
	// RegistryRTT the round trip to it.
	RegistryRate float64
	RegistryRTT  time.Duration
	// Peers turns the peer tier on.
	Peers bool
	// FailFraction of the nodes die at FailAt (their transfers in
	// progress fail; requests to them are refused from then on).
	FailFraction float64
	FailAt       time.Duration
	Seed         uint64
}

// Result is what one run measured.
type Result struct {
	RegistryBytes    int64
	RegistryRequests int64
	// Peak requests per second (1 s windows) at the registry and at the
	// busiest owner.
	RegistryPeakRPS, OwnerPeakRPS int
	// MaxFanIn is the most nodes waiting at once on one owner for one
	// stripe it was still fetching: the fan-in when a popular stripe is
	// first needed.
	MaxFanIn int
	// Ready times (environment start to all its stripes local) of the
	// environments on nodes that did not fail.
	ReadyP50, ReadyP99 time.Duration
	Envs               int
	// FailedPeerRequests were refused or cut by a dead owner and went to
	// the registry.
	FailedPeerRequests int64
}

type event struct {
	at  float64 // seconds
	seq int64
	fn  func()
}

type queue []*event

func (q queue) Len() int { return len(q) }
func (q queue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q queue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *queue) Push(x any)   { *q = append(*q, x.(*event)) }
func (q *queue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// stripe states on one node.
const (
	absent = iota
	fetching
	present
)

type entry struct {
	state   int
	waiters []func()
	// remote counts other nodes waiting on this node for the stripe
	// while it fetches it (fan-in).
	remote int
}

type node struct {
	id      int
	dead    bool
	egress  float64 // time the egress link is free
	ingress float64
	stripes map[int]*entry
	bad     map[int]bool // peers this node found dead
	reqs    map[int]int  // requests served per second
	// pending are peers' requests the node accepted and has not sent
	// yet: they fail when it dies.
	pending map[*pendingReq]struct{}
}

type pendingReq struct {
	done bool
	fail func()
}

type sim struct {
	p     Params
	now   float64
	seq   int64
	q     queue
	nodes []*node
	rank  map[int][]int // stripe -> nodes by falling rendezvous weight
	res   Result
	regQ  float64 // registry egress free at
	regPS map[int]int
	ready []float64
}

func (s *sim) at(t float64, fn func()) {
	s.seq++
	heap.Push(&s.q, &event{at: t, seq: s.seq, fn: fn})
}

func (s *sim) entry(n *node, st int) *entry {
	e := n.stripes[st]
	if e == nil {
		e = &entry{}
		n.stripes[st] = e
	}
	return e
}

// owner is rendezvous hashing over the members n has not found dead.
func (s *sim) owner(n *node, st int) int {
	r, ok := s.rank[st]
	if !ok {
		weights := make([]uint64, len(s.nodes))
		r = make([]int, len(s.nodes))
		for i := range s.nodes {
			h := fnv.New64a()
			fmt.Fprintf(h, "%d/%d", i, st)
			weights[i] = mix(h.Sum64())
			r[i] = i
		}
		slices.SortFunc(r, func(a, b int) int {
			if weights[a] > weights[b] {
				return -1
			}
			if weights[a] < weights[b] {
				return 1
			}
			return a - b
		})
		s.rank[st] = r
	}
	for _, m := range r {
		if !n.bad[m] {
			return m
		}
	}
	return -1
}

func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// fromRegistry fetches stripe st into n, then calls done.
func (s *sim) fromRegistry(n *node, st int, done func()) {
	size := float64(s.p.StripeBytes)
	start := s.now + s.p.RegistryRTT.Seconds()
	s.regQ = max(start, s.regQ) + size/s.p.RegistryRate
	n.ingress = max(start, n.ingress) + size/s.p.NodeRate
	end := max(s.regQ, n.ingress)
	s.res.RegistryBytes += s.p.StripeBytes
	s.res.RegistryRequests++
	s.regPS[int(s.now)]++
	s.at(end, func() {
		if n.dead {
			return
		}
		done()
	})
}

// need makes stripe st present on n and calls done then (on a live n).
func (s *sim) need(n *node, st int, done func()) {
	e := s.entry(n, st)
	switch e.state {
	case present:
		done()
		return
	case fetching:
		e.waiters = append(e.waiters, done)
		return
	}
	e.state = fetching
	e.waiters = append(e.waiters, done)
	land := func() {
		e.state = present
		ws := e.waiters
		e.waiters, e.remote = nil, 0
		for _, w := range ws {
			w()
		}
	}
	if !s.p.Peers {
		s.fromRegistry(n, st, land)
		return
	}
	s.viaOwner(n, st, land, false)
}

// viaOwner asks st's owner for it (or the registry, when n owns it). An
// owner found dead hands the read to the next owner, once, as
// peer.Client does; a second failure goes to the registry.
func (s *sim) viaOwner(n *node, st int, land func(), retried bool) {
	failover := func() {
		if retried {
			s.fromRegistry(n, st, land)
			return
		}
		s.viaOwner(n, st, land, true)
	}
	o := s.owner(n, st)
	if o == n.id || o < 0 {
		s.fromRegistry(n, st, land)
		return
	}
	owner := s.nodes[o]
	half := s.p.LANRTT.Seconds() / 2
	s.at(s.now+half, func() {
		if owner.dead {
			// Refused: one more half round trip to learn it.
			s.at(s.now+half, func() {
				s.res.FailedPeerRequests++
				n.bad[o] = true
				failover()
			})
			return
		}
		owner.reqs[int(s.now)]++
		oe := s.entry(owner, st)
		if oe.state == fetching {
			oe.remote++
			s.res.MaxFanIn = max(s.res.MaxFanIn, oe.remote)
		}
		pr := &pendingReq{fail: func() {
			s.res.FailedPeerRequests++
			n.bad[o] = true
			failover()
		}}
		owner.pending[pr] = struct{}{}
		// The owner fetches it for itself and the others once (owner
		// single flight), then sends it.
		s.serve(owner, st, func() {
			if pr.done {
				return
			}
			pr.done = true
			delete(owner.pending, pr)
			s.send(owner, n, st, land, failover)
		})
	})
}

// serve makes st present on the owner without asking another peer.
func (s *sim) serve(owner *node, st int, done func()) {
	e := s.entry(owner, st)
	switch e.state {
	case present:
		done()
		return
	case fetching:
		e.waiters = append(e.waiters, done)
		return
	}
	e.state = fetching
	e.waiters = append(e.waiters, done)
	s.fromRegistry(owner, st, func() {
		e.state = present
		ws := e.waiters
		e.waiters, e.remote = nil, 0
		for _, w := range ws {
			w()
		}
	})
}

// send transfers st from owner to n.
func (s *sim) send(owner, n *node, st int, land, failover func()) {
	size := float64(s.p.StripeBytes)
	start := s.now + s.p.LANRTT.Seconds()/2
	owner.egress = max(start, owner.egress) + size/s.p.NodeRate
	n.ingress = max(start, n.ingress) + size/s.p.NodeRate
	end := max(owner.egress, n.ingress)
	s.at(end, func() {
		if n.dead {
			return
		}
		if owner.dead {
			// Cut mid-transfer.
			s.res.FailedPeerRequests++
			n.bad[owner.id] = true
			failover()
			return
		}
		land()
	})
}

// Run simulates one iteration start.
func Run(p Params) Result {
	s := &sim{p: p, regPS: map[int]int{}, rank: map[int][]int{}}
	rng := rand.New(rand.NewPCG(p.Seed, 1))
	for i := range p.Nodes {
		s.nodes = append(s.nodes, &node{id: i, stripes: map[int]*entry{}, bad: map[int]bool{}, reqs: map[int]int{}, pending: map[*pendingReq]struct{}{}})
	}
	nFail := int(float64(p.Nodes) * p.FailFraction)
	for _, i := range rng.Perm(p.Nodes)[:nFail] {
		n := s.nodes[i]
		s.at(p.FailAt.Seconds(), func() {
			n.dead = true
			for pr := range n.pending {
				if !pr.done {
					pr.done = true
					pr.fail()
				}
			}
			n.pending = nil
		})
	}
	type envReady struct {
		n      *node
		start  float64
		doneAt float64
	}
	var envs []*envReady
	for _, n := range s.nodes {
		for k := range p.EnvsPerNode {
			start := float64(k) / p.EnvRate
			task := rng.IntN(p.TaskGroups)
			var stripes []int
			for b := range p.BaseStripes {
				stripes = append(stripes, b)
			}
			for t := range p.TaskStripes {
				stripes = append(stripes, p.BaseStripes+task*p.TaskStripes+t)
			}
			ev := &envReady{n: n, start: start, doneAt: -1}
			envs = append(envs, ev)
			s.at(start, func() {
				if n.dead {
					return
				}
				left := len(stripes)
				for _, st := range stripes {
					s.need(n, st, func() {
						if left--; left == 0 {
							ev.doneAt = s.now
						}
					})
				}
			})
		}
	}
	for s.q.Len() > 0 {
		e := heap.Pop(&s.q).(*event)
		s.now = e.at
		e.fn()
	}
	var ready []float64
	for _, ev := range envs {
		if ev.n.dead {
			continue
		}
		if ev.doneAt < 0 {
			panic("an environment on a live node never became ready")
		}
		ready = append(ready, ev.doneAt-ev.start)
	}
	slices.Sort(ready)
	s.res.Envs = len(ready)
	if len(ready) > 0 {
		s.res.ReadyP50 = secs(ready[len(ready)/2])
		s.res.ReadyP99 = secs(ready[min(len(ready)-1, len(ready)*99/100)])
	}
	for _, v := range s.regPS {
		s.res.RegistryPeakRPS = max(s.res.RegistryPeakRPS, v)
	}
	for _, n := range s.nodes {
		for _, v := range n.reqs {
			s.res.OwnerPeakRPS = max(s.res.OwnerPeakRPS, v)
		}
	}
	return s.res
}

func secs(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }
