//go:build linux

package layerstore

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/unpacked"
	"github.com/envsnap/envsnap/layerfmt"
)

// backing offers lazyfs local copies of one layer's files for FUSE
// passthrough, from one of two places:
//
//   - the layer's native copy (native), once it is complete: the file is
//     already on the node's disk, built from verified chunks, and costs
//     nothing more;
//   - otherwise an unpacked copy of the file alone (files). The second open
//     of a file whose chunks are all local starts building it (served by
//     the chunk path meanwhile); opens after the build get the copy. Not
//     the first: a build or a toolchain walking a tree opens most files
//     once, and in a cold episode of the headline workload copies built
//     on first opens (125-190 MB, 135-223 files) served 27-45 opens,
//     taking CPU from the workload they were meant to speed up.
//
// Either may be absent. The daemon sets only native when it builds native
// copies: the unpacked copies then duplicate, file by file and on the
// cores the first containers run on, what the native copy holds moments
// later (docs/lazyfs.md, "Passthrough").
type backing struct {
	layer   *fetch.Layer
	toc     *layerfmt.TOC
	minSize int64
	native  func() (string, bool) // the complete native copy's directory
	files   *unpacked.Store

	mu     sync.Mutex
	opened map[int]bool // files opened while local
}

func (b *backing) Backing(ctx context.Context, idx int) *os.File {
	size := b.toc.Size(idx)
	if size < max(b.minSize, 1) {
		return nil
	}
	if b.native != nil {
		if dir, ok := b.native(); ok {
			if f := openNativeFile(dir, b.toc.Name(idx), size); f != nil {
				return f
			}
		}
	}
	if b.files == nil {
		return nil
	}
	key := unpacked.Key(b.toc, idx)
	if f, ok := b.files.Get(key); ok {
		return f
	}
	if !b.layer.FileLocal(idx) {
		return nil
	}
	b.mu.Lock()
	again := b.opened[idx]
	if b.opened == nil {
		b.opened = map[int]bool{}
	}
	b.opened[idx] = true
	b.mu.Unlock()
	if again {
		b.files.Build(key, size, func(ctx context.Context, w io.Writer) error {
			return b.layer.WriteFile(ctx, idx, w)
		})
	}
	return nil
}

// openNativeFile opens name inside the native copy dir, or returns nil
// when it is not a regular file of size bytes there. The copy is the
// layer's overlay view, where a file's TOC name is its path; resolving
// beneath dir without symlinks keeps a layer's own symlinks from pointing
// the kernel at any other file.
func openNativeFile(dir, name string, size int64) *os.File {
	root, err := os.OpenFile(dir, unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil
	}
	defer root.Close()
	fd, err := unix.Openat2(int(root.Fd()), name, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil
	}
	f := os.NewFile(uintptr(fd), filepath.Join(dir, name))
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() || fi.Size() != size {
		f.Close()
		return nil
	}
	return f
}
