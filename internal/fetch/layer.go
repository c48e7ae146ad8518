package fetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/idleprio"
	"github.com/envsnap/envsnap/layerfmt"
)

type span struct {
	off, csize int64
	entry, k   int32
}

// Layer serves verified, decompressed chunks of one lazy layer: node cache
// first, then the registry. It is safe for concurrent use.
type Layer struct {
	blob   *BlobReader
	toc    *layerfmt.TOC
	cache  *chunkcache.Cache
	frames *FrameCache
	o      layerOptions
	label  string // layer digest, the metrics label
	owner  string // pin owner, unique per Layer

	spans []span // sorted by offset, one per distinct offset
	// canon maps a span to the first span with the same digest (identical
	// chunks within one layer are fetched and counted once); nil when the
	// layer has no duplicates.
	canon      []int32
	totalBytes int64

	cachedBytes atomic.Int64
	fillStarted atomic.Bool
	fillMu      sync.Mutex
	fillStatus  FillStatus
	prefetched  atomic.Int32 // last span index handed to chunkcache.Prefetch
	lastHit     atomic.Int32 // span index of the last read from the cache
	lastFullLog atomic.Int64
	envs        atomic.Int32 // environments prepared over the layer (NoteEnvironment)
	seq         seqTable
	ahead       aheadTable

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	closed  bool
	small   bool   // fillSmall started
	cached  []bool // by canonical span index
	flights *Flights

	// The footprint: frames in the order foreground reads first asked for
	// them, and when (Footprint).
	created   time.Time
	fpMu      sync.Mutex
	fpSeen    []atomic.Bool // by frame index; read without fpMu on every ReadChunk
	footprint []layerfmt.PrefetchEntry
}

var layerSeq atomic.Uint64

