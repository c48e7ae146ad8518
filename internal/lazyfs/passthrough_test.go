package lazyfs

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// fileBacking offers local copies of some entries.
type fileBacking struct {
	mu    sync.Mutex
	paths map[int]string // entry -> copy
	calls atomic.Int64
}

func newFileBacking() *fileBacking { return &fileBacking{paths: map[int]string{}} }

func (b *fileBacking) set(idx int, path string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.paths[idx] = path
}

func (b *fileBacking) Backing(ctx context.Context, idx int) *os.File {
	b.calls.Add(1)
	b.mu.Lock()
	p, ok := b.paths[idx]
	b.mu.Unlock()
	if !ok {
		return nil
	}
	f, err := os.Open(p)
	if err != nil {
		return nil
	}
	return f
}

// writeCopy writes the bytes of name, read through a plain mount, to a
// file and returns its entry index and path.
func writeCopy(t *testing.T, f fixtureLayer, name string) (int, string, []byte) {
	t.Helper()
	b, err := readVia(t, f, name)
	if err != nil {
		t.Fatal(err)
	}
	idx, ok := f.toc.Lookup(name)
	if !ok {
		t.Fatalf("fixture has no %s", name)
	}
	p := filepath.Join(t.TempDir(), "copy")
	if err := os.WriteFile(p, b, 0o400); err != nil {
		t.Fatal(err)
	}
	return idx, p, b
}

// requirePassthrough skips when the kernel did not agree to FUSE
// passthrough (Linux < 6.9) on srv's connection.
func requirePassthrough(t *testing.T, srv *Server) {
	t.Helper()
	if !srv.Passthrough() {
		prereq.Skip(t, prereq.NoFUSEPassthrough, "")
	}
}

