//go:build linux

// Package beneath reads a directory tree that someone else may be changing
// while it is read, such as a container's writable layer seen from the
// host, without ever reading anything outside it.
//
// The invariant: every name is resolved relative to a descriptor of a
// directory inside the tree, one component at a time, with openat2(2) and
// RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
// RESOLVE_NO_XDEV, or with statx(2) and AT_SYMLINK_NOFOLLOW on one
// component checked to be no mount point and on the tree's device. A symlink is never
// followed (it is an entry to describe, not a way to somewhere), ".."
// cannot climb above the descriptor, and a mount point inside the tree is
// refused (EXDEV), so a directory swapped for a symlink to a host path
// between two calls is seen as the symlink it has become, never as the
// host directory. Once opened, an entry is read through its own
// descriptor: what is stated, listed, read and compared is one inode,
// whatever happens to its name afterwards.
//
// Directories are opened O_RDONLY | O_DIRECTORY | O_NOFOLLOW, which fails
// before any driver's open for anything but a directory. Other entries
// are opened O_PATH: that never blocks and never runs a device driver's
// open, whatever the name has become (a FIFO, a socket, a device node).
// Only a regular file is opened for reading, by reopening its O_PATH
// descriptor through /proc/self/fd (which opens exactly the inode the
// descriptor holds, no name is looked up again) with O_NONBLOCK, and
// checked again with fstat. Extended attributes are read through the
// descriptor of a directory or a file open for reading (flistxattr(2),
// fgetxattr(2)), and of anything else through its O_PATH descriptor:
// /proc/self/fd/N with listxattr(2) and getxattr(2), which land on that
// inode even for a symlink (fgetxattr refuses O_PATH descriptors, and
// opening a symlink or a device to get a readable one is exactly what
// must not happen). A symlink's target is read with readlinkat(2) and an
// empty name on its own descriptor.
//
// The root itself is opened by path and trusted: it is the caller's.
//
// openat2 needs Linux 5.6.
package beneath

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// resolve confines every openat2 of the package.
const resolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// ErrNotRegular is returned by OpenFile for an entry that is not a
// regular file.
var ErrNotRegular = errors.New("not a regular file")

// ErrChanged is returned when an entry is not the inode it was expected to
// be: the name was given to another file meanwhile.
var ErrChanged = errors.New("changed while it was read")

// Dir is an open directory of a tree. It remembers the directories above
// it, so that two walks can tell whether a path went through the same
// directories (SameDirs).
type Dir struct {
	fd     int
	st     syscall.Stat_t
	name   string // "" for the root
	rel    string // path from the root, "" for the root
	parent *Dir
	root   string // the root's path, for messages
}

var procOnce struct {
	sync.Once
	err error
}

// checkProc makes sure /proc/self/fd is procfs: reopening and reading
// xattrs through it is only confined if its links are the kernel's.
func checkProc() error {
	procOnce.Do(func() {
		var fs unix.Statfs_t
		if err := unix.Statfs("/proc/self/fd", &fs); err != nil {
			procOnce.err = fmt.Errorf("statfs /proc/self/fd: %w", err)
		} else if fs.Type != unix.PROC_SUPER_MAGIC {
			procOnce.err = fmt.Errorf("/proc/self/fd is not procfs (type %#x)", fs.Type)
		}
	})
	return procOnce.err
}

