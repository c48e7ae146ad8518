package envsnapshot

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive/tarheader"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/beneath"
)

// OCI whiteout names (image-spec layer.md, "Whiteouts").
const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

// ErrDiffTooLarge is returned when a diff exceeds the configured cap.
var ErrDiffTooLarge = errors.New("diff larger than the configured cap")

// DiffStats describes a diff written by WriteUpperTar.
type DiffStats struct {
	Entries   int   // tar entries, whiteouts included
	Whiteouts int   // ".wh.<name>" entries
	Opaque    int   // ".wh..wh..opq" entries
	DataBytes int64 // regular file bytes
}

// WriteUpperTar writes dir, an overlayfs upper directory (or a faithful copy
// of one), to w as an OCI layer tar: a character device 0/0 (overlay's
// whiteout) becomes an empty ".wh.<name>" file, a directory with the
// trusted.overlay.opaque=y (or user.overlay.opaque=y) xattr gets a
// ".wh..wh..opq" entry, and every other entry keeps its type, mode, owner,
// nanosecond mtime, device numbers and extended attributes except overlay's
// own (trusted.overlay.*, user.overlay.*). Files sharing an inode become one
// regular entry plus hard links to it. Sparse files are written densely
// (the layer format has no holes; zstd compresses runs of zeros to almost
// nothing). Sockets are skipped, as containerd's differ does.
//
// Entries are written in lexical path order, so the same tree gives the
// same tar. A tree holding more than maxData bytes of file data (0: no cap)
// fails with ErrDiffTooLarge.
//
// An upper made with overlayfs' redirect_dir or metacopy features keeps
// file data or directory contents in lower layers, which a diff of the
// upper alone cannot express: such an upper is refused (both features are
// off unless the kernel or the mount enables them).
func WriteUpperTar(ctx context.Context, w io.Writer, dir string, maxData int64) (DiffStats, error) {
	root, err := beneath.OpenRoot(dir)
	if err != nil {
		return DiffStats{}, err
	}
	defer root.Close()
	entries, err := scanUpper(ctx, root)
	if err != nil {
		return DiffStats{}, err
	}
	tw := tar.NewWriter(w)
	st, err := writeDiff(ctx, tw, entries, maxData)
	if err != nil {
		return st, err
	}
	if err := tw.Close(); err != nil {
		return st, fmt.Errorf("finish diff tar: %w", err)
	}
	return st, nil
}

// tarSink receives a diff's entries: a tar.Writer, or a layerfmt.Writer
// that encodes them as they come, with no tar stream to parse again.
type tarSink interface {
	WriteHeader(hdr *tar.Header) error
	Write(p []byte) (int, error)
}

// upperEntry is one entry of an upper directory as a diff writes it.
type upperEntry struct {
	rel    string
	fi     fs.FileInfo
	xattrs map[string]string // without overlay's own
	opaque bool
	link   string // a symlink's target
	// A regular file's data: data when it was read into memory (see
	// capture), else read from beneath root as the diff is written.
	data *fileData
	root *beneath.Dir
	// ready, when set, is closed once data (or readErr) is in place: the
	// entry's read may still be running (see speculation).
	ready   chan struct{}
	readErr error
}

// scanUpper lists root's entries in lexical order with what a diff needs
// of each but the data of regular files, which writeDiff reads beneath
// root, checking that each is still the file scanned.
func scanUpper(ctx context.Context, root *beneath.Dir) ([]*upperEntry, error) {
	var entries []*upperEntry
	err := beneath.Walk(ctx, root, func(d *beneath.Dir, name string) (*beneath.Dir, error) {
		st, err := d.Lstat(name)
		if err != nil {
			return nil, err
		}
		e, x, sub, err := openEntry(d, name, st)
		if x != nil {
			defer x.Close()
			var f *beneath.File
			if f, err = x.OpenFile(); err != nil {
				return nil, err
			}
			e.xattrs, _, err = readXattrs(f)
			f.Close()
			if err != nil {
				return nil, fmt.Errorf("%s: %w", e.rel, err)
			}
			e.root = root
		}
		if e != nil {
			entries = append(entries, e)
		}
		return sub, err
	})
	if err != nil {
		return nil, fmt.Errorf("walk upper: %w", err)
	}
	sortEntries(entries)
	return entries, nil
}

