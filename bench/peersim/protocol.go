package peersim

import "slices"

// The peer protocol of internal/peer as the model plays it. Each function
// names the code it stands for.

// registryFetch sends f's piece from the registry to n (fetch.Layer's
// registryFrames): one request, RegistryRTT to the first byte, then the
// registry's egress shared with every transfer in progress.
func (s *sim) registryFetch(n *node, f *flight) {
	if f.regStarted || n.dead {
		return
	}
	f.fetching, f.regStarted = true, true
	s.st.RegistryRequests++
	s.st.registryPerSec = bump(s.st.registryPerSec, s.now)
	size := s.pieces[f.p].size
	s.after(s.cfg.RegistryRTT.Seconds(), func() {
		s.registry.add(size, func() {
			s.st.RegistryBytes += size
			s.deliver(n, f, size)
		})
	})
}

// deliver is the last hop: the receiver's downlink, in arrival order.
// A transfer that was limited by its sender has streamed through the
// downlink meanwhile, so it ends no earlier than the sender's end and no
// earlier than the downlink's backlog plus its own bytes.
func (s *sim) deliver(n *node, f *flight, size int64) {
	if n.dead {
		return
	}
	done := max(s.now, n.downFree+float64(size)/s.cfg.NodeBandwidth)
	n.downFree = done
	s.after(done-s.now, func() { s.complete(n, f) })
}

// complete: the piece is in n's cache; wake its readers and serve the
// peers waiting for it (the owner's "landed" path).
func (s *sim) complete(n *node, f *flight) {
	if f.done || n.dead {
		return
	}
	f.done = true
	ws, rs := f.waiters, f.servers
	f.waiters, f.servers = nil, nil
	for _, w := range ws {
		w()
	}
	for _, r := range rs {
		s.serve(n, r)
	}
}

// peerRequest is peer.Client.hedged: ask the owner; if it has not
// accepted after HedgeAfter, ask the registry too; give up on it after
// Timeout without progress (WholeAnswerTimeout: after Timeout). failover marks the request to the next owner that follows a
// failed one.
func (s *sim) peerRequest(n *node, o int32, f *flight, failover bool) {
	r := &request{from: n.id, to: o, f: f, failover: failover}
	s.st.PeerRequests++
	half := s.cfg.PeerRTT.Seconds() / 2
	s.after(half, func() { s.arrive(r) })
	s.after(s.cfg.HedgeAfter.Seconds(), func() {
		if r.closed || r.accepted || f.done || f.regStarted {
			return
		}
		s.st.Hedges++
		s.registryFetch(n, f)
	})
	timeout := s.cfg.Timeout.Seconds()
	var check func()
	check = func() {
		if r.closed {
			return
		}
		if o := s.nodes[r.to]; !s.cfg.WholeAnswerTimeout && r.accepted {
			// peer.Client counts time without progress: an owner that
			// accepted sends interim responses while it fetches and
			// bytes while it answers, until it dies.
			if !o.dead {
				s.after(timeout, check)
				return
			}
			if wait := o.diedAt + timeout - s.now; wait > 0 {
				s.after(wait, check)
				return
			}
		}
		s.st.Timeouts++
		s.giveUp(r, true)
	}
	s.after(timeout, check)
}

// giveUp abandons r: the owner stops sending, the requester marks it bad
// (unless it only lacked the layer or was busy) and, as peer.Client.Fetch
// does, asks the stripe's next owner by rendezvous once when it marked
// the owner bad (unless the registry is already asked), else the
// registry.
func (s *sim) giveUp(r *request, bad bool) {
	s.close(r)
	n, o := s.nodes[r.from], s.nodes[r.to]
	if r.flow != nil {
		o.up.remove(r.flow)
		r.flow = nil
	}
	if bad {
		s.markBad(n, r.to)
	}
	if r.f.done || n.dead {
		return
	}
	if bad && !r.failover && !r.f.regStarted {
		if next := s.owner(n, s.pieces[r.f.p].stripe); next != n.id && next != r.to {
			s.st.Failovers++
			s.peerRequest(n, next, r.f, true)
			return
		}
	}
	s.registryFetch(n, r.f)
}

// close ends r, freeing its place among what its owner answers.
func (s *sim) close(r *request) {
	r.closed = true
	if r.answering {
		r.answering = false
		s.nodes[r.to].answering--
	}
}

