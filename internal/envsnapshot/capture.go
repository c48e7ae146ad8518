package envsnapshot

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// precopySlack is how long before a pre-copy started a file must have
// last changed (its ctime) for the pre-copied data to be reused. The
// kernel stamps ctime from a coarse clock that lags by at most a jiffy
// (<= 10 ms); the rest covers small steps of the wall clock.
const precopySlack = time.Second

// fileData is a regular file's data held in memory: its data extents, in
// order (one for a dense file; a sparse file's holes are left out and
// read as zeros), and its size.
type fileData struct {
	size int64
	ext  []extent
}

type extent struct {
	off int64
	b   []byte
}

// bytes is how much memory c holds.
func (c *fileData) bytes() int64 {
	var n int64
	for _, e := range c.ext {
		n += int64(len(e.b))
	}
	return n
}

var zeros [64 << 10]byte

// writeTo writes c's first size bytes (size is c.size when it comes from
// the same stat), holes as zeros.
func (c *fileData) writeTo(w io.Writer, size int64) error {
	if size != c.size {
		return fmt.Errorf("%d bytes held for a file of %d", c.size, size)
	}
	var off int64
	pad := func(to int64) error {
		for off < to {
			n, err := w.Write(zeros[:min(to-off, int64(len(zeros)))])
			off += int64(n)
			if err != nil {
				return err
			}
		}
		return nil
	}
	for _, e := range c.ext {
		if err := pad(e.off); err != nil {
			return err
		}
		if _, err := w.Write(e.b); err != nil {
			return err
		}
		off += int64(len(e.b))
	}
	return pad(size)
}

// readContent reads the first st.Size bytes of the regular file at p into
// memory; only the data extents (SEEK_DATA, SEEK_HOLE) of a file with
// fewer blocks than its size, so a mostly empty file costs what it holds,
// not its length. A file that is no longer regular, or that is shorter
// than st says, is an error.
func readContent(p string, st *syscall.Stat_t) (*fileData, error) {
	// A bare descriptor: thousands of small files, and an *os.File
	// costs a system call and a finalizer each on top of the open.
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: p, Err: err}
	}
	defer unix.Close(fd)
	c := &fileData{size: st.Size}
	read := func(off, end int64) error {
		b := make([]byte, end-off)
		for n := 0; n < len(b); {
			k, err := unix.Pread(fd, b[n:], off+int64(n))
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				return &os.PathError{Op: "read", Path: p, Err: err}
			}
			if k == 0 {
				return fmt.Errorf("read %s: %d bytes at %d of a %d-byte file: %w", p, n, off, st.Size, io.ErrUnexpectedEOF)
			}
			n += k
		}
		c.ext = append(c.ext, extent{off, b})
		return nil
	}
	if st.Size == 0 {
		return c, nil
	}
	if st.Blocks*512 >= st.Size {
		return c, read(0, st.Size)
	}
	for off := int64(0); off < st.Size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // holes up to the end
		}
		if err != nil {
			return nil, fmt.Errorf("seek data in %s from %d: %w", p, off, err)
		}
		if data >= st.Size {
			break
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("seek hole in %s from %d: %w", p, data, err)
		}
		hole = min(hole, st.Size)
		if err := read(data, hole); err != nil {
			return nil, err
		}
		off = hole
	}
	return c, nil
}

// precopied is what a pre-copy read while the container ran: for each
// regular file with one name, what lstat said before its xattrs and data
// were read, and those.
type precopied struct {
	start time.Time
	files map[string]*preFile
}

type preFile struct {
	st     syscall.Stat_t
	xattrs map[string]string
	data   *fileData
}

// unchanged reports whether the pre-copy holds rel's current data and
// metadata: a regular file whose inode, size, mode, mtime and ctime are
// those the pre-copy saw, and whose ctime is older than the pre-copy's
// start (less precopySlack), cannot have changed since (every write,
// truncate, chmod, chown, xattr change or link moves ctime).
func (pre *precopied) unchanged(rel string, st *syscall.Stat_t) (*preFile, bool) {
	if pre == nil {
		return nil, false
	}
	f, ok := pre.files[rel]
	if !ok {
		return nil, false
	}
	old := &f.st
	limit := pre.start.Add(-precopySlack)
	same := old.Ino == st.Ino && old.Dev == st.Dev && old.Size == st.Size && old.Mode == st.Mode &&
		old.Mtim == st.Mtim && old.Ctim == st.Ctim &&
		time.Unix(st.Ctim.Unix()).Before(limit)
	return f, same
}

