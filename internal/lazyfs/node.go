package lazyfs

import (
	"context"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/envsnap/envsnap/layerfmt"
)

// OCI whiteout names and the overlay xattr; the rules of the overlay view
// live in layerfmt (TOC.OverlayChild), shared with native layer copies.
const (
	whiteoutPrefix = layerfmt.WhiteoutPrefix
	opaqueMarker   = layerfmt.OpaqueMarker
	opaqueXattr    = layerfmt.OverlayOpaqueXattr
)

// node is one inode of the layer. A single type serves every file type:
// the kernel only sends directory operations to directories and data
// operations to regular files, so the unused methods are never reached.
type node struct {
	fs.Inode
	l *layer

	// idx is the TOC entry that holds this inode's metadata: the hard-link
	// target for hard links, the ".wh.<name>" marker for whiteouts.
	idx int
	// whiteout marks an OCI whiteout presented as an overlayfs whiteout
	// (character device 0:0).
	whiteout bool
	// opaque marks a directory overlayfs must not merge with lower layers.
	opaque bool
}

var (
	_ fs.NodeGetattrer   = (*node)(nil)
	_ fs.NodeLookuper    = (*node)(nil)
	_ fs.NodeReaddirer   = (*node)(nil)
	_ fs.NodeReadlinker  = (*node)(nil)
	_ fs.NodeGetxattrer  = (*node)(nil)
	_ fs.NodeListxattrer = (*node)(nil)
	_ fs.NodeOpener      = (*node)(nil)
	_ fs.NodeReader      = (*node)(nil)
	_ fs.NodeFlusher     = (*node)(nil)
	_ fs.NodeLseeker     = (*node)(nil)
	_ fs.NodeStatfser    = (*node)(nil)
)

// ino maps a TOC index to an inode number. The root (index 0) becomes
// FUSE_ROOT_ID 1; with ExternalNodeID the inode number is also the FUSE
// node ID, so both are a pure function of the TOC and survive a restart.
func ino(idx int) uint64 { return uint64(idx) + 1 }

// typeBits maps an entry type to S_IFMT bits; 0 for types we cannot
// present (unresolved hard links, unknown values from a hostile TOC).
func typeBits(t layerfmt.EntryType) uint32 {
	switch t {
	case layerfmt.TypeReg:
		return syscall.S_IFREG
	case layerfmt.TypeDir:
		return syscall.S_IFDIR
	case layerfmt.TypeSymlink:
		return syscall.S_IFLNK
	case layerfmt.TypeChar:
		return syscall.S_IFCHR
	case layerfmt.TypeBlock:
		return syscall.S_IFBLK
	case layerfmt.TypeFIFO:
		return syscall.S_IFIFO
	}
	return 0
}

// child describes what a directory entry name resolves to.
type child struct {
	idx      int
	mode     uint32 // S_IFMT bits
	whiteout bool
}

// resolveChild maps the TOC child k of directory dir to what is presented
// for it. ok is false for entries that are hidden: whiteout markers that
// are shadowed or malformed, the opaque marker, broken hard links and hard
// links to directories (which would make the tree a graph).
func (l *layer) resolveChild(dir, k int) (c child, name string, ok bool) {
	idx, name, whiteout, ok := l.toc.OverlayChild(dir, k)
	if !ok {
		return child{}, "", false
	}
	if whiteout {
		return child{idx: idx, mode: syscall.S_IFCHR, whiteout: true}, name, true
	}
	mode := typeBits(l.toc.Type(idx))
	if mode == 0 {
		return child{}, "", false
	}
	return child{idx: idx, mode: mode}, name, true
}

// isOpaque reports whether overlayfs must hide lower-layer content of
// directory dir (layerfmt.TOC.OverlayOpaque).
func (l *layer) isOpaque(dir int) bool { return l.toc.OverlayOpaque(dir) }

func (l *layer) newNode(c child) *node {
	n := &node{l: l, idx: c.idx, whiteout: c.whiteout}
	if c.mode == syscall.S_IFDIR {
		n.opaque = l.isOpaque(c.idx)
	}
	return n
}

