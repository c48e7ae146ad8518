// Package lazyfs serves one envsnap layer as a read-only FUSE filesystem
// whose file data is fetched chunk by chunk on first read.
//
// Everything but file data comes from the layer's TOC, which the caller has
// already verified against the manifest: lookups, stat, readdir, readlink
// and xattrs never touch the network. A read maps its byte range to the
// chunks of the file that hold it and asks the ChunkSource for exactly
// those, so what a container never reads is never fetched. The layer is
// immutable, so the kernel is told to cache entries, attributes and pages
// indefinitely; one mount serves every container using the layer, from one
// page cache.
//
// The mount is meant to be an overlayfs lower directory: OCI whiteouts
// (".wh.<name>") are presented as overlayfs whiteouts (0:0 character
// devices) and opaque markers (".wh..wh..opq") as the trusted.overlay.opaque
// xattr on their directory.
//
// Invariant: a read either returns the exact bytes of the layer or fails
// with EIO (logged); it never blocks longer than the read timeout and never
// returns zeros or partial data for bytes it could not obtain.
package lazyfs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"github.com/containerd/log"
	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/layerfmt"
)

// ChunkSource returns the verified, decompressed bytes of one chunk. The
// returned slice must hold exactly c.Size bytes and must not be modified
// by the source until lazyfs calls release, which it does exactly once per
// successful read, when it has copied what it needs (into the reply and
// the page-cache stores): a source may return a slice it shares with other
// readers and reuses afterwards (fetch.Layer returns a window of a decoded
// frame in a slot of memory it reuses). Implementations should honour ctx,
// but lazyfs does not rely on it: a read fails at its timeout either way,
// and a result that arrives later is released unread.
type ChunkSource interface {
	ReadChunk(ctx context.Context, c layerfmt.Chunk) (data []byte, release func(), err error)
}

// ActivityObserver is implemented by a ChunkSource that wants to know when
// the mount is in use at all (every FUSE operation, metadata included): a
// container starting on a layer looks files up and opens them before it
// reads much, and background work of the source can yield to that.
type ActivityObserver interface {
	NoteActivity()
}

// BackingFiles offers complete local copies of regular files (WithBacking).
type BackingFiles interface {
	// Backing returns a read-only descriptor of a file holding exactly the
	// bytes of regular file idx, or nil when there is none yet. It is
	// called on every open and must not block on the network; the caller
	// closes the file.
	Backing(ctx context.Context, idx int) *os.File
}

// layer is the state shared by every node of one mount.
type layer struct {
	ctx  context.Context // logging only; never cancelled
	toc  *layerfmt.TOC
	src  ChunkSource
	opts options

	// extraLinks counts, per hard-link target entry, the hard links to it,
	// so st_nlink matches what the tar described. Computed once because
	// the links can be anywhere in the tree.
	extraLinks map[int]uint32
	totalSize  int64
	stats      *counters
	failLog    logLimiter
	stores     *cacheStorer
	// noXattrs: the layer's view shows no extended attribute anywhere
	// (layerfmt.TOC.OverlayXattrs), so xattr requests get ENOSYS, which
	// the kernel keeps for the mount and answers itself from then on:
	// overlayfs queries its lowers' xattrs on lookups and copy-ups (about
	// 6,000 requests in a cold go test of the benchmark), each a round
	// trip to the daemon for an answer known in advance.
	noXattrs bool
	// noOpen: no file of the mount can switch to passthrough (no
	// WithBacking), so opens get ENOSYS, which the kernel keeps for the
	// connection (FUSE_NO_OPEN_SUPPORT): it stops sending OPEN and
	// RELEASE and serves reads with the page cache kept, as
	// FOPEN_KEEP_CACHE does.
	noOpen bool
}

func newLayer(ctx context.Context, toc *layerfmt.TOC, src ChunkSource, o options) (*layer, error) {
	if toc == nil || toc.Len() == 0 || toc.Type(0) != layerfmt.TypeDir {
		return nil, fmt.Errorf("lazyfs: TOC has no root directory: %w", layerfmt.ErrBadTOC)
	}
	if src == nil {
		return nil, errors.New("lazyfs: nil chunk source")
	}
	l := &layer{
		ctx:        context.WithoutCancel(ctx),
		toc:        toc,
		src:        src,
		opts:       o,
		extraLinks: map[int]uint32{},
		stats:      &counters{},
		stores:     newCacheStorer(),
		noXattrs:   !toc.OverlayXattrs(),
		noOpen:     o.backing == nil,
	}
	if a, ok := src.(ActivityObserver); ok {
		l.stats.onOp = a.NoteActivity
	}
	for i := 1; i < toc.Len(); i++ {
		switch toc.Type(i) {
		case layerfmt.TypeReg:
			l.totalSize += max(toc.Size(i), 0)
		case layerfmt.TypeHardlink:
			if t, ok := toc.Resolve(i); ok && toc.Type(t) != layerfmt.TypeDir {
				l.extraLinks[t]++
			}
		}
	}
	return l, nil
}

