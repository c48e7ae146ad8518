package fetch

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/chunkcache"
)

// StartFill fetches every chunk not yet cached in the background, in large
// coalesced requests, a few in parallel. Unless WithFillYield(false), it
// yields to foreground work of every Layer sharing its Flights, as their
// FillPolicy decides: no batch while a foreground read waits on the
// network, shortly after a mount or during a container start, one batch
// at a time while reads arrive, and one anyway after a long pause. It
// returns at once; the fill stops at ctx's end, at Close, when the cache
// is full, or after repeated registry failures. Calling it again does
// nothing.
func (l *Layer) StartFill(ctx context.Context) {
	if !l.o.fill || !l.fillStarted.CompareAndSwap(false, true) {
		return
	}
	l.setFill(FillRunning, FillSend)
	if !l.goBackground(func() { l.fill(ctx) }) {
		l.setFill(FillStopped, FillSend)
	}
}

// FillState is where a layer's background fill stands.
type FillState int32

const (
	FillPending   FillState = iota // not started yet (StartFill)
	FillRunning                    // batches go out
	FillHeld                       // the fill waits for foreground work (FillStatus.Hold)
	FillComplete                   // every chunk of the layer is in the node cache
	FillCacheFull                  // stopped: the chunk cache is full
	FillAborted                    // stopped after repeated registry failures
	FillStopped                    // stopped with the layer or the daemon
	FillOff                        // the layer has no background fill (WithFill(false))
)

var fillStateNames = [...]string{"pending", "running", "held", "complete", "cache full", "aborted", "stopped", "off"}

func (s FillState) String() string { return fillStateNames[s] }

// MarshalText makes the state its name in JSON (the daemon's /status).
func (s FillState) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (s *FillState) UnmarshalText(b []byte) error { return unmarshalName(s, fillStateNames[:], b) }

// MarshalText makes the reason its name in JSON.
func (h FillHold) MarshalText() ([]byte, error) { return []byte(h.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (h *FillHold) UnmarshalText(b []byte) error { return unmarshalName(h, fillHoldNames[:], b) }

// unmarshalName sets *v to the index of name b in names.
func unmarshalName[T ~int | ~int32](v *T, names []string, b []byte) error {
	i := slices.Index(names, string(b))
	if i < 0 {
		return fmt.Errorf("unknown name %q (one of %q)", b, names)
	}
	*v = T(i)
	return nil
}

// FillStatus is what a layer's fill is doing, for an operator asking why
// a layer is not fully fetched yet.
type FillStatus struct {
	State FillState `json:"state"`
	// Hold is why a held fill waits: the reason its first worker, the
	// one that decides whether the fill sends at all, is held for.
	Hold  FillHold  `json:"hold,omitempty"`
	Since time.Time `json:"since"` // when State (and Hold) last changed
}

// FillStatus returns where the layer's fill stands. A layer whose chunks
// are all cached is complete whatever its fill did, as are the layers of
// a warm cache.
func (l *Layer) FillStatus() FillStatus {
	l.fillMu.Lock()
	st := l.fillStatus
	l.fillMu.Unlock()
	if !l.o.fill && st.State == FillPending {
		st.State = FillOff
	}
	if st.State != FillComplete {
		if cached, total := l.Progress(); cached >= total {
			st = FillStatus{State: FillComplete, Since: st.Since}
		}
	}
	return st
}

// setFill records a change of the fill's state; Since moves only when the
// state or the reason changes.
func (l *Layer) setFill(s FillState, h FillHold) {
	l.fillMu.Lock()
	defer l.fillMu.Unlock()
	if l.fillStatus.State != s || l.fillStatus.Hold != h {
		l.fillStatus = FillStatus{State: s, Hold: h, Since: time.Now()}
	}
}

func (l *Layer) fill(parent context.Context) {
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	stop := context.AfterFunc(l.ctx, cancel)
	defer stop()
	logger := log.G(ctx).WithField("layer", l.label)

	batches := l.fillPlan()
	start := time.Now()
	var (
		issued   atomic.Int64
		failures atomic.Int32
		full     atomic.Bool
		wg       sync.WaitGroup
		work     = make(chan []int)
	)
	for w := range l.o.fillParallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				// The first worker decides whether the fill sends at
				// all (the others also wait for calm), so its holds are
				// the layer's.
				var held func(FillHold)
				if w == 0 {
					held = func(h FillHold) {
						if h == FillSend {
							l.setFill(FillRunning, FillSend)
						} else {
							l.setFill(FillHeld, h)
						}
					}
				}
				if l.o.fillYield && l.flights.yieldFill(ctx, w, held) != nil {
					return
				}
				b, ok := <-work
				if !ok {
					return
				}
				if ctx.Err() != nil || full.Load() || failures.Load() >= fillAbortAfter {
					continue
				}
				err := l.fillBatch(ctx, b, start, &issued)
				switch {
				case err == nil:
					failures.Store(0)
				case errors.Is(err, chunkcache.ErrFull):
					full.Store(true)
				case ctx.Err() == nil:
					failures.Add(1)
					logger.WithError(err).Warn("background fill batch failed")
				}
			}
		}()
	}
