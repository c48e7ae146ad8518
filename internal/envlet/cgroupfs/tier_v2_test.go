package cgroupfs

import (
	"path/filepath"
	"testing"
)

// The v2 writers of tiers and freezing, against the kernel's file names
// in a fake cgroup directory (this host's cpu and memory controllers are
// on v1; the real v2 runs are in a VM).
func TestV2TierAndFreezeWriters(t *testing.T) {
	root, path := fakeV2(t, map[string]string{"cpu.weight": "100\n", "cpu.idle": "0\n", "cgroup.freeze": "0\n"})
	c, err := OpenV2(filepath.Join(root, path))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	dir := filepath.Join(root, path)
	if err := c.SetWeight(1000); err != nil {
		t.Fatal(err)
	}
	if err := c.SetIdle(true); err != nil {
		t.Fatal(err)
	}
	if err := c.Freeze(true); err != nil {
		t.Fatal(err)
	}
	for f, want := range map[string]string{"cpu.weight": "1000", "cpu.idle": "1", "cgroup.freeze": "1"} {
		if got := readFile(t, filepath.Join(dir, f)); got != want {
			t.Errorf("%s = %q, want %q", f, got, want)
		}
	}
	if err := c.Freeze(false); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(dir, "cgroup.freeze")); got != "0" {
		t.Errorf("cgroup.freeze = %q after thaw", got)
	}
}