// NewLayer prepares serving the layer read by blob and described by toc
// (verified by the caller against the manifest's TOC digest). It pins all
// the layer's chunks in cache until Close.
func NewLayer(blob *BlobReader, toc *layerfmt.TOC, cache *chunkcache.Cache, opts ...LayerOption) *Layer {
	o := layerOptions{
		readTimeout:  DefaultReadTimeout,
		fill:         true,
		readAhead:    DefaultReadAhead,
		seqReadAhead: DefaultSequentialReadAhead,
		decodeAhead:  DefaultDecodeAhead,
		maxGap:       DefaultMaxGap,
		fillBatch:    DefaultFillBatch,
		fillParallel: DefaultFillParallel,
		wholeBlobMax: DefaultWholeBlobMax,
		frameCache:   DefaultFrameCache,
		fillYield:    true,
	}
	for _, opt := range opts {
		opt(&o)
	}
	if o.flights == nil {
		o.flights = NewFlights()
	}
	if o.sharedFrames == nil {
		o.sharedFrames = NewFrameCache(o.frameCache)
	}
	if o.fillYield {
		// A layer is mounted because a container is about to start on it:
		// that start is foreground work the fill must not slow down.
		o.flights.noteMount()
		o.flights.noteRead()
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &Layer{
		blob:    blob,
		toc:     toc,
		cache:   cache,
		frames:  o.sharedFrames,
		o:       o,
		label:   blob.Descriptor().Digest.String(),
		ctx:     ctx,
		cancel:  cancel,
		flights: o.flights,
	}
	l.owner = fmt.Sprintf("%s#%d", l.label, layerSeq.Add(1))
	l.fpSeen = make([]atomic.Bool, toc.NumFrames())
	l.created = time.Now()
	l.fillStatus.Since = l.created

	for i := 0; i < toc.Len(); i++ {
		for k := range toc.NumChunks(i) {
			c := toc.Chunk(i, k)
			l.spans = append(l.spans, span{off: c.Offset, csize: c.CompressedSize, entry: int32(i), k: int32(k)})
		}
	}
	sort.Slice(l.spans, func(a, b int) bool { return l.spans[a].off < l.spans[b].off })
	l.spans = compactSpans(l.spans)

	first := make(map[digest.Digest]int32, len(l.spans))
	pins := make([]digest.Digest, 0, len(l.spans))
	var canon []int32
	for j := range l.spans {
		d := l.chunk(j).Digest
		if f, dup := first[d]; dup {
			if canon == nil {
				canon = make([]int32, len(l.spans))
				for x := range canon {
					canon[x] = int32(x)
				}
			}
			canon[j] = f
			continue
		}
		first[d] = int32(j)
		pins = append(pins, d)
		l.totalBytes += l.spans[j].csize
	}
	l.canon = canon
	l.cached = make([]bool, len(l.spans))
	cache.Pin(l.owner, pins)
	o.flights.open.add(l)
	for _, d := range pins {
		if cache.Contains(d) {
			j := first[d]
			l.cached[j] = true
			l.cachedBytes.Add(l.spans[j].csize)
		}
	}
	if m := o.metrics; m != nil {
		m.fillTotal.WithLabelValues(l.label).Set(float64(l.totalBytes))
		m.fillCached.WithLabelValues(l.label).Set(float64(l.cachedBytes.Load()))
	}
	return l
}

func compactSpans(s []span) []span {
	out := s[:0]
	for _, x := range s {
		if len(out) > 0 && out[len(out)-1].off == x.off {
			continue // hard links share their target's chunks
		}
		out = append(out, x)
	}
	return out
}

func (l *Layer) chunk(j int) layerfmt.Chunk {
	s := l.spans[j]
	return l.toc.Chunk(int(s.entry), int(s.k))
}

func (l *Layer) canonical(j int) int {
	if l.canon == nil {
		return j
	}
	return int(l.canon[j])
}

// find returns the span index of c, or -1 if c is not a chunk of this layer.
func (l *Layer) find(c layerfmt.Chunk) int {
	j := sort.Search(len(l.spans), func(x int) bool { return l.spans[x].off >= c.Offset })
	if j < len(l.spans) && l.spans[j].off == c.Offset && l.spans[j].csize == c.CompressedSize {
		return j
	}
	return -1
}

// flight is one registry request for a set of chunks; readers of any of
// them wait for it instead of sending their own (singleflight by digest).
// Each chunk is released to its readers as soon as its bytes are in and
// verified, while the rest of the response is still arriving: a reader
// does not wait for the read-ahead behind its chunk, and decompresses its
// frame on one core while the next frames arrive on the other.
type flight struct {
	lastErr  atomic.Pointer[error]      // latest registry error while retrying
	arrivals map[digest.Digest]*arrival // fixed when the flight is registered
	putErr   error                      // set before run returns
	// joined are the reads of other layers waiting for this flight
	// (Flights shared node-wide): the frames it caches count in their
	// layers' progress too. Guarded by Flights.mu.
	joined []joinedRead
	// peerLayer is the blob whose frames the flight asks the peer tier
	// for; empty when it goes to the registry (fixed when it is
	// registered). An owner answering a peer does not wait for such a
	// flight when another member owns the frame's stripe (awaitFrame).
	peerLayer digest.Digest

	// holds counts who may still read the arrivals' bytes: the flight's
	// own run, and every reader that joined it (join, awaitFrame) until
	// it is done with them. The last drop gives bufs, the buffers the
	// responses were received into, to recv for the next flights.
	holds atomic.Int32
	bufs  [][]byte // appended by the flight's goroutine alone
	recv  *recvBuffers

	// job runs a background flight (the fill's) at idle priority; a
	// reader that joins it boosts it (waited), as it is then on a
	// foreground read's path. nil for a flight a read or a prefetch
	// started. Fixed when the flight is registered.
	job *idleprio.Job
}

// waited notes that a foreground read waits on f: a background flight
// runs at the daemon's priority from then on.
func (f *flight) waited() { f.job.Boost() }

// hold notes one more reader of f's bytes; Flights.mu must be held and f
// registered (after run unregisters it, nobody can join it any more).
func (f *flight) hold() { f.holds.Add(1) }

// drop ends a hold of f; the last one frees its receive buffers.
func (f *flight) drop() {
	switch n := f.holds.Add(-1); {
	case n < 0:
		panic("fetch: flight dropped more often than it was held")
	case n == 0 && f.recv != nil:
		for _, b := range f.bufs {
			f.recv.put(b)
		}
		f.bufs = nil
	}
}

// receive is the flight's allocator of receive buffers (readRange).
func (f *flight) receive(n int64) []byte {
	b := f.recv.get(n)
	f.bufs = append(f.bufs, b)
	return b
}

// joinedRead is span j of layer l, whose frame is d.
type joinedRead struct {
	l *Layer
	j int
	d digest.Digest
}

// arrival is one chunk of a flight: data or err are set, then done closed,
// by the flight's goroutine alone.
type arrival struct {
	off  int64 // the chunk's offset in the flight's blob
	done chan struct{}
	data []byte
	err  error
	sent bool // done is closed; read and written by the flight's goroutine only
}

func (f *flight) arrival(d digest.Digest) *arrival {
	if a, ok := f.arrivals[d]; ok {
		return a
	}
	a := &arrival{done: make(chan struct{}), err: fmt.Errorf("chunk %s missing from its fetch: %w", d, errdefs.ErrUnknown)}
	close(a.done)
	return a
}

// failed says whether f has already released d's readers with an error.
// The flight stays registered until its other chunks are handled; a read
// arriving in that window fetches again instead of inheriting a failure
// it did not wait for (and a reader retrying a timed-out fetch does not
// spin on the same dead flight).
func (f *flight) failed(d digest.Digest) bool {
	a, ok := f.arrivals[d]
	if !ok {
		return false
	}
	select {
	case <-a.done:
		return a.err != nil // written before done was closed
	default:
		return false
	}
}

// complete releases a's readers with data or err (once).
func (a *arrival) complete(data []byte, err error) {
	if a.sent {
		return
	}
	a.sent = true
	a.data, a.err = data, err
	close(a.done)
}

var errClosed = fmt.Errorf("layer closed: %w", errdefs.ErrUnavailable)

// ReadChunk returns the decompressed bytes of chunk c, verified against its
// digest. It is what the FUSE filesystem calls on a read. A miss fetches c
// together with following uncached chunks in one request (read-ahead).
// Concurrent reads of chunks of one frame decode it once. The returned
// slice is shared with other readers (it is a window of the decoded frame,
// kept in the FrameCache): callers must not modify it, and must call
// release, once, when they no longer read it; the frame's memory is reused
// after that.
func (l *Layer) ReadChunk(ctx context.Context, c layerfmt.Chunk) (data []byte, release func(), err error) {
	l.flights.noteRead()
	l.noteFootprint(c.FrameIndex)
	if l.o.seqReadAhead > 0 || l.o.decodeAhead > 0 {
		if j := l.find(c); j >= 0 {
			l.sequential(j)
			l.decodeAhead(j)
		}
	}
	if fr, ok := l.frames.get(c.Digest); ok {
		return window(c, fr)
	}
	ctx, cancel := context.WithTimeout(ctx, l.o.readTimeout)
	defer cancel()
	for {
		fr, dec, mine := l.frames.claim(c.Digest)
		if fr != nil {
			// Verified when it was decoded.
			return window(c, fr)
		}
		if mine {
			fr, err := l.readFrame(ctx, c)
			l.frames.finish(c.Digest, dec, fr, err)
			if err != nil {
				return nil, nil, err
			}
			return window(c, fr)
		}
		select {
		case <-dec.done:
		case <-ctx.Done():
			l.frames.abandon(dec)
			return nil, nil, fmt.Errorf("read chunk %s at offset %d of %s: wait for its decoding: %w", c.Digest, c.Offset, l.label, ctx.Err())
		}
		if dec.err == nil {
			return window(c, dec.frame)
		}
		// The reader decoding it ran out of time (or its layer closed,
		// or it was decoding ahead and failed: errAheadFailed); with
		// time left, this one tries itself.
		if (errors.Is(dec.err, context.DeadlineExceeded) || errors.Is(dec.err, context.Canceled) || errors.Is(dec.err, errClosed)) &&
			ctx.Err() == nil && l.ctx.Err() == nil {
			continue
		}
		return nil, nil, dec.err
	}
}

// window returns chunk c's bytes in its decoded frame fr, which the caller
// holds, capped so that an append by the caller cannot write into the
// frame, and the release of fr.
func window(c layerfmt.Chunk, fr *frame) ([]byte, func(), error) {
	frame := fr.b
	if int64(len(frame)) != c.FrameSize || c.FrameOffset < 0 || c.Size <= 0 || c.FrameOffset+c.Size > c.FrameSize {
		fr.release()
		return nil, nil, fmt.Errorf("chunk at %d: %d+%d bytes of a %d-byte frame (decoded %d): %w",
			c.Offset, c.FrameOffset, c.Size, c.FrameSize, len(frame), layerfmt.ErrBadTOC)
	}
	var once sync.Once
	return frame[c.FrameOffset : c.FrameOffset+c.Size : c.FrameOffset+c.Size], func() { once.Do(fr.release) }, nil
}

// decode decodes c's frame from its verified compressed bytes b into a
// buffer of the frame cache, held once by the caller.
func (l *Layer) decode(c layerfmt.Chunk, b []byte) (*frame, error) {
	fr := l.frames.buffer(c)
	out, err := layerfmt.DecodeVerifiedFrame(c, b, fr.b)
	if err != nil {
		fr.release()
		return nil, err
	}
	fr.adopt(out)
	return fr, nil
}

// readFrame returns c's decoded frame from the node cache or the registry,
// held once by the caller.
func (l *Layer) readFrame(ctx context.Context, c layerfmt.Chunk) (*frame, error) {
	if b, ok := l.cache.Get(c.Digest); ok {
		// Get verified b against c.Digest: decode without hashing again.
		fr, err := l.decode(c, b)
		if err != nil {
			return nil, fmt.Errorf("decode cached chunk %s at offset %d: %w", c.Digest, c.Offset, err)
		}
		if j := l.find(c); j >= 0 {
			l.markCached(j)
			l.prefetchAfter(j)
		}
		if m := l.o.metrics; m != nil {
			m.cacheBytes.WithLabelValues(l.label).Add(float64(len(b)))
		}
		return fr, nil
	}

	l.flights.waiting.Add(1)
	waitStart := time.Now()
	defer func() {
		l.flights.waiting.Add(-1)
		l.flights.noteWait()
		if m := l.o.metrics; m != nil {
			m.readWait.Observe(time.Since(waitStart).Seconds())
		}
	}()
	for {
		f := l.join(ctx, c)
		a := f.arrival(c.Digest)
		select {
		case <-a.done:
		case <-ctx.Done():
			f.drop()
			err := fmt.Errorf("read chunk %s at offset %d of %s: %w", c.Digest, c.Offset, l.label, ctx.Err())
			if last := f.lastErr.Load(); last != nil {
				err = fmt.Errorf("%w (last registry error: %w)", err, *last)
			}
			l.logReadFailure(ctx, err)
			return nil, err
		}
		if a.err != nil {
			f.drop()
			err := a.err
			// A fetch started by someone with less time (or a cancelled
			// fill batch) gave up; if we still have time, fetch again.
			if (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) &&
				ctx.Err() == nil && l.ctx.Err() == nil && timeLeft(ctx) > 2*margin(l.o.readTimeout) {
				continue
			}
			err = fmt.Errorf("read chunk %s at offset %d of %s: %w", c.Digest, c.Offset, l.label, err)
			l.logReadFailure(ctx, err)
			return nil, err
		}
		// Verified on arrival (fetchFlight): decode without hashing again.
		fr, err := l.decode(c, a.data)
		f.drop()
		if err != nil {
			err = fmt.Errorf("read chunk %s at offset %d of %s: %w", c.Digest, c.Offset, l.label, err)
			l.logReadFailure(ctx, err)
			return nil, err
		}
		if j := l.find(c); j >= 0 && l.cache.Contains(c.Digest) {
			// Another layer's flight, ended already (the flight marks
			// the layers whose readers joined it before).
			l.markCached(j)
		}
		return fr, nil
	}
}

// logReadFailure reports a failed read at error level, unless the layer
// is closing: then every read in progress (a decoding ahead of its reader
// among them) ends with it, and that is no fault to report.
func (l *Layer) logReadFailure(ctx context.Context, err error) {
	if l.ctx.Err() != nil {
		log.G(ctx).WithError(err).Debug("lazy read ended by the layer closing")
		return
	}
	log.G(ctx).WithError(err).Error("lazy read failed")
}

// cachePrefetch is how many chunks after one read from the node cache are
// prefetched from disk (chunkcache.Prefetch): a sequential reader of a
// file whose chunks are on disk but not in memory otherwise reads them one
// 1 MiB file at a time, each a full disk round trip.
const cachePrefetch = 4

// prefetchAfter asks the cache to read ahead the cached chunks following
// span j when the reads from the cache look sequential (j follows the
// previous one): a random reader would only make the disk read chunks
// nobody asked for.
func (l *Layer) prefetchAfter(j int) {
	if int(l.lastHit.Swap(int32(j)))+1 != j {
		return
	}
	last := int(l.prefetched.Load())
	end := min(j+cachePrefetch, len(l.spans)-1)
	from := j + 1
	if last >= from && last <= end {
		from = last + 1 // continuing a run: only the chunks not asked for yet
	}
	if from > end {
		return
	}
	l.prefetched.Store(int32(end))
	var ds []digest.Digest
	l.mu.Lock()
	for k := from; k <= end; k++ {
		if l.cached[l.canonical(k)] {
			ds = append(ds, l.chunk(k).Digest)
		}
	}
	l.mu.Unlock()
	if len(ds) > 0 {
		l.cache.Prefetch(ds)
	}
}

func timeLeft(ctx context.Context) time.Duration {
	d, ok := ctx.Deadline()
	if !ok {
		return time.Hour
	}
	return time.Until(d)
}

// margin is how much earlier than the reader's deadline its fetch gives up,
// so the reader receives the fetch's reason (the registry error) rather
// than a bare "deadline exceeded".
func margin(budget time.Duration) time.Duration {
	return min(budget/20, 100*time.Millisecond)
}

// join returns the flight that will deliver c, starting one if none is in
// progress.
func (l *Layer) join(ctx context.Context, c layerfmt.Chunk) *flight {
	// Lock order: the layer, then the (possibly node-wide) flights.
	l.mu.Lock()
	defer l.mu.Unlock()
	l.flights.mu.Lock()
	defer l.flights.mu.Unlock()
	if f, ok := l.flights.m[c.Digest]; ok && !f.failed(c.Digest) {
		if j := l.find(c); j >= 0 {
			f.joined = append(f.joined, joinedRead{l, j, c.Digest})
		}
		f.hold()
		f.waited()
		return f
	}
	if l.closed {
		f := &flight{arrivals: map[digest.Digest]*arrival{}}
		f.hold()
		a := &arrival{done: make(chan struct{})}
		a.complete(nil, errClosed)
		f.arrivals[c.Digest] = a
		return f
	}
	chunks := l.planLocked(c)
	f := l.registerLocked(chunks, l.o.peers != nil)
	f.hold()
	if !l.small && l.fillStarted.Load() && l.totalBytes <= l.flights.fillPolicy.SmallLayer {
		l.small = true
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.fillSmall(log.WithLogger(l.ctx, log.G(ctx)))
		}()
	}
	deadline := time.Now().Add(l.o.readTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	deadline = deadline.Add(-margin(l.o.readTimeout))
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		// Detached from the reader's cancellation: other readers may be
		// waiting on this fetch, and its result is cached either way.
		ctx, cancel := context.WithDeadline(log.WithLogger(l.ctx, log.G(ctx)), deadline)
		defer cancel()
		l.run(ctx, f, chunks, "read")
	}()
	return f
}

