//go:build linux

package layerstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

// The registry metadata of a layer (the manifest that names it and its
// encoded TOC) is kept in the node cache next to the layer's chunks, under
// its own digest: the manifest digest, and the TOC digest of the manifest's
// layer descriptor (layerfmt.AnnotationTOCDigest is the sha256 of the
// encoded TOC). So a daemon restarted while the registry is unreachable
// still has everything it needs to serve the mounts of its predecessor
// (Restore) and to remount the layers of its snapshots: the outage then
// costs what it costs without a restart, the reads of chunks not in the
// cache. Both are verified when loaded, by the cache (content against its
// digest) and here (the TOC against the descriptor, the manifest by the
// digest containerd resolved), so a damaged file is a miss, never a wrong
// tree. While a layer is mounted its two entries are pinned (metaPinOwner),
// like its chunks; afterwards they age out of the cache with them.

// metaPinOwner names the cache pin of a mounted layer's metadata.
func metaPinOwner(mountpoint string) string { return "layerstore-meta:" + mountpoint }

// cachedManifest returns the manifest bytes of dgst from the node cache.
func (s *Store) cachedManifest(dgst digest.Digest) ([]byte, bool) {
	return s.cfg.Cache.Get(dgst)
}

// keepManifest stores the verified manifest bytes b of dgst in the node
// cache. A failure only costs a registry round trip on a later restart.
func (s *Store) keepManifest(ctx context.Context, dgst digest.Digest, b []byte) {
	if err := s.cfg.Cache.PutVerified(dgst, b); err != nil {
		warnUnlessFull(log.G(ctx).WithField("manifest", dgst), err, "cannot keep the manifest in the node cache; a restart will need the registry for it")
	}
}

// cachedTOC returns the TOC of desc from the node cache and its encoded
// bytes, or nil.
func (s *Store) cachedTOC(ctx context.Context, desc ocispec.Descriptor, tocDigest digest.Digest) (*layerfmt.TOC, []byte) {
	b, ok := s.cfg.Cache.Get(tocDigest)
	if !ok {
		return nil, nil
	}
	toc, err := layerfmt.DecodeTOC(b, tocDigest)
	if err == nil && toc.DataEnd() != desc.Size-layerfmt.TailSize(int64(len(b))) {
		err = fmt.Errorf("TOC says data ends at %d, the TOC frame of a %d-byte blob starts at %d: %w",
			toc.DataEnd(), desc.Size, desc.Size-layerfmt.TailSize(int64(len(b))), layerfmt.ErrBadTOC)
	}
	if err != nil {
		// The descriptor and the TOC disagree (the check DecodeTail
		// makes on a tail read from the blob): let the registry's copy
		// decide.
		log.G(ctx).WithError(err).WithField("layer", desc.Digest).Warn("ignoring the TOC kept in the node cache")
		return nil, nil
	}
	return toc, b
}

// keepTOC stores the encoded TOC of desc, taken from the blob tail that
// layerfmt.ReadTOC read last, in the node cache, and returns it (nil if
// the tail did not hold it). A failure here is not final: keepMetadata
// tries again before the layer is mounted, and fails the mount then.
func (s *Store) keepTOC(ctx context.Context, desc ocispec.Descriptor, tocDigest digest.Digest, tail *tailRecorder) []byte {
	b, err := tail.encodedTOC(desc.Size)
	if err != nil {
		log.G(ctx).WithError(err).WithField("layer", desc.Digest).Warn("cannot cut the encoded TOC out of the blob's tail")
		return nil
	}
	if err := s.cfg.Cache.Put(tocDigest, b); err != nil {
		warnUnlessFull(log.G(ctx).WithField("layer", desc.Digest), err, "cannot keep the TOC in the node cache yet")
	}
	return b
}

// keepMetadata makes sure the manifest and TOC of the opened layer are in
// the node cache and pinned there for as long as it stays mounted at
// mountpoint: pinned first (a pin protects an entry from the moment it
// arrives), then stored again if they are missing (the cache was full when
// they were read, or the entry was evicted since). It fails when they
// cannot be kept: a mount without its metadata in the cache would need the
// registry again after a restart, and a restart during an outage would
// then leave its containers without the layer. The pin stays also on
// failure: the caller unpins (Unmount, or a mount it gives up).
func (s *Store) keepMetadata(mountpoint string, o *opened) error {
	type blob struct {
		what string
		d    digest.Digest
		b    []byte
	}
	want := []blob{{"TOC", o.tocDigest, o.tocRaw}}
	if o.manifest != "" { // a hinted layer has no manifest of its own
		want = append(want, blob{"manifest", o.manifest, o.manifestRaw})
	}
	ds := make([]digest.Digest, len(want))
	for i, w := range want {
		ds[i] = w.d
	}
	owner := metaPinOwner(mountpoint)
	s.cfg.Cache.Pin(owner, ds)
	for _, w := range want {
		if s.cfg.Cache.Contains(w.d) {
			continue
		}
		err := errors.New("its bytes were not kept in memory")
		if w.b != nil {
			err = s.cfg.Cache.Put(w.d, w.b)
		}
		if err != nil {
			return fmt.Errorf("keep the %s %s of layer %s in the node cache, which a restart serves the mount from: %w: %w", w.what, w.d, o.desc.Digest, err, errdefs.ErrResourceExhausted)
		}
	}
	return nil
}

// warnUnlessFull logs err, quietly when the cache is full: that is the
// cache keeping its bound, already counted in its PutErrors.
func warnUnlessFull(lg *log.Entry, err error, msg string) {
	lg = lg.WithError(err)
	if errors.Is(err, chunkcache.ErrFull) {
		lg.Debug(msg)
		return
	}
	lg.Warn(msg)
}

// tailRecorder is an io.ReaderAt that remembers the last range read through
// it. layerfmt.ReadTOC reads the blob's tail last, and that read covers the
// whole TOC frame and the footer.
type tailRecorder struct {
	ra io.ReaderAt

	mu   sync.Mutex
	off  int64
	last []byte
}

func (r *tailRecorder) ReadAt(p []byte, off int64) (int, error) {
	n, err := r.ra.ReadAt(p, off)
	if err == nil {
		r.mu.Lock()
		r.off, r.last = off, p[:n]
		r.mu.Unlock()
	}
	return n, err
}

// encodedTOC cuts the encoded TOC out of the recorded tail of a blob of
// blobSize bytes.
func (r *tailRecorder) encodedTOC(blobSize int64) ([]byte, error) {
	r.mu.Lock()
	off, tail := r.off, r.last
	r.mu.Unlock()
	if len(tail) < layerfmt.FooterSize || off+int64(len(tail)) != blobSize {
		return nil, errors.New("no read of the blob's tail recorded")
	}
	tocOff, tocSize, err := layerfmt.TOCRange(tail[len(tail)-layerfmt.FooterSize:], blobSize)
	if err != nil {
		return nil, err
	}
	if tocOff < off || tocOff+tocSize > blobSize {
		return nil, fmt.Errorf("TOC at %d+%d is not in the recorded tail at %d", tocOff, tocSize, off)
	}
	return tail[tocOff-off : tocOff-off+tocSize], nil
}
