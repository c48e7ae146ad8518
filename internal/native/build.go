//go:build linux

package native

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/layerfmt"
)

// Chunks returns the compressed bytes of a frame, verified against its
// digest (chunkcache.Cache.Get), or false when it has none.
type Chunks interface {
	Get(d digest.Digest) ([]byte, bool)
}

// blockSize is what file sizes are rounded up to, and what a directory is
// charged (TreeSize): the disk a copy takes, not its byte count.
const blockSize = 4096

// ErrChunkMissing reports that a chunk of the layer is not in the chunk
// source (or failed its verification there): the layer is not fully
// present, or a cached chunk is corrupt.
var ErrChunkMissing = errors.New("chunk not available")

// BuildTree writes the overlayfs lower directory of the layer toc
// describes into dir, which must not exist: the tree overlayfs would get
// from containerd's overlay applier, as the FUSE mount of the layer
// presents it (layerfmt.TOC.OverlayChild). File bytes come only from
// chunks, each decoded from a frame the chunk source verified; a missing
// or corrupt chunk fails the build. On error dir may hold a partial tree:
// callers build under a temporary name.
func BuildTree(ctx context.Context, dir string, toc *layerfmt.TOC, chunks Chunks) error {
	b := &builder{ctx: ctx, toc: toc, chunks: chunks, made: map[int]string{}}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("build native layer: %w", err)
	}
	var dirs []dirEntry // directories in breadth-first order
	dirs = append(dirs, dirEntry{idx: 0, path: dir})
	var links []linkEntry
	for q := 0; q < len(dirs); q++ {
		d := dirs[q]
		first, n := toc.ChildRange(d.idx)
		for k := first; k < first+n; k++ {
			if err := ctx.Err(); err != nil {
				return err
			}
			idx, name, whiteout, ok := toc.OverlayChild(d.idx, k)
			if !ok {
				continue
			}
			p := filepath.Join(d.path, name)
			switch {
			case whiteout:
				if err := b.whiteout(p, idx); err != nil {
					return err
				}
			case toc.Type(idx) == layerfmt.TypeDir:
				if err := os.Mkdir(p, 0o700); err != nil {
					return fmt.Errorf("build native layer: %w", err)
				}
				dirs = append(dirs, dirEntry{idx: idx, path: p})
			case idx != k:
				// A hard link: made once every entry it may point
				// at exists.
				links = append(links, linkEntry{target: idx, path: p})
			default:
				if err := b.materialize(p, idx); err != nil {
					return err
				}
			}
		}
	}
	for _, l := range links {
		if first, ok := b.made[l.target]; ok {
			if err := os.Link(first, l.path); err != nil {
				return fmt.Errorf("build native layer: hard link %s: %w", l.path, err)
			}
			continue
		}
		// The target itself is not shown (a name too long for the
		// kernel): the first link holds the data, as in the FUSE view.
		if err := b.materialize(l.path, l.target); err != nil {
			return err
		}
	}
	// Directories last and deepest first: their mtimes change with every
	// entry made in them, and a read-only mode must not stop the build.
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		if err := b.setMeta(d.path, d.idx, true); err != nil {
			return err
		}
		if err := b.opaque(d.path, d.idx); err != nil {
			return err
		}
	}
	return nil
}

type dirEntry struct {
	idx  int
	path string
}

type linkEntry struct {
	target int
	path   string
}

type builder struct {
	ctx    context.Context
	toc    *layerfmt.TOC
	chunks Chunks
	made   map[int]string // entries with data, by TOC index: first path

	// The frame decoded last: files are laid out in blob order and small
	// files share frames, so each frame is decoded about once.
	frame    []byte
	frameOff int64
	frameOK  bool
}

// materialize creates the non-directory entry idx at p with its metadata.
func (b *builder) materialize(p string, idx int) error {
	t := b.toc
	e := t.Entry(idx)
	var err error
	switch e.Type {
	case layerfmt.TypeReg:
		err = b.writeFile(p, idx)
	case layerfmt.TypeSymlink:
		err = os.Symlink(e.Linkname, p)
	case layerfmt.TypeChar:
		err = unix.Mknod(p, unix.S_IFCHR, int(unix.Mkdev(e.Devmajor, e.Devminor)))
	case layerfmt.TypeBlock:
		err = unix.Mknod(p, unix.S_IFBLK, int(unix.Mkdev(e.Devmajor, e.Devminor)))
	case layerfmt.TypeFIFO:
		err = unix.Mknod(p, unix.S_IFIFO, 0)
	default:
		return nil // not presented by the FUSE view either
	}
	if err != nil {
		return fmt.Errorf("build native layer: create %s: %w", e.Name, err)
	}
	b.made[idx] = p
	return b.setMeta(p, idx, false)
}

