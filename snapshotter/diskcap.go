//go:build linux

package snapshotter

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/envsnap/envsnap/internal/diskcap"
)

// WithWritableCap gives every container snapshot (an active snapshot that
// is not an unpack's) a hard size and inode limit unless its Prepare
// labels say otherwise (diskcap.LabelBytes, diskcap.LabelInodes; 0 for
// none). The zero value caps none.
func WithWritableCap(l diskcap.Limits) Opt {
	return func(c *config) error {
		if _, err := diskcap.FromLabels(nil, l); err != nil {
			return err
		}
		c.writableCap = l
		return nil
	}
}

// writableCap is the cap a container snapshot prepared with opts gets,
// and the options that record it on the snapshot (the label a restarted
// daemon remounts it by).
func (s *Snapshotter) writableCap(opts []snapshots.Opt) (diskcap.Limits, []snapshots.Opt, error) {
	var info snapshots.Info
	for _, o := range opts {
		if err := o(&info); err != nil {
			return diskcap.Limits{}, nil, err
		}
	}
	l, err := diskcap.FromLabels(info.Labels, s.writableDefault)
	if err != nil {
		return diskcap.Limits{}, nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	if l.Bytes == 0 {
		return l, opts, nil
	}
	return l, append(opts, snapshots.WithLabels(map[string]string{diskcap.LabelBytes: fmt.Sprint(l.Bytes)})), nil
}

// capWritable puts the writable directories of the new active snapshot
// key on a file system of l; on error the snapshot is removed.
func (s *Snapshotter) capWritable(ctx context.Context, key string, mounts []mount.Mount, l diskcap.Limits) error {
	upper, err := upperDir(mounts)
	if err == nil {
		err = diskcap.Setup(ctx, filepath.Dir(upper), l)
	}
	if err != nil {
		if rerr := s.Snapshotter.Remove(ctx, key); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("key", key).Warn("remove snapshot whose disk cap failed")
		}
		return fmt.Errorf("prepare %s with a disk cap of %d bytes: %w", key, l.Bytes, err)
	}
	return nil
}

// isCapped reports whether info is a capped active snapshot.
func isCapped(info snapshots.Info) bool {
	v, ok := info.Labels[diskcap.LabelBytes]
	return ok && v != "0" && info.Kind == snapshots.KindActive
}

// cappedDir is the directory of the capped active snapshot key.
func (s *Snapshotter) cappedDir(ctx context.Context, key string) (string, error) {
	mounts, err := s.Snapshotter.Mounts(ctx, key)
	if err != nil {
		return "", err
	}
	upper, err := upperDir(mounts)
	if err != nil {
		return "", err
	}
	return filepath.Dir(upper), nil
}

// uncapWritable unmounts the file system of the capped active snapshot
// key before overlay removes its directory.
func (s *Snapshotter) uncapWritable(ctx context.Context, key string) error {
	dir, err := s.cappedDir(ctx, key)
	if err != nil {
		return fmt.Errorf("remove %s: find its disk cap: %w", key, err)
	}
	if err := diskcap.Unmount(dir); err != nil {
		return fmt.Errorf("remove %s: %w", key, err)
	}
	return nil
}

// restoreCaps mounts again the file systems of capped snapshots that are
// not mounted (after a reboot; a crashed daemon leaves them mounted).
func (s *Snapshotter) restoreCaps(ctx context.Context) error {
	var keys []string
	err := s.Snapshotter.Walk(ctx, func(ctx context.Context, info snapshots.Info) error {
		if isCapped(info) {
			keys = append(keys, info.Name)
		}
		return nil
	}, fmt.Sprintf("labels.%q", diskcap.LabelBytes))
	if err != nil && !errdefs.IsNotFound(err) {
		return fmt.Errorf("walk capped snapshots: %w", err)
	}
	for _, key := range keys {
		dir, err := s.cappedDir(ctx, key)
		if err != nil {
			return fmt.Errorf("restore disk cap of %s: %w", key, err)
		}
		mounted, err := diskcap.Mounted(dir)
		if err != nil {
			return fmt.Errorf("restore disk cap of %s: %w", key, err)
		}
		if mounted || !diskcap.Capped(dir) {
			continue
		}
		if err := diskcap.Mount(dir); err != nil {
			log.G(ctx).WithError(err).WithField("key", key).Error("restore disk cap; the snapshot's writable layer is unusable until removed")
			continue
		}
		log.G(ctx).WithField("key", key).Info("disk cap mounted again")
	}
	return nil
}
