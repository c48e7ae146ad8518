package lazyfs

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/log"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// passthroughFS switches regular files that have a local copy
// (BackingFiles) to FUSE passthrough: the kernel then reads the copy
// itself and the reads never reach the daemon.
//
// The kernel keeps one I/O mode per inode while any file of it is open:
// an open in passthrough mode fails with EIO while the inode has cached
// (page-cache) opens, a cached open fails while it has passthrough opens,
// and a passthrough open with a different backing file fails while one is
// in use. So an inode switches only when this server knows it has no open
// file (every cached open it answered has been released), and once
// switched it stays in passthrough, with the same backing ID, for the
// life of the mount: every later open, including those answered by a
// successor after a restart, gets that ID. The IDs are appended to a
// state file before the open is answered; a successor (WithTakeover)
// reads it back and, not knowing which cached opens of its predecessor
// are still alive, switches no other inode.
//
// Backing IDs are never unregistered: the kernel keeps each copy open
// until the mount ends, even when the copy store has evicted it. That
// bounds the pinned copies by the files a mount serves in passthrough.
type passthroughFS struct {
	fuse.RawFileSystem
	l        *layer
	b        BackingFiles
	srv      *fuse.Server // set before the server starts serving
	restored bool         // a successor: switch no inode the state file does not name

	mu       sync.Mutex
	disabled bool             // the kernel refused a backing file
	ids      map[uint64]int32 // node ID -> backing ID
	cached   map[uint64]int   // node ID -> cached opens answered by this server
	state    *os.File         // append-only "<node ID> <backing ID>" lines
}

// newPassthroughFS opens (fresh: truncates; restored: reads) the state file.
func newPassthroughFS(raw fuse.RawFileSystem, l *layer, b BackingFiles, statePath string, restored bool) (*passthroughFS, error) {
	p := &passthroughFS{
		RawFileSystem: raw,
		l:             l,
		b:             b,
		restored:      restored,
		ids:           map[uint64]int32{},
		cached:        map[uint64]int{},
	}
	flags := os.O_RDWR | os.O_CREATE | os.O_APPEND
	if !restored {
		flags |= os.O_TRUNC
	}
	f, err := os.OpenFile(statePath, flags, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open passthrough state: %w", err)
	}
	if restored {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			node, id, ok := strings.Cut(sc.Text(), " ")
			n, err1 := strconv.ParseUint(node, 10, 64)
			b, err2 := strconv.ParseInt(id, 10, 32)
			if !ok || err1 != nil || err2 != nil || b <= 0 {
				continue // a line torn by a crash names nothing the kernel was told
			}
			p.ids[n] = int32(b)
		}
		if err := sc.Err(); err != nil {
			f.Close()
			return nil, fmt.Errorf("read passthrough state: %w", err)
		}
	}
	p.state = f
	return p, nil
}

func (p *passthroughFS) Open(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	st := p.RawFileSystem.Open(c, in, out)
	if !st.Ok() {
		return st
	}
	node := in.NodeId
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.ids[node]
	if !ok && !p.restored && !p.disabled && p.cached[node] == 0 {
		id, ok = p.register(node)
	}
	if ok {
		out.OpenFlags = out.OpenFlags&^fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_PASSTHROUGH
		out.BackingID = id
		p.l.stats.backedOpens.Add(1)
		return st
	}
	p.cached[node]++
	return st
}

// register hands the kernel the local copy of node's file, if there is
// one, and records its backing ID. p.mu is held.
func (p *passthroughFS) register(node uint64) (int32, bool) {
	idx := int(node) - 1 // node IDs are TOC index + 1 (ino)
	if idx < 1 || idx >= p.l.toc.Len() {
		return 0, false
	}
	f := p.b.Backing(p.l.ctx, idx)
	if f == nil {
		return 0, false
	}
	defer f.Close()
	id, errno := p.srv.RegisterBackingFd(&fuse.BackingMap{Fd: int32(f.Fd())})
	if errno != 0 {
		// No passthrough on this kernel or connection (or not root):
		// the read path serves everything, as without copies.
		p.disabled = true
		log.G(p.l.ctx).WithError(errno).Info("lazyfs: kernel refused a passthrough backing file; serving reads through the daemon")
		return 0, false
	}
	if _, err := fmt.Fprintf(p.state, "%d %d\n", node, id); err != nil {
		// A successor could not know the inode is in passthrough and
		// would answer its opens in a mode the kernel refuses.
		if errno := p.srv.UnregisterBackingFd(id); errno != 0 {
			log.G(p.l.ctx).WithError(errno).Warn("lazyfs: unregister backing file")
		}
		log.G(p.l.ctx).WithError(err).Warn("lazyfs: cannot record passthrough state; serving reads through the daemon")
		p.disabled = true
		return 0, false
	}
	p.ids[node] = id
	return id, true
}

func (p *passthroughFS) Release(c <-chan struct{}, in *fuse.ReleaseIn) {
	// The bridge gives handle-less opens no handle of their own (Fh 0),
	// so releases are counted per inode: an inode in passthrough never
	// has cached opens again, so any other release ends a cached one.
	p.mu.Lock()
	if _, pt := p.ids[in.NodeId]; !pt && p.cached[in.NodeId] > 0 {
		if p.cached[in.NodeId]--; p.cached[in.NodeId] == 0 {
			delete(p.cached, in.NodeId)
		}
	}
	p.mu.Unlock()
	p.RawFileSystem.Release(c, in)
}

// remove deletes the state file once the mount is gone: the backing IDs
// it names died with the connection.
func (p *passthroughFS) remove() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state == nil {
		return
	}
	p.state.Close()
	if err := os.Remove(p.state.Name()); err != nil && !errors.Is(err, os.ErrNotExist) {
		log.G(p.l.ctx).WithError(err).Warn("lazyfs: remove passthrough state")
	}
	p.state = nil
}
