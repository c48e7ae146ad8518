//go:build linux

package snapshotter

import (
	"context"
	"os"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"

	"github.com/envsnap/envsnap/internal/prereq"
)

// TestConformance runs containerd's snapshotter suite. It exercises the
// normal (non-lazy) path, which must behave exactly like overlayfs; the name
// "overlayfs" selects the suite's overlay expectations for rename.
func TestConformance(t *testing.T) {
	if os.Getuid() != 0 {
		prereq.Missing(t, "the snapshotter suite mounts overlayfs: needs root")
	}
	testsuite.SnapshotterSuite(t, "overlayfs", func(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
		s, err := New(ctx, root, newFakeFS())
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	})
}
