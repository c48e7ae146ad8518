//go:build linux

package snapshotter

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

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
// of that size, refuses Commit, and Remove takes the mount away; the
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
		if err := s.Commit(ctx, tc.name+"-c", tc.name); !errdefs.IsFailedPrecondition(err) {
			t.Errorf("%s: Commit: %v, want FailedPrecondition", tc.name, err)
		}
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