// registerLocked needs l.mu and l.flights.mu held. viaPeers says whether
// the flight will ask the peer tier (fetchFlight).
func (l *Layer) registerLocked(chunks []layerfmt.Chunk, viaPeers bool) *flight {
	f := &flight{arrivals: make(map[digest.Digest]*arrival, len(chunks)), recv: &l.flights.recv}
	f.hold() // run's
	if viaPeers {
		f.peerLayer = l.blob.Descriptor().Digest
	}
	for _, c := range chunks {
		if _, dup := f.arrivals[c.Digest]; !dup {
			f.arrivals[c.Digest] = &arrival{off: c.Offset, done: make(chan struct{})}
		}
		l.flights.m[c.Digest] = f
	}
	return f
}

// planLocked chooses the chunks to fetch with c: following chunks that are
// neither cached nor being fetched, while the holes between them stay small
// and the extra bytes stay within the read-ahead budget.
func (l *Layer) planLocked(c layerfmt.Chunk) []layerfmt.Chunk {
	chunks := []layerfmt.Chunk{c}
	idx := l.find(c)
	if idx < 0 {
		return chunks
	}
	if l.blob.RangeIgnored() && l.blob.Size() <= l.o.wholeBlobMax {
		// Whatever range we ask for, the registry sends the whole blob:
		// keep every chunk it carries.
		for j := range l.spans {
			if j == idx || l.canonical(j) != j || l.cached[j] {
				continue
			}
			cj := l.chunk(j)
			if _, busy := l.flights.m[cj.Digest]; busy || cj.Digest == c.Digest {
				continue
			}
			chunks = append(chunks, cj)
		}
		sort.Slice(chunks, func(a, b int) bool { return chunks[a].Offset < chunks[b].Offset })
		return chunks
	}
	end := c.Offset + c.CompressedSize
	limit := end + l.o.readAhead
	for j := idx + 1; j < len(l.spans); j++ {
		s := l.spans[j]
		if s.off-end > l.o.maxGap || s.off+s.csize > limit {
			break
		}
		if l.cached[l.canonical(j)] {
			break
		}
		cj := l.chunk(j)
		if _, busy := l.flights.m[cj.Digest]; busy {
			break
		}
		if cj.Digest != c.Digest {
			chunks = append(chunks, cj)
		}
		end = s.off + s.csize
	}
	return chunks
}

