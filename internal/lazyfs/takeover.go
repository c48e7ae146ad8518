package lazyfs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Handover is what a successor process needs to keep serving a live mount
// after this one exits: containers keep their open files and their
// in-flight reads. The kernel keeps the FUSE connection alive as long as a
// /dev/fuse descriptor for it is open anywhere, and sends INIT only once
// per connection, so both the descriptor and the INIT message go across.
type Handover struct {
	// FD is a duplicate of the connection's /dev/fuse descriptor, owned by
	// the receiver (pass it with SCM_RIGHTS or the systemd FD store).
	FD int
	// Init is the kernel's FUSE_INIT request as received, opaque.
	Init []byte
}

// Handover returns what a successor needs to take this mount over with
// WithTakeover. Only mounts lazyfs made itself (as root) or received with
// WithDevFD/WithTakeover have a descriptor to hand over. The caller must
// then stop this process without unmounting.
func (m *Server) Handover() (Handover, error) {
	if m.fd < 0 {
		return Handover{}, errors.New("lazyfs: mount made by fusermount3 has no descriptor to hand over")
	}
	fd, err := unix.FcntlInt(uintptr(m.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return Handover{}, fmt.Errorf("lazyfs: dup /dev/fuse descriptor: %w", err)
	}
	in := m.srv.KernelSettings()
	init := unsafe.Slice((*byte)(unsafe.Pointer(in)), unsafe.Sizeof(*in))
	return Handover{FD: fd, Init: append([]byte(nil), init...)}, nil
}

// WithTakeover makes Mount serve the live connection of a previous server
// (see Server.Handover) instead of mounting: the mount at mountpoint stays
// as it is and open files keep working. Mount takes ownership of h.FD: it
// is closed on failure too. A takeover that fails once its server has
// started aborts the connection (Abort); one that fails before leaves the
// connection to the caller, who must Abort it unless it retries: the
// requests waiting in it are answered by no one.
func WithTakeover(h Handover) Option {
	return func(o *options) { o.takeover = &h }
}

// takeOver starts a go-fuse server on a connection whose INIT was answered
// by a previous server. go-fuse only starts by reading and answering INIT,
// so it is given the saved INIT through a socketpair at the descriptor
// number it will keep reading from; once answered (into the socketpair),
// that number is re-pointed at the live /dev/fuse with dup3 before the
// serve loop starts.
func takeOver(raw fuse.RawFileSystem, h Handover, mo *fuse.MountOptions) (*fuse.Server, error) {
	opts := *mo
	opts.DirectMount = false // see serveFD
	mo = &opts
	var in fuse.InitIn
	if len(h.Init) != int(unsafe.Sizeof(in)) {
		return nil, fmt.Errorf("INIT message is %d bytes, want %d", len(h.Init), unsafe.Sizeof(in))
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&in)), unsafe.Sizeof(in)), h.Init)
	const opInit = 26 // FUSE_INIT
	if in.InHeader.Opcode != opInit || in.InHeader.Length != uint32(unsafe.Sizeof(in)) {
		return nil, fmt.Errorf("saved INIT message has opcode %d length %d", in.InHeader.Opcode, in.InHeader.Length)
	}
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	defer unix.Close(sp[1])
	if _, err := unix.Write(sp[1], h.Init); err != nil {
		unix.Close(sp[0])
		return nil, fmt.Errorf("replay INIT: %w", err)
	}
	srv, err := fuse.NewServer(raw, fmt.Sprintf("/dev/fd/%d", sp[0]), mo)
	if err != nil {
		unix.Close(sp[0])
		return nil, fmt.Errorf("answer replayed INIT: %w", err)
	}
	// sp[0] now belongs to srv; make it (a duplicate of) the live
	// connection. h.FD stays ours, for the next hand-over. srv is not
	// serving yet, so on failure below sp[0] is closed here: the serve
	// loop never runs, and a leaked duplicate of the live connection would
	// keep it from ever being aborted by its last close.
	if err := unix.Dup3(h.FD, sp[0], unix.O_CLOEXEC); err != nil {
		unix.Close(sp[0])
		return nil, fmt.Errorf("attach live connection: %w", err)
	}
	// Requests the previous server read but never answered (it died in
	// the middle of a read) would hang their callers forever; the kernel
	// queues them again on FUSE_NOTIFY_RESEND (Linux 6.9+).
	if in.Flags64()&fuse.CAP_HAS_RESEND != 0 {
		var hdr fuse.OutHeader
		hdr.Length = uint32(unsafe.Sizeof(hdr))
		hdr.Status = -int32(fuse.NOTIFY_RESEND) // notify codes go positive on the wire
		if _, err := unix.Write(sp[0], unsafe.Slice((*byte)(unsafe.Pointer(&hdr)), unsafe.Sizeof(hdr))); err != nil {
			unix.Close(sp[0])
			return nil, fmt.Errorf("ask the kernel to resend pending requests: %w", err)
		}
	}
	return srv, nil
}

