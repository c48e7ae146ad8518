package lazyfs

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// fileBacking offers one local copy, for one entry.
type fileBacking struct {
	idx   int
	path  string
	calls atomic.Int64
}

func (b *fileBacking) Backing(ctx context.Context, idx int) *os.File {
	b.calls.Add(1)
	if idx != b.idx {
		return nil
	}
	f, err := os.Open(b.path)
	if err != nil {
		return nil
	}
	return f
}

// requirePassthrough skips when the kernel did not agree to FUSE
// passthrough (Linux < 6.9) on srv's connection.
func requirePassthrough(t *testing.T, srv *Server) {
	t.Helper()
	if srv.srv.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH == 0 {
		t.Skip("kernel without FUSE passthrough")
	}
}

// TestPassthroughBypassesDaemon: a file with a local copy is read, mapped
// and read through overlayfs without a single chunk read, and with the
// layer's bytes; files without one still take the chunk path.
func TestPassthroughBypassesDaemon(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	want, err := readVia(t, f, "data/big")
	if err != nil {
		t.Fatal(err)
	}
	idx, ok := f.toc.Lookup("data/big")
	if !ok {
		t.Fatal("fixture has no data/big")
	}
	copyPath := filepath.Join(t.TempDir(), "copy")
	if err := os.WriteFile(copyPath, want, 0o400); err != nil {
		t.Fatal(err)
	}
	b := &fileBacking{idx: idx, path: copyPath}
	mnt, src, srv := f.mount(t, WithBacking(b))
	requirePassthrough(t, srv)

	p := filepath.Join(mnt, "data/big")
	got, err := os.ReadFile(p)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read through passthrough: %v (equal %v)", err, bytes.Equal(got, want))
	}
	fd, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(fd.Fd()), 0, len(want), unix.PROT_READ, unix.MAP_SHARED)
	fd.Close()
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	mapped := bytes.Equal(m, want)
	unix.Munmap(m)
	if !mapped {
		t.Fatal("mapped bytes differ from the layer's")
	}
	ovl := mountOverlay(t, mnt)
	if got, err := os.ReadFile(filepath.Join(ovl, "data/big")); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read through overlayfs over passthrough: %v", err)
	}
	if n := src.calls.Load(); n != 0 {
		t.Errorf("%d chunk reads for a file with a local copy, want 0", n)
	}
	if s := srv.Stats(); s.BackedOpens == 0 {
		t.Errorf("BackedOpens = 0 after opens of a backed file")
	}

	// Another file has no copy: the chunk path serves it.
	if _, err := os.ReadFile(filepath.Join(mnt, "etc/passwd")); err != nil {
		t.Fatal(err)
	}
	if src.calls.Load() == 0 {
		t.Error("a file without a copy was not read from the chunk source")
	}
}

// readVia reads name through a mount without backing.
func readVia(t *testing.T, f fixtureLayer, name string) ([]byte, error) {
	t.Helper()
	mnt, _, srv := f.mount(t)
	b, err := os.ReadFile(filepath.Join(mnt, name))
	cleanupMount(t, mnt, srv)
	return b, err
}