// run fetches chunks (sorted by offset) in one range request, releases
// each chunk's readers as soon as it has arrived and been verified, caches
// the good ones and then retires f. When the registry sent the whole blob
// instead, the other chunks in it are kept after that.
func (l *Layer) run(ctx context.Context, f *flight, chunks []layerfmt.Chunk, kind string) {
	whole := l.fetchFlight(ctx, f, chunks, kind)
	l.flights.mu.Lock()
	for _, c := range chunks {
		if l.flights.m[c.Digest] == f {
			delete(l.flights.m, c.Digest)
		}
	}
	l.flights.mu.Unlock()
	if whole != nil {
		l.keepWhole(ctx, whole, chunks)
	}
	f.drop()
}

// fetchFlight completes every arrival of f, then caches the chunks that
// arrived; it returns the blob when the registry ignored Range and sent
// all of it.
func (l *Layer) fetchFlight(ctx context.Context, f *flight, chunks []layerfmt.Chunk, kind string) (whole []byte) {
	off := chunks[0].Offset
	last := chunks[len(chunks)-1]
	n := last.Offset + last.CompressedSize - off
	start := time.Now()
	ctx = withObserver(ctx, func(err error) { f.lastErr.Store(&err) })
	if l.o.peers != nil && !servingPeer(ctx) {
		l.fetchViaPeers(ctx, f, chunks, kind, start)
		l.keepFlight(ctx, f, chunks)
		return nil
	}
	// next is the first chunk not released yet; the response (or a retry
	// of it, from its first byte again) reports what has arrived.
	next := 0
	release := func(data []byte, base int64) {
		for ; next < len(chunks); next++ {
			c := chunks[next]
			if c.Offset < base || c.Offset+c.CompressedSize > base+int64(len(data)) {
				return
			}
			l.verify(ctx, f, c, data[c.Offset-base:c.Offset-base+c.CompressedSize])
		}
	}
	data, base, err := l.blob.readRange(ctx, off, n, l.o.wholeBlobMax, release, f.receive)
	m := l.o.metrics
	if m != nil {
		m.latency.WithLabelValues(kind).Observe(time.Since(start).Seconds())
	}
	if err == nil {
		if m != nil {
			m.registryBytes.WithLabelValues(l.label).Add(float64(len(data)))
		}
		if base != off {
			// The registry ignored Range and sent the whole (small) blob.
			whole = data
		}
		release(data, base)
	}
	if next < len(chunks) && err == nil {
		err = fmt.Errorf("fetch %s range %d+%d: response ends before chunk at %d: %w", l.label, off, n, chunks[next].Offset, errdefs.ErrUnknown)
	}
	for _, c := range chunks[next:] {
		f.arrivals[c.Digest].complete(nil, err)
	}
	l.keepFlight(ctx, f, chunks)
	return whole
}