// inode identifies a file.
type inode struct{ dev, ino uint64 }

// tooLarge is the error for more than maxData bytes of file data.
func tooLarge(maxData int64) error {
	return fmt.Errorf("%w: over %d bytes of file data: %w", ErrDiffTooLarge, maxData, errdefs.ErrResourceExhausted)
}

// precopy reads the regular files of upper into memory while the
// container still runs, with their xattrs, recording what lstat said of
// each before they were read, so that capture, frozen, keeps the
// unchanged ones (with one name) instead of reading them again. Entries
// that vanish while it walks are skipped. More than maxData bytes of file
// data (0: no cap), all names counted, fail with ErrDiffTooLarge before
// anything is frozen; any other error makes the caller read everything
// while frozen.
func precopy(upper string, maxData int64) (*precopied, error) {
	s, err := startPrecopy(upper, maxData)
	if err != nil {
		return nil, err
	}
	return s.wait()
}

// speculation is a pre-copy seen as a whole diff: every entry of the
// upper directory as the walk found it, in diff order, the data of a
// regular file arriving when its read finishes (ready). It is the diff
// of one state of the upper only if nothing changed while it was read,
// which only the frozen pass can tell (sameDiff); until then it lets the
// layer be encoded while the files are still being read.
type speculation struct {
	upper   string
	entries []*upperEntry
	pre     *precopied
	g       errgroup.Group
	mu      sync.Mutex
	// broken: an entry could not be read as walked (gone, truncated,
	// replaced): the entries are not a diff of any one state.
	broken bool
}

// startPrecopy walks upper, queues the reads of its regular files and
// returns once the walk is done, with the reads running; wait returns
// the pre-copy when they are done.
func startPrecopy(upper string, maxData int64) (*speculation, error) {
	s := &speculation{upper: upper, pre: &precopied{start: time.Now(), files: map[string]*preFile{}}}
	s.g.SetLimit(max(2, runtime.GOMAXPROCS(0)))
	var total int64
	err := filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, iofs.ErrNotExist) {
				s.broken = true
				return nil
			}
			return err
		}
		if p == upper {
			return nil
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			if errors.Is(err, iofs.ErrNotExist) {
				s.broken = true
				return nil
			}
			return fmt.Errorf("stat %s: %w", rel, err)
		}
		if !fi.Mode().IsRegular() {
			e, err := describeEntry(p, rel, fi)
			if err != nil {
				// Read again, frozen, where it is an error if it still
				// is one.
				s.broken = true
				return nil
			}
			if e != nil {
				s.entries = append(s.entries, e)
			}
			return nil
		}
		st := fi.Sys().(*syscall.Stat_t)
		total += st.Size
		if maxData > 0 && total > maxData {
			return tooLarge(maxData)
		}
		e := &upperEntry{rel: rel, fi: fi, ready: make(chan struct{})}
		s.entries = append(s.entries, e)
		s.g.Go(func() error {
			defer close(e.ready)
			var err error
			if e.xattrs, _, err = readXattrs(p); err == nil {
				e.data, err = readContent(p, st)
			}
			if errors.Is(err, iofs.ErrNotExist) || errors.Is(err, unix.ELOOP) || errors.Is(err, io.ErrUnexpectedEOF) {
				// Gone, replaced by a symlink, or truncated while read:
				// it changed, and is read frozen.
				e.readErr = errStale
				s.mu.Lock()
				s.broken = true
				s.mu.Unlock()
				return nil
			}
			if err != nil {
				e.readErr = err
				return fmt.Errorf("%s: %w", filepath.ToSlash(rel), err)
			}
			if st.Nlink == 1 {
				s.mu.Lock()
				s.pre.files[rel] = &preFile{st: *st, xattrs: e.xattrs, data: e.data}
				s.mu.Unlock()
			}
			return nil
		})
		return nil
	})
	if err != nil {
		_ = s.g.Wait()
		return nil, fmt.Errorf("pre-copy upper %s: %w", upper, err)
	}
	sortEntries(s.entries)
	return s, nil
}

