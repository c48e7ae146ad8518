package fetch

import (
	"time"

	"github.com/envsnap/envsnap/internal/peer"
)

// Defaults of a Layer. The coalescing numbers come from the link we are
// measured on (docs/benchmarks.md: 1 Gbit/s, 20 ms round trip): one round trip is
// worth ~2.5 MB of transfer, so fetching a few hundred KiB of bytes nobody
// asked for costs less than one extra request, and the measured failure
// mode was ~440 serial 50 kB requests.
const (
	DefaultReadTimeout = 30 * time.Second
	// DefaultReadAhead is how many compressed bytes of following chunks
	// (next chunks of the same file, then the next files in the blob) a
	// foreground miss fetches in the same request: 1 MiB costs ~8 ms at
	// 1 Gbit/s, less than half a round trip.
	DefaultReadAhead = 1 << 20
	// DefaultSequentialReadAhead caps the windows fetched ahead of a
	// file read sequentially (see Layer.sequential); 0, the default,
	// turns them off. With a 4 MiB cap, BenchmarkColdBigBinary on this
	// shared 2-core machine (load average ~30, no link shaping) read
	// 54 MiB of a 400 MiB executable in 9.97-13.69 s against
	// 8.46-9.05 s without, fetching 82-92 MiB instead of 52-53 MiB
	// (docs/fetching.md, "Cold reads of a large file"): where the CPU is
	// the bottleneck the bytes fetched past where the reader stops cost
	// more than the round trips they hide.
	DefaultSequentialReadAhead = 0
	// DefaultDecodeAhead is how many frames past a file's sequential
	// reader are fetched and decoded before it asks for them
	// (Layer.decodeAhead): the reader of a large file otherwise waits
	// for one frame's request and decompression at a time.
	// BenchmarkDecodeAhead on this shared 2-core machine: 1 frame 0.78x
	// the time without, 2 frames 0.60x, 4 frames 1.05x (the frames past
	// where the reader stops cost more than the overlap saves);
	// docs/fetching.md, "Decoding ahead of a sequential reader".
	DefaultDecodeAhead = 2
	// DefaultMaxGap is the largest hole (bytes of no chunk we want: tar
	// headers, cached chunks are never bridged) coalesced into one request.
	DefaultMaxGap = 256 << 10
	// DefaultFillBatch and DefaultFillParallel shape the background fill:
	// large requests keep per-request overhead negligible, a few in
	// parallel fill a long fat pipe without starving foreground reads.
	DefaultFillBatch    = 8 << 20
	DefaultFillParallel = 3
	// DefaultWholeBlobMax: when a registry ignores Range, every read costs
	// the whole blob anyway, so for blobs up to this size the first miss
	// caches every chunk it carried.
	DefaultWholeBlobMax = 64 << 20
	// fillGap is the largest hole bridged inside a fill batch: the fill
	// wants nearly everything, holes are only tar headers and chunks
	// already cached.
	fillGap = 1 << 20
	// fillAbortAfter consecutive failed fill batches stop the fill; reads
	// keep working on demand.
	fillAbortAfter = 3
	// DefaultFrameCache bounds the decoded frames a Layer keeps in memory:
	// a few frames catch sequential reads of big files and neighbouring
	// small files, and stay small with hundreds of layers mounted.
	DefaultFrameCache = 4 << 20
)

// LayerOption configures a Layer.
type LayerOption func(*layerOptions)

type layerOptions struct {
	readTimeout  time.Duration
	fillRate     int64
	fill         bool
	metrics      *Metrics
	readAhead    int64
	seqReadAhead int64
	decodeAhead  int
	maxGap       int64
	fillBatch    int64
	fillParallel int
	wholeBlobMax int64
	frameCache   int64
	sharedFrames *FrameCache
	flights      *Flights
	fillYield    bool
	peers        *peer.Client
}

// WithReadTimeout bounds one ReadChunk, retries included (default
// DefaultReadTimeout; zero or negative keeps the default). Past it the read
// fails and FUSE returns EIO.
func WithReadTimeout(d time.Duration) LayerOption {
	return func(o *layerOptions) {
		if d > 0 {
			o.readTimeout = d
		}
	}
}

// WithFillRate limits the background fill to bytesPerSec of compressed
// data (0, the default, is unlimited).
func WithFillRate(bytesPerSec int64) LayerOption {
	return func(o *layerOptions) { o.fillRate = bytesPerSec }
}

// WithFill enables (default) or disables the background fill; with false,
// StartFill does nothing.
func WithFill(enabled bool) LayerOption { return func(o *layerOptions) { o.fill = enabled } }

// WithMetrics records the layer's traffic and fill progress.
func WithMetrics(m *Metrics) LayerOption { return func(o *layerOptions) { o.metrics = m } }

// WithReadAhead sets the compressed bytes of following chunks fetched with a
// foreground miss (default DefaultReadAhead; 0 disables read-ahead).
func WithReadAhead(n int64) LayerOption { return func(o *layerOptions) { o.readAhead = n } }

// WithSequentialReadAhead enables windows fetched ahead of a file read
// sequentially, doubling from twice the read-ahead up to n compressed
// bytes (default DefaultSequentialReadAhead: off). At most about two
// windows past where the reader stops are fetched for nothing.
func WithSequentialReadAhead(n int64) LayerOption {
	return func(o *layerOptions) { o.seqReadAhead = n }
}

// WithDecodeAhead sets how many frames past a file read sequentially are
// fetched and decoded ahead of its reader (default DefaultDecodeAhead; 0
// disables it).
func WithDecodeAhead(frames int) LayerOption { return func(o *layerOptions) { o.decodeAhead = frames } }

// WithMaxGap sets the largest hole coalesced into one foreground request
// (default DefaultMaxGap).
func WithMaxGap(n int64) LayerOption { return func(o *layerOptions) { o.maxGap = n } }

// WithFillBatch sets the size of background fill requests and how many run
// in parallel (defaults DefaultFillBatch, DefaultFillParallel).
func WithFillBatch(size int64, parallel int) LayerOption {
	return func(o *layerOptions) {
		if size > 0 {
			o.fillBatch = size
		}
		o.fillParallel = max(parallel, 1)
	}
}

// WithFrameCache bounds the decoded frames kept in memory per layer (default
// DefaultFrameCache; 0 disables it).
func WithFrameCache(bytes int64) LayerOption { return func(o *layerOptions) { o.frameCache = bytes } }

// WithSharedFrameCache makes the layer keep its decoded frames in fc, shared
// with other layers, instead of a cache of its own (WithFrameCache). A
// build walking thousands of small files cycles through far more frames
// than a per-layer cache holds: the same frame was decoded up to 115 times
// in one cold episode of the headline workload, 68% of the daemon's CPU.
func WithSharedFrameCache(fc *FrameCache) LayerOption {
	return func(o *layerOptions) { o.sharedFrames = fc }
}

// WithFlights shares in-progress fetches with the other Layers using f.
func WithFlights(f *Flights) LayerOption { return func(o *layerOptions) { o.flights = f } }

// WithFillYield makes the background fill yield to foreground work
// (default true): see StartFill. With false the fill runs at full speed
// from the start, for a caller that waits for it (fetch everything, then
// mount).
func WithFillYield(yield bool) LayerOption { return func(o *layerOptions) { o.fillYield = yield } }
