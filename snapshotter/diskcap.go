//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

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

// DefaultWritableReserve is the share of the snapshotter's file system,
// in percent, that no single writable layer can take (diskcap.Share).
const DefaultWritableReserve = 10

// WithWritableReserve sets the percentage of the snapshotter's file
// system that a capped writable layer leaves free when it is full
// (diskcap.Share); DefaultWritableReserve without it.
func WithWritableReserve(percent int) Opt {
	return func(c *config) error {
		if percent < 0 || percent >= 100 {
			return fmt.Errorf("writable reserve %d%%: want 0 to 99", percent)
		}
		c.writableReserve = &percent
		return nil
	}
}

// writableCap is the cap a container snapshot prepared with opts gets,
// and the options that record it on the snapshot (the label a restarted
// daemon remounts it by). A cap larger than the node can give beyond its
// reserve shrinks to what it can give.
func (s *Snapshotter) writableCap(ctx context.Context, opts []snapshots.Opt) (diskcap.Limits, []snapshots.Opt, error) {
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
	size, avail, err := diskcap.Space(filepath.Join(s.root, "snapshots"))
	if err != nil {
		return diskcap.Limits{}, nil, fmt.Errorf("size the writable layer: %w", err)
	}
	share, err := diskcap.Share(l.Bytes, size, avail, s.writableReserve)
	if err != nil {
		return diskcap.Limits{}, nil, fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
	}
	if share < l.Bytes {
		log.G(ctx).WithField("asked", l.Bytes).WithField("cap", share).WithField("free", avail).
			Info("writable layer capped at the node's free space beyond its reserve")
		l.Bytes = share
	}
	return l, append(opts, snapshots.WithLabels(map[string]string{diskcap.LabelBytes: fmt.Sprint(l.Bytes)})), nil
}

// defaultCapFits reports whether a container snapshot prepared now
// would get the whole default cap (writableCap does not shrink it to the
// node's free space): the images diskcap.Pool makes ahead are of it.
func (s *Snapshotter) defaultCapFits() bool {
	size, avail, err := diskcap.Space(filepath.Join(s.root, "snapshots"))
	if err != nil {
		return false
	}
	share, err := diskcap.Share(s.writableDefault.Bytes, size, avail, s.writableReserve)
	return err == nil && share == s.writableDefault.Bytes
}

// capWritable puts the writable directories of the new active snapshot
// key on a file system of l; on error the snapshot is removed.
func (s *Snapshotter) capWritable(ctx context.Context, key string, mounts []mount.Mount, l diskcap.Limits) error {
	upper, err := upperDir(mounts)
	if err == nil {
		err = diskcap.Setup(ctx, filepath.Dir(upper), l, s.capPool)
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

// capPoolDir holds, under the snapshotter's root, the images of the
// default cap made ahead (diskcap.Pool); capPoolSize is how many. Four
// cover the first half of a crowded start of eight; the rest format
// their own while the pool refills at idle priority.
const (
	capPoolDir  = "diskcap-pool"
	capPoolSize = 4
)

// uncapDir holds, under the snapshotter's root, the copies Commit makes
// of capped upper directories (uncapWritable).
const uncapDir = "uncap"

// commitCapped moves the files of the capped active snapshot info off
// its cap's file system (diskcap.Uncap) so that overlay can commit it,
// and records that it has no cap any more.
func (s *Snapshotter) commitCapped(ctx context.Context, info snapshots.Info) error {
	dir, err := s.cappedDir(ctx, info.Name)
	if err != nil {
		return fmt.Errorf("find its disk cap: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(s.root, uncapDir), 0o700); err != nil {
		return fmt.Errorf("disk cap: %w", err)
	}
	if err := diskcap.Uncap(dir, filepath.Join(s.root, uncapDir, filepath.Base(dir))); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("%w (still mounted by a container): %w", err, errdefs.ErrFailedPrecondition)
		}
		return err
	}
	info.Labels[diskcap.LabelBytes] = "0"
	if _, err := s.Snapshotter.Update(ctx, info, "labels."+diskcap.LabelBytes); err != nil {
		return fmt.Errorf("record that the disk cap is gone: %w", err)
	}
	return nil
}

// restoreCaps mounts again the file systems of capped snapshots that are
// not mounted (after a reboot; a crashed daemon leaves them mounted),
// and drops the copies of a Commit that died before it ended (the cap's
// file system still holds the files).
func (s *Snapshotter) restoreCaps(ctx context.Context) error {
	if err := os.RemoveAll(filepath.Join(s.root, uncapDir)); err != nil {
		return fmt.Errorf("remove unfinished disk cap copies: %w", err)
	}
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
