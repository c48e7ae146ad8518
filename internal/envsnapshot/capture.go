package envsnapshot

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/continuity/sysx"
	"github.com/containerd/errdefs"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// measure sums the file data below an upper directory, so an oversized
// diff is refused before the container is frozen.
func measure(dir string, maxData int64) (int64, error) {
	var total int64
	err := filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		total += fi.Size()
		if maxData > 0 && total > maxData {
			return fmt.Errorf("%w: over %d bytes of file data: %w", ErrDiffTooLarge, maxData, errdefs.ErrResourceExhausted)
		}
		return nil
	})
	if err != nil {
		return total, fmt.Errorf("measure %s: %w", dir, err)
	}
	return total, nil
}

// precopySlack is how long before a pre-copy started a file must have
// last changed (its ctime) for the pre-copied data to be reused. The
// kernel stamps ctime from a coarse clock that lags by at most a jiffy
// (<= 10 ms); the rest covers small steps of the wall clock.
const precopySlack = time.Second

// staged is a copied upper directory and, for the regular files copied
// with their data, what lstat said before the data was read.
type staged struct {
	dir   string
	start time.Time
	files map[string]unix.Stat_t
	// made lists every path a pre-copy created (true for directories),
	// including files whose copy did not complete.
	made map[string]bool
	// Reused counts files kept from the pre-copy; Copied the files whose
	// data was copied.
	Reused, Copied int
}

// inode identifies a file.
type inode struct{ dev, ino uint64 }

// stage copies an upper directory to dst, keeping everything WriteUpperTar
// reads: types, owners, modes, mtimes, xattrs (overlay's opaque marker
// included), whiteout devices, hard links and holes of sparse files. dst
// should be on tmpfs. It returns the directory that holds the copy.
//
// With pre == nil the copy is complete and exact only if nothing writes
// to upper meanwhile: it is what runs while the container is frozen. It
// does as few system calls as it can and copies file data with a few
// workers.
//
// With pre set (a pre-copy made by precopy while the container ran), the
// pre-copy is brought up to date in place, and dst is not used: a regular
// file whose inode, size, mode, mtime and ctime are those the pre-copy
// saw, and whose ctime is older than the pre-copy's start (less
// precopySlack), cannot have changed since (every write, truncate, chmod,
// chown, xattr change or link moves ctime), so its pre-copied file stays
// as it is; everything else is copied or made again, and what the upper
// no longer has is removed. Files in dirty (mapped shared and writable by
// a process of the container) and files with several names are always
// copied.
//
// continuity's fs.CopyDir does the same job but costs about twice the
// system calls per file (it reopens both files after a failed
// copy_file_range across file systems, fsyncs every file, and sets
// metadata by path), which is what the freeze is made of: 2,000 files and
// 24 MiB took it 1.1 s on a loaded 2-core machine.
func stage(upper, dst string, pre *staged, dirty *mapped) (*staged, error) {
	type dirMeta struct {
		src, dst string
		st       unix.Stat_t
	}
	if pre != nil {
		dst = pre.dir
	}
	out := &staged{dir: dst, start: time.Now()}
	var seen map[string]bool
	if pre != nil {
		seen = make(map[string]bool, len(pre.made))
	}
	// clear removes what the pre-copy made at rel before something else
	// is made there.
	clear := func(rel, target string) error {
		if _, ok := pre.madeAt(rel); !ok {
			return nil
		}
		if err := os.RemoveAll(target); err != nil {
			return fmt.Errorf("replace pre-copied %s: %w", rel, err)
		}
		return nil
	}
	var dirs []dirMeta
	firstCopy := map[inode]string{}
	var links [][3]string // [existing, new, new's rel]
	var g errgroup.Group
	g.SetLimit(max(2, runtime.GOMAXPROCS(0)))
	err := filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil {
			return err
		}
		if seen != nil {
			seen[rel] = true
		}
		target := filepath.Join(dst, rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return fmt.Errorf("stat %s: %w", rel, err)
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			if isDir, ok := pre.madeAt(rel); !ok || !isDir {
				if err := clear(rel, target); err != nil {
					return err
				}
				if err := os.Mkdir(target, 0o700); err != nil {
					return fmt.Errorf("mkdir %s: %w", rel, err)
				}
			}
			dirs = append(dirs, dirMeta{p, target, st})
			return nil
		case unix.S_IFREG:
			key := inode{st.Dev, st.Ino}
			if st.Nlink > 1 {
				if first, ok := firstCopy[key]; ok {
					links = append(links, [3]string{first, target, rel})
					return nil
				}
				firstCopy[key] = target
			} else if pre.unchanged(rel, &st) && !dirty.has(rel, key) {
				out.Reused++
				return nil
			}
			if err := clear(rel, target); err != nil {
				return err
			}
			out.Copied++
			g.Go(func() error { return copyRegular(p, target, &st) })
			return nil
		case unix.S_IFLNK:
			if err := clear(rel, target); err != nil {
				return err
			}
			link, err := os.Readlink(p)
			if err != nil {
				return err
			}
			if err := os.Symlink(link, target); err != nil {
				return err
			}
		case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO:
			if err := clear(rel, target); err != nil {
				return err
			}
			if err := unix.Mknod(target, st.Mode, int(st.Rdev)); err != nil {
				return fmt.Errorf("mknod %s: %w", rel, err)
			}
		default: // sockets: not part of a diff
			return nil
		}
		return setMeta(p, target, &st, -1)
	})
	if werr := g.Wait(); err == nil {
		err = werr
	}
	if err != nil {
		return nil, fmt.Errorf("copy upper %s: %w", upper, err)
	}
	for _, l := range links {
		if err := clear(l[2], l[1]); err != nil {
			return nil, fmt.Errorf("copy upper %s: %w", upper, err)
		}
		if err := os.Link(l[0], l[1]); err != nil {
			return nil, fmt.Errorf("copy upper %s: %w", upper, err)
		}
	}
	// What the pre-copy has and the upper no longer does. A path below
	// one already replaced is gone with it.
	for rel := range pre.madeAll() {
		if seen[rel] {
			continue
		}
		target := filepath.Join(dst, rel)
		var st unix.Stat_t
		if err := unix.Lstat(target, &st); err != nil {
			continue
		}
		if err := os.RemoveAll(target); err != nil {
			return nil, fmt.Errorf("copy upper %s: remove %s: %w", upper, rel, err)
		}
	}
	// Directories last, deepest first: filling a directory moves its
	// mtime, and a mode without write permission would stop the filling.
	for _, d := range slices.Backward(dirs) {
		if err := setMeta(d.src, d.dst, &d.st, -1); err != nil {
			return nil, fmt.Errorf("copy upper %s: %w", upper, err)
		}
	}
	return out, nil
}

