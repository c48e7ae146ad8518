package envsnapshot

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive/tarheader"
	"github.com/containerd/continuity/sysx"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
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
	entries, err := scanUpper(ctx, dir)
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
	// capture), else read from path as the diff is written.
	data *fileData
	path string
	// ready, when set, is closed once data (or readErr) is in place: the
	// entry's read may still be running (see speculation).
	ready   chan struct{}
	readErr error
}

// scanUpper lists dir's entries in lexical order with what a diff needs
// of each but the data of regular files.
func scanUpper(ctx context.Context, dir string) ([]*upperEntry, error) {
	var entries []*upperEntry
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if p == dir {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return fmt.Errorf("stat %s: %w", rel, err)
		}
		e, err := describeEntry(p, rel, fi)
		if err != nil || e == nil {
			return err
		}
		e.path = p
		entries = append(entries, e)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("walk %s: %w", dir, err)
	}
	sortEntries(entries)
	return entries, nil
}

// describeEntry reads the xattrs and symlink target of the entry at p,
// stated as fi. It returns nil for what a diff leaves out (sockets).
func describeEntry(p, rel string, fi fs.FileInfo) (*upperEntry, error) {
	e := &upperEntry{rel: rel, fi: fi}
	mode := fi.Mode()
	switch {
	case mode&fs.ModeSocket != 0:
		return nil, nil
	case isWhiteout(fi):
		return e, nil
	}
	var err error
	if e.xattrs, e.opaque, err = readXattrs(p); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.ToSlash(rel), err)
	}
	if mode&fs.ModeSymlink != 0 {
		if e.link, err = os.Readlink(p); err != nil {
			return nil, fmt.Errorf("readlink %s: %w", filepath.ToSlash(rel), err)
		}
	}
	return e, nil
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
			<-e.ready
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
				err = copyFile(tw, e.path, hdr.Size)
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

// copyFile copies exactly size bytes of p: a file that changed size since
// it was stated is an inconsistent source, not something to paper over.
func copyFile(w io.Writer, p string, size int64) error {
	f, err := openFile(p, unix.O_RDONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(w, io.LimitReader(f, size))
	if err != nil {
		return err
	}
	if n != size {
		return fmt.Errorf("file shrank from %d to %d bytes while being read", size, n)
	}
	return nil
}

// readXattrs returns p's extended attributes without overlay's own, and
// whether p is an opaque directory. Overlay features whose state lives in
// lower layers are refused (see WriteUpperTar).
func readXattrs(p string) (map[string]string, bool, error) {
	keys, err := sysx.LListxattr(p)
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("list xattrs: %w", err)
	}
	var out map[string]string
	opaque := false
	for _, k := range keys {
		v, err := sysx.LGetxattr(p, k)
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
