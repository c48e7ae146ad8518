package peersim

import (
	"container/heap"
	"math"
	"math/rand"
	"slices"
)

// piece is one fetch's worth of one layer: PieceSize bytes (the last of a
// group's read set may be smaller) at a slot of the layer's blob.
type piece struct {
	layer  int32
	stripe int32 // global stripe id: the unit of ownership
	size   int64
}

type layer struct {
	group  int
	pieces []int32 // in read order
	ready  int     // the first ready pieces are read before ready
}

type flight struct {
	p          int32
	done       bool
	fetching   bool // a fetch of this node's own is going
	regStarted bool
	waiters    []func()
	servers    []*request // peers waiting for this node to serve p
}

// request is one peer request for one piece (the model's stripes are
// never split: a piece lies in one stripe).
type request struct {
	from, to int32
	f        *flight
	accepted bool
	closed   bool // answered, failed or given up
	flow     *flow
	failover bool // to the next owner, after the first failed
	// answering: counted in its owner's answering (accepted, not closed)
	answering bool
}

type node struct {
	id       int32
	dead     bool
	diedAt   float64
	open     map[int32]bool // layers with an environment on this node, open once started
	flights  map[int32]*flight
	bad      map[int32]float64 // peer -> until
	downFree float64
	up       *psLink
	served   int64 // bytes sent to peers
	serving  []*request
	// answering counts the requests it has accepted and not finished:
	// what Config.MaxServing bounds.
	answering int
	envs      []*env
	start     float64
	started   bool    // its layers are mounted (open) from then on
	received  []int32 // peer requests received per second
	// prefetch of the shared ready set
	readyLeft int
	queue     []int32
	inflight  int
}

type env struct {
	node    int32
	reads   []int32 // after ready, in order
	readyAt float64
	doneAt  float64
}

type sim struct {
	cfg    Config
	rng    *rand.Rand
	now    float64
	seq    uint64
	events eventHeap

	pieces   []piece
	layers   []layer
	shared   []int32 // shared layers
	readySet []int32 // pieces read before ready, in order
	ranks    map[int32][]int32

	nodes    []*node
	registry *psLink

	st Stats
}

// after schedules fn dt seconds from now.
func (s *sim) after(dt float64, fn func()) {
	s.seq++
	heap.Push(&s.events, event{t: s.now + dt, seq: s.seq, fn: fn})
}

// Run simulates one iteration.
func Run(cfg Config) (Result, error) {
	if err := cfg.validate(); err != nil {
		return Result{}, err
	}
	s := &sim{cfg: cfg, rng: rand.New(rand.NewSource(cfg.Seed)), ranks: map[int32][]int32{}, st: Stats{fanins: map[int64]int32{}}}
	s.registry = &psLink{s: s, rate: cfg.RegistryBandwidth}
	s.build()
	for _, n := range s.nodes {
		var at float64
		if cfg.Stagger > 0 {
			at = s.rng.Float64() * cfg.Stagger.Seconds()
		}
		s.after(at, func() { s.startNode(n) })
	}
	if k := int(math.Round(cfg.FailFraction * float64(cfg.Nodes))); k > 0 {
		victims := s.rng.Perm(cfg.Nodes)[:k]
		s.after(cfg.FailAt.Seconds(), func() {
			for _, v := range victims {
				s.fail(s.nodes[v])
			}
		})
	}
	for s.events.Len() > 0 {
		e := heap.Pop(&s.events).(event)
		s.now = e.t
		e.fn()
	}
	return s.result(), nil
}