// madeAt reports whether the pre-copy made rel, and if it is a directory.
func (pre *staged) madeAt(rel string) (isDir, ok bool) {
	if pre == nil {
		return false, false
	}
	isDir, ok = pre.made[rel]
	return isDir, ok
}

// madeAll is every path the pre-copy made (none for no pre-copy).
func (pre *staged) madeAll() map[string]bool {
	if pre == nil {
		return nil
	}
	return pre.made
}

// unchanged reports whether the pre-copy holds rel's current data and
// metadata (see stage).
func (pre *staged) unchanged(rel string, st *unix.Stat_t) bool {
	if pre == nil {
		return false
	}
	old, ok := pre.files[rel]
	if !ok {
		return false
	}
	limit := pre.start.Add(-precopySlack)
	return old.Ino == st.Ino && old.Dev == st.Dev && old.Size == st.Size && old.Mode == st.Mode &&
		old.Mtim == st.Mtim && old.Ctim == st.Ctim &&
		time.Unix(st.Ctim.Unix()).Before(limit)
}

// precopy copies the regular files (with one name) of upper to dst while
// the container still runs, recording what each looked like before its
// data was read, so that stage, frozen, keeps the unchanged ones instead
// of copying them. It copies nothing else: the frozen pass re-creates
// directories, links, symlinks and devices, which cost no data. Entries
// that vanish while it walks are skipped; any other error is returned
// and the caller copies everything while frozen.
func precopy(upper, dst string) (*staged, error) {
	out := &staged{dir: dst, start: time.Now(), files: map[string]unix.Stat_t{}, made: map[string]bool{}}
	var mu sync.Mutex
	var g errgroup.Group
	g.SetLimit(max(2, runtime.GOMAXPROCS(0)))
	err := filepath.WalkDir(upper, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, iofs.ErrNotExist) {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(upper, p)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		if d.IsDir() {
			if err := os.Mkdir(target, 0o700); err != nil {
				return fmt.Errorf("mkdir %s: %w", rel, err)
			}
			out.made[rel] = true
			return nil
		}
		if !d.Type().IsRegular() {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			if errors.Is(err, unix.ENOENT) {
				return nil
			}
			return fmt.Errorf("stat %s: %w", rel, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink != 1 {
			return nil
		}
		out.made[rel] = false
		g.Go(func() error {
			err := copyRegular(p, target, &st)
			if errors.Is(err, iofs.ErrNotExist) {
				return nil
			}
			if err == nil {
				mu.Lock()
				out.files[rel] = st
				mu.Unlock()
			}
			return err
		})
		return nil
	})
	if werr := g.Wait(); err == nil {
		err = werr
	}
	if err != nil {
		return nil, fmt.Errorf("pre-copy upper %s: %w", upper, err)
	}
	out.Copied = len(out.files)
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

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 128<<10); return &b }}

