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
// may cost a manifest and a TOC round trip).
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
// in the kernel's queue). It returns the mountpoints now served.
//
// The layers' manifests and TOCs come from the node cache (metadata.go),
// so a registry outage does not stop a takeover; reads of chunks not in
// the cache then fail with EIO after the read timeout, as in an outage
// without a restart. A mount that cannot be taken over (its metadata is
// neither in the cache nor fetched within the read timeout, or is corrupt)
// is logged and its connection aborted, so its containers get ENOTCONN
// instead of waiting; the snapshotter then remounts the layer fresh. The
// fetch is not retried in the background: the containers would wait in
// the kernel meanwhile, with nothing to tell that wait from a hang.
//
// When ctx is done (the daemon is told to stop while restoring) nothing
// is aborted: the mounts not yet served stay with the keeper, and their
// requests wait in the kernel for the next daemon.
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
			if ctx.Err() != nil {
				// Stopping: the entry stays with the keeper for the next
				// daemon, its containers wait in the kernel meanwhile.
				unix.Close(e.FD)
				return nil
			}
			if err := s.takeOver(ctx, e); err != nil {
				if ctx.Err() != nil {
					log.G(ctx).WithError(err).WithField("mountpoint", e.Mountpoint).Warn("take-over interrupted by shutdown; the layer mount stays with the keeper for the next daemon")
					return nil
				}
				log.G(ctx).WithError(err).WithField("mountpoint", e.Mountpoint).Error("cannot take over layer mount of the previous daemon; its connection is aborted and the layer will be remounted")
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

// takeOver serves one kept mount. It owns e.FD until it hands it to
// lazyfs, which closes it on failure. A kept connection that is not served
// again is aborted (abandon): closing this process's descriptor alone
// would leave the connection alive for as long as any other copy exists
// (the keeper's, one in flight in a keeper message), and the containers
// using it would wait forever for an answer no process gives.
func (s *Store) takeOver(ctx context.Context, e fdstore.Entry) error {
	fd := e.FD
	defer func() {
		if fd >= 0 {
			unix.Close(fd)
		}
	}()
	dev, err := fdstore.MountDev(e.Mountpoint)
	if err != nil || dev != e.Dev {
		// Not the kept connection's mount any more: nothing to abort.
		return fmt.Errorf("mount is gone (now %q, was %s): %v", dev, e.Dev, err)
	}
	s.mu.Lock()
	_, busy := s.mounts[e.Mountpoint]
	s.mu.Unlock()
	if busy {
		// Ours already: never abort a connection this process serves.
		return fmt.Errorf("already served")
	}
	var meta keeperMeta
	if err := json.Unmarshal(e.Meta, &meta); err != nil {
		s.abandon(ctx, e)
		return fmt.Errorf("decode kept metadata: %w", err)
	}
	// The metadata normally comes from the node cache (metadata.go); a
	// registry round trip here is bounded by the read timeout.
	o, err := s.open(ctx, meta.Labels, true, false)
	if err != nil {
		if ctx.Err() == nil {
			s.abandon(ctx, e)
		}
		return err
	}
	h := lazyfs.Handover{FD: fd, Init: meta.Init}
	fd = -1
	if _, err := s.serve(ctx, e.Mountpoint, o, &h); err != nil {
		if ctx.Err() == nil {
			s.abandon(ctx, e)
		}
		return err
	}
	return nil
}

// abandon aborts the FUSE connection of a kept mount that will not be
// served again and detaches the mount (lazyfs.Abort): the requests waiting
// in it, and every later one, fail with ENOTCONN. The snapshotter then
// remounts the layer fresh for new containers.
func (s *Store) abandon(ctx context.Context, e fdstore.Entry) {
	if dev, err := fdstore.MountDev(e.Mountpoint); err != nil || dev != e.Dev {
		return // already gone; whatever is mounted there now is not ours to abort
	}
	if err := lazyfs.Abort(e.Mountpoint); err != nil {
		log.G(ctx).WithError(err).WithField("mountpoint", e.Mountpoint).Error("abort FUSE connection of the previous daemon; its containers may hang until it is aborted by hand")
	}
}