// arrive is peer.Server.ServeHTTP and fetch.Flights.Frames on the owner.
func (s *sim) arrive(r *request) {
	if r.closed {
		return
	}
	o := s.nodes[r.to]
	half := s.cfg.PeerRTT.Seconds() / 2
	if o.dead {
		if s.cfg.FailMode == FailRefuse {
			s.after(half, func() {
				if !r.closed {
					s.st.Refused++
					s.giveUp(r, true)
				}
			})
		}
		// Silent: the hedge and then the timeout act.
		return
	}
	o.received = bump(o.received, s.now)
	if s.cfg.MaxServing > 0 && o.answering >= s.cfg.MaxServing {
		// peer.Server's bound: refused at once (503); the requester
		// reads from the registry and does not mark the owner bad.
		s.after(half, func() {
			if !r.closed {
				s.st.Busy++
				s.giveUp(r, false)
			}
		})
		return
	}
	p := s.pieces[r.f.p]
	if !(o.started && o.open[p.layer]) && !s.cfg.AnyLayer {
		// 404: the layer is not open there; the registry serves, and
		// the owner is not held responsible.
		s.after(half, func() {
			if !r.closed {
				s.st.Unknown++
				s.giveUp(r, false)
			}
		})
		return
	}
	s.st.fanIn(r.to, r.f.p)
	o.answering++
	r.answering = true
	// Headers go out before the owner fetches: the requester stops its
	// hedge timer when they arrive.
	s.after(half, func() { r.accepted = true })
	o.serving = append(o.serving, r)
	of := s.flightOf(o, r.f.p)
	if of.done {
		s.serve(o, r)
		return
	}
	of.servers = append(of.servers, r)
	// A fetch made for a peer goes to the registry, whatever the owner's
	// own flight is waiting on.
	s.registryFetch(o, of)
}

// serve sends the piece from o's uplink, shared with o's other answers.
func (s *sim) serve(o *node, r *request) {
	if r.closed || o.dead {
		return
	}
	size := s.pieces[r.f.p].size
	r.flow = o.up.add(size, func() {
		r.flow = nil
		if r.closed {
			return
		}
		s.close(r)
		s.st.PeerBytes += size
		o.served += size
		s.deliver(s.nodes[r.from], r.f, size)
	})
	if o.up.peak > s.st.PeakOwnerTransfers {
		s.st.PeakOwnerTransfers = o.up.peak
	}
}

// fail kills node o: what it was sending stops; its requesters learn it
// at once (refused) or at their timeout (silent).
func (s *sim) fail(o *node) {
	o.dead, o.diedAt = true, s.now
	s.st.FailedNodes++
	half := s.cfg.PeerRTT.Seconds() / 2
	for _, r := range o.serving {
		if r.closed {
			continue
		}
		if r.flow != nil {
			o.up.remove(r.flow)
			r.flow = nil
		}
		if s.cfg.FailMode == FailRefuse {
			s.after(half, func() {
				if !r.closed {
					s.st.Refused++
					s.giveUp(r, true)
				}
			})
		}
	}
	o.serving = nil
}

func (s *sim) markBad(n *node, peer int32) {
	if until, ok := n.bad[peer]; ok && s.now < until {
		return
	}
	n.bad[peer] = s.now + s.cfg.BadFor.Seconds()
	s.st.BadMarks++
}

// rankDepth is how many members of a stripe's rendezvous order are kept:
// a requester skips the ones it has marked bad.
const rankDepth = 8

// owner is peer.Owner over the members n has not marked bad: the member
// with the highest rendezvous weight for the stripe. The weight is a
// different hash from peer's (splitmix64 of member and stripe); what
// matters here is the rule and that ownership is uniform.
func (s *sim) owner(n *node, stripe int32) int32 {
	rank, ok := s.ranks[stripe]
	if !ok {
		rank = s.rank(stripe, rankDepth)
		s.ranks[stripe] = rank
	}
	if k := s.cfg.Replicas; k > 1 {
		// The requester's replica first, then the others in order.
		first := int(mix(uint64(n.id)^uint64(stripe)<<32) % uint64(k))
		rank = append(append(append([]int32(nil), rank[first]), rank[:first]...), rank[first+1:]...)
		if slices.Contains(rank[:k], n.id) {
			return n.id
		}
	}
	for _, m := range rank {
		if m == n.id {
			return m
		}
		if until, ok := n.bad[m]; ok && s.now < until {
			continue
		}
		return m
	}
	// Every member kept is bad for n: rank them all.
	for _, m := range s.rank(stripe, len(s.nodes)) {
		if until, ok := n.bad[m]; m == n.id || !ok || s.now >= until {
			return m
		}
	}
	return n.id
}

// rank returns the depth members of highest weight for stripe, highest
// first.
func (s *sim) rank(stripe int32, depth int) []int32 {
	type mw struct {
		m int32
		w uint64
	}
	top := make([]mw, 0, depth+1)
	key := uint64(stripe)*0x9e3779b97f4a7c15 ^ uint64(s.cfg.Seed)
	for m := range int32(len(s.nodes)) {
		w := mix(key ^ mix(uint64(m)+1))
		if len(top) == depth && w <= top[depth-1].w {
			continue
		}
		i := len(top)
		for i > 0 && top[i-1].w < w {
			i--
		}
		top = append(top, mw{})
		copy(top[i+1:], top[i:])
		top[i] = mw{m, w}
		if len(top) > depth {
			top = top[:depth]
		}
	}
	out := make([]int32, len(top))
	for i, t := range top {
		out[i] = t.m
	}
	return out
}

func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
