//go:build linux

package layerstore

import (
	"context"
	"io"
	"os"

	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/unpacked"
	"github.com/envsnap/envsnap/layerfmt"
)

// backing offers lazyfs the unpacked copies of one layer's files. The first
// open of a file whose chunks are all local starts building its copy and
// is served by the chunk path; opens after the build get the copy.
type backing struct {
	layer   *fetch.Layer
	toc     *layerfmt.TOC
	files   *unpacked.Store
	minSize int64
}

func (b *backing) Backing(ctx context.Context, idx int) *os.File {
	size := b.toc.Size(idx)
	if size < max(b.minSize, 1) {
		return nil
	}
	key := unpacked.Key(b.toc, idx)
	if f, ok := b.files.Get(key); ok {
		return f
	}
	if b.layer.FileLocal(idx) {
		b.files.Build(key, size, func(ctx context.Context, w io.Writer) error {
			return b.layer.WriteFile(ctx, idx, w)
		})
	}
	return nil
}