// keepFlight caches the chunks of f that arrived, after their readers
// were released: writing the cache is not on their path.
func (l *Layer) keepFlight(ctx context.Context, f *flight, chunks []layerfmt.Chunk) {
	for _, c := range chunks {
		a := f.arrivals[c.Digest]
		if a.data == nil {
			continue
		}
		if err := l.cache.PutVerified(c.Digest, a.data); err != nil {
			f.putErr = err
			l.logPutError(ctx, err)
			continue
		}
		if j := l.find(c); j >= 0 {
			l.markCached(j)
		}
	}
	l.flights.mu.Lock()
	joined := f.joined
	l.flights.mu.Unlock()
	for _, r := range joined {
		if r.l != l && f.arrivals[r.d].data != nil && l.cache.Contains(r.d) {
			r.l.markCached(r.j)
		}
	}
}

// verify checks the fetched bytes b of c against its digest and releases
// c's readers with them, or with the mismatch.
func (l *Layer) verify(ctx context.Context, f *flight, c layerfmt.Chunk, b []byte) {
	a := f.arrivals[c.Digest]
	if a.sent {
		return // the same chunk twice in one request
	}
	if got := c.Digest.Algorithm().FromBytes(b); got != c.Digest {
		// Never cached, never served, never retried into success: a
		// registry or proxy returning wrong bytes needs a human.
		err := fmt.Errorf("chunk at offset %d of %s: fetched bytes have digest %s, want %s: %w",
			c.Offset, l.label, got, c.Digest, layerfmt.ErrDigestMismatch)
		log.G(ctx).WithField("digest", c.Digest).WithField("layer", l.label).WithField("offset", c.Offset).
			WithError(err).Error("chunk digest mismatch")
		if m := l.o.metrics; m != nil {
			m.mismatches.Inc()
		}
		a.complete(nil, err)
		return
	}
	a.complete(b, nil)
}