func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (_ *fs.Inode, errno syscall.Errno) {
	start := time.Now()
	defer func() { n.l.stats.record(opLookup, start, errno != 0 && errno != syscall.ENOENT) }()

	if n.whiteout || n.l.toc.Type(n.idx) != layerfmt.TypeDir || strings.HasPrefix(name, whiteoutPrefix) {
		return nil, syscall.ENOENT
	}
	t := n.l.toc
	k, ok := t.LookupChild(n.idx, name)
	if !ok {
		if k, ok = t.LookupChild(n.idx, whiteoutPrefix+name); !ok {
			return nil, syscall.ENOENT
		}
	}
	c, _, ok := n.l.resolveChild(n.idx, k)
	if !ok {
		return nil, syscall.ENOENT
	}
	cn := n.l.newNode(c)
	cn.fillAttr(&out.Attr)
	return n.NewInode(ctx, cn, fs.StableAttr{Mode: c.mode, Ino: ino(c.idx)}), 0
}

// listing returns the presented entries of directory n, sorted by name.
func (n *node) listing() ([]fuse.DirEntry, syscall.Errno) {
	t := n.l.toc
	if n.whiteout || t.Type(n.idx) != layerfmt.TypeDir {
		return nil, syscall.ENOTDIR
	}
	first, cnt := t.ChildRange(n.idx)
	// "." and ".." first, as every kernel file system lists them: overlayfs
	// passes a directory that only this layer has straight through to
	// this listing, and tools (ls -a, find's link-count optimisation,
	// fts) expect both. The root's parent is outside the mount; it lists
	// itself, as the kernel does for a mount root.
	parent := n.idx
	if n.idx != 0 {
		parent = t.Parent(n.idx)
	}
	entries := make([]fuse.DirEntry, 0, cnt+2)
	entries = append(entries,
		fuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: ino(n.idx)},
		fuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: ino(parent)})
	for k := first; k < first+cnt; k++ {
		c, name, ok := n.l.resolveChild(n.idx, k)
		if !ok {
			continue
		}
		entries = append(entries, fuse.DirEntry{Name: name, Mode: c.mode, Ino: ino(c.idx)})
	}
	// Whiteouts are renamed, so restore name order (deterministic offsets
	// matter: a directory stream resumed after a takeover seeks by them).
	names := entries[2:]
	sort.Slice(names, func(a, b int) bool { return names[a].Name < names[b].Name })
	return entries, 0
}

// Readdir is what go-fuse uses when no handle is involved; open
// directories go through OpendirHandle.
func (n *node) Readdir(ctx context.Context) (_ fs.DirStream, errno syscall.Errno) {
	start := time.Now()
	defer func() { n.l.stats.record(opReaddir, start, errno != 0) }()
	entries, errno := n.listing()
	if errno != 0 {
		return nil, errno
	}
	return fs.NewListDirStream(entries), 0
}

// OpendirHandle lets the kernel cache the listing (FOPEN_CACHE_DIR): a
// directory listed once is listed again from the kernel's cache, by every
// container sharing the mount.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if n.whiteout || n.l.toc.Type(n.idx) != layerfmt.TypeDir {
		return nil, 0, syscall.ENOTDIR
	}
	return &dirHandle{n: n}, fuse.FOPEN_CACHE_DIR | fuse.FOPEN_KEEP_CACHE, 0
}

// dirHandle is one open directory. A directory offset (the cookie to go
// on after an entry) of a child is its 1-based position among the sorted
// children, as before "." and ".." were listed, so that a server taking
// over from one of an older version resumes its open listings where they
// were; "." and "..", listed first, take the two cookies after the last
// child's.
type dirHandle struct {
	n       *node
	entries []fuse.DirEntry
	listed  bool
	pos     int
}

var (
	_ fs.FileReaddirenter = (*dirHandle)(nil)
	_ fs.FileSeekdirer    = (*dirHandle)(nil)
	_ fs.FileReleasedirer = (*dirHandle)(nil)
)

func (d *dirHandle) list() syscall.Errno {
	if d.listed {
		return 0
	}
	start := time.Now()
	entries, errno := d.n.listing()
	d.n.l.stats.record(opReaddir, start, errno != 0)
	if errno != 0 {
		return errno
	}
	d.entries, d.listed = entries, true
	return 0
}

func (d *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	if errno := d.list(); errno != 0 {
		return nil, errno
	}
	if d.pos >= len(d.entries) {
		return nil, 0
	}
	e := d.entries[d.pos]
	e.Off = dirOffset(d.pos, len(d.entries)-2)
	d.pos++
	return &e, 0
}

func (d *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	if errno := d.list(); errno != 0 {
		return errno
	}
	d.pos = dirPosition(off, len(d.entries)-2)
	return 0
}

