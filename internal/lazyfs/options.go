package lazyfs

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Defaults, all in one place.
const (
	// DefaultReadTimeout bounds one FUSE read: a read whose chunks cannot be
	// fetched in time fails with EIO instead of hanging the reader (and the
	// kernel's request slot) forever.
	DefaultReadTimeout = 30 * time.Second

	// DefaultFSName is the mount source shown in /proc/mounts when
	// WithFSName is not given.
	DefaultFSName = "envsnap"

	// fuseSubtype makes the mount show as "fuse.envsnap".
	fuseSubtype = "envsnap"

	// cacheTimeout is the kernel entry/attr/negative-entry timeout. The
	// layer is immutable (its TOC is pinned by digest), so nothing the
	// kernel caches can ever become stale; the only reason not to use
	// "forever" is that the kernel stores it in jiffies.
	cacheTimeout = 365 * 24 * time.Hour

	// maxRequest is the largest READ the kernel may send (max_read and
	// max_pages). 1 MiB is the kernel's limit with the default
	// fs.fuse.max_pages_limit and matches the default chunk size, so a
	// sequential reader costs about one request per chunk.
	maxRequest = 1 << 20

	// maxBackground is the number of asynchronous (readahead) requests the
	// kernel keeps in flight. The go-fuse default of 12 is tuned for local
	// disks; readahead on a lazy layer waits on the network, and many
	// containers share one mount.
	maxBackground = 64
)

type options struct {
	readTimeout  time.Duration
	fsName       string
	debug        bool
	devFD        int
	registerer   prometheus.Registerer
	layerLabel   string
	takeover     *Handover
	backing      BackingFiles
	backingState string
}

func defaultOptions() options {
	return options{
		readTimeout: DefaultReadTimeout,
		fsName:      DefaultFSName,
		devFD:       -1,
	}
}

// Option configures Mount and NewRoot.
type Option func(*options)

// WithReadTimeout bounds each FUSE read (default DefaultReadTimeout). A read
// that cannot be served in time returns EIO and is logged. Non-positive
// values are ignored.
func WithReadTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.readTimeout = d
		}
	}
}

// WithFSName sets the mount source shown in /proc/mounts (for example the
// layer digest), so operators can tell mounts apart.
func WithFSName(name string) Option {
	return func(o *options) {
		if name != "" {
			o.fsName = name
		}
	}
}

// WithDebug logs every FUSE request and reply (very verbose).
func WithDebug(debug bool) Option {
	return func(o *options) { o.debug = debug }
}

// WithDevFD serves the FUSE connection behind an already-open /dev/fuse
// descriptor instead of mounting (go-fuse's "/dev/fd/N" mode): the mount
// must already exist at the mountpoint passed to Mount, and its INIT must
// not have been answered yet. Mount takes ownership of fd. To continue a
// connection another server has been serving, use WithTakeover.
func WithDevFD(fd int) Option {
	return func(o *options) { o.devFD = fd }
}

// WithMetrics registers Prometheus metrics for this mount with reg, labelled
// layer=layerLabel. They are unregistered by Unmount.
func WithMetrics(reg prometheus.Registerer, layerLabel string) Option {
	return func(o *options) {
		o.registerer = reg
		o.layerLabel = layerLabel
	}
}

// WithBacking lets regular files that b has a local copy of be read by the
// kernel straight from that copy (FUSE passthrough, Linux 6.9+): such reads
// never reach the daemon. Files without a copy, and kernels without
// passthrough, take the normal chunk path. statePath is a file in which
// the mount records which inodes it switched, so that a successor
// (WithTakeover, given the same path) keeps answering their opens the way
// the kernel requires; Unmount removes it.
func WithBacking(b BackingFiles, statePath string) Option {
	return func(o *options) { o.backing, o.backingState = b, statePath }
}