// openEntry reads what a diff needs of d's entry name, stated as st, but
// a regular file's data: its stat, xattrs, opaque marker and symlink target, each
// through one descriptor of it. It returns a nil entry for what a diff
// leaves out (sockets); for a directory, the directory opened, to walk;
// for a regular file, its descriptor, open, for the caller to read
// (readFile) and close.
func openEntry(d *beneath.Dir, name string, st *syscall.Stat_t) (e *upperEntry, file *beneath.Entry, sub *beneath.Dir, err error) {
	// A name can change type between its stat and its open while the
	// container runs (never while it is frozen): state it again, a few
	// times, then give up with ErrChanged.
	for try := 0; ; try++ {
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			e, sub, err = openDirEntry(d, name)
			if !errors.Is(err, unix.ENOTDIR) && !errors.Is(err, unix.ELOOP) {
				return e, nil, sub, err
			}
		} else {
			e, file, err = openOtherEntry(d, name)
			if !errors.Is(err, errIsDir) {
				return e, file, nil, err
			}
		}
		if try == 3 {
			return nil, nil, nil, fmt.Errorf("%s: %w", d.Join(name), beneath.ErrChanged)
		}
		if st, err = d.Lstat(name); err != nil {
			return nil, nil, nil, err
		}
	}
}

// errIsDir: a name stated as something else is now a directory.
var errIsDir = errors.New("a directory now")

// openDirEntry opens d's directory name and reads its xattrs.
func openDirEntry(d *beneath.Dir, name string) (*upperEntry, *beneath.Dir, error) {
	sub, err := d.OpenDir(name)
	if err != nil {
		return nil, nil, err
	}
	e := &upperEntry{rel: sub.Rel(), fi: sub.Info()}
	if e.xattrs, e.opaque, err = readXattrs(sub); err != nil {
		sub.Close()
		return nil, nil, fmt.Errorf("%s: %w", e.rel, err)
	}
	return e, sub, nil
}

// openOtherEntry opens d's entry name, anything but a directory, O_PATH,
// and reads what a diff needs of it through that descriptor but a regular
// file's data and xattrs: for a regular file it returns the descriptor.
func openOtherEntry(d *beneath.Dir, name string) (*upperEntry, *beneath.Entry, error) {
	x, err := d.Open(name)
	if err != nil {
		return nil, nil, err
	}
	// From here on, what the descriptor holds, whatever the name was
	// when it was stated.
	fi := x.Info()
	mode := fi.Mode()
	e := &upperEntry{rel: x.Rel(), fi: fi}
	switch {
	case mode.IsRegular():
		return e, x, nil
	case mode.IsDir():
		x.Close()
		return nil, nil, errIsDir
	}
	defer x.Close()
	switch {
	case mode&fs.ModeSocket != 0:
		return nil, nil, nil
	case isWhiteout(fi):
		return e, nil, nil
	}
	if e.xattrs, e.opaque, err = readXattrs(x); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", e.rel, err)
	}
	if mode&fs.ModeSymlink != 0 {
		if e.link, err = x.Readlink(); err != nil {
			return nil, nil, err
		}
	}
	return e, nil, nil
}

// isWhiteout reports whether fi is overlay's whiteout, a character device
// 0/0.
func isWhiteout(fi fs.FileInfo) bool {
	sys, ok := fi.Sys().(*syscall.Stat_t)
	return ok && fi.Mode()&fs.ModeCharDevice != 0 && sys.Rdev == 0
}

// sortEntries puts entries in the order a diff lists them.
func sortEntries(entries []*upperEntry) {
	sort.Slice(entries, func(i, j int) bool { return entries[i].rel < entries[j].rel })
}

