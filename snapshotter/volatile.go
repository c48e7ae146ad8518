package snapshotter

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/moby/sys/mountinfo"
)

// WithVolatileWritable mounts the writable layer of every container
// snapshot (an active snapshot that is not an unpack's) with overlayfs'
// "volatile" option: nothing the container does is synced to disk (the
// fsync overlayfs makes after each copy-up, and the container's own
// fsync and syncfs, return at once). An environment's writable layer
// dies with it, so it gives up only what a host crash would take anyway;
// a `go` run that touches a thousand build-cache entries copies each up,
// and each of those syncs cost 0.3-0.5 ms on the disk cap's file system.
//
// overlayfs refuses to mount a volatile upper again until its
// work/incompat/volatile directory is removed, because after a crash its
// contents may be incomplete. Mounts removes it when the snapshot was
// last mounted in this boot and nothing mounts it now (a container
// started again after it stopped), and refuses the snapshot, with
// FailedPrecondition, when it was mounted before the host restarted.
func WithVolatileWritable(on bool) Opt {
	return func(c *config) error {
		c.volatile = on
		return nil
	}
}

const (
	optVolatile = "volatile"
	// volatileBootFile, in the snapshot's directory beside its upper
	// ("fs") and work directories, holds the boot id of the last boot
	// that mounted the upper volatile.
	volatileBootFile = "volatile-boot-id"
	bootIDPath       = "/proc/sys/kernel/random/boot_id"
)

// volatileMounts adds the volatile option to overlay's mount of an active
// container snapshot and records this boot as the one that mounts it.
// key names the snapshot in errors.
func (s *Snapshotter) volatileMounts(ctx context.Context, key string, mounts []mount.Mount) ([]mount.Mount, error) {
	if !s.volatile || len(mounts) != 1 || mounts[0].Type != "overlay" {
		// A snapshot without a parent is a bind mount of its upper:
		// there is no overlay to copy up through.
		return mounts, nil
	}
	upper, err := upperDir(mounts)
	if err != nil {
		return nil, err
	}
	if err := clearVolatileMark(ctx, key, mounts[0].Options, upper, s.bootID); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(upper), volatileBootFile), s.bootID, 0o600); err != nil {
		return nil, fmt.Errorf("snapshot %s: record the boot that mounts it volatile: %w", key, err)
	}
	m := mounts[0]
	if !slices.Contains(m.Options, optVolatile) {
		m.Options = append(slices.Clone(m.Options), optVolatile)
	}
	return []mount.Mount{m}, nil
}

// clearVolatileMark removes the mark overlayfs leaves in the work
// directory of a volatile mount, so that the upper can be mounted again,
// when that is safe: the mount was made in this boot (every write is
// still in the page cache) and has ended. While the upper is mounted the
// mark stays (it is what tells a later boot the upper is not to be
// trusted); from an earlier boot the snapshot is refused. boot is this
// boot's id.
func clearVolatileMark(ctx context.Context, key string, opts []string, upper string, boot []byte) error {
	var work string
	for _, o := range opts {
		if v, ok := strings.CutPrefix(o, "workdir="); ok {
			work = v
		}
	}
	if work == "" {
		return fmt.Errorf("snapshot %s: no workdir in its overlay mount", key)
	}
	mark := filepath.Join(work, "work", "incompat", optVolatile)
	if _, err := os.Lstat(mark); errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("snapshot %s: %w", key, err)
	}
	recorded, err := os.ReadFile(filepath.Join(filepath.Dir(upper), volatileBootFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("snapshot %s: read the boot that mounted it volatile: %w", key, err)
	}
	if !bytes.Equal(bytes.TrimSpace(recorded), boot) {
		return fmt.Errorf("snapshot %s: its writable layer was mounted volatile (nothing synced to disk) before the host restarted, so its contents may be incomplete; remove the container and start a new one (writable_volatile = false keeps writable layers across host restarts): %w", key, errdefs.ErrFailedPrecondition)
	}
	inUse, err := upperMounted(upper)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", key, err)
	}
	if inUse {
		return nil
	}
	if err := os.RemoveAll(mark); err != nil {
		return fmt.Errorf("snapshot %s: clear overlayfs' volatile mark: %w", key, err)
	}
	log.G(ctx).WithField("key", key).Debug("cleared the volatile mark of a writable layer mounted earlier in this boot")
	return nil
}

// upperMounted reports whether a container's overlay mount (see
// containerMounts) has upper as its upper directory.
func upperMounted(upper string) (bool, error) {
	ms, err := containerMounts(mountinfo.FSTypeFilter("overlay"))
	if err != nil {
		return false, fmt.Errorf("list overlay mounts: %w", err)
	}
	for _, m := range ms {
		if slices.Contains(strings.Split(m.VFSOptions, ","), "upperdir="+upper) {
			return true, nil
		}
	}
	return false, nil
}

// volatileSupported mounts an empty overlay with the volatile option in a
// temporary directory under root (Linux 5.10 and later have it), and
// returns this boot's id, which the snapshots mounted volatile record.
func volatileSupported(root string) ([]byte, error) {
	boot, err := os.ReadFile(bootIDPath)
	if err != nil {
		return nil, fmt.Errorf("read the boot id: %w", err)
	}
	dir, err := os.MkdirTemp(root, "volatile-probe-")
	if err != nil {
		return nil, fmt.Errorf("probe overlayfs volatile: %w", err)
	}
	defer os.RemoveAll(dir)
	for _, d := range []string{"lower", "upper", "work", "merged"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return nil, fmt.Errorf("probe overlayfs volatile: %w", err)
		}
	}
	m := mount.Mount{Type: "overlay", Source: "overlay", Options: []string{
		"lowerdir=" + filepath.Join(dir, "lower"),
		"upperdir=" + filepath.Join(dir, "upper"),
		"workdir=" + filepath.Join(dir, "work"),
		optVolatile,
	}}
	merged := filepath.Join(dir, "merged")
	if err := m.Mount(merged); err != nil {
		return nil, fmt.Errorf("probe overlayfs volatile: %w", err)
	}
	if err := mount.UnmountAll(merged, 0); err != nil {
		return nil, fmt.Errorf("probe overlayfs volatile: %w", err)
	}
	return bytes.TrimSpace(boot), nil
}