// keepWhole verifies and caches every chunk of the whole blob in data that
// is not cached yet, except those of the flight (already handled).
func (l *Layer) keepWhole(ctx context.Context, data []byte, done []layerfmt.Chunk) {
	skip := make(map[int64]bool, len(done))
	for _, c := range done {
		skip[c.Offset] = true
	}
	for j := range l.spans {
		l.mu.Lock()
		cached := l.cached[l.canonical(j)]
		l.mu.Unlock()
		if cached || skip[l.spans[j].off] || l.canonical(j) != j {
			continue
		}
		c := l.chunk(j)
		b := data[c.Offset : c.Offset+c.CompressedSize]
		if c.Digest.Algorithm().FromBytes(b) != c.Digest {
			log.G(ctx).WithField("digest", c.Digest).WithField("layer", l.label).WithField("offset", c.Offset).
				Error("chunk digest mismatch in full-blob response; not cached")
			if m := l.o.metrics; m != nil {
				m.mismatches.Inc()
			}
			continue
		}
		if err := l.cache.PutVerified(c.Digest, b); err != nil {
			l.logPutError(ctx, err)
			return
		}
		l.markCached(j)
	}
}

// logPutError reports a cache that cannot store chunks at most every 10 s:
// reads are still served, uncached, and every later Put tries again.
func (l *Layer) logPutError(ctx context.Context, err error) {
	now := time.Now().UnixNano()
	last := l.lastFullLog.Load()
	if now-last < int64(10*time.Second) || !l.lastFullLog.CompareAndSwap(last, now) {
		return
	}
	log.G(ctx).WithError(err).WithField("layer", l.label).Warn("chunk cache cannot store chunks; serving uncached")
}

