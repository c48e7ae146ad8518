//go:build linux

package layerstore

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/containerd/log"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/fdstore"
	"github.com/envsnap/envsnap/internal/lazyfs"
)

// restoreParallel bounds the layers taken over at once on startup (each
// costs a manifest and a TOC round trip).
const restoreParallel = 8

// keeperMeta is what a successor needs, besides the descriptor, to serve a
// mount again: which layer it is and the kernel's INIT message.
type keeperMeta struct {
	Labels map[string]string `json:"labels"`
	Init   []byte            `json:"init"`
}

// keep hands a duplicate of the mount's FUSE descriptor to the keeper, so
// the mount survives this process. A failure only costs restart safety for
// this mount, so it is logged, not returned.
func (s *Store) keep(ctx context.Context, mountpoint string, labels map[string]string, srv *lazyfs.Server) {
	if s.cfg.Keeper == nil {
		return
	}
	lg := log.G(ctx).WithField("mountpoint", mountpoint)
	h, err := srv.Handover()
	if err != nil {
		lg.WithError(err).Warn("layer mount will not survive a daemon restart")
		return
	}
	defer unix.Close(h.FD)
	dev, err := fdstore.MountDev(mountpoint)
	if err != nil {
		lg.WithError(err).Warn("layer mount will not survive a daemon restart")
		return
	}
	meta, err := json.Marshal(keeperMeta{Labels: labels, Init: h.Init})
	if err != nil {
		lg.WithError(err).Warn("layer mount will not survive a daemon restart")
		return
	}
	if err := s.cfg.Keeper.Put(fdstore.Entry{Key: mountpoint, Mountpoint: mountpoint, Dev: dev, Meta: meta, FD: h.FD}); err != nil {
		lg.WithError(err).Warn("layer mount will not survive a daemon restart: hand its descriptor to the keeper")
	}
}

// forget drops the keeper's descriptor of an unmounted layer.
func (s *Store) forget(ctx context.Context, mountpoint string) {
	if s.cfg.Keeper == nil {
		return
	}
	if err := s.cfg.Keeper.Delete(mountpoint); err != nil {
		log.G(ctx).WithError(err).WithField("mountpoint", mountpoint).Warn("drop kept descriptor of unmounted layer")
	}
}

// Restore takes over the layer mounts a previous daemon left with the
// keeper: each is served again on its live FUSE connection, so containers
// reading it never notice the restart (requests they made meanwhile wait
// in the kernel's queue). It returns the mountpoints now served. Mounts
// that cannot be taken over are logged and their descriptors dropped; the
// snapshotter then detaches and remounts them fresh.
func (s *Store) Restore(ctx context.Context) ([]string, error) {
	if s.cfg.Keeper == nil {
		return nil, nil
	}
	entries, err := s.cfg.Keeper.List()
	if err != nil {
		return nil, fmt.Errorf("list kept layer mounts: %w", err)
	}
	restored := make([]string, len(entries))
	var g errgroup.Group
	g.SetLimit(restoreParallel)
	for i, e := range entries {
		g.Go(func() error {
			if err := s.takeOver(ctx, e); err != nil {
				log.G(ctx).WithError(err).WithField("mountpoint", e.Mountpoint).Error("cannot take over layer mount of the previous daemon; it will be remounted")
				s.forget(ctx, e.Key)
				return nil
			}
			restored[i] = e.Mountpoint
			return nil
		})
	}
	_ = g.Wait()
	out := restored[:0]
	for _, mp := range restored {
		if mp != "" {
			out = append(out, mp)
		}
	}
	return out, nil
}

// takeOver serves one kept mount; it owns e.FD.
func (s *Store) takeOver(ctx context.Context, e fdstore.Entry) error {
	dev, err := fdstore.MountDev(e.Mountpoint)
	if err != nil || dev != e.Dev {
		unix.Close(e.FD)
		return fmt.Errorf("mount is gone (now %q, was %s): %v", dev, e.Dev, err)
	}
	var meta keeperMeta
	if err := json.Unmarshal(e.Meta, &meta); err != nil {
		unix.Close(e.FD)
		return fmt.Errorf("decode kept metadata: %w", err)
	}
	s.mu.Lock()
	_, busy := s.mounts[e.Mountpoint]
	s.mu.Unlock()
	if busy {
		unix.Close(e.FD)
		return fmt.Errorf("already served")
	}
	// lazyfs owns the descriptor from here, also on error.
	if _, err := s.mount(ctx, e.Mountpoint, meta.Labels, &lazyfs.Handover{FD: e.FD, Init: meta.Init}); err != nil {
		return err
	}
	return nil
}