// takeoverFS adapts go-fuse's bridge to a connection it did not start:
// the kernel holds node IDs and directory handles the bridge never issued,
// and lookup counts it never saw. Node IDs are TOC index + 1 (see ino), so
// an unknown one is registered on first use through the bridge's
// LOOKUP(".") path (NodeLookupNoder on the root); unknown directory
// handles are replaced by fresh ones. FORGETs are dropped: the counts
// include lookups answered by the previous server, and go-fuse panics on
// an underflow. That keeps every inode used since the takeover in memory,
// bounded by the TOC.
type takeoverFS struct {
	fuse.RawFileSystem

	mu      sync.Mutex
	known   map[uint64]bool   // node IDs registered with the bridge
	dirFhs  map[uint64]bool   // directory handles this server issued
	remaped map[uint64]uint64 // previous server's directory handle -> ours
}

func newTakeoverFS(raw fuse.RawFileSystem) *takeoverFS {
	return &takeoverFS{
		RawFileSystem: raw,
		known:         map[uint64]bool{fuse.FUSE_ROOT_ID: true},
		dirFhs:        map[uint64]bool{},
		remaped:       map[uint64]uint64{},
	}
}

// revive makes sure the bridge knows node h.NodeId. An ID that does not
// name a presented TOC entry gets ESTALE (the bridge would panic on it).
func (t *takeoverFS) revive(cancel <-chan struct{}, h *fuse.InHeader) fuse.Status {
	t.mu.Lock()
	known := t.known[h.NodeId]
	t.mu.Unlock()
	if known {
		return fuse.OK
	}
	hdr := *h
	var out fuse.EntryOut
	if st := t.RawFileSystem.Lookup(cancel, &hdr, ".", &out); !st.Ok() {
		return st
	}
	t.mu.Lock()
	t.known[h.NodeId] = true
	t.mu.Unlock()
	return fuse.OK
}

func (t *takeoverFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	if st := t.revive(cancel, h); !st.Ok() {
		return st
	}
	st := t.RawFileSystem.Lookup(cancel, h, name, out)
	if st.Ok() && out.NodeId != 0 {
		t.mu.Lock()
		t.known[out.NodeId] = true
		t.mu.Unlock()
	}
	return st
}

func (t *takeoverFS) Forget(nodeid, nlookup uint64) {}

func (t *takeoverFS) GetAttr(c <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	return t.RawFileSystem.GetAttr(c, in, out)
}

func (t *takeoverFS) SetAttr(c <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	return fuse.EROFS
}

func (t *takeoverFS) Readlink(c <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	if st := t.revive(c, h); !st.Ok() {
		return nil, st
	}
	return t.RawFileSystem.Readlink(c, h)
}

func (t *takeoverFS) Access(c <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	return t.RawFileSystem.Access(c, in)
}

func (t *takeoverFS) GetXAttr(c <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	if st := t.revive(c, h); !st.Ok() {
		return 0, st
	}
	return t.RawFileSystem.GetXAttr(c, h, attr, dest)
}

func (t *takeoverFS) ListXAttr(c <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	if st := t.revive(c, h); !st.Ok() {
		return 0, st
	}
	return t.RawFileSystem.ListXAttr(c, h, dest)
}

func (t *takeoverFS) Open(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	return t.RawFileSystem.Open(c, in, out)
}

