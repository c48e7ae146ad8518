package diskcap

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"github.com/containerd/log"

	"github.com/envsnap/envsnap/internal/idleprio"
)

// Pool keeps a few images of one Limits made ahead, so that Setup takes
// one (a rename) instead of running mkfs.ext4 while a container start
// waits for its snapshot: 23-31 ms of every Prepare on the 2-core test
// machine, for the default 20 GiB cap. The images are made at idle
// priority (idleprio.RunProcess), one at a time, after each take; a
// Setup that finds the pool empty, or wants other limits, makes its own
// as before. The directory must be on the file system of the snapshots
// (a rename moves an image into its snapshot's directory).
type Pool struct {
	dir    string
	limits Limits

	mu     sync.Mutex
	ready  []string // images made, oldest first
	closed bool

	kick   chan struct{}
	cancel context.CancelFunc
	done   chan struct{}
}

// NewPool empties dir (images a previous daemon made may be of other
// limits, or half made) and starts keeping size images of l in it,
// making each only if wanted (nil: always) says a Setup would ask for l
// now: a node short of space caps its layers smaller than l, and images
// it would not take only cost it space.
func NewPool(ctx context.Context, dir string, l Limits, size int, wanted func() bool) (*Pool, error) {
	if l.Bytes < MinBytes || size < 1 {
		return nil, fmt.Errorf("disk cap pool: %d images of %d bytes: want at least one, of at least %d bytes", size, l.Bytes, MinBytes)
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("disk cap pool: empty %s: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("disk cap pool: %w", err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p := &Pool{dir: dir, limits: l, kick: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
	go p.fill(ctx, size, wanted)
	return p, nil
}

// Ready is the number of images the pool holds now.
func (p *Pool) Ready() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ready)
}

// take moves an image of l to img, if the pool has one; false leaves
// img to the caller. A nil pool has none.
func (p *Pool) take(ctx context.Context, l Limits, img string) bool {
	if p == nil || l != p.limits {
		return false
	}
	// Wake the fill whatever happens below: after a failed make it
	// waits for a take to try again.
	defer func() {
		select {
		case p.kick <- struct{}{}:
		default:
		}
	}()
	p.mu.Lock()
	if len(p.ready) == 0 {
		p.mu.Unlock()
		return false
	}
	src := p.ready[0]
	p.ready = p.ready[1:]
	p.mu.Unlock()
	if err := os.Rename(src, img); err != nil {
		// Another file system under the snapshots (EXDEV), or the
		// image is gone: the caller makes its own.
		log.G(ctx).WithError(err).WithField("image", src).Warn("disk cap pool: cannot move a made image into its snapshot; making one there")
		os.Remove(src)
		return false
	}
	return true
}

// fill makes images until the pool holds size (or wanted says no more),
// then waits for a take.
func (p *Pool) fill(ctx context.Context, size int, wanted func() bool) {
	defer close(p.done)
	made := 0 // names the next image
	for {
		for p.Ready() < size && (wanted == nil || wanted()) {
			img := filepath.Join(p.dir, strconv.Itoa(made)+".ext4")
			made++
			tmp := img + ".tmp"
			if err := format(ctx, tmp, p.limits, idleprio.RunProcess); err != nil {
				if ctx.Err() == nil {
					// Setup makes its own, and says why if it cannot.
					log.G(ctx).WithError(err).Warn("disk cap pool: making an image failed; container starts make their own until the next take")
				}
				break
			}
			// Only whole images carry the name take hands out.
			if err := os.Rename(tmp, img); err != nil {
				os.Remove(tmp)
				log.G(ctx).WithError(err).Warn("disk cap pool: keeping a made image failed")
				break
			}
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				os.Remove(img)
				return
			}
			p.ready = append(p.ready, img)
			p.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
		}
	}
}

// Close stops making images and removes the pool's directory.
func (p *Pool) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	<-p.done
	if err := os.RemoveAll(p.dir); err != nil {
		return fmt.Errorf("disk cap pool: remove %s: %w", p.dir, err)
	}
	return nil
}
