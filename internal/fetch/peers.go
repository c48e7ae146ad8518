package fetch

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/peer"
	"github.com/envsnap/envsnap/layerfmt"
)

// The peer tier (internal/peer) sits between the node cache and the
// registry: a flight's frames go to the members that own their stripes,
// each hedged with the registry, instead of to the registry directly.
// This file is both of its ends in the fetcher: the requester side
// (fetchViaPeers, called from fetchFlight) and the owner side (Flights
// implements peer.Source over the node's open layers).

// WithPeers sends the layer's fetches through the peer tier c.
func WithPeers(c *peer.Client) LayerOption { return func(o *layerOptions) { o.peers = c } }

// servingPeerKey marks a fetch made to answer a peer: it goes to the
// registry, never to another peer, whatever this node thinks of the
// stripe's owner (two nodes whose member lists differ for a moment must
// not send a request back and forth).
type servingPeerKey struct{}

func servingPeer(ctx context.Context) bool { return ctx.Value(servingPeerKey{}) != nil }

// openLayers indexes a node's open Layers by blob digest: the layers the
// node knows, and so the only ones it serves to peers. It also tells
// owners waiting for a frame that frames landed in the cache.
type openLayers struct {
	mu sync.Mutex
	m  map[digest.Digest][]*Layer
	// landed is closed (and replaced) whenever a stripe fetched from the
	// registry on a flight's behalf is in the cache. A flight spanning
	// stripes of several owners completes only when every owner has
	// answered; an owner serving its stripe must not wait for that, or
	// two nodes whose flights each wait for the other's stripe would
	// wait for each other until the peer timeout.
	landed chan struct{}
}

// landing returns the channel the next landing closes.
func (o *openLayers) landing() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.landed == nil {
		o.landed = make(chan struct{})
	}
	return o.landed
}

func (o *openLayers) land() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.landed != nil {
		close(o.landed)
		o.landed = nil
	}
}

func (o *openLayers) add(l *Layer) {
	d := l.blob.Descriptor().Digest
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		o.m = map[digest.Digest][]*Layer{}
	}
	o.m[d] = append(o.m[d], l)
}

func (o *openLayers) remove(l *Layer) {
	d := l.blob.Descriptor().Digest
	o.mu.Lock()
	defer o.mu.Unlock()
	ls := o.m[d]
	for i, x := range ls {
		if x == l {
			ls = append(ls[:i], ls[i+1:]...)
			break
		}
	}
	if len(ls) == 0 {
		delete(o.m, d)
	} else {
		o.m[d] = ls
	}
}

func (o *openLayers) get(d digest.Digest) *Layer {
	o.mu.Lock()
	defer o.mu.Unlock()
	if ls := o.m[d]; len(ls) > 0 {
		return ls[0]
	}
	return nil
}

var _ peer.Source = (*Flights)(nil)

// Frames implements peer.Source: frames of an open layer of this node,
// from the node cache or, once for every asker, from the registry.
func (f *Flights) Frames(ctx context.Context, layer digest.Digest, frames []peer.Frame) (func() ([][]byte, error), error) {
	l := f.open.get(layer)
	if l == nil {
		return nil, fmt.Errorf("layer %s is not open on this node: %w", layer, errdefs.ErrNotFound)
	}
	idx := make([]int, len(frames))
	for i, fr := range frames {
		j := l.find(layerfmt.Chunk{Offset: fr.Offset, CompressedSize: fr.Size})
		if j < 0 || l.chunk(j).Digest != fr.Digest {
			return nil, fmt.Errorf("no frame %s at %d+%d in layer %s: %w", fr.Digest, fr.Offset, fr.Size, l.label, errdefs.ErrNotFound)
		}
		idx[i] = l.canonical(j)
	}
	return func() ([][]byte, error) {
		return l.serveFrames(context.WithValue(ctx, servingPeerKey{}, true), frames, idx)
	}, nil
}

// serveFrames returns the compressed, verified bytes of frames (spans
// idx), fetching those not in the cache from the registry in one request
// (they are one stripe of a requester's flight: contiguous, or nearly).
func (l *Layer) serveFrames(ctx context.Context, frames []peer.Frame, idx []int) ([][]byte, error) {
	out := make([][]byte, len(frames))
	var missing []int
	for i, fr := range frames {
		if b, ok := l.cache.Get(fr.Digest); ok {
			out[i] = b
			continue
		}
		missing = append(missing, i)
	}
	if len(missing) == 0 {
		return out, nil
	}
	// fetchSpans wants distinct spans in blob order; a frame that
	// repeats an earlier one of the layer maps to that earlier span.
	spans := make([]int, 0, len(missing))
	for _, i := range missing {
		spans = append(spans, idx[i])
	}
	slices.Sort(spans)
	spans = slices.Compact(spans)
	if err := l.fetchSpans(ctx, spans, "peer", nil); err != nil {
		return nil, err
	}
	for _, i := range missing {
		b, err := l.awaitFrame(ctx, frames[i].Digest, idx[i])
		if err != nil {
			return nil, err
		}
		out[i] = b
	}
	return out, nil
}

