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
	var st DiffStats
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			paths = append(paths, p)
		}
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("walk %s: %w", dir, err)
	}
	sort.Strings(paths)
	tw := tar.NewWriter(w)
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	for _, p := range paths {
		if err := ctx.Err(); err != nil {
			return st, err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return st, err
		}
		name := filepath.ToSlash(rel)
		fi, err := os.Lstat(p)
		if err != nil {
			return st, fmt.Errorf("stat %s: %w", name, err)
		}
		sys, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return st, fmt.Errorf("stat %s: no unix stat", name)
		}
		mode := fi.Mode()
		if mode&fs.ModeSocket != 0 {
			continue
		}
		if mode&fs.ModeCharDevice != 0 && sys.Rdev == 0 {
			hdr := whiteoutHeader(path.Join(path.Dir(name), whiteoutPrefix+path.Base(name)))
			if err := tw.WriteHeader(hdr); err != nil {
				return st, fmt.Errorf("write whiteout for %s: %w", name, err)
			}
			st.Entries++
			st.Whiteouts++
			continue
		}
		xattrs, opaque, err := readXattrs(p)
		if err != nil {
			return st, fmt.Errorf("%s: %w", name, err)
		}
		var target string
		if mode&fs.ModeSymlink != 0 {
			if target, err = os.Readlink(p); err != nil {
				return st, fmt.Errorf("readlink %s: %w", name, err)
			}
		}
		hdr, err := tarheader.FileInfoHeaderNoLookups(fi, target)
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
		for k, v := range xattrs {
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
			if err := copyFile(tw, p, hdr.Size); err != nil {
				return st, fmt.Errorf("copy %s: %w", name, err)
			}
		}
		if opaque {
			if err := tw.WriteHeader(whiteoutHeader(path.Join(name, whiteoutOpaque))); err != nil {
				return st, fmt.Errorf("write opaque marker for %s: %w", name, err)
			}
			st.Entries++
			st.Opaque++
		}
	}
	if err := tw.Close(); err != nil {
		return st, fmt.Errorf("finish diff tar: %w", err)
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
	f, err := os.Open(p)
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