func copyRegular(src, dst string, st *unix.Stat_t) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer out.Close()
	buf := copyBufs.Get().(*[]byte)
	if st.Blocks*512 < st.Size {
		err = copyHoles(out, in, st.Size, *buf)
	} else {
		// Plain reads and writes: copy_file_range fails across file
		// systems (upper on disk, staging on tmpfs), and the failed
		// attempt costs a system call per file.
		_, err = io.CopyBuffer(struct{ io.Writer }{out}, struct{ io.Reader }{in}, *buf)
	}
	copyBufs.Put(buf)
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	if err := setMeta(src, dst, st, int(out.Fd())); err != nil {
		return err
	}
	return out.Close()
}

// copyHoles copies the first size bytes of a sparse file: only its data
// extents (SEEK_DATA, SEEK_HOLE), leaving the holes as holes, so a mostly
// empty file costs the staging tmpfs and the freeze what it holds, not
// its length.
func copyHoles(out, in *os.File, size int64, buf []byte) error {
	fd := int(in.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // holes up to the end
		}
		if err != nil {
			return fmt.Errorf("seek data from %d: %w", off, err)
		}
		if data >= size {
			break
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole from %d: %w", data, err)
		}
		hole = min(hole, size)
		if _, err := io.CopyBuffer(io.NewOffsetWriter(out, data), io.NewSectionReader(in, data, hole-data), buf); err != nil {
			return err
		}
		off = hole
	}
	return out.Truncate(size)
}

// setMeta gives dst src's xattrs, owner, mode and times (fd >= 0: dst is
// open as fd). Owner before mode: chown clears setuid and setgid.
func setMeta(src, dst string, st *unix.Stat_t, fd int) error {
	if err := copyXattrs(src, dst); err != nil {
		return err
	}
	if fd >= 0 {
		if err := unix.Fchown(fd, int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("chown %s: %w", dst, err)
		}
		if err := unix.Fchmod(fd, st.Mode&0o7777); err != nil {
			return fmt.Errorf("chmod %s: %w", dst, err)
		}
	} else {
		if err := unix.Lchown(dst, int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("chown %s: %w", dst, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			if err := unix.Chmod(dst, st.Mode&0o7777); err != nil {
				return fmt.Errorf("chmod %s: %w", dst, err)
			}
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, dst, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times of %s: %w", dst, err)
	}
	return nil
}

func copyXattrs(src, dst string) error {
	keys, err := sysx.LListxattr(src)
	if err != nil {
		if errors.Is(err, syscall.ENOTSUP) {
			return nil
		}
		return fmt.Errorf("list xattrs of %s: %w", src, err)
	}
	for _, k := range keys {
		v, err := sysx.LGetxattr(src, k)
		if err != nil {
			return fmt.Errorf("get xattr %s of %s: %w", k, src, err)
		}
		if err := sysx.LSetxattr(dst, k, v, 0); err != nil {
			return fmt.Errorf("set xattr %s on %s: %w", k, dst, err)
		}
	}
	return nil
}

// stagingRoot picks where staged copies go: dir if set, else /dev/shm when
// it is a tmpfs with room for twice the diff, else the system temporary
// directory.
func stagingRoot(dir string, need int64) string {
	if dir != "" {
		return dir
	}
	var st unix.Statfs_t
	if unix.Statfs("/dev/shm", &st) == nil && st.Type == unix.TMPFS_MAGIC && int64(st.Bavail)*st.Bsize > 2*need {
		return "/dev/shm"
	}
	return os.TempDir()
}