// errStale marks an entry a speculation could not read as walked.
var errStale = errors.New("changed while the pre-copy read it")

// wait waits for the pre-copy's reads.
func (s *speculation) wait() (*precopied, error) {
	if err := s.g.Wait(); err != nil {
		return nil, fmt.Errorf("pre-copy upper %s: %w", s.upper, err)
	}
	return s.pre, nil
}

// holds reports whether the speculation's entries, once read, are
// exactly the diff of the frozen state read as frozen, so that the layer
// encoded from them is the layer of frozen. Only the fields a diff
// writes are compared; a regular file's data is compared by identity
// (frozen kept the pre-copy's, which the ctime rule vouches for) or, if
// read again, byte for byte.
func (s *speculation) holds(frozen *captured) bool {
	if _, err := s.wait(); err != nil || s.broken || len(s.entries) != len(frozen.entries) {
		return false
	}
	for i, a := range s.entries {
		if !sameEntry(a, frozen.entries[i]) {
			return false
		}
	}
	return true
}

func sameEntry(a, b *upperEntry) bool {
	if a.rel != b.rel || a.link != b.link || a.opaque != b.opaque || !maps.Equal(a.xattrs, b.xattrs) {
		return false
	}
	x, y := a.fi.Sys().(*syscall.Stat_t), b.fi.Sys().(*syscall.Stat_t)
	if a.fi.Mode() != b.fi.Mode() || !a.fi.ModTime().Equal(b.fi.ModTime()) || x.Size != y.Size ||
		x.Uid != y.Uid || x.Gid != y.Gid || x.Rdev != y.Rdev {
		return false
	}
	if !a.fi.Mode().IsRegular() {
		return true
	}
	// Hard links are written as links to the first name of their inode.
	if (x.Nlink > 1) != (y.Nlink > 1) || x.Nlink > 1 && (x.Dev != y.Dev || x.Ino != y.Ino) {
		return false
	}
	if a.data == b.data {
		return a.data != nil
	}
	if a.data == nil || b.data == nil || a.data.size != b.data.size {
		return false
	}
	return bytes.Equal(a.data.flat(), b.data.flat())
}

// flat is c's bytes, holes included; only for comparing files read
// twice (hard links, files a pre-copy could not vouch for).
func (c *fileData) flat() []byte {
	if len(c.ext) == 1 && c.ext[0].off == 0 && int64(len(c.ext[0].b)) == c.size {
		return c.ext[0].b
	}
	var b bytes.Buffer
	_ = c.writeTo(&b, c.size)
	return b.Bytes()
}

// captured is an upper directory read into memory: its entries, in the
// order a diff lists them, with the data of every regular file.
type captured struct {
	entries []*upperEntry
	// Reused counts the files kept from the pre-copy, Copied those read
	// by capture itself.
	Reused, Copied int
}

// capture reads all of upper that a diff holds into memory: what
// WriteUpperTar would write of it, without a file left to read. With
// pre == nil the result is exact only if nothing writes to upper
// meanwhile: it is what runs while the container is frozen, with a few
// workers reading file data.
//
// With pre (read by precopy while the container ran), a regular file
// that pre.unchanged says cannot have changed since is taken from the
// pre-copy, data and xattrs; every other file (changed, new, with
// several names, or in dirty: mapped shared and writable by a process of
// the container) is read again, and everything else (directories,
// symlinks, devices, whiteouts) is read here. More than maxData bytes of
// file data (0: no cap) fail with ErrDiffTooLarge.
func capture(upper string, pre *precopied, dirty *mapped, maxData int64) (*captured, error) {
	out := &captured{}
	var g errgroup.Group
	g.SetLimit(max(2, runtime.GOMAXPROCS(0)))
	first := map[inode]*upperEntry{}
	var later []*upperEntry // further names of an inode already read
	var total int64
	err := filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == upper {
			return nil
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return fmt.Errorf("stat %s: %w", rel, err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		if !fi.Mode().IsRegular() {
			e, err := describeEntry(p, rel, fi)
			if e != nil {
				out.entries = append(out.entries, e)
			}
			return err
		}
		total += st.Size
		if maxData > 0 && total > maxData {
			return tooLarge(maxData)
		}
		e := &upperEntry{rel: rel, fi: fi}
		out.entries = append(out.entries, e)
		key := inode{st.Dev, st.Ino}
		if st.Nlink > 1 {
			if _, ok := first[key]; ok {
				later = append(later, e)
				return nil
			}
			first[key] = e
		} else if f, ok := pre.unchanged(rel, st); ok && !dirty.has(rel, key) {
			e.xattrs, e.data = f.xattrs, f.data
			out.Reused++
			return nil
		}
		out.Copied++
		g.Go(func() error {
			var err error
			if e.xattrs, _, err = readXattrs(p); err != nil {
				return fmt.Errorf("%s: %w", filepath.ToSlash(rel), err)
			}
			e.data, err = readContent(p, st)
			return err
		})
		return nil
	})
	if werr := g.Wait(); err == nil {
		err = werr
	}
	if err != nil {
		return nil, fmt.Errorf("read upper %s: %w", upper, err)
	}
	for _, e := range later {
		st := e.fi.Sys().(*syscall.Stat_t)
		f := first[inode{st.Dev, st.Ino}]
		e.xattrs, e.data = f.xattrs, f.data
	}
	sortEntries(out.entries)
	return out, nil
}

