package fetch

import (
	"context"
	"sort"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/layerfmt"
)

// Prefetch fetches the listed frames (layerfmt.AnnotationPrefetch) that are
// not cached yet, at foreground priority: a few large requests instead of
// one round trip per first read. Each window of the list is sorted by
// offset and coalesced; each request is due when its first frame was first
// read in the recorded run, after this layer's creation, and requests of
// every layer sharing the Flights go out in that order, at most
// PrefetchPolicy.Inflight at a time, so the frames an image needs first arrive first whichever of
// its layers holds them. Reads of frames being prefetched wait for them.
// It returns when every request has finished, or ctx ends; failures are
// logged, not returned (reads fetch on demand as before).
func (l *Layer) Prefetch(ctx context.Context, entries []layerfmt.PrefetchEntry) {
	if !l.enter() {
		return
	}
	defer l.wg.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(l.ctx, cancel)()
	l.flights.prefetching.Add(1)
	defer l.flights.prefetching.Add(-1)
	p := l.flights.prefetchPolicy
	start := time.Now()

	type batch struct {
		spans []int
		due   time.Time
	}
	var batches []batch
	due := map[int]time.Time{} // span -> when its frame was first read
	var window []int
	var windowBytes int64
	flush := func() {
		sort.Slice(window, func(a, b int) bool { return l.spans[window[a]].off < l.spans[window[b]].off })
		for _, spans := range l.coalesce(window, l.o.maxGap, p.Batch) {
			b := batch{spans: spans, due: due[spans[0]]}
			for _, j := range spans[1:] {
				if due[j].Before(b.due) {
					b.due = due[j]
				}
			}
			batches = append(batches, b)
		}
		window, windowBytes = nil, 0
	}
	l.mu.Lock()
	for _, e := range entries {
		if e.Frame < 0 || e.Frame >= l.toc.NumFrames() {
			continue
		}
		fr := l.toc.Frame(e.Frame)
		j := l.find(layerfmt.Chunk{Offset: fr.Offset, CompressedSize: fr.CompressedSize})
		if j < 0 {
			continue
		}
		j = l.canonical(j)
		if _, seen := due[j]; seen || l.cached[j] {
			continue
		}
		due[j] = l.created.Add(time.Duration(e.AtMS) * time.Millisecond)
		window = append(window, j)
		windowBytes += l.spans[j].csize
		if windowBytes >= p.Window {
			flush()
		}
	}
	l.mu.Unlock()
	flush()
	sort.SliceStable(batches, func(a, b int) bool { return batches[a].due.Before(batches[b].due) })

	var fetched atomic.Int64
	var failed atomic.Int32
	var g errgroup.Group
	g.SetLimit(p.Parallel)
	for _, b := range batches {
		if ctx.Err() != nil {
			break
		}
		g.Go(func() error {
			if d := time.Until(b.due.Add(-p.Lead)); d > 0 {
				t := time.NewTimer(d)
				select {
				case <-ctx.Done():
				case <-t.C:
				}
				t.Stop()
			}
			if ctx.Err() != nil || l.flights.gate.acquire(ctx, b.due) != nil {
				return nil
			}
			err := l.fetchSpans(ctx, b.spans, "prefetch", func(n int64) { fetched.Add(n) })
			l.flights.gate.release()
			if err != nil && ctx.Err() == nil {
				failed.Add(1)
				log.G(ctx).WithError(err).WithField("layer", l.label).Debug("prefetch request failed; reads fetch on demand")
			}
			return nil
		})
	}
	g.Wait()
	log.G(ctx).WithField("layer", l.label).WithField("frames", len(due)).WithField("requests", len(batches)).
		WithField("bytes", fetched.Load()).WithField("failed", failed.Load()).
		WithField("elapsed", time.Since(start).Round(time.Millisecond)).Info("prefetched the layer's listed frames")
}