// build lays out every group's read set as pieces and places the
// environments on nodes.
func (s *sim) build() {
	cfg := s.cfg
	envs := cfg.Nodes * cfg.EnvsPerNode
	tasks := (envs + cfg.Rollouts - 1) / cfg.Rollouts
	stripes := int32(0)
	newLayer := func(gi int) int32 {
		g := cfg.Groups[gi]
		id := int32(len(s.layers))
		slots := int((g.Size + cfg.PieceSize - 1) / cfg.PieceSize)
		k := int((g.Read + cfg.PieceSize - 1) / cfg.PieceSize)
		perm := s.rng.Perm(slots)[:k]
		l := layer{group: gi, ready: int((g.ReadyRead + cfg.PieceSize - 1) / cfg.PieceSize)}
		left := g.Read
		for _, slot := range perm {
			size := min(cfg.PieceSize, left)
			left -= size
			l.pieces = append(l.pieces, int32(len(s.pieces)))
			s.pieces = append(s.pieces, piece{layer: id, stripe: stripes + int32(int64(slot)*cfg.PieceSize/cfg.StripeSize), size: size})
		}
		stripes += int32((g.Size + cfg.StripeSize - 1) / cfg.StripeSize)
		s.layers = append(s.layers, l)
		return id
	}
	var taskGroup, envGroup = -1, -1
	for gi, g := range cfg.Groups {
		switch g.Kind {
		case Shared:
			if g.Read > 0 {
				s.shared = append(s.shared, newLayer(gi))
			}
		case PerTask:
			taskGroup = gi
		case PerEnv:
			envGroup = gi
		}
	}
	// The ready set: the shared groups' ready pieces, interleaved as a
	// node-wide prefetch sends them (in order of first use, across
	// layers).
	for i := 0; ; i++ {
		more := false
		for _, id := range s.shared {
			if l := s.layers[id]; i < l.ready {
				s.readySet = append(s.readySet, l.pieces[i])
				more = true
			}
		}
		if !more {
			break
		}
	}
	taskLayers := make([]int32, 0, tasks)
	if taskGroup >= 0 && cfg.Groups[taskGroup].Read > 0 {
		for range tasks {
			taskLayers = append(taskLayers, newLayer(taskGroup))
		}
	}
	// Environment i runs task order[i]/Rollouts: packed, the rollouts
	// of a task are neighbours and land on the same node; spread, they
	// are shuffled over the cluster.
	order := make([]int, envs)
	for i := range order {
		order[i] = i
	}
	if !cfg.Pack {
		s.rng.Shuffle(envs, func(i, j int) { order[i], order[j] = order[j], order[i] })
	}
	for i := range cfg.Nodes {
		s.nodes = append(s.nodes, &node{
			id: int32(i), open: map[int32]bool{}, flights: map[int32]*flight{}, bad: map[int32]float64{},
			up: &psLink{s: s, rate: cfg.NodeBandwidth},
		})
	}
	for i := range envs {
		n := s.nodes[i/cfg.EnvsPerNode]
		e := &env{node: n.id, readyAt: -1, doneAt: -1}
		for _, id := range s.shared {
			n.open[id] = true
			e.reads = append(e.reads, s.layers[id].pieces[s.layers[id].ready:]...)
		}
		if len(taskLayers) > 0 {
			id := taskLayers[order[i]/cfg.Rollouts]
			n.open[id] = true
			e.reads = append(e.reads, s.layers[id].pieces...)
		}
		if envGroup >= 0 && cfg.Groups[envGroup].Read > 0 {
			id := newLayer(envGroup)
			n.open[id] = true
			e.reads = append(e.reads, s.layers[id].pieces...)
		}
		n.envs = append(n.envs, e)
	}
}

// startNode starts the node's environments: the mounts' prefetch of the
// ready set, then each environment's reads, one at a time, from ready on.
func (s *sim) startNode(n *node) {
	n.start = s.now
	n.queue = slices.Clone(s.readySet)
	n.readyLeft = len(s.readySet)
	n.started = true
	for _, p := range s.readySet {
		// Pieces this node already holds (fetched to serve a peer
		// before it started) count at once.
		if f := s.flightOf(n, p); f.done {
			n.readyLeft--
		} else {
			f.waiters = append(f.waiters, func() {
				if n.readyLeft--; n.readyLeft == 0 {
					s.ready(n)
				}
			})
		}
	}
	if n.readyLeft == 0 {
		s.ready(n)
	}
	s.pump(n)
}

// pump keeps PrefetchInflight prefetch requests of the node in flight.
func (s *sim) pump(n *node) {
	for n.inflight < s.cfg.PrefetchInflight && len(n.queue) > 0 && !n.dead {
		p := n.queue[0]
		n.queue = n.queue[1:]
		f := s.flightOf(n, p)
		if f.done {
			continue
		}
		n.inflight++
		f.waiters = append(f.waiters, func() { n.inflight--; s.pump(n) })
		if !f.fetching {
			s.fetch(n, f)
		}
	}
}

func (s *sim) ready(n *node) {
	if n.dead {
		return
	}
	at := s.cfg.LocalReady.Seconds()
	for _, e := range n.envs {
		e.readyAt = s.now + at
		s.after(at, func() { s.read(n, e, 0) })
	}
}

// read fetches the environment's i-th read, then the next.
func (s *sim) read(n *node, e *env, i int) {
	if n.dead {
		return
	}
	if i == len(e.reads) {
		e.doneAt = s.now
		return
	}
	s.need(n, e.reads[i], func() { s.read(n, e, i+1) })
}

// flightOf returns the node's flight for p, creating an idle one.
func (s *sim) flightOf(n *node, p int32) *flight {
	f := n.flights[p]
	if f == nil {
		f = &flight{p: p}
		n.flights[p] = f
	}
	return f
}

// need runs cb once the node has p, fetching it if nobody is.
func (s *sim) need(n *node, p int32, cb func()) {
	f, ok := n.flights[p]
	if ok && f.done {
		cb()
		return
	}
	if !ok {
		f = s.flightOf(n, p)
		f.waiters = append(f.waiters, cb)
		s.fetch(n, f)
		return
	}
	f.waiters = append(f.waiters, cb)
	if !f.fetching {
		s.fetch(n, f)
	}
}

// fetch gets f's piece for n: from the stripe's owner, or from the
// registry when n owns it or peers are off.
func (s *sim) fetch(n *node, f *flight) {
	f.fetching = true
	if !s.cfg.Peers {
		s.registryFetch(n, f)
		return
	}
	o := s.owner(n, s.pieces[f.p].stripe)
	if o == n.id {
		s.registryFetch(n, f)
		return
	}
	s.peerRequest(n, o, f, false)
}