func (l *Layer) markCached(j int) {
	j = l.canonical(j)
	l.mu.Lock()
	if l.cached[j] {
		l.mu.Unlock()
		return
	}
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.cached[j] = true
	l.mu.Unlock()
	l.cachedBytes.Add(l.spans[j].csize)
	if m := l.o.metrics; m != nil {
		// Add, not Set: concurrent markers would race to Set stale sums.
		m.fillCached.WithLabelValues(l.label).Add(float64(l.spans[j].csize))
	}
}

// NoteActivity tells the layer its file system is in use (lazyfs calls it
// on every FUSE operation): shortly after a mount, the background fill of
// every layer sharing its Flights holds back while that goes on.
func (l *Layer) NoteActivity() { l.flights.noteOp() }

// NoteEnvironment tells the layer one more environment (a container's
// snapshot) was prepared over it; the daemon's status reports the count.
func (l *Layer) NoteEnvironment() { l.envs.Add(1) }

// Environments returns how many environments were prepared over the layer.
func (l *Layer) Environments() int { return int(l.envs.Load()) }

// Progress returns the compressed bytes of this layer's distinct chunks that
// are in the node cache, and their total.
func (l *Layer) Progress() (cachedBytes, totalBytes int64) {
	return l.cachedBytes.Load(), l.totalBytes
}

// fetchSpans fetches the spans idx (canonical, in blob order) that are
// neither cached nor being fetched, registered as flights so that reads of
// them wait for those instead of asking again. Spans close together go in
// one request; a gap wider than the layer's maxGap starts another, run
// concurrently: a peer asking for a frame that repeats an earlier one of
// the layer (the canonical span) must not cost the registry everything in
// between. before, when set, is called with each request's size before it
// is sent.
func (l *Layer) fetchSpans(ctx context.Context, idx []int, kind string, before func(n int64)) error {
	l.mu.Lock()
	l.flights.mu.Lock()
	var runs [][]layerfmt.Chunk
	for _, j := range idx {
		if l.cached[j] {
			continue
		}
		c := l.chunk(j)
		if _, busy := l.flights.m[c.Digest]; busy {
			continue
		}
		if n := len(runs); n > 0 {
			prev := runs[n-1][len(runs[n-1])-1]
			if c.Offset-(prev.Offset+prev.CompressedSize) <= l.o.maxGap {
				runs[n-1] = append(runs[n-1], c)
				continue
			}
		}
		runs = append(runs, []layerfmt.Chunk{c})
	}
	var flights []*flight
	if !l.closed {
		for _, chunks := range runs {
			f := l.registerLocked(chunks, l.o.peers != nil && !servingPeer(ctx))
			if kind == "fill" {
				f.job = idleprio.NewJob()
			}
			flights = append(flights, f)
		}
	}
	l.flights.mu.Unlock()
	l.mu.Unlock()
	var g errgroup.Group
	for i, f := range flights {
		chunks := runs[i]
		g.Go(func() error {
			if before != nil {
				before(chunks[len(chunks)-1].Offset + chunks[len(chunks)-1].CompressedSize - chunks[0].Offset)
			}
			run := func() {
				rctx, cancel := context.WithTimeout(ctx, l.o.readTimeout)
				defer cancel()
				l.run(rctx, f, chunks, kind)
			}
			if f.job != nil {
				// Receiving, hashing and caching the batch take
				// the CPU and disk an environment may need; its
				// time starts when it may run.
				f.job.Run(run)
			} else {
				run()
			}
			for _, a := range f.arrivals {
				if a.err != nil {
					return a.err
				}
			}
			return f.putErr
		})
	}
	return g.Wait()
}