// OpenRoot opens the directory at path, which the caller trusts, as the
// root of a tree: nothing read through it leaves it or its device.
func OpenRoot(path string) (*Dir, error) {
	if err := checkProc(); err != nil {
		return nil, err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	d := &Dir{fd: fd, root: path}
	if err := fstat(fd, &d.st); err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return d, nil
}

// Close closes d's descriptor. d's identity stays usable (SameDirs).
func (d *Dir) Close() error {
	if d.fd < 0 {
		return nil
	}
	err := unix.Close(d.fd)
	d.fd = -1
	return err
}

// Rel is d's path from the root ("" for the root), by the names the walk
// that opened it went through.
func (d *Dir) Rel() string { return d.rel }

// Stat is what fstat said of d when it was opened.
func (d *Dir) Stat() *syscall.Stat_t { return &d.st }

// Join is the path from the root of d's entry name.
func (d *Dir) Join(name string) string {
	if d.rel == "" {
		return name
	}
	return d.rel + "/" + name
}

// pathErr names the entry in the root's terms.
func (d *Dir) pathErr(op, name string, err error) error {
	return &os.PathError{Op: op, Path: d.root + "/" + d.Join(name), Err: err}
}

// Info is d's stat as an fs.FileInfo.
func (d *Dir) Info() fs.FileInfo { return FileInfo(d.name, &d.st) }

// OpenDir opens d's entry name, which must be one component and a
// directory, without following it, for listing and for opening its
// entries.
func (d *Dir) OpenDir(name string) (*Dir, error) {
	if err := validName(name); err != nil {
		return nil, d.pathErr("open", name, err)
	}
	fd, err := d.openat2(name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC)
	if err != nil {
		return nil, err
	}
	sub := &Dir{fd: fd, name: name, rel: d.Join(name), parent: d, root: d.root}
	if err := fstat(fd, &sub.st); err != nil {
		unix.Close(fd)
		return nil, d.pathErr("stat", name, err)
	}
	return sub, nil
}

// ListXattrs lists d's extended attributes.
func (d *Dir) ListXattrs() ([]string, error) {
	keys, err := listXattrs(func(b []byte) (int, error) { return unix.Flistxattr(d.fd, b) })
	if err != nil {
		return nil, &os.PathError{Op: "listxattr", Path: d.root + "/" + d.rel, Err: err}
	}
	return keys, nil
}

// GetXattr reads d's extended attribute key.
func (d *Dir) GetXattr(key string) ([]byte, error) {
	v, err := getXattr(func(b []byte) (int, error) { return unix.Fgetxattr(d.fd, key, b) })
	if err != nil {
		return nil, &os.PathError{Op: "getxattr " + key, Path: d.root + "/" + d.rel, Err: err}
	}
	return v, nil
}

// Names lists d's entries (without "." and ".."), in the order the
// file system gives them.
func (d *Dir) Names() ([]string, error) {
	if _, err := unix.Seek(d.fd, 0, 0); err != nil {
		return nil, d.pathErr("seek", ".", err)
	}
	buf := make([]byte, 16<<10)
	var names []string
	for {
		n, err := unix.Getdents(d.fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, d.pathErr("getdents", ".", err)
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

// validName refuses anything but one component: the names a directory
// lists are such, and nothing else is asked for.
func validName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return unix.EINVAL
	}
	return nil
}

// Lstat states d's entry name without following it, and refuses a mount
// point (statx(2)'s STATX_ATTR_MOUNT_ROOT, also for a bind mount of the
// tree's own file system) and anything on another device.
func (d *Dir) Lstat(name string) (*syscall.Stat_t, error) {
	if err := validName(name); err != nil {
		return nil, d.pathErr("lstat", name, err)
	}
	var x unix.Statx_t
	for {
		err := unix.Statx(d.fd, name, unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_SYNC_AS_STAT, unix.STATX_BASIC_STATS, &x)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, d.pathErr("lstat", name, err)
		}
		break
	}
	s := statxStat(&x)
	if x.Attributes_mask&x.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0 || s.Dev != d.st.Dev {
		return nil, d.pathErr("lstat", name, unix.EXDEV)
	}
	return &s, nil
}

// statxStat is what stat(2) says, from what statx(2) said: the same
// device encoding (makedev) and times.
func statxStat(x *unix.Statx_t) syscall.Stat_t {
	s := syscall.Stat_t{
		Dev: unix.Mkdev(x.Dev_major, x.Dev_minor), Ino: x.Ino, Mode: uint32(x.Mode), Uid: x.Uid, Gid: x.Gid,
		Rdev: unix.Mkdev(x.Rdev_major, x.Rdev_minor), Size: int64(x.Size), Blocks: int64(x.Blocks),
	}
	setInt(&s.Nlink, x.Nlink)
	setInt(&s.Blksize, x.Blksize)
	for _, t := range []struct {
		dst *syscall.Timespec
		src unix.StatxTimestamp
	}{{&s.Atim, x.Atime}, {&s.Mtim, x.Mtime}, {&s.Ctim, x.Ctime}} {
		setInt(&t.dst.Sec, t.src.Sec)
		setInt(&t.dst.Nsec, t.src.Nsec)
	}
	return s
}

// setInt converts between the integer types that differ by architecture
// in syscall.Stat_t.
func setInt[T, F ~int32 | ~int64 | ~uint32 | ~uint64](dst *T, v F) { *dst = T(v) }

// Entry is one entry of a tree held by an O_PATH descriptor: whatever
// its name becomes, Stat, Readlink, the xattrs and OpenFile are of the
// inode that was opened.
type Entry struct {
	fd   int
	st   syscall.Stat_t
	rel  string
	dir  *Dir
	name string
}

// Open opens d's entry name, which must be one component, without
// following it.
func (d *Dir) Open(name string) (*Entry, error) {
	if err := validName(name); err != nil {
		return nil, d.pathErr("open", name, err)
	}
	return d.open(name, name)
}

// Lookup opens the entry at rel, a slash-separated path beneath d, with
// every component resolved beneath d: no symlink followed, no mount
// crossed, no ".." above d.
func (d *Dir) Lookup(rel string) (*Entry, error) {
	if rel == "" || strings.Contains(rel, "\x00") {
		return nil, d.pathErr("open", rel, unix.EINVAL)
	}
	base := strings.TrimRight(rel, "/")
	base = base[strings.LastIndexByte(base, '/')+1:]
	return d.open(rel, base)
}

// openRetries bounds the retries of an openat2 that the kernel answers
// with EAGAIN: with RESOLVE_BENEATH it does so when a rename or a mount
// anywhere raced a ".." of the path, which a writer renaming in a loop
// could otherwise make endless.
const openRetries = 100

// openat2 opens path beneath d with flags, confined.
func (d *Dir) openat2(path string, flags uint64) (int, error) {
	how := unix.OpenHow{Flags: flags, Resolve: resolve}
	for try := 0; ; try++ {
		fd, err := unix.Openat2(d.fd, path, &how)
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) && try < openRetries {
			continue
		}
		if err != nil {
			return -1, d.pathErr("open", path, err)
		}
		return fd, nil
	}
}