// writeDiff writes entries (in lexical order) to tw as WriteUpperTar
// does, and leaves tw open.
func writeDiff(ctx context.Context, tw tarSink, entries []*upperEntry, maxData int64) (DiffStats, error) {
	var st DiffStats
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		name := filepath.ToSlash(e.rel)
		if e.ready != nil {
			select {
			case <-e.ready:
			case <-ctx.Done():
				return st, ctx.Err()
			}
			if e.readErr != nil {
				return st, fmt.Errorf("read %s: %w", name, e.readErr)
			}
		}
		fi := e.fi
		sys, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return st, fmt.Errorf("stat %s: no unix stat", name)
		}
		mode := fi.Mode()
		if mode&fs.ModeSocket != 0 {
			continue
		}
		if isWhiteout(fi) {
			hdr := whiteoutHeader(path.Join(path.Dir(name), whiteoutPrefix+path.Base(name)))
			if err := tw.WriteHeader(hdr); err != nil {
				return st, fmt.Errorf("write whiteout for %s: %w", name, err)
			}
			st.Entries++
			st.Whiteouts++
			continue
		}
		hdr, err := tarheader.FileInfoHeaderNoLookups(fi, e.link)
		if err != nil {
			return st, fmt.Errorf("tar header for %s: %w", name, err)
		}
		hdr.Name = name
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Format = tar.FormatPAX
		hdr.Uname, hdr.Gname = "", ""
		hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
		for k, v := range e.xattrs {
			if hdr.PAXRecords == nil {
				hdr.PAXRecords = map[string]string{}
			}
			hdr.PAXRecords["SCHILY.xattr."+k] = v
		}
		if mode.IsRegular() && sys.Nlink > 1 {
			key := inode{uint64(sys.Dev), sys.Ino}
			if first, seen := links[key]; seen {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				links[key] = name
			}
		}
		if hdr.Typeflag == tar.TypeReg {
			st.DataBytes += hdr.Size
			if maxData > 0 && st.DataBytes > maxData {
				return st, fmt.Errorf("%w: over %d bytes of file data: %w", ErrDiffTooLarge, maxData, errdefs.ErrResourceExhausted)
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return st, fmt.Errorf("write header %s: %w", name, err)
		}
		st.Entries++
		if hdr.Typeflag == tar.TypeReg && hdr.Size > 0 {
			if e.data != nil {
				err = e.data.writeTo(tw, hdr.Size)
			} else {
				err = copyFile(ctx, tw, e.root, e.rel, sys)
			}
			if err != nil {
				return st, fmt.Errorf("copy %s: %w", name, err)
			}
		}
		if e.opaque {
			if err := tw.WriteHeader(whiteoutHeader(path.Join(name, whiteoutOpaque))); err != nil {
				return st, fmt.Errorf("write opaque marker for %s: %w", name, err)
			}
			st.Entries++
			st.Opaque++
		}
	}
	return st, nil
}

// whiteoutHeader is an OCI whiteout entry; containerd's differ dates them
// at the epoch too, so the same deletions give the same bytes.
func whiteoutHeader(name string) *tar.Header {
	epoch := time.Unix(0, 0).UTC()
	return &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, ModTime: epoch, Format: tar.FormatPAX}
}

// copyFile copies the regular file at rel beneath root, which must still
// be the inode st describes, and exactly st.Size bytes of it: a file that
// changed since it was stated is an inconsistent source, not something to
// paper over.
func copyFile(ctx context.Context, w io.Writer, root *beneath.Dir, rel string, st *syscall.Stat_t) error {
	x, err := root.Lookup(rel)
	if err != nil {
		return err
	}
	defer x.Close()
	if now := x.Stat(); now.Dev != st.Dev || now.Ino != st.Ino {
		return fmt.Errorf("%s: another file than the one listed: %w", rel, beneath.ErrChanged)
	}
	f, err := x.OpenFile()
	if err != nil {
		return err
	}
	defer f.Close()
	buf := make([]byte, min(st.Size, 1<<20))
	for off := int64(0); off < st.Size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := f.ReadAt(buf[:min(int64(len(buf)), st.Size-off)], off)
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("file shrank from %d to %d bytes while being read", st.Size, off+int64(n))
		}
		if err != nil {
			return err
		}
		if _, err := w.Write(buf[:n]); err != nil {
			return err
		}
		off += int64(n)
	}
	return nil
}

// xattrSource is an entry of the upper directory held by a descriptor.
type xattrSource interface {
	ListXattrs() ([]string, error)
	GetXattr(key string) ([]byte, error)
}

// readXattrs returns x's extended attributes without overlay's own, and
// whether x is an opaque directory. Overlay features whose state lives in
// lower layers are refused (see WriteUpperTar).
func readXattrs(x xattrSource) (map[string]string, bool, error) {
	keys, err := x.ListXattrs()
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("list xattrs: %w", err)
	}
	var out map[string]string
	opaque := false
	for _, k := range keys {
		v, err := x.GetXattr(k)
		if err != nil {
			if errors.Is(err, unix.ENODATA) {
				continue // removed since it was listed
			}
			return nil, false, fmt.Errorf("get xattr %s: %w", k, err)
		}
		if rest, ok := overlayXattr(k); ok {
			switch rest {
			case "opaque":
				opaque = string(v) == "y"
			case "redirect", "metacopy":
				return nil, false, fmt.Errorf("overlay %s xattr: uppers made with overlayfs redirect_dir or metacopy cannot be snapshotted: %w", rest, errdefs.ErrNotImplemented)
			}
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[k] = string(v)
	}
	return out, opaque, nil
}

// overlayXattr reports whether k is one of overlayfs' private attributes
// and returns its name after the prefix.
func overlayXattr(k string) (string, bool) {
	for _, prefix := range []string{"trusted.overlay.", "user.overlay."} {
		if rest, ok := strings.CutPrefix(k, prefix); ok {
			return rest, true
		}
	}
	return "", false
}
