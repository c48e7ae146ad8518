package snapshotter

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"

	"github.com/envsnap/envsnap/internal/diskcap"
	"github.com/envsnap/envsnap/internal/prereq"
)

func TestConformanceVolatile(t *testing.T) {
	if os.Getuid() != 0 {
		prereq.Missing(t, "the snapshotter suite mounts overlayfs: needs root")
	}
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		s, err := New(ctx, root, newFakeFS(), WithVolatileWritable(true))
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	})
}

// TestVolatileWritable: a container snapshot's upper is mounted volatile,
// can be mounted again after its mount ended in this boot, keeps the mark
// while mounted, and is refused once the boot that mounted it is not this
// one. An unpack's snapshot and a snapshotter without the option are not
// volatile.
func TestVolatileWritable(t *testing.T) {
	if os.Getuid() != 0 {
		prereq.Missing(t, "mounts overlayfs: needs root")
	}
	for _, capped := range []bool{false, true} {
		name := "plain"
		opts := []Opt{WithVolatileWritable(true)}
		if capped {
			name = "capped"
			opts = append(opts, WithWritableCap(diskcap.Limits{Bytes: 16 << 20}))
		}
		t.Run(name, func(t *testing.T) {
			if capped {
				requireCapTools(t)
			}
			ctx := testContext(t)
			s, err := New(ctx, t.TempDir(), newFakeFS(), opts...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			testVolatileWritable(t, ctx, s)
		})
	}
	t.Run("off", func(t *testing.T) {
		ctx := testContext(t)
		s, err := New(ctx, t.TempDir(), newFakeFS())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		commitBase(t, ctx, s)
		ms, err := s.Prepare(ctx, "c", "base")
		if err != nil {
			t.Fatal(err)
		}
		if isVolatile(ms) {
			t.Errorf("volatile without WithVolatileWritable: %v", ms[0].Options)
		}
	})
}

func testVolatileWritable(t *testing.T, ctx context.Context, s *Snapshotter) {
	commitBase(t, ctx, s)
	ms, err := s.Prepare(ctx, "c", "base")
	if err != nil {
		t.Fatal(err)
	}
	// A capped snapshot's file system stays mounted until it is removed.
	t.Cleanup(func() {
		if err := s.Remove(ctx, "c"); err != nil {
			t.Error(err)
		}
	})
	if !isVolatile(ms) {
		t.Fatalf("container snapshot not volatile: %v", ms[0].Options)
	}
	upper, err := upperDir(ms)
	if err != nil {
		t.Fatal(err)
	}
	mark := filepath.Join(filepath.Dir(upper), "work", "work", "incompat", "volatile")
	target := t.TempDir()
	// Touching a lower file copies it up: what volatile spares a sync.
	touch := func(ms []mount.Mount, file string) {
		t.Helper()
		if err := mount.All(ms, target); err != nil {
			t.Fatalf("mount: %v", err)
		}
		defer func() {
			if err := mount.UnmountAll(target, 0); err != nil {
				t.Fatal(err)
			}
		}()
		now := time.Now()
		if err := os.Chtimes(filepath.Join(target, file), now, now); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(mark); err != nil {
			t.Fatalf("no volatile mark while mounted: %v", err)
		}
		// Mounts while the upper is mounted keeps the mark.
		if _, err := s.Mounts(ctx, "c"); err != nil {
			t.Fatalf("Mounts while mounted: %v", err)
		}
		if _, err := os.Stat(mark); err != nil {
			t.Fatalf("Mounts while mounted removed the mark: %v", err)
		}
	}
	touch(ms, "a")
	if _, err := os.Stat(filepath.Join(upper, "a")); err != nil {
		t.Fatalf("no copy-up in the upper: %v", err)
	}
	// The container starts again on the same snapshot.
	ms, err = s.Mounts(ctx, "c")
	if err != nil {
		t.Fatal(err)
	}
	if !isVolatile(ms) {
		t.Fatalf("Mounts not volatile: %v", ms[0].Options)
	}
	touch(ms, "b")
	for _, f := range []string{"a", "b"} {
		if _, err := os.Stat(filepath.Join(upper, f)); err != nil {
			t.Errorf("upper lost %s: %v", f, err)
		}
	}
	// The boot that mounted it is not this one.
	if err := os.WriteFile(filepath.Join(filepath.Dir(upper), volatileBootFile), []byte("00000000-0000-0000-0000-000000000000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = s.Mounts(ctx, "c")
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "before the host restarted") {
		t.Fatalf("Mounts of a layer mounted volatile in an earlier boot: %v, want FailedPrecondition", err)
	}
}

// commitBase commits "base", an unpack's snapshot holding files a and b,
// and checks that the unpack was not mounted volatile.
func commitBase(t *testing.T, ctx context.Context, s *Snapshotter) {
	t.Helper()
	ms, err := s.Prepare(ctx, "base-x", "", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "base"}))
	if err != nil {
		t.Fatal(err)
	}
	if isVolatile(ms) {
		t.Errorf("an unpack's snapshot is volatile: %v", ms[0].Options)
	}
	up, err := upperDir(ms)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(up, f), []byte(f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Commit(ctx, "base", "base-x"); err != nil {
		t.Fatal(err)
	}
}

func isVolatile(ms []mount.Mount) bool {
	return len(ms) == 1 && slices.Contains(ms[0].Options, optVolatile)
}

// BenchmarkCopyUp measures copying files up from a lower layer (what
// `go` does when it touches the mtime of build-cache entries) in a
// container snapshot on the disk cap (1 GiB), with and without
// WithVolatileWritable, side by side in each iteration.
func BenchmarkCopyUp(b *testing.B) {
	requireCapTools(b)
	const files = 1000
	ctx := namespaces.WithNamespace(b.Context(), "test")
	type mode struct {
		name string
		s    *Snapshotter
		took time.Duration
	}
	var modes []*mode
	for _, volatile := range []bool{true, false} {
		s, err := New(ctx, b.TempDir(), newFakeFS(), WithWritableCap(diskcap.Limits{Bytes: 1 << 30}), WithVolatileWritable(volatile))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		ms, err := s.Prepare(ctx, "base-x", "", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "base"}))
		if err != nil {
			b.Fatal(err)
		}
		up, err := upperDir(ms)
		if err != nil {
			b.Fatal(err)
		}
		data := make([]byte, 16<<10)
		for i := range files {
			if err := os.WriteFile(filepath.Join(up, fmt.Sprint(i)), data, 0o644); err != nil {
				b.Fatal(err)
			}
		}
		if err := s.Commit(ctx, "base", "base-x"); err != nil {
			b.Fatal(err)
		}
		name := "durable"
		if volatile {
			name = "volatile"
		}
		modes = append(modes, &mode{name: name, s: s})
	}
	target := b.TempDir()
	for i := 0; b.Loop(); i++ {
		for _, m := range modes {
			key := fmt.Sprint("c", i)
			ms, err := m.s.Prepare(ctx, key, "base")
			if err != nil {
				b.Fatal(err)
			}
			if err := mount.All(ms, target); err != nil {
				b.Fatal(err)
			}
			now := time.Now()
			start := time.Now()
			for f := range files {
				if err := os.Chtimes(filepath.Join(target, fmt.Sprint(f)), now, now); err != nil {
					b.Fatal(err)
				}
			}
			m.took += time.Since(start)
			if err := mount.UnmountAll(target, 0); err != nil {
				b.Fatal(err)
			}
			if err := m.s.Remove(ctx, key); err != nil {
				b.Fatal(err)
			}
		}
	}
	n := float64(b.N) * files
	for _, m := range modes {
		b.ReportMetric(m.took.Seconds()*1e6/n, "us-copyup-"+m.name)
	}
	b.ReportMetric(modes[0].took.Seconds()/modes[1].took.Seconds(), "x-volatile")
}