// open opens path beneath d, an entry called name (its last component).
func (d *Dir) open(path, name string) (*Entry, error) {
	fd, err := d.openat2(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC)
	if err != nil {
		return nil, err
	}
	e := &Entry{fd: fd, rel: d.Join(path), dir: d, name: name}
	if err := fstat(fd, &e.st); err != nil {
		unix.Close(fd)
		return nil, d.pathErr("stat", path, err)
	}
	return e, nil
}

// Close closes e's descriptor.
func (e *Entry) Close() error {
	if e.fd < 0 {
		return nil
	}
	err := unix.Close(e.fd)
	e.fd = -1
	return err
}

// Stat is what fstat said of e when it was opened.
func (e *Entry) Stat() *syscall.Stat_t { return &e.st }

// Rel is e's path from the root.
func (e *Entry) Rel() string { return e.rel }

// Info is e's stat as an fs.FileInfo.
func (e *Entry) Info() fs.FileInfo { return FileInfo(e.name, &e.st) }

func (e *Entry) err(op string, err error) error {
	return &os.PathError{Op: op, Path: e.dir.root + "/" + e.rel, Err: err}
}

// proc is the path that reaches e's inode through its descriptor.
func (e *Entry) proc() string { return "/proc/self/fd/" + strconv.Itoa(e.fd) }

// Readlink returns the target of e, a symlink.
func (e *Entry) Readlink() (string, error) {
	b := make([]byte, 256)
	for {
		k, err := unix.Readlinkat(e.fd, "", b)
		switch {
		case errors.Is(err, unix.EINTR):
		case err != nil:
			return "", e.err("readlink", err)
		case k < len(b):
			return string(b[:k]), nil
		default:
			b = make([]byte, 2*len(b))
		}
	}
}

// ListXattrs lists e's extended attributes.
func (e *Entry) ListXattrs() ([]string, error) {
	p := e.proc()
	keys, err := listXattrs(func(b []byte) (int, error) { return unix.Listxattr(p, b) })
	if err != nil {
		return nil, e.err("listxattr", err)
	}
	return keys, nil
}

