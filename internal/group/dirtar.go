package group

import (
	"archive/tar"
	"context"
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
)

// DirOptions control how a directory becomes a layer.
type DirOptions struct {
	// Prefix is where the directory's contents land in the image
	// (e.g. "/opt/harness"); "" or "/" means the image root.
	Prefix string
	// UID and GID, when not nil, replace every entry's owner (a harness
	// built as an unprivileged user is usually published as root).
	UID, GID *int
	// ModeMask, when non-zero, is ANDed into every entry's permission bits
	// (e.g. 0o755 strips group/other write).
	ModeMask fs.FileMode
	// ModTime, when not nil, replaces every entry's mtime, so a rebuilt
	// directory with the same contents publishes byte-identical layers.
	ModTime *time.Time
}

// WriteDirTar writes dir as a tar stream, entries in lexical path order with
// parents of Prefix first, so the same tree always gives the same bytes
// (and, through the deterministic converter, the same layer digest).
func WriteDirTar(ctx context.Context, w io.Writer, dir string, o DirOptions) error {
	tw := tar.NewWriter(w)
	prefix := strings.Trim(path.Clean("/"+o.Prefix), "/")
	if prefix != "" {
		// Parents of the prefix are synthetic; the prefix itself is the
		// source directory's own entry, written by the walk below.
		parts := strings.Split(prefix, "/")
		for i := range parts[:len(parts)-1] {
			hdr := &tar.Header{Typeflag: tar.TypeDir, Name: strings.Join(parts[:i+1], "/") + "/", Mode: 0o755, Format: tar.FormatPAX}
			if o.ModTime != nil {
				hdr.ModTime = *o.ModTime
			} else {
				hdr.ModTime = time.Unix(0, 0)
			}
			if err := tw.WriteHeader(hdr); err != nil {
				return fmt.Errorf("write prefix %s: %w", hdr.Name, err)
			}
		}
	}
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		paths = append(paths, p)
		return nil
	})
	if err != nil {
		return fmt.Errorf("walk %s: %w", dir, err)
	}
	sort.Strings(paths)
	// Hard links: the first path of an inode carries the data, the others
	// link to it, as tar(1) does.
	type inodeKey struct{ dev, ino uint64 }
	links := map[inodeKey]string{}
	for _, p := range paths {
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		name := path.Join(prefix, filepath.ToSlash(rel))
		if rel == "." {
			if prefix == "" {
				continue
			}
			name = prefix
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return fmt.Errorf("stat %s: %w", p, err)
		}
		var target string
		if fi.Mode()&fs.ModeSymlink != 0 {
			if target, err = os.Readlink(p); err != nil {
				return fmt.Errorf("readlink %s: %w", p, err)
			}
		}
		hdr, err := tar.FileInfoHeader(fi, target)
		if err != nil {
			return fmt.Errorf("tar header for %s: %w", p, err)
		}
		hdr.Name = name
		hdr.Format = tar.FormatPAX
		// Names of the building user's account do not belong in an image.
		hdr.Uname, hdr.Gname = "", ""
		hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
		if fi.IsDir() {
			hdr.Name += "/"
		}
		if o.UID != nil {
			hdr.Uid = *o.UID
		}
		if o.GID != nil {
			hdr.Gid = *o.GID
		}
		if o.ModeMask != 0 {
			hdr.Mode = hdr.Mode&^0o777 | hdr.Mode&int64(o.ModeMask.Perm())
		}
		if o.ModTime != nil {
			hdr.ModTime = *o.ModTime
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && fi.Mode().IsRegular() && st.Nlink > 1 {
			key := inodeKey{uint64(st.Dev), st.Ino}
			if first, seen := links[key]; seen {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				links[key] = name
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("write header %s: %w", name, err)
		}
		if hdr.Typeflag == tar.TypeReg {
			f, err := os.Open(p)
			if err != nil {
				return fmt.Errorf("open %s: %w", p, err)
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return fmt.Errorf("copy %s: %w", p, err)
			}
		}
	}
	return tw.Close()
}