// awaitFrame returns frame d (span j) from the cache, the flight fetching
// it, or a fetch of its own.
func (l *Layer) awaitFrame(ctx context.Context, d digest.Digest, j int) ([]byte, error) {
	alone := func() ([]byte, error) {
		b, err := l.registryFrames(ctx, []peer.Frame{{Offset: l.spans[j].off, Size: l.spans[j].csize, Digest: d}}, "peer")
		if err != nil {
			return nil, err
		}
		return b[0], nil
	}
	for attempt := 0; ; attempt++ {
		landed := l.flights.open.landing()
		if b, ok := l.cache.Get(d); ok {
			return b, nil
		}
		l.flights.mu.Lock()
		f := l.flights.m[d]
		if f != nil {
			f.hold()
		}
		l.flights.mu.Unlock()
		if f != nil && f.peerLayer != "" && servingPeer(ctx) && l.o.peers != nil && !l.o.peers.Owns(f.peerLayer, f.arrival(d).off) {
			// This node's own read of the frame is asking another
			// member, possibly the very requester (each failing over
			// from a bad owner to the other, their views of the
			// members differing), whose answer may wait on this one:
			// two owners that keep reporting progress to each other
			// would wait until the read timeout. A peer's request
			// goes to the registry, never to another peer. (A stripe
			// this node owns lands in the cache as soon as the
			// registry sent it: waiting for that is safe.)
			f.drop()
			return alone()
		}
		if f == nil {
			if attempt > 0 {
				// Fetched, but the cache could not keep it (full):
				// fetch it for this request alone.
				return alone()
			}
			if err := l.fetchSpans(ctx, []int{j}, "peer", nil); err != nil {
				return nil, err
			}
			continue
		}
		f.waited()
		a := f.arrival(d)
		select {
		case <-a.done:
			if a.err == nil {
				// A copy: the flight's buffer goes to the next flight
				// once its readers are done, and this one is answered
				// after we return.
				b := bytes.Clone(a.data)
				f.drop()
				return b, nil
			}
			f.drop()
			if attempt > 0 {
				return nil, a.err
			}
		case <-landed:
			f.drop()
			attempt-- // not a failed try: look again
		case <-ctx.Done():
			f.drop()
			return nil, fmt.Errorf("wait for frame %s of %s: %w", d, l.label, ctx.Err())
		}
	}
}

// fetchViaPeers completes f with chunks from their owners, or from the
// registry where this node owns them, an owner is slow or fails.
func (l *Layer) fetchViaPeers(ctx context.Context, f *flight, chunks []layerfmt.Chunk, kind string, start time.Time) {
	frames := make([]peer.Frame, len(chunks))
	for i, c := range chunks {
		frames[i] = peer.Frame{Offset: c.Offset, Size: c.CompressedSize, Digest: c.Digest}
	}
	data, err := l.o.peers.Fetch(ctx, l.blob.Descriptor().Digest, frames, func(ctx context.Context, fs []peer.Frame) ([][]byte, error) {
		data, err := l.registryFrames(ctx, fs, kind)
		if err == nil {
			l.keepLanded(ctx, fs, data)
		}
		return data, err
	})
	if m := l.o.metrics; m != nil {
		m.latency.WithLabelValues(kind).Observe(time.Since(start).Seconds())
	}
	for i, c := range chunks {
		if err != nil {
			f.arrivals[c.Digest].complete(nil, err)
			continue
		}
		// Verified by whoever delivered them: the peer client or
		// registryFrames.
		f.arrivals[c.Digest].complete(data[i], nil)
	}
}

// keepLanded caches frames fetched from the registry as soon as they
// arrive, before the rest of their flight, and tells waiting owners.
func (l *Layer) keepLanded(ctx context.Context, frames []peer.Frame, data [][]byte) {
	for i, fr := range frames {
		if err := l.cache.PutVerified(fr.Digest, data[i]); err != nil {
			l.logPutError(ctx, err)
			continue
		}
		if j := l.find(layerfmt.Chunk{Offset: fr.Offset, CompressedSize: fr.Size}); j >= 0 {
			l.markCached(j)
		}
	}
	l.flights.open.land()
}

// registryFrames fetches frames (sorted by offset, of this layer) from the
// registry in one range request and verifies each.
func (l *Layer) registryFrames(ctx context.Context, frames []peer.Frame, kind string) ([][]byte, error) {
	off := frames[0].Offset
	last := frames[len(frames)-1]
	data, err := l.blob.ReadRange(ctx, off, last.Offset+last.Size-off)
	if err != nil {
		return nil, err
	}
	m := l.o.metrics
	if m != nil {
		m.registryBytes.WithLabelValues(l.label).Add(float64(len(data)))
	}
	out := make([][]byte, len(frames))
	for i, fr := range frames {
		b := data[fr.Offset-off : fr.Offset-off+fr.Size]
		if got := fr.Digest.Algorithm().FromBytes(b); got != fr.Digest {
			err := fmt.Errorf("%s fetch of frame at offset %d of %s: registry bytes have digest %s, want %s: %w",
				kind, fr.Offset, l.label, got, fr.Digest, layerfmt.ErrDigestMismatch)
			log.G(ctx).WithField("digest", fr.Digest).WithField("layer", l.label).WithError(err).Error("chunk digest mismatch")
			if m != nil {
				m.mismatches.Inc()
			}
			return nil, err
		}
		out[i] = b
	}
	return out, nil
}