// GetXattr reads e's extended attribute key.
func (e *Entry) GetXattr(key string) ([]byte, error) {
	p := e.proc()
	v, err := getXattr(func(b []byte) (int, error) { return unix.Getxattr(p, key, b) })
	if err != nil {
		return nil, e.err("getxattr "+key, err)
	}
	return v, nil
}

// listXattrs calls list (a listxattr(2)) with a buffer that fits.
func listXattrs(list func([]byte) (int, error)) ([]string, error) {
	b, err := xattrCall(list)
	if err != nil {
		return nil, err
	}
	var keys []string
	for k := range strings.SplitSeq(string(b), "\x00") {
		if k != "" {
			keys = append(keys, k)
		}
	}
	return keys, nil
}

// getXattr calls get (a getxattr(2)) with a buffer that fits.
func getXattr(get func([]byte) (int, error)) ([]byte, error) { return xattrCall(get) }

// xattrCall sizes the buffer with a call on none, and again while the
// value grows under it (ERANGE).
func xattrCall(call func([]byte) (int, error)) ([]byte, error) {
	for {
		n, err := call(nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return nil, nil
		}
		b := make([]byte, n)
		n, err = call(b)
		if errors.Is(err, unix.ERANGE) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return b[:n], nil
	}
}

// reopen opens e's inode for reading, with extra flags, and checks it is
// still the inode e holds.
func (e *Entry) reopen(flags int) (int, error) {
	var fd int
	for {
		var err error
		fd, err = unix.Open(e.proc(), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY|flags, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return -1, e.err("open", err)
		}
		break
	}
	var st syscall.Stat_t
	if err := fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, e.err("stat", err)
	}
	if st.Dev != e.st.Dev || st.Ino != e.st.Ino || st.Mode&unix.S_IFMT != e.st.Mode&unix.S_IFMT {
		unix.Close(fd)
		return -1, e.err("open", ErrChanged)
	}
	return fd, nil
}

// File is a regular file of a tree open for reading.
type File struct {
	fd  int
	st  syscall.Stat_t
	rel string
	dir *Dir
}

// OpenFile opens e for reading if it is a regular file (ErrNotRegular
// otherwise; nothing else is ever opened), without blocking: a file with
// a lease someone holds is an EWOULDBLOCK error, not a wait.
func (e *Entry) OpenFile() (*File, error) {
	if e.st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, e.err("open", ErrNotRegular)
	}
	fd, err := e.reopen(unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	return &File{fd: fd, st: e.st, rel: e.rel, dir: e.dir}, nil
}

func (f *File) err(op string, err error) error {
	return &os.PathError{Op: op, Path: f.dir.root + "/" + f.rel, Err: err}
}

// ReadAt is io.ReaderAt's: len(b) bytes at off, or fewer and io.EOF at
// the end of the file.
func (f *File) ReadAt(b []byte, off int64) (int, error) {
	n := 0
	for n < len(b) {
		k, err := unix.Pread(f.fd, b[n:], off+int64(n))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return n, f.err("read", err)
		}
		if k == 0 {
			return n, io.EOF
		}
		n += k
	}
	return n, nil
}

// Seek is lseek(2), for SEEK_DATA and SEEK_HOLE.
func (f *File) Seek(off int64, whence int) (int64, error) {
	n, err := unix.Seek(f.fd, off, whence)
	if err != nil {
		return n, f.err("seek", err)
	}
	return n, nil
}

// Close closes f.
func (f *File) Close() error { return unix.Close(f.fd) }

// Stat is what fstat said of f's entry when it was opened (Entry.Stat).
func (f *File) Stat() *syscall.Stat_t { return &f.st }

// Rel is f's path from the root.
func (f *File) Rel() string { return f.rel }

// ListXattrs lists f's extended attributes.
func (f *File) ListXattrs() ([]string, error) {
	keys, err := listXattrs(func(b []byte) (int, error) { return unix.Flistxattr(f.fd, b) })
	if err != nil {
		return nil, f.err("listxattr", err)
	}
	return keys, nil
}

// GetXattr reads f's extended attribute key.
func (f *File) GetXattr(key string) ([]byte, error) {
	v, err := getXattr(func(b []byte) (int, error) { return unix.Fgetxattr(f.fd, key, b) })
	if err != nil {
		return nil, f.err("getxattr "+key, err)
	}
	return v, nil
}