func (t *takeoverFS) Read(c <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return nil, st
	}
	return t.RawFileSystem.Read(c, in, buf)
}

func (t *takeoverFS) Lseek(c <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	return t.RawFileSystem.Lseek(c, in, out)
}

func (t *takeoverFS) Flush(c <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	return t.RawFileSystem.Flush(c, in)
}

func (t *takeoverFS) Release(c <-chan struct{}, in *fuse.ReleaseIn) {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return
	}
	t.RawFileSystem.Release(c, in)
}

func (t *takeoverFS) Statx(c <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	return t.RawFileSystem.Statx(c, in, out)
}

func (t *takeoverFS) StatFs(c <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	if st := t.revive(c, h); !st.Ok() {
		return st
	}
	return t.RawFileSystem.StatFs(c, h, out)
}

func (t *takeoverFS) OpenDir(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	st := t.RawFileSystem.OpenDir(c, in, out)
	if st.Ok() {
		t.mu.Lock()
		t.dirFhs[out.Fh] = true
		t.mu.Unlock()
	}
	return st
}

// dirHandle maps a directory handle from the kernel to one this server
// issued, opening the directory again for handles of the previous server.
func (t *takeoverFS) dirHandle(c <-chan struct{}, in *fuse.ReadIn) (uint64, fuse.Status) {
	t.mu.Lock()
	if t.dirFhs[in.Fh] {
		t.mu.Unlock()
		return in.Fh, fuse.OK
	}
	fh, ok := t.remaped[in.Fh]
	t.mu.Unlock()
	if ok {
		return fh, fuse.OK
	}
	open := fuse.OpenIn{InHeader: in.InHeader, Flags: syscall.O_RDONLY | syscall.O_DIRECTORY}
	var out fuse.OpenOut
	if st := t.OpenDir(c, &open, &out); !st.Ok() {
		return 0, st
	}
	t.mu.Lock()
	t.remaped[in.Fh] = out.Fh
	t.mu.Unlock()
	return out.Fh, fuse.OK
}

func (t *takeoverFS) ReadDir(c <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	fh, st := t.dirHandle(c, in)
	if !st.Ok() {
		return st
	}
	mapped := *in
	mapped.Fh = fh
	return t.RawFileSystem.ReadDir(c, &mapped, out)
}

func (t *takeoverFS) ReadDirPlus(c <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if st := t.revive(c, &in.InHeader); !st.Ok() {
		return st
	}
	fh, st := t.dirHandle(c, in)
	if !st.Ok() {
		return st
	}
	mapped := *in
	mapped.Fh = fh
	return t.RawFileSystem.ReadDirPlus(c, &mapped, out)
}

func (t *takeoverFS) ReleaseDir(in *fuse.ReleaseIn) {
	t.mu.Lock()
	fh, remapped := t.remaped[in.Fh]
	own := t.dirFhs[in.Fh]
	delete(t.remaped, in.Fh)
	if remapped {
		own = true
		delete(t.dirFhs, fh)
	} else {
		fh = in.Fh
		delete(t.dirFhs, fh)
	}
	t.mu.Unlock()
	if !own {
		return // a handle of the previous server that was never read again
	}
	mapped := *in
	mapped.Fh = fh
	t.RawFileSystem.ReleaseDir(&mapped)
}

var _ fs.NodeLookupNoder = (*node)(nil)

// LookupNode resolves a node ID without a path (only asked of the root):
// after a takeover, and for NFS-style handles. Node IDs are TOC index + 1,
// and what each index presents as is a pure function of the TOC.
func (n *node) LookupNode(ctx context.Context, id uint64, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	t := n.l.toc
	if id < 2 || id-1 >= uint64(t.Len()) {
		return nil, syscall.ESTALE
	}
	idx := int(id - 1)
	c, _, ok := n.l.resolveChild(t.Parent(idx), idx)
	if !ok || c.idx != idx {
		// Hidden entries and hard-link names were never handed out
		// under this ID.
		return nil, syscall.ESTALE
	}
	cn := n.l.newNode(c)
	cn.fillAttr(&out.Attr)
	return n.NewInode(ctx, cn, fs.StableAttr{Mode: c.mode, Ino: ino(c.idx)}), 0
}
