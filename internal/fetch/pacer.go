package fetch

import (
	"container/heap"
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
)

// Flights is the node-wide half of fetching, shared by every Layer of a
// node (create one with NewFlights, pass it with WithFlights; by default
// each Layer has its own):
//
//   - the flights in progress, by frame digest: a frame present in
//     several layers (content addressed: same digest, same bytes) that
//     more than one of them misses at the same moment is fetched once;
//   - the foreground activity of those Layers (reads waiting on the
//     network, mounts, file-system operations, prefetches), which every
//     Layer's background fill yields to through FillPolicy.Decide: the
//     link is shared by all layers, so one layer's fill slows another
//     layer's container start as much as its own (the fill's CPU and
//     disk work runs at idle priority: idleprio);
//   - the prefetch gate, which lets PrefetchPolicy.Inflight prefetch
//     requests of all layers out at a time, the earliest due first.
//
// A Layer's read path (layer.go) registers flights and notes activity;
// the fill (fill.go) and prefetch (prefetch.go) ask Flights when to go.
type Flights struct {
	fillPolicy     FillPolicy
	prefetchPolicy PrefetchPolicy

	mu sync.Mutex
	m  map[digest.Digest]*flight

	waiting     atomic.Int32 // foreground reads waiting on the network
	prefetching atomic.Int32 // Prefetch calls in progress
	lastWait    atomic.Int64 // unix ns of the latest foreground network wait
	lastMount   atomic.Int64 // unix ns of the latest yielding Layer's creation
	lastOp      atomic.Int64 // unix ns of the latest NoteActivity
	lastRead    atomic.Int64 // unix ns of the latest ReadChunk
	lastForced  atomic.Int64 // unix ns of the latest batch sent past MaxPause

	gate prefetchGate

	open openLayers // the layers served to peers (peers.go)

	recv recvBuffers // what finished flights received into, for the next
}

// FlightsOption configures Flights.
type FlightsOption func(*Flights)

// WithFillPolicy replaces DefaultFillPolicy.
func WithFillPolicy(p FillPolicy) FlightsOption { return func(f *Flights) { f.fillPolicy = p } }

// WithPrefetchPolicy replaces DefaultPrefetchPolicy.
func WithPrefetchPolicy(p PrefetchPolicy) FlightsOption {
	return func(f *Flights) { f.prefetchPolicy = p }
}

// NewFlights returns an empty set of shared flights.
func NewFlights(opts ...FlightsOption) *Flights {
	f := &Flights{
		fillPolicy:     DefaultFillPolicy(),
		prefetchPolicy: DefaultPrefetchPolicy(),
		m:              map[digest.Digest]*flight{},
	}
	for _, o := range opts {
		o(f)
	}
	f.gate.limit = max(f.prefetchPolicy.Inflight, 1)
	return f
}

func (f *Flights) noteWait()  { f.lastWait.Store(time.Now().UnixNano()) }
func (f *Flights) noteMount() { f.lastMount.Store(time.Now().UnixNano()) }
func (f *Flights) noteOp()    { f.lastOp.Store(time.Now().UnixNano()) }
func (f *Flights) noteRead()  { f.lastRead.Store(time.Now().UnixNano()) }

// LastActivity is when a Layer sharing f last served a file-system
// operation (Layer.NoteActivity); zero if none has.
func (f *Flights) LastActivity() time.Time {
	if n := f.lastOp.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// foreground returns what the fill policy decides on.
func (f *Flights) foreground() Foreground {
	at := func(v *atomic.Int64) time.Time {
		if n := v.Load(); n != 0 {
			return time.Unix(0, n)
		}
		return time.Time{}
	}
	fg := Foreground{
		Waiting:     int(f.waiting.Load()),
		Prefetching: int(f.prefetching.Load()),
		LastWait:    at(&f.lastWait),
		LastMount:   at(&f.lastMount),
		LastOp:      at(&f.lastOp),
		LastRead:    at(&f.lastRead),
		LastForced:  at(&f.lastForced),
	}
	return fg
}

// yieldFill waits until fill worker w may send its next batch
// (FillPolicy.Decide): node-wide foreground work goes first. note, when
// set, hears every decision's reason to hold, and FillSend once the batch
// may go.
func (f *Flights) yieldFill(ctx context.Context, w int, note func(FillHold)) error {
	held := time.Now()
	for {
		now := time.Now()
		fg := f.foreground()
		d := f.fillPolicy.Decide(now, fg, w, held)
		if note != nil {
			note(d.Hold)
		}
		if d.Send() && !d.Forced {
			return ctx.Err()
		}
		if d.Send() {
			// One forced batch per MaxPause node-wide: the first
			// worker to claim it sends, the others look again.
			var seen int64
			if !fg.LastForced.IsZero() {
				seen = fg.LastForced.UnixNano()
			}
			if f.lastForced.CompareAndSwap(seen, now.UnixNano()) {
				return ctx.Err()
			}
			continue
		}
		t := time.NewTimer(max(d.Until.Sub(now), time.Millisecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// prefetchGate lets limit prefetch requests out at a time,
// node-wide, the earliest due first.
type prefetchGate struct {
	mu       sync.Mutex
	limit    int
	inflight int
	waiters  gateWaiters
}

type gateWaiter struct {
	due   time.Time
	ready chan struct{}
	index int // in the heap; -1 once granted
}

type gateWaiters []*gateWaiter

func (h gateWaiters) Len() int           { return len(h) }
func (h gateWaiters) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h gateWaiters) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *gateWaiters) Push(x any) {
	w := x.(*gateWaiter)
	w.index = len(*h)
	*h = append(*h, w)
}
func (h *gateWaiters) Pop() any {
	old := *h
	w := old[len(old)-1]
	*h = old[:len(old)-1]
	w.index = -1
	return w
}

func (g *prefetchGate) acquire(ctx context.Context, due time.Time) error {
	g.mu.Lock()
	if g.inflight < g.limit && len(g.waiters) == 0 {
		g.inflight++
		g.mu.Unlock()
		return nil
	}
	w := &gateWaiter{due: due, ready: make(chan struct{})}
	heap.Push(&g.waiters, w)
	g.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
		g.mu.Lock()
		granted := w.index < 0
		if !granted {
			heap.Remove(&g.waiters, w.index)
		}
		g.mu.Unlock()
		if granted {
			g.release()
		}
		return ctx.Err()
	}
}

// release hands the slot to the earliest waiter, if any.
func (g *prefetchGate) release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.waiters) > 0 {
		close(heap.Pop(&g.waiters).(*gateWaiter).ready)
		return
	}
	g.inflight--
}