// mapped is what the processes of a frozen task map shared and
// writable: writes through such a mapping to a page that is already dirty
// do not move the file's ctime, so a pre-copy of these files cannot be
// trusted.
type mapped struct {
	inodes map[inode]bool
	// paths are as the processes see them, relative to their root: on
	// overlayfs /proc/PID/maps shows the overlay's device and inode
	// numbers, not the upper file's, but a container's process sees its
	// root filesystem at /, so "/srv/db" is the upper's "srv/db".
	paths map[string]bool
}

// has reports whether the upper's file rel, with inode key, is mapped.
func (m *mapped) has(rel string, key inode) bool {
	return m != nil && (m.inodes[key] || m.paths[rel])
}

// mappedShared reads /proc/PID/maps of pids. A process that exited
// meanwhile maps nothing.
func mappedShared(pids []int) (*mapped, error) {
	m := &mapped{inodes: map[inode]bool{}, paths: map[string]bool{}}
	for _, pid := range pids {
		f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
		if err != nil {
			if errors.Is(err, iofs.ErrNotExist) {
				continue
			}
			return nil, err
		}
		err = m.parse(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("read /proc/%d/maps: %w", pid, err)
		}
	}
	return m, nil
}

// parse adds the shared writable file mappings of one maps file.
func (m *mapped) parse(r io.Reader) error {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		// 7f..-7f.. rw-s 00000000 fe:01 1234      /srv/db
		line := sc.Text()
		var fields [5]string
		rest := line
		for i := range fields {
			rest = strings.TrimLeft(rest, " ")
			f, r, _ := strings.Cut(rest, " ")
			fields[i], rest = f, r
		}
		perms := fields[1]
		if len(perms) < 4 || perms[1] != 'w' || perms[3] != 's' {
			continue
		}
		maj, min, ok := strings.Cut(fields[3], ":")
		if !ok {
			continue
		}
		ma, err1 := strconv.ParseUint(maj, 16, 32)
		mi, err2 := strconv.ParseUint(min, 16, 32)
		ino, err3 := strconv.ParseUint(fields[4], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil || ino == 0 {
			continue
		}
		m.inodes[inode{unix.Mkdev(uint32(ma), uint32(mi)), ino}] = true
		if p := strings.TrimSuffix(strings.TrimLeft(rest, " "), " (deleted)"); strings.HasPrefix(p, "/") {
			m.paths[strings.TrimPrefix(path.Clean(p), "/")] = true
		}
	}
	return sc.Err()
}

// openFile opens p as os.OpenFile does, without trying to register the
// descriptor with the runtime's poller: for a regular file that fails
// anyway, after four fcntl calls and an epoll_ctl, which were a third of
// the system calls of copying or reading thousands of small files.
func openFile(p string, flag int, perm uint32) (*os.File, error) {
	fd, err := unix.Open(p, flag|unix.O_CLOEXEC, perm)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: p, Err: err}
	}
	return os.NewFile(uintptr(fd), p), nil
}