// dirOffset is the cookie after entry i of a listing of ".", ".." and n
// children.
func dirOffset(i, n int) uint64 {
	if i < 2 {
		return uint64(n + 1 + i)
	}
	return uint64(i - 1)
}

// dirPosition is the index of the entry that follows cookie off in a
// listing of ".", ".." and n children (the inverse of dirOffset; 0 is
// the start, anything unknown the end).
func dirPosition(off uint64, n int) int {
	switch {
	case off == 0:
		return 0
	case off <= uint64(n):
		return int(off) + 2
	case off <= uint64(n)+2:
		return int(off) - n
	}
	return n + 2
}

func (d *dirHandle) Releasedir(ctx context.Context, releaseFlags uint32) {}

func (n *node) Getattr(ctx context.Context, f fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	start := time.Now()
	n.fillAttr(&out.Attr)
	n.l.stats.record(opGetattr, start, false)
	return 0
}

// fillAttr sets the attributes of n from the TOC alone.
func (n *node) fillAttr(a *fuse.Attr) {
	t := n.l.toc
	e := t.Entry(n.idx)
	*a = fuse.Attr{}
	a.Ino = ino(n.idx)
	a.Owner = fuse.Owner{Uid: clampID(e.UID), Gid: clampID(e.GID)}
	mtime := e.ModTime.Unix()
	if mtime < 0 {
		mtime = 0
	}
	a.Mtime, a.Mtimensec = uint64(mtime), uint32(e.ModTime.Nanosecond())
	a.Atime, a.Atimensec = a.Mtime, a.Mtimensec
	a.Ctime, a.Ctimensec = a.Mtime, a.Mtimensec
	a.Blksize = 4096
	a.Nlink = 1

	if n.whiteout {
		// overlayfs recognises exactly a 0:0 character device; keep the
		// owner and mtime of the marker for anyone listing the lower dir.
		a.Mode = syscall.S_IFCHR
		return
	}
	a.Mode = typeBits(e.Type) | t.UnixMode(n.idx)&0o7777
	switch e.Type {
	case layerfmt.TypeReg:
		a.Size = uint64(max(e.Size, 0))
		a.Nlink += n.l.extraLinks[n.idx]
	case layerfmt.TypeSymlink:
		a.Size = uint64(len(e.Linkname))
	case layerfmt.TypeDir:
		a.Nlink = 2 + n.l.subdirs(n.idx)
	case layerfmt.TypeChar, layerfmt.TypeBlock:
		a.Rdev = encodeDev(e.Devmajor, e.Devminor)
		a.Nlink += n.l.extraLinks[n.idx]
	default:
		a.Nlink += n.l.extraLinks[n.idx]
	}
	a.Blocks = (a.Size + 511) / 512
}

// subdirs counts the directories directly inside dir (for st_nlink, which
// find(1) uses to skip stat calls).
func (l *layer) subdirs(dir int) uint32 {
	first, cnt := l.toc.ChildRange(dir)
	var d uint32
	for k := first; k < first+cnt; k++ {
		if l.toc.Type(k) == layerfmt.TypeDir {
			d++
		}
	}
	return d
}

// encodeDev packs a device number the way the FUSE protocol carries it
// (the kernel's new_encode_dev; fuse_attr.rdev is 32 bits).
func encodeDev(major, minor uint32) uint32 {
	return (minor & 0xff) | (major&0xfff)<<8 | (minor&^0xff)<<12
}

// clampID maps ids that do not fit uid_t to the kernel's overflow id.
func clampID(id int) uint32 {
	if id < 0 || id > 1<<32-2 {
		return 65534
	}
	return uint32(id)
}

func (n *node) Readlink(ctx context.Context) (_ []byte, errno syscall.Errno) {
	start := time.Now()
	defer func() { n.l.stats.record(opReadlink, start, errno != 0) }()
	if n.whiteout || n.l.toc.Type(n.idx) != layerfmt.TypeSymlink {
		return nil, syscall.EINVAL
	}
	return []byte(n.l.toc.Entry(n.idx).Linkname), 0
}

// xattrs returns the extended attributes presented for n, sorted by name.
func (n *node) xattrs() (names []string, values map[string]string) {
	if n.whiteout {
		return nil, nil
	}
	values = n.l.toc.Entry(n.idx).Xattrs
	for k := range values {
		if layerfmt.HiddenXattr(k) {
			delete(values, k)
		}
	}
	if n.opaque {
		if values == nil {
			values = map[string]string{}
		}
		values[opaqueXattr] = "y"
	}
	for k := range values {
		names = append(names, k)
	}
	sort.Strings(names)
	return names, values
}