// TestPassthroughBypassesDaemon: a file with a local copy is read, mapped
// and read through overlayfs without a single chunk read, and with the
// layer's bytes; files without one still take the chunk path.
func TestPassthroughBypassesDaemon(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	idx, copyPath, want := writeCopy(t, f, "data/big")
	b := newFileBacking()
	b.set(idx, copyPath)
	mnt, src, srv := f.mount(t, WithBacking(b, filepath.Join(t.TempDir(), "state")))
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
	// Writing through the overlay copies the file up from the copy.
	w, err := os.OpenFile(filepath.Join(ovl, "data/big"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatalf("open for write through overlayfs (copy-up): %v", err)
	}
	if _, err := w.Write([]byte("tail")); err != nil {
		t.Fatalf("append: %v", err)
	}
	w.Close()
	if got, err := os.ReadFile(filepath.Join(ovl, "data/big")); err != nil || !bytes.Equal(got, append(want, "tail"...)) {
		t.Fatalf("copied-up file: %v", err)
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

// TestPassthroughWaitsForCachedOpens: the kernel refuses (EIO) a
// passthrough open of an inode that has cached opens, so a file whose copy
// appears while it is open stays on the read path until every open of it
// is closed, then switches.
func TestPassthroughWaitsForCachedOpens(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	idx, copyPath, want := writeCopy(t, f, "data/big")
	b := newFileBacking()
	mnt, src, srv := f.mount(t, WithBacking(b, filepath.Join(t.TempDir(), "state")))
	requirePassthrough(t, srv)
	p := filepath.Join(mnt, "data/big")

	held, err := os.Open(p) // a cached open: no copy yet
	if err != nil {
		t.Fatal(err)
	}
	b.set(idx, copyPath)
	for range 2 {
		got, err := os.ReadFile(p)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("open while a cached open is alive: %v", err)
		}
	}
	if s := srv.Stats(); s.BackedOpens != 0 {
		t.Fatalf("switched to passthrough with a cached open alive (%d backed opens)", s.BackedOpens)
	}
	held.Close()
	waitFor(t, func() bool {
		// Release reaches the daemon asynchronously after close.
		got, err := os.ReadFile(p)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("open after the cached opens closed: %v", err)
		}
		return srv.Stats().BackedOpens > 0
	})
	src.reset()
	if _, err := os.ReadFile(p); err != nil {
		t.Fatal(err)
	}
	if n := src.calls.Load(); n != 0 {
		t.Errorf("%d chunk reads after the switch", n)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for range 1000 {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("condition not reached in 10s")
}

// TestTakeoverPassthrough: after a restart the kernel still holds the
// predecessor's passthrough files and cached opens. The successor answers
// opens of an inode the predecessor switched with the same backing file,
// and does not switch an inode that has cached opens it cannot see.
func TestTakeoverPassthrough(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	bigIdx, bigCopy, bigWant := writeCopy(t, f, "data/big")
	pwIdx, pwCopy, pwWant := writeCopy(t, f, "etc/passwd")
	state := filepath.Join(t.TempDir(), "state")
	// The predecessor has a copy of data/big only.
	rig := startTakeoverRig(t, f, "LAZYFS_STUCK_FRAME=-1", "LAZYFS_STUCK_OFF=-1",
		fmt.Sprintf("LAZYFS_COPIES=%d=%s", bigIdx, bigCopy), "LAZYFS_STATE="+state)
	mnt, open := rig.mnt, rig.open
	big := open("data/big") // passthrough, by the predecessor
	m, err := unix.Mmap(int(big.Fd()), 0, len(bigWant), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	passwd := open("etc/passwd") // cached: no copy in the predecessor
	if b, err := io.ReadAll(passwd); err != nil || !bytes.Equal(b, pwWant) {
		t.Fatalf("passwd before takeover: %v", err)
	}
	if st, err := os.ReadFile(state); err != nil || !strings.HasPrefix(string(st), fmt.Sprintf("%d ", ino(bigIdx))) {
		t.Fatalf("state file %q, %v: want data/big's inode recorded", st, err)
	}

	// The successor has copies of both.
	b := newFileBacking()
	b.set(bigIdx, bigCopy)
	b.set(pwIdx, pwCopy)
	srv := rig.takeOver(WithBacking(b, state))
	for range 2 {
		for name, want := range map[string][]byte{"data/big": bigWant, "etc/passwd": pwWant} {
			if got, err := os.ReadFile(filepath.Join(mnt, name)); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("open %s after takeover: %v", name, err)
			}
		}
	}
	if !bytes.Equal(m, bigWant) {
		t.Error("mapping made before takeover changed")
	}
	if s := srv.Stats(); s.BackedOpens != 2 {
		t.Errorf("%d passthrough opens after takeover, want 2 (data/big only)", s.BackedOpens)
	}
	unix.Munmap(m)
	for _, f := range rig.opened {
		f.Close()
	}
	rig.opened = nil
	if err := srv.Unmount(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(state); !os.IsNotExist(err) {
		t.Errorf("state file left after unmount: %v", err)
	}
}

// TestTakeoverWithoutCopies: the kernel refuses a page-cache open of an
// inode while a passthrough open of it lives (EIO), so a successor that
// hands out no copies (the daemon with passthrough turned off across a
// restart) still takes the predecessor's state: it answers opens of the
// switched inode with the same backing file and every other open on the
// read path.
func TestTakeoverWithoutCopies(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	bigIdx, bigCopy, bigWant := writeCopy(t, f, "data/big")
	_, _, pwWant := writeCopy(t, f, "etc/passwd")
	state := filepath.Join(t.TempDir(), "state")
	rig := startTakeoverRig(t, f, "LAZYFS_STUCK_FRAME=-1", "LAZYFS_STUCK_OFF=-1",
		fmt.Sprintf("LAZYFS_COPIES=%d=%s", bigIdx, bigCopy), "LAZYFS_STATE="+state)
	mnt, open := rig.mnt, rig.open
	big := open("data/big") // passthrough, by the predecessor
	if b, err := io.ReadAll(big); err != nil || !bytes.Equal(b, bigWant) {
		t.Fatalf("data/big before takeover: %v", err)
	}
	srv := rig.takeOver(WithBacking(newFileBacking(), state))
	for range 2 {
		for name, want := range map[string][]byte{"data/big": bigWant, "etc/passwd": pwWant} {
			if got, err := os.ReadFile(filepath.Join(mnt, name)); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("open %s after takeover: %v", name, err)
			}
		}
	}
	if n, err := big.ReadAt(make([]byte, 10), 0); err != nil || n != 10 {
		t.Errorf("read of the predecessor's open after takeover: %d, %v", n, err)
	}
	if s := srv.Stats(); s.BackedOpens != 2 {
		t.Errorf("%d passthrough opens after takeover, want 2 (data/big)", s.BackedOpens)
	}
	for _, f := range rig.opened {
		f.Close()
	}
	rig.opened = nil
	if err := srv.Unmount(); err != nil {
		t.Fatal(err)
	}
}