// NewRoot returns the root node of the filesystem for toc, for callers that
// mount it themselves (tests, fs.Mount with their own options). Mount is
// the normal entry point.
func NewRoot(toc *layerfmt.TOC, src ChunkSource, opts ...Option) (fs.InodeEmbedder, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	l, err := newLayer(context.Background(), toc, src, o)
	if err != nil {
		return nil, err
	}
	return l.root(), nil
}

func (l *layer) root() *node {
	return &node{l: l, idx: 0, opaque: l.isOpaque(0)}
}

// Server is one mounted layer and the FUSE server behind it. (It cannot be
// called Mount: that is the function creating it.)
type Server struct {
	mountpoint string
	dev        uint64 // st_dev of the mounted root: tells our mount from whatever is there later
	srv        *fuse.Server
	layer      *layer
	metrics    *collector
	// fd is our own descriptor of the FUSE connection (-1 when
	// fusermount3 made the mount): what Handover duplicates.
	fd int
	// viaHelper is set when go-fuse mounted through fusermount3.
	viaHelper bool
	// passthrough is nil without WithBacking.
	passthrough *passthroughFS

	unmountMu sync.Mutex
	unmounted bool
}

// fsOptions are the go-fuse node options for an immutable layer.
func fsOptions(o options) *fs.Options {
	timeout := cacheTimeout
	return &fs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NegativeTimeout: &timeout,
		// Inode numbers derive from TOC indices (see ino); using them as
		// node IDs too keeps every ID the kernel holds a function of the
		// TOC, which a replacement server needs to serve an existing
		// connection.
		ExternalNodeID: true,
		RootStableAttr: &fs.StableAttr{Ino: ino(0)},
		// Mode 0 files must stay mode 0, not be "fixed" to 0644/0755.
		NullPermissions: true,
		MountOptions: fuse.MountOptions{
			FsName:     o.fsName,
			Name:       fuseSubtype,
			AllowOther: true,
			// The kernel checks permissions from our modes (the
			// daemon runs as root and has no per-caller policy).
			// "ro" keeps the fusermount3 fallback read-only too.
			Options:     []string{"ro", "default_permissions"},
			DirectMount: true,
			// nosuid/nodev do not affect containers: overlayfs checks
			// the flags of its own mount when executing or opening a
			// device, not those of the lower layers.
			DirectMountFlags:     syscall.MS_RDONLY | syscall.MS_NOSUID | syscall.MS_NODEV,
			MaxWrite:             maxRequest,
			MaxReadAhead:         maxRequest,
			MaxBackground:        maxBackground,
			EnableSymlinkCaching: true,
			// Reads return memory, not file descriptors, so splice
			// only adds a pipe copy; and a full 1 MiB reply plus its
			// header exceeds the default pipe size, which go-fuse logs
			// on every such read.
			DisableSplice:            true,
			ExplicitDataCacheControl: true,
			Debug:                    o.debug,
		},
	}
}