// SameDirs reports whether a and b are the same directory reached through
// the same directories by the same names: the same inode at every level
// up to the root. Two walks of a tree that agree on a file's directories
// this way read it at the same place.
func SameDirs(a, b *Dir) bool {
	for a != nil && b != nil {
		if a == b {
			return true
		}
		if a.name != b.name || a.st.Dev != b.st.Dev || a.st.Ino != b.st.Ino {
			return false
		}
		a, b = a.parent, b.parent
	}
	return a == nil && b == nil
}

func fstat(fd int, st *syscall.Stat_t) error {
	var u unix.Stat_t
	for {
		err := unix.Fstat(fd, &u)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		*st = sysStat(&u)
		return nil
	}
}

// sysStat converts u to the syscall package's type, which fs.FileInfo
// users (archive/tar, containerd's tarheader) expect from Sys(). The
// scalar fields have the same type in both packages on every
// architecture.
func sysStat(u *unix.Stat_t) syscall.Stat_t {
	return syscall.Stat_t{
		Dev: u.Dev, Ino: u.Ino, Nlink: u.Nlink, Mode: u.Mode, Uid: u.Uid, Gid: u.Gid, Rdev: u.Rdev,
		Size: u.Size, Blksize: u.Blksize, Blocks: u.Blocks,
		Atim: syscall.Timespec{Sec: u.Atim.Sec, Nsec: u.Atim.Nsec},
		Mtim: syscall.Timespec{Sec: u.Mtim.Sec, Nsec: u.Mtim.Nsec},
		Ctim: syscall.Timespec{Sec: u.Ctim.Sec, Nsec: u.Ctim.Nsec},
	}
}

// FileInfo presents st, the stat of an entry called name, as os.Lstat
// would.
func FileInfo(name string, st *syscall.Stat_t) fs.FileInfo {
	return &fileInfo{name: name, st: *st}
}

type fileInfo struct {
	name string
	st   syscall.Stat_t
}

func (fi *fileInfo) Name() string       { return fi.name }
func (fi *fileInfo) Size() int64        { return fi.st.Size }
func (fi *fileInfo) IsDir() bool        { return fi.Mode().IsDir() }
func (fi *fileInfo) Sys() any           { return &fi.st }
func (fi *fileInfo) ModTime() time.Time { return time.Unix(fi.st.Mtim.Unix()) }

// Mode is os's conversion of st_mode (os/stat_linux.go).
func (fi *fileInfo) Mode() fs.FileMode {
	m := fs.FileMode(fi.st.Mode & 0o777)
	switch fi.st.Mode & syscall.S_IFMT {
	case syscall.S_IFBLK:
		m |= fs.ModeDevice
	case syscall.S_IFCHR:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case syscall.S_IFDIR:
		m |= fs.ModeDir
	case syscall.S_IFIFO:
		m |= fs.ModeNamedPipe
	case syscall.S_IFLNK:
		m |= fs.ModeSymlink
	case syscall.S_IFSOCK:
		m |= fs.ModeSocket
	}
	if fi.st.Mode&syscall.S_ISGID != 0 {
		m |= fs.ModeSetgid
	}
	if fi.st.Mode&syscall.S_ISUID != 0 {
		m |= fs.ModeSetuid
	}
	if fi.st.Mode&syscall.S_ISVTX != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// Walk calls fn for every entry beneath root, depth first: with the
// directory that holds it (open while fn runs) and its name, in the order
// the directory lists them. When fn returns a directory, opened from that
// entry (Dir.OpenDir), Walk walks it next and then closes it. Walk stops
// at the first error from fn or from listing a directory, and when ctx is
// done. It holds one descriptor per level of the directory it walks.
func Walk(ctx context.Context, root *Dir, fn func(d *Dir, name string) (*Dir, error)) error {
	names, err := root.Names()
	if err != nil {
		return err
	}
	for _, name := range names {
		if err := ctx.Err(); err != nil {
			return err
		}
		sub, err := fn(root, name)
		if err != nil {
			return err
		}
		if sub != nil {
			err = Walk(ctx, sub, fn)
			sub.Close()
			if err != nil {
				return err
			}
		}
	}
	return nil
}