// whiteout makes the overlayfs whiteout for OCI marker idx at p, with the
// marker's owner, as containerd's overlay applier does
// (archive.OverlayConvertWhiteout), and its mtime, as the FUSE view shows.
func (b *builder) whiteout(p string, idx int) error {
	e := b.toc.Entry(idx)
	if err := unix.Mknod(p, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("build native layer: whiteout %s: %w", e.Name, err)
	}
	if err := os.Lchown(p, e.UID, e.GID); err != nil {
		return fmt.Errorf("build native layer: whiteout %s: %w", e.Name, err)
	}
	return setMtime(p, e.ModTime)
}

// setMeta applies owner, mode, xattrs and mtime of entry idx to p, in the
// order that keeps each: chown clears setuid bits and file capabilities.
func (b *builder) setMeta(p string, idx int, dir bool) error {
	e := b.toc.Entry(idx)
	if err := os.Lchown(p, e.UID, e.GID); err != nil {
		return fmt.Errorf("build native layer: chown %s: %w", e.Name, err)
	}
	if e.Type != layerfmt.TypeSymlink {
		if err := unix.Chmod(p, b.toc.UnixMode(idx)&0o7777); err != nil {
			return fmt.Errorf("build native layer: chmod %s: %w", e.Name, err)
		}
	}
	for k, v := range e.Xattrs {
		if layerfmt.HiddenXattr(k) {
			continue
		}
		if err := unix.Lsetxattr(p, k, []byte(v), 0); err != nil {
			return fmt.Errorf("build native layer: xattr %s of %s: %w", k, e.Name, err)
		}
	}
	if dir {
		return nil // after the opaque xattr; see BuildTree
	}
	return setMtime(p, e.ModTime)
}

func (b *builder) opaque(p string, idx int) error {
	if b.toc.OverlayOpaque(idx) {
		if err := unix.Lsetxattr(p, layerfmt.OverlayOpaqueXattr, []byte{'y'}, 0); err != nil {
			return fmt.Errorf("build native layer: mark %s opaque: %w", b.toc.Name(idx), err)
		}
	}
	return setMtime(p, b.toc.Entry(idx).ModTime)
}

// setMtime sets atime and mtime of p (not following a symlink). Times
// before the epoch are shown as the epoch, as the FUSE view does.
func setMtime(p string, mt time.Time) error {
	if mt.Unix() < 0 {
		mt = time.Unix(0, 0)
	}
	ts := unix.NsecToTimespec(mt.UnixNano())
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("build native layer: set mtime of %s: %w", p, err)
	}
	return nil
}

// writeFile writes regular file idx to a new file at p.
func (b *builder) writeFile(p string, idx int) (retErr error) {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err := f.Close(); retErr == nil {
			retErr = err
		}
	}()
	t := b.toc
	for k := range t.NumChunks(idx) {
		if err := b.ctx.Err(); err != nil {
			return err
		}
		c := t.Chunk(idx, k)
		if !b.frameOK || b.frameOff != c.Offset {
			compressed, ok := b.chunks.Get(c.Digest)
			if !ok {
				b.frameOK = false
				return fmt.Errorf("chunk %s at %d of %s: %w", c.Digest, c.Offset, t.Name(idx), ErrChunkMissing)
			}
			frame, err := layerfmt.DecodeVerifiedFrame(c, compressed, b.frame)
			if err != nil {
				b.frameOK = false
				return fmt.Errorf("decode chunk %s of %s: %w", c.Digest, t.Name(idx), err)
			}
			b.frame, b.frameOff, b.frameOK = frame, c.Offset, true
		}
		if _, err := f.Write(b.frame[c.FrameOffset : c.FrameOffset+c.Size]); err != nil {
			return err
		}
	}
	return nil
}
