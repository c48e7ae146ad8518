package snapshotter

import (
	"fmt"
	"os"

	"github.com/moby/sys/mountinfo"
)

// containerMounts lists the mounts matching filter that containers' root
// file systems may be among: those of this process's mount namespace and
// those of PID 1's. containerd mounts every container's overlay in the
// host's namespace; a daemon in a Kubernetes pod sees its own layer mounts
// (propagated both ways through its root) but not those overlays, so
// without the host's table it would take every layer for unused and
// unmount it under running containers on its way out. PID 1's table is the
// host's when the daemon shares the host's PID namespace (the DaemonSet's
// hostPID: true); in the host's own namespace it is ours again, and mount
// IDs, which the kernel numbers across all namespaces, drop the repeats.
func containerMounts(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	own, err := mountinfo.GetMounts(filter)
	if err != nil {
		return nil, fmt.Errorf("read this mount namespace's mounts: %w", err)
	}
	f, err := os.Open("/proc/1/mountinfo")
	if err != nil {
		// PID 1 of a PID namespace of our own may be unreadable; our
		// table is then all there is to read.
		return own, nil
	}
	defer f.Close()
	host, err := mountinfo.GetMountsFromReader(f, filter)
	if err != nil {
		return nil, fmt.Errorf("read the mounts of PID 1's mount namespace: %w", err)
	}
	seen := make(map[int]bool, len(own))
	for _, m := range own {
		seen[m.ID] = true
	}
	for _, m := range host {
		if !seen[m.ID] {
			own = append(own, m)
		}
	}
	return own, nil
}
