package cgroupfs

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/opencontainers/cgroups"
	"github.com/opencontainers/cgroups/fs2"
	"github.com/opencontainers/cgroups/systemd"
)

// A container's OCI cgroupsPath comes in three forms, and runc, which
// creates the cgroup, decides where it lands:
//
//   - "slice:prefix:name" with the systemd driver (containerd's CRI writes
//     it when the pod's cgroup parent is a .slice, the kubeadm default):
//     the scope "prefix-name.scope" under the slice, nested slices
//     expanded by dashes ("kubepods-burstable-pod1.slice" lives at
//     kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice).
//     An empty slice is system.slice; a name ending in ".slice" is used
//     as is.
//   - an absolute path ("/kubepods/burstable/pod1/id"): below the root of
//     the hierarchy.
//   - a relative path: on v2 below the parent of the runtime's own cgroup
//     (runc runs in the shim's cgroup).
//
// The resolution is runc's own (github.com/opencontainers/cgroups, the
// library runc is built on), so envlet opens the directory runc created.
// Which driver a path is meant for is read from its shape, as runc's
// systemd driver accepts only the colon form and containerd emits it only
// for a .slice parent.

// IsSystemdPath reports whether p is in the systemd driver's
// "slice:prefix:name" form.
func IsSystemdPath(p string) bool {
	return !strings.HasPrefix(p, "/") && strings.Count(p, ":") == 2
}

// systemdCgroup splits a "slice:prefix:name" path the way runc's specconv
// does.
func systemdCgroup(p string) (*cgroups.Cgroup, error) {
	parts := strings.Split(p, ":")
	if len(parts) != 3 || parts[2] == "" {
		return nil, fmt.Errorf("cgroupsPath %q: expected slice:prefix:name for the systemd driver", p)
	}
	return &cgroups.Cgroup{Parent: parts[0], ScopePrefix: parts[1], Name: parts[2]}, nil
}

// ResolveV2 returns the directory of the cgroup runc creates for
// cgroupsPath on a cgroup v2 host (mounted at /sys/fs/cgroup).
func ResolveV2(cgroupsPath string) (string, error) {
	if cgroupsPath == "" {
		return "", fmt.Errorf("empty cgroupsPath")
	}
	if IsSystemdPath(cgroupsPath) {
		c, err := systemdCgroup(cgroupsPath)
		if err != nil {
			return "", err
		}
		// Builds the path only; the D-Bus connection is made lazily by
		// calls envlet never makes.
		m, err := systemd.NewUnifiedManager(c, "")
		if err != nil {
			return "", fmt.Errorf("cgroupsPath %q: %w", cgroupsPath, err)
		}
		return m.Path(""), nil
	}
	m, err := fs2.NewManager(&cgroups.Cgroup{Path: cgroupsPath}, "")
	if err != nil {
		return "", fmt.Errorf("cgroupsPath %q: %w", cgroupsPath, err)
	}
	return m.Path(""), nil
}

// ResolveV1 returns cgroupsPath relative to the root of each v1
// hierarchy: the expanded slice and scope for the systemd form, the path
// itself otherwise. A relative path is taken below the hierarchy's root
// (runc places it below its own cgroup of each hierarchy; the two agree
// for a runtime in the root cgroup, the only v1 layout envlet supports).
func ResolveV1(cgroupsPath string) (string, error) {
	if cgroupsPath == "" {
		return "", fmt.Errorf("empty cgroupsPath")
	}
	if !IsSystemdPath(cgroupsPath) {
		return cgroupsPath, nil
	}
	c, err := systemdCgroup(cgroupsPath)
	if err != nil {
		return "", err
	}
	slice := "/system.slice"
	if c.Parent != "" {
		if slice, err = systemd.ExpandSlice(c.Parent); err != nil {
			return "", fmt.Errorf("cgroupsPath %q: %w", cgroupsPath, err)
		}
	}
	unit := c.Name
	if !strings.HasSuffix(unit, ".slice") {
		unit = c.ScopePrefix + "-" + c.Name + ".scope"
	}
	return filepath.Join(slice, unit), nil
}
