package peersim

import "container/heap"

// psLink is a link shared fairly by the transfers crossing it (processor
// sharing: n transfers each get 1/n of the bandwidth), which is what many
// TCP connections out of one sender get from the kernel's fair queueing.
// It tracks the service v every transfer in progress has had so far; a
// transfer of b bytes added at v0 completes when v reaches v0+b.
type psLink struct {
	s     *sim
	rate  float64 // bytes/s
	v     float64
	last  float64
	flows flowHeap
	gen   uint64  // invalidates a scheduled completion
	due   float64 // when the scheduled completion fires, if one is
	armed bool
	peak  int // most transfers at once
}

type flow struct {
	finishV float64
	idx     int
	done    func()
}

func (l *psLink) advance() {
	if n := len(l.flows); n > 0 {
		l.v += (l.s.now - l.last) * l.rate / float64(n)
	}
	l.last = l.s.now
}

// add starts a transfer of size bytes; done runs when it completes.
func (l *psLink) add(size int64, done func()) *flow {
	l.advance()
	f := &flow{finishV: l.v + float64(size), done: done}
	heap.Push(&l.flows, f)
	l.peak = max(l.peak, len(l.flows))
	l.schedule()
	return f
}

// remove cancels a transfer in progress (its receiver gave up).
func (l *psLink) remove(f *flow) {
	if f == nil || f.idx < 0 {
		return
	}
	l.advance()
	heap.Remove(&l.flows, f.idx)
	f.idx = -1
	l.schedule()
}

// schedule makes sure a completion check fires no later than the first
// transfer's end. Adding a transfer only delays the others, so a check
// already due earlier is kept (it finds nothing done and looks again):
// this keeps stale events out of the queue when thousands of transfers
// share a link.
func (l *psLink) schedule() {
	if len(l.flows) == 0 {
		return
	}
	dt := max(0, (l.flows[0].finishV-l.v)*float64(len(l.flows))/l.rate)
	if l.armed && l.due <= l.s.now+dt {
		return
	}
	l.gen++
	gen := l.gen
	l.armed, l.due = true, l.s.now+dt
	l.s.after(dt, func() {
		if gen != l.gen {
			return
		}
		l.armed = false
		l.advance()
		var done []*flow
		// One byte of slack absorbs float rounding in v.
		for len(l.flows) > 0 && l.flows[0].finishV-l.v <= 1 {
			f := heap.Pop(&l.flows).(*flow)
			f.idx = -1
			done = append(done, f)
		}
		l.schedule()
		for _, f := range done {
			f.done()
		}
	})
}

type flowHeap []*flow

func (h flowHeap) Len() int           { return len(h) }
func (h flowHeap) Less(i, j int) bool { return h[i].finishV < h[j].finishV }
func (h flowHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx, h[j].idx = i, j
}
func (h *flowHeap) Push(x any) {
	f := x.(*flow)
	f.idx = len(*h)
	*h = append(*h, f)
}
func (h *flowHeap) Pop() any {
	old := *h
	f := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return f
}

// event is a callback due at t; seq orders events due at the same time by
// when they were scheduled, so a run is a function of its seed.
type event struct {
	t   float64
	seq uint64
	fn  func()
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].t != h[j].t {
		return h[i].t < h[j].t
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
