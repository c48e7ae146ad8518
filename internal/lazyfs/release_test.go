package lazyfs

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envsnap/envsnap/layerfmt"
)

// holdingSource counts the chunks it returned that lazyfs has not released
// yet; a second release of one chunk fails the test.
type holdingSource struct {
	*blobSource
	t     *testing.T
	delay time.Duration // before answering, ignoring ctx
	held  atomic.Int64
	reads atomic.Int64
}

func (s *holdingSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	time.Sleep(s.delay)
	b, err := s.readChunk(ctx, c)
	if err != nil {
		return nil, nil, err
	}
	s.held.Add(1)
	s.reads.Add(1)
	var released atomic.Bool
	return b, func() {
		if released.Swap(true) {
			s.t.Errorf("chunk at %d released twice", c.Offset)
			return
		}
		s.held.Add(-1)
	}, nil
}

// waitReleased waits for the page-cache stores in flight to end.
func (s *holdingSource) waitReleased(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for s.held.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d chunks read were never released", s.held.Load(), s.reads.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestChunksReleased: every chunk the source returns is released once,
// by reads that copy it whole, by reads whose rest goes to the page cache
// (FUSE_NOTIFY_STORE, asynchronously), and by reads that timed out before
// the source answered.
func TestChunksReleased(t *testing.T) {
	requireFUSE(t)
	r := rand.New(rand.NewPCG(3, 4))
	data := make([]byte, 5<<20+1234)
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	blob, toc := convert(t, bytes.NewReader(buildTar(t, []tarFile{{hdr: hdr('0', "file", 0o644), data: data}})))

	src := &holdingSource{blobSource: newBlobSource(bytes.NewReader(blob)), t: t}
	mnt, _ := mountLayer(t, toc, src)
	f, err := os.Open(filepath.Join(mnt, "file"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Small reads at random offsets: each chunk's rest is stored.
	buf := make([]byte, 4096)
	for range 64 {
		off := r.Int64N(int64(len(data) - len(buf)))
		if _, err := f.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, data[off:off+int64(len(buf))]) {
			t.Fatalf("wrong bytes at %d", off)
		}
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "file")); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read the whole file: %v", err)
	}
	src.waitReleased(t)
	if src.reads.Load() == 0 {
		t.Fatal("no chunk read through the source")
	}

	// A source slower than the read timeout: the reads fail, and the
	// answers that come after are released unread.
	slow := &holdingSource{blobSource: newBlobSource(bytes.NewReader(blob)), t: t, delay: 300 * time.Millisecond}
	mnt, _ = mountLayer(t, toc, slow, WithReadTimeout(50*time.Millisecond))
	if _, err := os.ReadFile(filepath.Join(mnt, "file")); err == nil {
		t.Fatal("reads slower than the timeout succeeded")
	}
	time.Sleep(2 * slow.delay)
	slow.waitReleased(t)
	if slow.reads.Load() == 0 {
		t.Fatal("the slow source never answered")
	}
}