// Mount mounts the layer described by toc at mountpoint (an existing
// directory) and serves it until Unmount. src supplies file data. ctx is
// used for logging only: cancelling it does not unmount.
func Mount(ctx context.Context, mountpoint string, toc *layerfmt.TOC, src ChunkSource, opts ...Option) (*Server, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	ctx = log.WithLogger(ctx, log.G(ctx).WithFields(log.Fields{"mountpoint": mountpoint, "fsname": o.fsName}))
	l, err := newLayer(ctx, toc, src, o)
	if err != nil {
		if o.takeover != nil {
			unix.Close(o.takeover.FD)
		}
		return nil, err
	}
	fsOpts := fsOptions(o)
	var raw fuse.RawFileSystem = fs.NewNodeFS(l.root(), fsOpts)
	if o.takeover != nil {
		raw = newTakeoverFS(raw)
	}
	mo := &fsOpts.MountOptions

	m := &Server{mountpoint: mountpoint, layer: l, fd: -1}
	if o.backing != nil {
		pt, err := newPassthroughFS(raw, l, o.backing, o.backingState, o.takeover != nil)
		if err != nil {
			if o.takeover != nil {
				unix.Close(o.takeover.FD)
			}
			return nil, fmt.Errorf("lazyfs: mount %s: %w", mountpoint, err)
		}
		raw, m.passthrough = pt, pt
	}
	// Metrics first: a failure after a takeover must not leave the live
	// mount torn down.
	if o.registerer != nil {
		m.metrics = newCollector(l.stats, o.layerLabel)
		if err := o.registerer.Register(m.metrics); err != nil {
			if o.takeover != nil {
				unix.Close(o.takeover.FD)
			}
			return nil, fmt.Errorf("lazyfs: register metrics for layer %q: %w", o.layerLabel, err)
		}
	}
	fail := func(err error) (*Server, error) {
		if m.metrics != nil {
			o.registerer.Unregister(m.metrics)
		}
		if m.passthrough != nil && o.takeover == nil {
			m.passthrough.remove()
		}
		return nil, fmt.Errorf("lazyfs: mount %s: %w", mountpoint, err)
	}

	switch {
	case o.takeover != nil:
		m.fd = o.takeover.FD
		m.srv, err = takeOver(raw, *o.takeover, mo)
	case o.devFD >= 0:
		m.fd = o.devFD
		m.srv, err = serveFD(raw, o.devFD, mo)
	default:
		if os.Geteuid() == 0 {
			if m.fd, err = mountFUSE(mountpoint, o.fsName); err == nil {
				if m.srv, err = serveFD(raw, m.fd, mo); err != nil {
					_ = unix.Unmount(mountpoint, unix.MNT_DETACH)
				}
				break
			}
			log.G(ctx).WithError(err).Warn("lazyfs: mount(2) failed, trying fusermount3")
		}
		m.fd = -1
		m.viaHelper = true
		m.srv, err = fuse.NewServer(raw, mountpoint, mo)
	}
	if err != nil {
		if m.fd >= 0 {
			unix.Close(m.fd)
		}
		return fail(err)
	}
	if m.passthrough != nil {
		m.passthrough.srv = m.srv
	}
	go m.srv.Serve()

	// Past this point the server runs: a new mount is detached on
	// failure, a taken-over connection aborted (which also ends the serve
	// loop, blocked in a read of it).
	failServing := func(err error) (*Server, error) {
		if o.takeover == nil {
			_ = forceUnmount(mountpoint)
		} else {
			if aerr := Abort(mountpoint); aerr != nil {
				log.G(ctx).WithError(aerr).Error("lazyfs: abort the connection of a failed takeover")
			}
			unix.Close(m.fd)
		}
		return fail(err)
	}
	if err := m.srv.WaitMount(); err != nil {
		return failServing(fmt.Errorf("wait for mount: %w", err))
	}
	// The predecessor already did this for a taken-over connection.
	if !m.viaHelper && o.takeover == nil {
		if err := disablePoll(mountpoint); err != nil {
			return failServing(fmt.Errorf("disable poll: %w", err))
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(mountpoint, &st); err != nil {
		return failServing(fmt.Errorf("stat mounted root: %w", err))
	}
	m.dev = st.Dev
	if err := setReadahead(st.Dev, maxRequest); err != nil {
		log.G(ctx).WithError(err).Warn("lazyfs: cannot raise readahead; sequential reads will use more FUSE requests")
	}
	log.G(ctx).WithField("entries", toc.Len()).Debug("lazyfs: mounted")
	return m, nil
}

// mountFUSE mounts a new FUSE connection at mountpoint with mount(2) and
// returns its /dev/fuse descriptor. lazyfs mounts itself rather than
// through go-fuse's DirectMount so that it holds the descriptor, which a
// successor process needs to take the mount over (Handover).
func mountFUSE(mountpoint, fsName string) (int, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open /dev/fuse: %w", err)
	}
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=%d,group_id=%d,default_permissions,allow_other,max_read=%d",
		fd, os.Geteuid(), os.Getegid(), maxRequest)
	// nosuid/nodev do not affect containers: overlayfs checks the flags
	// of its own mount when executing or opening a device, not those of
	// the lower layers.
	if err := unix.Mount(fsName, mountpoint, "fuse."+fuseSubtype, unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("mount(2) %s: %w", mountpoint, err)
	}
	return fd, nil
}

// disablePoll makes the kernel stop sending POLL for files of the mount,
// as go-fuse does in WaitMount only for mounts it made itself. Otherwise
// the first os.Open of a file in the mount by this process registers it
// with Go's netpoller: epoll_ctl then waits in the kernel for our answer to
// POLL while holding its P, and the next GC stop-the-world deadlocks the
// whole daemon (seen here in tests: processes stuck in D state until the
// connection was aborted). go-fuse answers POLL on its magic file with
// ENOSYS, after which the kernel never asks again on this connection.
func disablePoll(mountpoint string) error {
	fd, err := unix.Open(filepath.Join(mountpoint, ".go-fuse-epoll-hack"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLPRI | unix.POLLOUT}}, 0)
	return err
}