feed:
	for _, b := range batches {
		select {
		case work <- b:
		case <-ctx.Done():
			break feed
		}
	}
	close(work)
	wg.Wait()

	cached, total := l.Progress()
	entry := logger.WithField("cached", cached).WithField("total", total).WithField("elapsed", time.Since(start).Round(time.Millisecond))
	switch {
	case ctx.Err() != nil:
		l.setFill(FillStopped, FillSend)
		entry.Debug("background fill cancelled")
	case full.Load():
		l.setFill(FillCacheFull, FillSend)
		entry.Warn("background fill stopped: chunk cache full")
	case failures.Load() >= fillAbortAfter:
		l.setFill(FillAborted, FillSend)
		entry.Error("background fill aborted after repeated registry failures; reads continue on demand")
	default:
		l.setFill(FillComplete, FillSend)
		entry.Info("background fill complete")
	}
}

// fillSmall fetches the chunks of a small layer (FillPolicy.SmallLayer)
// that are neither cached nor in flight, at its first foreground miss and
// without yielding: the batches go out at once, in parallel, and the
// reads that miss meanwhile wait on them instead of starting a round trip
// each. A failure only leaves the rest to the reads and the fill.
func (l *Layer) fillSmall(ctx context.Context) {
	var g errgroup.Group
	for _, b := range l.fillPlan() {
		g.Go(func() error { return l.fetchSpans(ctx, b, "fill", nil) })
	}
	if err := g.Wait(); err != nil && l.ctx.Err() == nil {
		log.G(ctx).WithError(err).WithField("layer", l.label).Warn("fetching a small layer whole at its first miss failed; reads fetch on demand")
	}
}

// fillPlan groups the chunks not cached yet into batches of span indexes in
// blob order.
func (l *Layer) fillPlan() [][]int {
	var todo []int
	for j := range l.spans {
		if l.canonical(j) != j {
			continue
		}
		l.mu.Lock()
		cached := l.cached[j]
		l.mu.Unlock()
		if cached {
			continue
		}
		if l.cache.Contains(l.chunk(j).Digest) {
			// Cached meanwhile, possibly by another layer sharing it.
			l.markCached(j)
			continue
		}
		todo = append(todo, j)
	}
	return l.coalesce(todo, fillGap, l.o.fillBatch)
}

// coalesce groups spans (indexes in blob order) into requests: a request
// ends at a hole larger than maxGap or before it would span more than
// maxBytes.
func (l *Layer) coalesce(spans []int, maxGap, maxBytes int64) [][]int {
	var batches [][]int
	var cur []int
	var curStart, curEnd int64
	for _, j := range spans {
		s := l.spans[j]
		if len(cur) > 0 && (s.off-curEnd > maxGap || s.off+s.csize-curStart > maxBytes) {
			batches = append(batches, cur)
			cur = nil
		}
		if len(cur) == 0 {
			curStart = s.off
		}
		cur = append(cur, j)
		curEnd = s.off + s.csize
	}
	if len(cur) > 0 {
		batches = append(batches, cur)
	}
	return batches
}

// fillBatch fetches one batch, paced to the fill rate.
func (l *Layer) fillBatch(ctx context.Context, idx []int, start time.Time, issued *atomic.Int64) error {
	l.mu.Lock()
	if l.blob.RangeIgnored() && l.blob.Size() <= l.o.wholeBlobMax {
		// Every request streams the whole blob: window-by-window would
		// cost the blob size per batch. Take everything at once.
		idx = idx[:0:0]
		for j := range l.spans {
			if l.canonical(j) == j {
				idx = append(idx, j)
			}
		}
	}
	l.mu.Unlock()
	var paced func(n int64)
	if rate := l.o.fillRate; rate > 0 {
		paced = func(n int64) {
			due := start.Add(time.Duration(float64(issued.Add(n)-n) / float64(rate) * float64(time.Second)))
			if d := time.Until(due); d > 0 {
				t := time.NewTimer(d)
				select {
				case <-ctx.Done():
					t.Stop()
				case <-t.C:
				}
			}
		}
	}
	return l.fetchSpans(ctx, idx, "fill", paced)
}
