package diskcap

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/mounttest"
	"github.com/envsnap/envsnap/internal/prereq"
)

// newSnapshotDir makes a directory as overlay leaves a new active
// snapshot's: empty "fs" and "work".
func newSnapshotDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, n := range []string{"fs", "work"} {
		if err := os.Mkdir(filepath.Join(dir, n), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// backingInode is the inode of the image behind the loop device mounted
// at dir (the image itself is under the mount).
func backingInode(t *testing.T, dir string) uint64 {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(dir))
	if err != nil || len(infos) != 1 {
		t.Fatalf("mount at %s: %v %v", dir, infos, err)
	}
	f, err := os.Open(infos[0].Source)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		t.Fatalf("LOOP_GET_STATUS64 %s: %v", infos[0].Source, err)
	}
	return info.Inode
}

func waitReady(t *testing.T, p *Pool, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for p.Ready() != n {
		if time.Now().After(deadline) {
			t.Fatalf("the pool holds %d images a minute on, want %d", p.Ready(), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestPool: Setup takes an image the pool made ahead (the same file ends
// up under the snapshot, mounted, of the pool's size) and the pool makes
// another; a Setup of other limits formats its own and leaves the pool
// alone; a pool that is not wanted makes nothing; Close removes the
// pool's directory and a previous pool's leftovers go at NewPool.
func TestPool(t *testing.T) {
	prereq.RequireRoot(t)
	mounttest.NoLeaks(t)
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		prereq.Missing(t, "mkfs.ext4 (e2fsprogs): %v", err)
	}
	ctx := context.Background()
	l := Limits{Bytes: 64 << 20}
	dir := filepath.Join(t.TempDir(), "pool")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "7.ext4"), []byte("left by a previous daemon"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := NewPool(ctx, dir, l, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	if _, err := os.Stat(filepath.Join(dir, "7.ext4")); !os.IsNotExist(err) {
		t.Errorf("NewPool kept a previous pool's file: %v", err)
	}
	waitReady(t, p, 2)
	first := inode(t, filepath.Join(dir, "0.ext4"))

	snap := newSnapshotDir(t)
	if err := Setup(ctx, snap, l, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(snap) })
	if got := backingInode(t, snap); got != first {
		t.Errorf("the snapshot's loop device reads inode %d, want the pool's first image %d", got, first)
	}
	if mounted, err := Mounted(snap); err != nil || !mounted {
		t.Fatalf("snapshot directory not mounted: %v %v", mounted, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Join(snap, "fs"), &st); err != nil {
		t.Fatal(err)
	}
	if size := int64(st.Blocks) * st.Bsize; size > l.Bytes || size < l.Bytes*9/10 {
		t.Errorf("the writable layer's file system has %d bytes, want about %d", size, l.Bytes)
	}
	waitReady(t, p, 2)

	other := newSnapshotDir(t)
	if err := Setup(ctx, other, Limits{Bytes: 32 << 20}, p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { Unmount(other) })
	if p.Ready() != 2 {
		t.Errorf("a Setup of other limits took from the pool: %d left", p.Ready())
	}
	if err := unix.Statfs(filepath.Join(other, "fs"), &st); err != nil {
		t.Fatal(err)
	}
	if size := int64(st.Blocks) * st.Bsize; size > 32<<20 {
		t.Errorf("a 32 MiB cap's file system has %d bytes", size)
	}

	asked := make(chan struct{}, 1)
	unwanted, err := NewPool(ctx, filepath.Join(t.TempDir(), "unwanted"), l, 2, func() bool {
		select {
		case asked <- struct{}{}:
		default:
		}
		return false
	})
	if err != nil {
		t.Fatal(err)
	}
	<-asked
	if n := unwanted.Ready(); n != 0 {
		t.Errorf("a pool that is not wanted holds %d images", n)
	}
	if err := unwanted.Close(); err != nil {
		t.Fatal(err)
	}

	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("Close left the pool's directory: %v", err)
	}
}
