//go:build linux

package snapshotter

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/diskcap"
	"github.com/envsnap/envsnap/internal/mounttest"
	"github.com/envsnap/envsnap/internal/prereq"
)

func requireCapTools(tb testing.TB) {
	tb.Helper()
	prereq.RequireRoot(tb)
	mounttest.NoLeaks(tb)
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		prereq.Missing(tb, "mkfs.ext4 (e2fsprogs): %v", err)
	}
}

// TestWritableCap: a container snapshot prepared with the disk-cap label
// (or under the default) has its writable directories on a file system
// of that size, commits with its files copied off that file system, and
// Remove takes the mount away; the
// label 0 opts out of the default; unpacks never get a cap; a daemon
// that finds a capped snapshot unmounted mounts it again, and Mounts
// never hands out the directories under the mount point.
func TestWritableCap(t *testing.T) {
	requireCapTools(t)
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	s, err := New(ctx, root, fsys, WithWritableCap(diskcap.Limits{Bytes: 16 << 20}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.Prepare(ctx, "base-x", "", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "base"})); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "base", "base-x"); err != nil {
		t.Fatal(err)
	}
	label := func(v string) snapshots.Opt {
		return snapshots.WithLabels(map[string]string{diskcap.LabelBytes: v})
	}
	dirOf := func(key string) string {
		ms, err := s.Mounts(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		up, err := upperDir(ms)
		if err != nil {
			t.Fatal(err)
		}
		return filepath.Dir(up)
	}
	size := func(dir string) int64 {
		l, ok, err := diskcap.Read(filepath.Join(dir, "fs"))
		if err != nil {
			t.Fatal(err)
		}
		mounted, _ := diskcap.Mounted(dir)
		if ok != mounted {
			t.Fatalf("%s: record %v, mounted %v", dir, ok, mounted)
		}
		return l.Bytes
	}
	for _, tc := range []struct {
		name string
		opts []snapshots.Opt
		want int64
	}{
		{"default", nil, 16 << 20},
		{"label", []snapshots.Opt{label(fmt.Sprint(8 << 20))}, 8 << 20},
		{"opted out", []snapshots.Opt{label("0")}, 0},
	} {
		if _, err := s.Prepare(ctx, tc.name, "base", tc.opts...); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		dir := dirOf(tc.name)
		if got := size(dir); got != tc.want {
			t.Errorf("%s: cap %d, want %d", tc.name, got, tc.want)
		}
		if tc.want == 0 {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, "fs", "big"), make([]byte, tc.want), 0o644); err == nil {
			t.Errorf("%s: wrote the cap's size into a capped upper", tc.name)
		}
	}
	// Commit copies the layer off its cap (a whiteout and an opaque
	// directory too) and takes the cap's file system away.
	if _, err := s.Prepare(ctx, "commit", "base"); err != nil {
		t.Fatal(err)
	}
	cdir := dirOf("commit")
	up := filepath.Join(cdir, "fs")
	if err := os.WriteFile(filepath.Join(up, "kept"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(up, "gone"), unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(up, "opaque"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(filepath.Join(up, "opaque"), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "committed", "commit"); err != nil {
		t.Fatalf("Commit of a capped snapshot: %v", err)
	}
	if mounted, _ := diskcap.Mounted(cdir); mounted || diskcap.Capped(cdir) {
		t.Errorf("after Commit: mounted %v, image %v; want neither", mounted, diskcap.Capped(cdir))
	}
	if b, err := os.ReadFile(filepath.Join(up, "kept")); err != nil || string(b) != "kept" {
		t.Errorf("committed file: %q, %v", b, err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(up, "gone"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("committed whiteout: %+v, %v", st, err)
	}
	if v := make([]byte, 1); func() error {
		_, err := unix.Getxattr(filepath.Join(up, "opaque"), "trusted.overlay.opaque", v)
		return err
	}() != nil || v[0] != 'y' {
		t.Errorf("committed opaque marker lost")
	}
	if left, _ := os.ReadDir(filepath.Join(root, uncapDir)); len(left) > 0 {
		t.Errorf("copies left in %s: %v", uncapDir, left)
	}
	if _, err := s.Prepare(ctx, "bad", "base", label("12")); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a 12-byte cap: %v", err)
	}

	// A reboot: the mount is gone; the next daemon mounts it again.
	dir := dirOf("label")
	if err := diskcap.Unmount(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Mounts(ctx, "label"); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Mounts of a capped snapshot without its mount: %v", err)
	}
	s.Close()
	if s, err = New(ctx, root, fsys); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if got := size(dir); got != 8<<20 {
		t.Errorf("after a restart: cap %d", got)
	}
	for _, key := range []string{"default", "label", "opted out"} {
		d := dirOf(key)
		if err := s.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
		if mounted, _ := diskcap.Mounted(d); mounted {
			t.Errorf("%s: still mounted after Remove", key)
		}
	}
}

// TestWritableCapShare: on a small file system a cap shrinks to what is
// free beyond the reserve, so a layer filled to its cap leaves the
// reserve to the others; with less than that free, Prepare fails with
// ResourceExhausted.
func TestWritableCapShare(t *testing.T) {
	requireCapTools(t)
	root := t.TempDir()
	if err := unix.Mount("tmpfs", root, "tmpfs", 0, "size=64m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(root, unix.MNT_DETACH) })
	ctx := testContext(t)
	s, err := New(ctx, root, newFakeFS(), WithWritableCap(diskcap.Limits{Bytes: 1 << 30}), WithWritableReserve(25))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.Prepare(ctx, "base-x", "", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "base"})); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "base", "base-x"); err != nil {
		t.Fatal(err)
	}
	ms, err := s.Prepare(ctx, "c", "base")
	if err != nil {
		t.Fatal(err)
	}
	up, err := upperDir(ms)
	if err != nil {
		t.Fatal(err)
	}
	l, ok, err := diskcap.Read(up)
	if err != nil || !ok || l.Bytes >= 48<<20 {
		t.Fatalf("cap on a 64 MiB file system with a 25%% reserve: %+v %v %v, want below 48 MiB", l, ok, err)
	}
	f, err := os.Create(filepath.Join(up, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	_, werr := f.Write(make([]byte, 64<<20))
	f.Close()
	if !errors.Is(werr, unix.ENOSPC) {
		t.Errorf("filling the layer: %v, want ENOSPC", werr)
	}
	_, avail, err := diskcap.Space(root)
	if err != nil {
		t.Fatal(err)
	}
	if avail < 14<<20 {
		t.Errorf("a full layer left %d bytes of the node's 64 MiB, want about its 16 MiB reserve", avail)
	}
	// Something else takes what the full layer left beyond the reserve
	// (ext4 refuses writes with some room still free).
	if over := avail - 16<<20 - 1<<20; over > 0 {
		if err := os.WriteFile(filepath.Join(root, "other"), make([]byte, over), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Prepare(ctx, "d", "base"); !errdefs.IsResourceExhausted(err) {
		t.Errorf("Prepare with only the reserve free: %v, want ResourceExhausted", err)
	}
}

// BenchmarkPrepareWritableCap measures what a disk cap adds to preparing
// and removing a container snapshot: each iteration does both, capped
// (1 GiB) and uncapped, side by side.
func BenchmarkPrepareWritableCap(b *testing.B) {
	requireCapTools(b)
	s, err := New(namespaces.WithNamespace(b.Context(), "test"), b.TempDir(), newFakeFS())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	ctx := namespaces.WithNamespace(b.Context(), "test")
	if _, err := s.Prepare(ctx, "base-x", "", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "base"})); err != nil {
		b.Fatal(err)
	}
	if err := s.Commit(ctx, "base", "base-x"); err != nil {
		b.Fatal(err)
	}
	var plain, capped, removeCapped time.Duration
	for i := 0; b.Loop(); i++ {
		for _, c := range []struct {
			label string
			prep  *time.Duration
			rm    *time.Duration
		}{{"0", &plain, new(time.Duration)}, {fmt.Sprint(1 << 30), &capped, &removeCapped}} {
			key := fmt.Sprintf("c%d-%s", i, c.label)
			start := time.Now()
			if _, err := s.Prepare(ctx, key, "base", snapshots.WithLabels(map[string]string{diskcap.LabelBytes: c.label})); err != nil {
				b.Fatal(err)
			}
			*c.prep += time.Since(start)
			start = time.Now()
			if err := s.Remove(ctx, key); err != nil {
				b.Fatal(err)
			}
			*c.rm += time.Since(start)
		}
	}
	n := float64(b.N)
	b.ReportMetric(plain.Seconds()*1000/n, "ms-prepare-plain")
	b.ReportMetric(capped.Seconds()*1000/n, "ms-prepare-capped")
	b.ReportMetric(removeCapped.Seconds()*1000/n, "ms-remove-capped")
	b.ReportMetric(capped.Seconds()/plain.Seconds(), "x-prepare")
}

// TestWritableCapUnavailable: on a node without mkfs.ext4 the default
// cap is dropped with a warning (not an error): container snapshots are
// made uncapped, and a label that asks for a cap fails Prepare.
func TestWritableCapUnavailable(t *testing.T) {
	prereq.RequireRoot(t)
	t.Setenv("PATH", t.TempDir())
	ctx := testContext(t)
	s, err := New(ctx, t.TempDir(), newFakeFS(), WithWritableCap(diskcap.Limits{Bytes: 16 << 20}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := s.Prepare(ctx, "base-x", "", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "base"})); err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(ctx, "base", "base-x"); err != nil {
		t.Fatal(err)
	}
	ms, err := s.Prepare(ctx, "c", "base")
	if err != nil {
		t.Fatalf("Prepare without mkfs.ext4: %v", err)
	}
	up, err := upperDir(ms)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := diskcap.Read(up); ok {
		t.Errorf("a cap without mkfs.ext4")
	}
	if _, err := s.Prepare(ctx, "d", "base", snapshots.WithLabels(map[string]string{diskcap.LabelBytes: fmt.Sprint(8 << 20)})); err == nil {
		t.Errorf("a label asking for a cap was prepared without mkfs.ext4")
	}
}
