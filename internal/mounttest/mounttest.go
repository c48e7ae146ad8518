// Package mounttest fails a test that leaves a mount behind. A leaked FUSE
// mount outlives the test binary as a dead mount (`Transport endpoint is
// not connected`) that breaks every later walk of the temporary directory,
// and a leaked overlay or loop mount pins its files; neither makes the
// test itself fail unless something looks.
package mounttest

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// NoLeaks fails t if, once its other clean-ups ran, a mount is left at or
// below the directory that holds t's temporary directories (t.TempDir),
// and detaches what it finds so the temporary directories can still be
// removed. Call it before anything of t mounts: clean-ups run last in,
// first out, so the check runs after the test's own unmounts and before
// its temporary directories are removed. Mounts elsewhere (another test
// binary's, the daemons of an e2e harness) are not looked at.
func NoLeaks(t testing.TB) {
	t.Helper()
	// Every t.TempDir of t is a directory of its own below one parent.
	dir := filepath.Dir(t.TempDir())
	t.Cleanup(func() {
		ms, err := Below(dir)
		if err != nil {
			t.Errorf("check for leaked mounts: %v", err)
		}
		for _, m := range ms {
			t.Errorf("test left a %s mount at %s (now detached)", m.FSType, m.Mountpoint)
			// MNT_FORCE aborts a FUSE connection whose server is gone,
			// so nothing waits on it; MNT_DETACH takes it out of the
			// tree even while busy.
			_ = unix.Unmount(m.Mountpoint, unix.MNT_FORCE|unix.MNT_DETACH)
		}
	})
}

// Below returns the mounts at or below dir, deepest first (so detaching
// them in order never meets a parent that still has mounts below it).
func Below(dir string) ([]*mountinfo.Info, error) {
	ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) {
		return m.Mountpoint != dir && !strings.HasPrefix(m.Mountpoint, dir+"/"), false
	})
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	sort.SliceStable(ms, func(i, j int) bool { return len(ms[i].Mountpoint) > len(ms[j].Mountpoint) })
	return ms, nil
}