// enter registers work on the layer, which Close waits for (the caller
// ends it with l.wg.Done); it reports false once the layer is closed.
func (l *Layer) enter() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.wg.Add(1)
	return true
}

// goBackground runs fn in a goroutine that Close waits for; it reports
// false, and runs nothing, once the layer is closed.
func (l *Layer) goBackground(fn func()) bool {
	if !l.enter() {
		return false
	}
	go func() {
		defer l.wg.Done()
		fn()
	}()
	return true
}

// Close stops the background fill, waits for fetches in progress and
// releases the layer's pins in the cache.
func (l *Layer) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.mu.Unlock()
	l.flights.open.remove(l)
	l.cancel()
	l.wg.Wait()
	l.cache.Unpin(l.owner)
	if m := l.o.metrics; m != nil {
		m.registryBytes.DeleteLabelValues(l.label)
		m.cacheBytes.DeleteLabelValues(l.label)
		m.fillCached.DeleteLabelValues(l.label)
		m.fillTotal.DeleteLabelValues(l.label)
	}
	return nil
}

// FileLocal reports whether every chunk of regular file idx is in the node
// cache, so WriteFile can produce it without the network.
func (l *Layer) FileLocal(idx int) bool {
	n := l.toc.NumChunks(idx)
	if n == 0 {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for k := range n {
		j := l.find(l.toc.Chunk(idx, k))
		if j < 0 || !l.cached[l.canonical(j)] {
			return false
		}
	}
	return true
}

// WriteFile writes the bytes of regular file idx to w from the node cache,
// every chunk verified on the way (chunkcache.Get). A chunk missing from
// the cache fails it: it never fetches, so it is cheap to give up on.
func (l *Layer) WriteFile(ctx context.Context, idx int, w io.Writer) error {
	var buf []byte
	for k := range l.toc.NumChunks(idx) {
		if err := ctx.Err(); err != nil {
			return err
		}
		c := l.toc.Chunk(idx, k)
		b, ok := l.cache.Get(c.Digest)
		if !ok {
			return fmt.Errorf("chunk %s of %s not in the node cache: %w", c.Digest, l.toc.Name(idx), errdefs.ErrNotFound)
		}
		frame, err := layerfmt.DecodeVerifiedFrame(c, b, buf)
		if err != nil {
			return fmt.Errorf("decode chunk %s of %s: %w", c.Digest, l.toc.Name(idx), err)
		}
		buf = frame
		if _, err := w.Write(frame[c.FrameOffset : c.FrameOffset+c.Size]); err != nil {
			return err
		}
	}
	return nil
}

// noteFootprint records frame k as read, the first time it is.
func (l *Layer) noteFootprint(k int) {
	// ReadChunk is the FUSE read path: frames already noted cost one
	// atomic load, not a lock.
	if k < 0 || k >= len(l.fpSeen) || l.fpSeen[k].Load() || !l.fpSeen[k].CompareAndSwap(false, true) {
		return
	}
	at := time.Since(l.created).Milliseconds()
	l.fpMu.Lock()
	l.footprint = append(l.footprint, layerfmt.PrefetchEntry{Frame: k, AtMS: at})
	l.fpMu.Unlock()
}

// Footprint returns the frames foreground reads have asked for since the
// layer was created, in the order of their first read, with its time: what
// a workload needs of the layer and when, which layerfmt.AnnotationPrefetch
// carries to the next node.
func (l *Layer) Footprint() []layerfmt.PrefetchEntry {
	l.fpMu.Lock()
	defer l.fpMu.Unlock()
	return append([]layerfmt.PrefetchEntry(nil), l.footprint...)
}