// serveFD starts go-fuse on a connection that is mounted but whose INIT is
// not answered yet, through its "/dev/fd/N" mode. go-fuse gets (and
// closes) a duplicate; fd stays ours.
func serveFD(raw fuse.RawFileSystem, fd int, mo *fuse.MountOptions) (*fuse.Server, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return nil, fmt.Errorf("fd %d is not an open /dev/fuse (%v)", fd, err)
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup /dev/fuse descriptor: %w", err)
	}
	// go-fuse tries DirectMount before it recognises "/dev/fd/N"; left
	// on, it would mount a new filesystem over the path the magic name
	// resolves to, which is /dev/fuse itself.
	opts := *mo
	opts.DirectMount = false
	srv, err := fuse.NewServer(raw, fmt.Sprintf("/dev/fd/%d", dup), &opts)
	if err != nil {
		return nil, fmt.Errorf("serve /dev/fuse descriptor: %w", err)
	}
	return srv, nil
}

// Mountpoint returns the directory the layer is mounted on.
func (m *Server) Mountpoint() string { return m.mountpoint }

// Unmount removes the layer's mount point. It fails with EBUSY while a
// process has files open or its cwd there, but not because an overlay uses
// the layer: overlayfs holds private clones of its lower mounts, and those
// keep working, served by this Server, until the overlay is gone (Wait
// returns then). So the ChunkSource must stay usable until Wait returns.
// Unmount is safe to call more than once and after the mount disappeared
// by other means.
func (m *Server) Unmount() error {
	m.unmountMu.Lock()
	defer m.unmountMu.Unlock()
	if m.unmounted {
		return nil
	}
	if err := m.unmount(); err != nil {
		return err
	}
	m.unmounted = true
	if m.fd >= 0 {
		unix.Close(m.fd)
		m.fd = -1
	}
	if m.metrics != nil {
		m.layer.opts.registerer.Unregister(m.metrics)
	}
	if m.passthrough != nil {
		m.passthrough.remove()
	}
	return nil
}

func (m *Server) unmount() error {
	if !m.mounted() {
		return nil
	}
	err := unix.Unmount(m.mountpoint, 0)
	if err == nil || !m.mounted() {
		return nil
	}
	if errors.Is(err, unix.EPERM) && m.viaHelper {
		// Not root: the fusermount3 helper can unmount what it mounted.
		if ferr := m.srv.Unmount(); ferr == nil {
			return nil
		}
	}
	return fmt.Errorf("lazyfs: unmount %s: %w", m.mountpoint, err)
}

// mounted reports whether our FUSE mount is still at the mountpoint. A
// different st_dev means it is gone (and something else may be there now,
// which must not be unmounted).
func (m *Server) mounted() bool {
	var st unix.Stat_t
	if err := unix.Stat(m.mountpoint, &st); err != nil {
		// ENOTCONN: our connection is dead but still mounted.
		return errors.Is(err, unix.ENOTCONN)
	}
	return st.Dev == m.dev
}

// Wait blocks until the FUSE connection ends (after Unmount, or when the
// kernel aborts it).
func (m *Server) Wait() { m.srv.Wait() }

// Stats returns the mount's counters.
func (m *Server) Stats() Stats { return m.layer.stats.snapshot() }

// Passthrough reports whether the kernel agreed to FUSE passthrough on the
// mount's connection (Linux 6.9+), which WithBacking needs.
func (m *Server) Passthrough() bool {
	return m.srv.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH != 0
}

// setReadahead sets the kernel readahead window of the mount's backing
// device. The kernel offers FUSE at most 128 KiB in INIT (and go-fuse
// passes that through), so a sequential reader of a 1 MiB chunk would
// cost eight requests, each waiting for the same chunk; the sysfs knob is
// the only way to raise it.
func setReadahead(dev uint64, bytes int) error {
	p := fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(dev), unix.Minor(dev))
	return os.WriteFile(p, []byte(strconv.Itoa(bytes>>10)), 0)
}

// Abort ends the FUSE connection mounted at mountpoint, whoever serves it,
// and detaches the mount: every request waiting in the connection, and
// every later one, fails with ENOTCONN, and a server reading it gets
// ENODEV. It is for connections no server will answer (a takeover that
// failed): closing descriptors would end the connection only once the
// last copy anywhere is closed, and until then its callers wait in the
// kernel, unkillable. MNT_FORCE makes the kernel abort the connection
// (fuse_umount_begin) before it looks at whether the mount is busy, so
// this works without the fusectl file system.
func Abort(mountpoint string) error {
	if err := unix.Unmount(mountpoint, unix.MNT_FORCE|unix.MNT_DETACH); err != nil {
		return fmt.Errorf("lazyfs: abort connection at %s: %w", mountpoint, err)
	}
	return nil
}

// forceUnmount is for tests and error paths: detach even if busy.
func forceUnmount(mountpoint string) error {
	err := unix.Unmount(mountpoint, unix.MNT_DETACH)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
