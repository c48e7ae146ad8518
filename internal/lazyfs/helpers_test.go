package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// requireFUSE stops tests that need to mount FUSE and overlayfs unless
// they can.
func requireFUSE(t testing.TB) {
	t.Helper()
	prereq.RequireFUSE(t)
}

// tarFile is one entry of a synthetic layer.
type tarFile struct {
	hdr  tar.Header
	data []byte
}

func buildTar(t testing.TB, files []tarFile) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := f.hdr
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(f.data))
		}
		if h.Format == tar.FormatUnknown {
			h.Format = tar.FormatPAX
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatalf("tar header %s: %v", h.Name, err)
		}
		if _, err := tw.Write(f.data); err != nil {
			t.Fatalf("tar data %s: %v", h.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// convert turns a tar stream into an envsnap blob and decodes its TOC.
func convert(t testing.TB, tarStream io.Reader, opts ...layerfmt.WriteOption) ([]byte, *layerfmt.TOC) {
	t.Helper()
	var blob bytes.Buffer
	res, err := layerfmt.Convert(context.Background(), &blob, tarStream, opts...)
	if err != nil {
		t.Fatalf("convert: %v", err)
	}
	toc, err := layerfmt.ReadTOC(context.Background(), bytes.NewReader(blob.Bytes()), int64(blob.Len()), res.TOCDigest)
	if err != nil {
		t.Fatalf("read TOC: %v", err)
	}
	return blob.Bytes(), toc
}

// blobSource serves chunks from a blob through layerfmt.DecodeChunk (so
// digests are verified as the real fetcher does) and records every call.
type blobSource struct {
	ra io.ReaderAt

	mu     sync.Mutex
	reads  map[chunkKey]int // ReadChunk calls per chunk
	frames map[int64][]byte // decoded frames by blob offset, as a real fetcher caches them
	calls  atomic.Int64

	// hook, when set, replaces the normal behaviour (for failure tests).
	hook func(ctx context.Context, c layerfmt.Chunk) ([]byte, error)
}

func newBlobSource(ra io.ReaderAt) *blobSource {
	return &blobSource{ra: ra, reads: map[chunkKey]int{}, frames: map[int64][]byte{}}
}

// ReadChunk serves chunks from the test's own memory: nothing to release.
func (s *blobSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	b, err := s.readChunk(ctx, c)
	return b, nil, err
}

func (s *blobSource) readChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, error) {
	s.calls.Add(1)
	s.mu.Lock()
	s.reads[keyOf(c)]++
	frame := s.frames[c.Offset]
	s.mu.Unlock()
	if s.hook != nil {
		return s.hook(ctx, c)
	}
	if frame == nil {
		compressed := make([]byte, c.CompressedSize)
		if _, err := s.ra.ReadAt(compressed, c.Offset); err != nil {
			return nil, err
		}
		var err error
		if frame, err = layerfmt.DecodeFrame(c, compressed, nil); err != nil {
			return nil, err
		}
		s.mu.Lock()
		if len(s.frames) > 64 {
			clear(s.frames)
		}
		s.frames[c.Offset] = frame
		s.mu.Unlock()
	}
	return frame[c.FrameOffset : c.FrameOffset+c.Size], nil
}

// chunkKey identifies a chunk: small files share compressed frames, so
// the blob offset alone does not.
type chunkKey struct{ frame, off int64 }

func keyOf(c layerfmt.Chunk) chunkKey { return chunkKey{c.Offset, c.FrameOffset} }

// readChunks returns the chunks read so far.
func (s *blobSource) readChunks() map[chunkKey]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[chunkKey]int, len(s.reads))
	for k, v := range s.reads {
		out[k] = v
	}
	return out
}

func (s *blobSource) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reads = map[chunkKey]int{}
	s.calls.Store(0)
}

// mountLayer mounts toc on a fresh temp dir and unmounts it at cleanup,
// forcefully if a test left it busy.
func mountLayer(t testing.TB, toc *layerfmt.TOC, src ChunkSource, opts ...Option) (string, *Server) {
	t.Helper()
	mnt := t.TempDir()
	srv, err := Mount(context.Background(), mnt, toc, src, opts...)
	if err != nil {
		t.Fatalf("mount: %v", err)
	}
	t.Cleanup(func() { cleanupMount(t, mnt, srv) })
	return mnt, srv
}

func cleanupMount(t testing.TB, mnt string, srv *Server) {
	t.Helper()
	if err := srv.Unmount(); err != nil {
		t.Logf("unmount %s: %v; detaching", mnt, err)
		if err := forceUnmount(mnt); err != nil {
			// Last resort; the helper knows mounts made by anyone.
			out, ferr := exec.Command("fusermount3", "-u", "-z", mnt).CombinedOutput()
			t.Errorf("detach %s: %v; fusermount3: %v %s", mnt, err, ferr, out)
		}
	}
	done := make(chan struct{})
	go func() { srv.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		// Not necessarily a bug: a mount namespace created (with private
		// propagation) while the layer was mounted keeps a copy of the
		// mount, and the connection serves it until that namespace
		// lets go. Other engineers' sandboxes on this machine do that.
		t.Logf("FUSE server for %s still serving 10s after unmount (copy held by another mount namespace?); aborting the connection", mnt)
		abortConnection(t, srv.dev)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Errorf("FUSE server for %s still serving after abort", mnt)
		}
	}
}

// abortConnection fails every request of a FUSE connection, so that a
// failed test leaves no process stuck in the kernel. It writes the
// connection's abort file in fusectl, mounting fusectl on a directory of
// its own for the write when it is not at /sys/fs/fuse/connections
// (these machines do not mount it).
func abortConnection(t testing.TB, dev uint64) {
	t.Helper()
	dir := "/sys/fs/fuse/connections"
	conn := strconv.FormatUint(uint64(unix.Minor(dev)), 10)
	if _, err := os.Stat(filepath.Join(dir, conn)); err != nil {
		tmp, err := os.MkdirTemp("", "fusectl-")
		if err != nil {
			t.Logf("abort FUSE connection %s: %v", conn, err)
			return
		}
		defer os.Remove(tmp)
		if err := unix.Mount("fusectl", tmp, "fusectl", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			t.Logf("abort FUSE connection %s: mount fusectl: %v", conn, err)
			return
		}
		defer func() {
			if err := unix.Unmount(tmp, 0); err != nil {
				t.Errorf("unmount fusectl at %s: %v", tmp, err)
			}
		}()
		dir = tmp
	}
	if err := os.WriteFile(filepath.Join(dir, conn, "abort"), []byte("1"), 0); err != nil {
		t.Logf("abort FUSE connection %s: %v", conn, err)
	}
}

// withinDeadline runs f and fails the test if it has not returned after d:
// a hang detector, not a performance assertion.
func withinDeadline(t *testing.T, d time.Duration, what string, f func() error) error {
	t.Helper()
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		t.Fatalf("%s hung for %s", what, d)
		return nil
	}
}

func errnoOf(err error) unix.Errno {
	var e unix.Errno
	if errors.As(err, &e) {
		return e
	}
	return 0
}