func (n *node) Getxattr(ctx context.Context, attr string, dest []byte) (_ uint32, errno syscall.Errno) {
	start := time.Now()
	defer func() {
		n.l.stats.record(opGetxattr, start, errno != 0 && errno != syscall.ENODATA && errno != syscall.ERANGE && errno != syscall.ENOSYS)
	}()
	if n.l.noXattrs {
		return 0, syscall.ENOSYS
	}
	_, values := n.xattrs()
	v, ok := values[attr]
	if !ok {
		return 0, syscall.ENODATA
	}
	if len(dest) < len(v) {
		return uint32(len(v)), syscall.ERANGE
	}
	return uint32(copy(dest, v)), 0
}

func (n *node) Listxattr(ctx context.Context, dest []byte) (_ uint32, errno syscall.Errno) {
	start := time.Now()
	defer func() {
		n.l.stats.record(opListxattr, start, errno != 0 && errno != syscall.ERANGE && errno != syscall.ENOSYS)
	}()
	if n.l.noXattrs {
		return 0, syscall.ENOSYS
	}
	names, _ := n.xattrs()
	size := 0
	for _, k := range names {
		size += len(k) + 1
	}
	if len(dest) < size {
		return uint32(size), syscall.ERANGE
	}
	off := 0
	for _, k := range names {
		off += copy(dest[off:], k)
		dest[off] = 0
		off++
	}
	return uint32(size), 0
}

func (n *node) Open(ctx context.Context, flags uint32) (_ fs.FileHandle, _ uint32, errno syscall.Errno) {
	start := time.Now()
	defer func() { n.l.stats.record(opOpen, start, errno != 0 && errno != syscall.ENOSYS) }()
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC|syscall.O_APPEND) != 0 {
		return nil, 0, syscall.EROFS
	}
	if n.whiteout || n.l.toc.Type(n.idx) != layerfmt.TypeReg {
		return nil, 0, syscall.EINVAL
	}
	if n.l.noOpen {
		return nil, 0, syscall.ENOSYS
	}
	// The layer is immutable: let the kernel keep cached pages across
	// opens, so every container sharing this mount reads them from the
	// one page cache. (Files with a local copy are switched to FUSE
	// passthrough by passthroughFS, below the node API.)
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *node) Read(ctx context.Context, f fs.FileHandle, dest []byte, off int64) (_ fuse.ReadResult, errno syscall.Errno) {
	start := time.Now()
	defer func() { n.l.stats.record(opRead, start, errno != 0) }()
	if n.whiteout || n.l.toc.Type(n.idx) != layerfmt.TypeReg {
		return nil, syscall.EINVAL
	}
	ino := n.EmbeddedInode()
	size := n.l.toc.Size(n.idx)
	cnt, errno := n.l.read(dest, off, n.idx, func(parts []spilled, release func()) { n.l.stores.store(ino, parts, size, release) })
	if errno != 0 {
		return nil, errno
	}
	n.l.stats.bytesRead.Add(uint64(cnt))
	return fuse.ReadResultData(dest[:cnt]), 0
}

// Flush answers ENOSYS, which the kernel keeps for the connection
// (no_flush): nothing is written to a layer, and without it every close
// of a layer file waits for a round trip to the daemon (a cold go test
// closes about 5,700 of them).
func (n *node) Flush(ctx context.Context, f fs.FileHandle) syscall.Errno {
	n.l.stats.record(opFlush, time.Now(), false)
	return syscall.ENOSYS
}

// Lseek answers ENOSYS, which the kernel keeps for the connection
// (no_lseek) and then answers SEEK_DATA and SEEK_HOLE itself from the
// file size, as go-fuse would have in the daemon. overlayfs asks
// SEEK_DATA on every copy-up of a file from the layer.
func (n *node) Lseek(ctx context.Context, f fs.FileHandle, off uint64, whence uint32) (uint64, syscall.Errno) {
	n.l.stats.record(opLseek, time.Now(), false)
	return 0, syscall.ENOSYS
}

func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	const bsize = 4096
	*out = fuse.StatfsOut{}
	out.Bsize = bsize
	out.Frsize = bsize
	out.Blocks = uint64(n.l.totalSize+bsize-1) / bsize
	out.Files = uint64(n.l.toc.Len())
	out.NameLen = 255
	return 0
}
