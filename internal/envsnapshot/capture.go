package envsnapshot

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"maps"
	"os"
	"path"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/beneath"
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

// readChunk bounds one read of a file's data, so that a cancelled
// snapshot stops within one chunk's read.
const readChunk = 8 << 20

// readFile reads x, a regular file, into memory through one descriptor:
// its xattrs, then its data (readContent).
func readFile(ctx context.Context, x *beneath.Entry) (map[string]string, *fileData, error) {
	f, err := x.OpenFile()
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	xattrs, _, err := readXattrs(f)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", x.Rel(), err)
	}
	data, err := readContent(ctx, f)
	return xattrs, data, err
}

// readContent reads the first f.Stat().Size bytes of f into memory; only
// the data extents (SEEK_DATA, SEEK_HOLE) of a file with fewer blocks
// than its size, so a mostly empty file costs what it holds, not its
// length. A file that is shorter than its stat says is an error
// (io.ErrUnexpectedEOF).
func readContent(ctx context.Context, f *beneath.File) (*fileData, error) {
	st := f.Stat()
	c := &fileData{size: st.Size}
	if st.Size == 0 {
		return c, nil
	}
	read := func(off, end int64) error {
		b := make([]byte, end-off)
		for n := int64(0); n < int64(len(b)); {
			if err := ctx.Err(); err != nil {
				return err
			}
			k, err := f.ReadAt(b[n:min(n+readChunk, int64(len(b)))], off+n)
			n += int64(k)
			if errors.Is(err, io.EOF) {
				return fmt.Errorf("read %s: %d bytes at %d of a %d-byte file: %w", f.Rel(), n, off, st.Size, io.ErrUnexpectedEOF)
			}
			if err != nil {
				return err
			}
		}
		c.ext = append(c.ext, extent{off, b})
		return nil
	}
	if st.Blocks*512 >= st.Size {
		return c, read(0, st.Size)
	}
	for off := int64(0); off < st.Size; {
		data, err := f.Seek(off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // holes up to the end
		}
		if err != nil {
			return nil, fmt.Errorf("seek data from %d: %w", off, err)
		}
		if data >= st.Size {
			break
		}
		hole, err := f.Seek(data, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("seek hole from %d: %w", data, err)
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
// regular file with one name, what fstat of its descriptor said before
// its xattrs and data were read through it, those, and the directory it
// was found in (with every directory above it).
type precopied struct {
	start time.Time
	files map[string]*preFile
}

type preFile struct {
	st     syscall.Stat_t
	xattrs map[string]string
	data   *fileData
	dir    *beneath.Dir
}

// unchanged reports whether the pre-copy holds the current data and
// metadata of rel, found in dir and stated as st: a regular file whose
// inode, size, mode, mtime and ctime are those the pre-copy saw, and
// whose ctime is older than the pre-copy's start (less precopySlack),
// cannot have changed since (every write, truncate, chmod, chown, xattr
// change or link moves ctime). Its path must also go through the same
// directories as the pre-copy's did (beneath.SameDirs): the data was read
// through the file's own descriptor, so this only proves again what the
// inode check already does, that no directory swapped in between the
// walks could have lent the pre-copy another file.
func (pre *precopied) unchanged(rel string, dir *beneath.Dir, st *syscall.Stat_t) (*preFile, bool) {
	if pre == nil {
		return nil, false
	}
	f, ok := pre.files[rel]
	if !ok || !beneath.SameDirs(f.dir, dir) {
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

// precopy reads the regular files beneath root into memory while the
// container still runs, with their xattrs, recording what fstat of each
// one's descriptor said before they were read through it, so that
// capture, frozen, keeps the unchanged ones (with one name) instead of
// reading them again. Entries that vanish or change while it walks are
// left to the frozen pass. More than maxData bytes of file data (0: no
// cap), all names counted, fail with ErrDiffTooLarge before anything is
// frozen; any other error makes the caller read everything while frozen.
func precopy(ctx context.Context, root *beneath.Dir, maxData int64) (*precopied, error) {
	s, err := startPrecopy(ctx, root, maxData)
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
	entries []*upperEntry
	pre     *precopied
	g       errgroup.Group
	mu      sync.Mutex
	// broken: an entry could not be read as walked (gone, truncated,
	// replaced): the entries are not a diff of any one state.
	broken bool
}

// stale reports whether err means that an entry changed while a pre-copy
// read it: gone, replaced, or truncated.
func stale(err error) bool {
	return errors.Is(err, iofs.ErrNotExist) || errors.Is(err, beneath.ErrChanged) || errors.Is(err, io.ErrUnexpectedEOF)
}

// startPrecopy walks root, queues the reads of its regular files and
// returns once the walk is done, with the reads running; wait returns
// the pre-copy when they are done.
func startPrecopy(ctx context.Context, root *beneath.Dir, maxData int64) (*speculation, error) {
	s := &speculation{pre: &precopied{start: time.Now(), files: map[string]*preFile{}}}
	s.g.SetLimit(max(2, runtime.GOMAXPROCS(0)))
	var total int64
	err := beneath.Walk(ctx, root, func(d *beneath.Dir, name string) (*beneath.Dir, error) {
		st, err := d.Lstat(name)
		var e *upperEntry
		var x *beneath.Entry
		var sub *beneath.Dir
		if err == nil {
			e, x, sub, err = openEntry(d, name, st)
		}
		if err != nil {
			// Read again, frozen, where it is an error if it still
			// is one.
			s.broken = true
			return nil, nil
		}
		if e == nil {
			return sub, nil
		}
		s.entries = append(s.entries, e)
		if x == nil {
			return sub, nil
		}
		st = x.Stat()
		total += st.Size
		if maxData > 0 && total > maxData {
			x.Close()
			return nil, tooLarge(maxData)
		}
		e.ready = make(chan struct{})
		s.g.Go(func() error {
			defer close(e.ready)
			defer x.Close()
			var err error
			e.xattrs, e.data, err = readFile(ctx, x)
			if stale(err) {
				e.readErr = errStale
				s.mu.Lock()
				s.broken = true
				s.mu.Unlock()
				return nil
			}
			if err != nil {
				e.readErr = err
				return fmt.Errorf("%s: %w", e.rel, err)
			}
			if st.Nlink == 1 {
				s.mu.Lock()
				s.pre.files[e.rel] = &preFile{st: *st, xattrs: e.xattrs, data: e.data, dir: d}
				s.mu.Unlock()
			}
			return nil
		})
		return nil, nil
	})
	if err != nil {
		_ = s.g.Wait()
		return nil, fmt.Errorf("pre-copy of the writable layer: %w", err)
	}
	sortEntries(s.entries)
	return s, nil
}

// errStale marks an entry a speculation could not read as walked.
var errStale = errors.New("changed while the pre-copy read it")

// wait waits for the pre-copy's reads.
func (s *speculation) wait() (*precopied, error) {
	if err := s.g.Wait(); err != nil {
		return nil, fmt.Errorf("pre-copy of the writable layer: %w", err)
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

// capture reads all of the upper directory beneath root that a diff
// holds into memory: what WriteUpperTar would write of it, without a file
// left to read. With pre == nil the result is exact only if nothing
// writes to upper meanwhile: it is what runs while the container is
// frozen, with a few workers reading file data.
//
// With pre (read by precopy while the container ran), a regular file
// that pre.unchanged says cannot have changed since, reached through the
// same directories, is taken from the pre-copy, data and xattrs; every
// other file (changed, new, with several names, or in dirty: mapped
// shared and writable by a process of the container) is read again, and
// everything else (directories, symlinks, devices, whiteouts) is read
// here. More than maxData bytes of file data (0: no cap) fail with
// ErrDiffTooLarge.
func capture(ctx context.Context, root *beneath.Dir, pre *precopied, dirty *mapped, maxData int64) (*captured, error) {
	out := &captured{}
	var g errgroup.Group
	g.SetLimit(max(2, runtime.GOMAXPROCS(0)))
	first := map[inode]*upperEntry{}
	var later []*upperEntry // further names of an inode already read
	var total int64
	addData := func(size int64) error {
		total += size
		if maxData > 0 && total > maxData {
			return tooLarge(maxData)
		}
		return nil
	}
	err := beneath.Walk(ctx, root, func(d *beneath.Dir, name string) (*beneath.Dir, error) {
		st, err := d.Lstat(name)
		if err != nil {
			return nil, err
		}
		rel := d.Join(name)
		if st.Mode&unix.S_IFMT == unix.S_IFREG && st.Nlink == 1 {
			if f, ok := pre.unchanged(rel, d, st); ok && !dirty.has(rel, inode{st.Dev, st.Ino}) {
				if err := addData(st.Size); err != nil {
					return nil, err
				}
				out.entries = append(out.entries, &upperEntry{rel: rel, fi: beneath.FileInfo(name, st), xattrs: f.xattrs, data: f.data})
				out.Reused++
				return nil, nil
			}
		}
		e, x, sub, err := openEntry(d, name, st)
		if err != nil || e == nil {
			return sub, err
		}
		out.entries = append(out.entries, e)
		if x == nil {
			return sub, nil
		}
		// What is read is the file the descriptor holds, stated through
		// it.
		st = x.Stat()
		if err := addData(st.Size); err != nil {
			x.Close()
			return nil, err
		}
		if st.Nlink > 1 {
			key := inode{st.Dev, st.Ino}
			if _, ok := first[key]; ok {
				later = append(later, e)
				x.Close()
				return nil, nil
			}
			first[key] = e
		}
		out.Copied++
		g.Go(func() error {
			defer x.Close()
			var err error
			e.xattrs, e.data, err = readFile(ctx, x)
			return err
		})
		return nil, nil
	})
	if werr := g.Wait(); err == nil {
		err = werr
	}
	if err != nil {
		return nil, fmt.Errorf("read the writable layer: %w", err)
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
