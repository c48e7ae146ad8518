//go:build linux

package shim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/api/types"
	"github.com/containerd/continuity/fs"
	"github.com/containerd/fifo"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/diskcap"
	"github.com/envsnap/envsnap/internal/envlet"
)

// pidsTick is how often the guard reads pids.events while forks are
// refused or the cgroup is at its limit, pidsIdleTick while they are not:
// a fork bomb that runs a few ticks longer costs nothing (the limit
// already holds it), so these only bound how soon it is reported (within
// pidsIdleTick + the grace). Every wake-up of an idle shim costs more than
// its reads (the Go scheduler spins up for it).
const (
	pidsTick     = 500 * time.Millisecond
	pidsIdleTick = 2 * time.Second
)

// The guard measures the writable layer every diskTick, or less often:
// one measurement stats every file of the upper directory (containerd's
// fs.DiskUsage, as its overlay snapshotter's Usage does), which took
// 1.3 s for 100,000 files here, so the pause after a measurement is at
// least diskDuty times what it took (the shim spends at most about a
// tenth of a core per environment on it).
//
// A layer that did not change since the last measurement is measured
// half as often each time, up to diskMaxTick, but never so rarely that a
// writer at diskFillRate bytes or diskFileRate files a second could go
// from the last measurement to a cap before the next one: a writer is
// still seen at most about a diskTick after it passes the cap, and an
// idle environment's layer (the common case) stops costing a walk every
// 2 s (13% of an idle shim's CPU, the largest part after the arbiter
// reports).
const (
	diskTick     = 2 * time.Second
	diskDuty     = 10
	diskMaxTick  = 16 * time.Second
	diskFillRate = 1 << 30 // bytes/s: page-cache writes of one writer, about
	diskFileRate = 100_000 // files/s
)

// nextDiskWait is the period of the next measurement of a layer whose last
// two measurements were prev and u, the last period being last (see
// diskMaxTick). The wait is UntilTick of it, at most 1.5 periods.
func nextDiskWait(last time.Duration, prev, u fs.Usage, g guardLimits) time.Duration {
	if u != prev {
		return diskTick
	}
	// How long a writer needs to reach a cap from u.
	reach := diskMaxTick * 3 / 2
	if g.disk > 0 {
		reach = min(reach, time.Duration(float64(max(g.disk-u.Size, 0))/diskFillRate*float64(time.Second)))
	}
	if g.inodes > 0 {
		reach = min(reach, time.Duration(float64(max(g.inodes-u.Inodes, 0))/diskFileRate*float64(time.Second)))
	}
	p := diskTick
	for p < last*2 && p < diskMaxTick && p*2*3/2 <= reach {
		p *= 2
	}
	return p
}

// decideDisk names the writable-layer cap a usage is above, if any.
func decideDisk(u fs.Usage, g guardLimits) string {
	switch {
	case g.disk > 0 && u.Size > g.disk:
		return fmt.Sprintf("the writable layer holds %s, above the disk cap %s", envlet.FormatBytes(u.Size), envlet.FormatBytes(g.disk))
	case g.inodes > 0 && u.Inodes > g.inodes:
		return fmt.Sprintf("the writable layer holds %d files, above the inode cap %d", u.Inodes, g.inodes)
	}
	return ""
}

// upperDir is the upper directory of a rootfs that is one overlay mount,
// else "".
func upperDir(rootfs []*types.Mount) string {
	if len(rootfs) != 1 || rootfs[0].Type != "overlay" {
		return ""
	}
	for _, o := range rootfs[0].Options {
		if v, ok := strings.CutPrefix(o, "upperdir="); ok {
			return v
		}
	}
	return ""
}

// watchDisk measures upper until ctx ends (see diskTick). It is a
// watcher, not a limit: what a process writes between two measurements
// (a single fallocate can take the file system) lands before the
// environment fails.
func (g *guard) watchDisk(ctx context.Context, upper string) {
	t := time.NewTimer(diskTick)
	defer t.Stop()
	period := diskTick
	prev := fs.Usage{Size: -1}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			start := time.Now()
			u, err := fs.DiskUsage(ctx, upper)
			if err == nil {
				period = nextDiskWait(period, prev, u, g.limits)
				prev = u
			}
			// The periods are powers of two times diskTick, so the
			// environments of a shim, and its other watchers, share
			// wake-ups.
			t.Reset(max(envlet.UntilTick(time.Now(), period), diskDuty*time.Since(start)))
			if err != nil {
				if ctx.Err() != nil || errors.Is(err, os.ErrNotExist) {
					return
				}
				// Files vanish under a walk of a live directory: the next
				// tick measures again.
				log.G(ctx).WithError(err).Debug("envlet: measure writable layer")
				continue
			}
			if why := decideDisk(u, g.limits); why != "" {
				log.G(ctx).WithField("took", time.Since(start)).WithField("bytes", u.Size).WithField("inodes", u.Inodes).Warn("envlet: writable layer over its cap")
				g.fail(envlet.Failure{
					Env: g.env, Reason: envlet.ReasonDiskCapExceeded, Cap: g.limits.disk, Requested: u.Size,
					Message: why,
				})
				return
			}
		}
	}
}

// cappedTick is how often the guard looks at a writable layer with a
// hard cap: one statfs, whatever the layer holds.
const cappedTick = 500 * time.Millisecond

// watchWritable watches the writable layer whose upper directory is
// upper until ctx ends: by statfs when the snapshotter gave it a hard
// cap (internal/diskcap), else by measuring it (watchDisk) when the guard
// has caps.
func (g *guard) watchWritable(ctx context.Context, upper string) {
	if upper == "" {
		if g.limits.disk > 0 || g.limits.inodes > 0 {
			log.G(ctx).Warn("envlet: the rootfs is not an overlay; its writable layer is not measured")
		}
		return
	}
	hard, ok, err := diskcap.Read(upper)
	if err != nil {
		log.G(ctx).WithError(err).Warn("envlet: read the writable layer's disk cap; measuring it instead")
	}
	switch {
	case ok:
		g.watchCapped(ctx, upper, hard)
	case g.limits.disk > 0 || g.limits.inodes > 0:
		log.G(ctx).WithField("upper", upper).Warn("envlet: the writable layer has no hard cap (its snapshot's disk-limit label or the snapshotter's writable_disk_limit is 0, the node has no mkfs.ext4 or loop devices, or another snapshotter made it); it is only measured, and a fast writer can fill the node's disk before it fails")
		g.watchDisk(ctx, upper)
	}
}

// watchCapped ends the environment once the hard-capped file system of
// its writable layer is full (the kernel already refuses the writes with
// ENOSPC) or holds more than the guard's caps.
func (g *guard) watchCapped(ctx context.Context, upper string, hard diskcap.Limits) {
	t := time.NewTimer(envlet.UntilTick(time.Now(), cappedTick))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			t.Reset(envlet.UntilTick(time.Now(), cappedTick))
			used, files, full, err := diskcap.Usage(upper)
			if err != nil {
				if ctx.Err() != nil || errors.Is(err, os.ErrNotExist) {
					return
				}
				log.G(ctx).WithError(err).Warn("envlet: statfs of the writable layer")
				continue
			}
			f := envlet.Failure{Env: g.env, Reason: envlet.ReasonDiskCapExceeded, Cap: g.limits.disk, Requested: used}
			f.Message = decideDisk(fs.Usage{Size: used, Inodes: files}, g.limits)
			if f.Message == "" && full != "" {
				f.Cap = hard.Bytes
				f.Message = fmt.Sprintf("the writable layer's file system is full (hard cap %s, %s): %s and %d files in use; writes fail with ENOSPC",
					envlet.FormatBytes(hard.Bytes), full, envlet.FormatBytes(used), files)
			}
			if f.Message != "" {
				log.G(ctx).WithField("bytes", used).WithField("inodes", files).Warn("envlet: writable layer at its cap")
				g.fail(f)
				return
			}
		}
	}
}

// pidsState is what decidePids remembers between ticks.
type pidsState struct {
	refused uint64    // pids.events "max" at the last tick
	since   time.Time // first tick of the current saturated run; zero when none
}

// decidePids says whether an environment has been fork-bombing for
// grace: at every tick of that span its cgroup either refused forks
// (pids.events "max" rose to refused) or was at its limit (atLimit:
// pids.current >= pids.max; a bomb whose processes block on a full pipe
// stops forking but keeps every pid). A build that touches the limit and
// backs off has a tick below it, which starts the count over.
func decidePids(st pidsState, refused uint64, atLimit bool, now time.Time, grace time.Duration) (pidsState, bool) {
	saturated := refused > st.refused || atLimit
	st.refused = refused
	if !saturated {
		st.since = time.Time{}
		return st, false
	}
	if st.since.IsZero() {
		st.since = now
	}
	return st, now.Sub(st.since) >= grace
}

// guard contains the resource bombs of one environment: it watches the
// pids cgroup for sustained fork refusals and counts what the
// environment's processes write to stdout and stderr. Either one ends the
// environment once, through trip.
type guard struct {
	env    string
	limits guardLimits
	grace  time.Duration
	trip   func(envlet.Failure)

	written atomic.Int64
	once    sync.Once
}

func (g *guard) fail(f envlet.Failure) {
	g.once.Do(func() { g.trip(f) })
}

// watchPids reads the pids cgroup dir every pidsTick until ctx ends.
func (g *guard) watchPids(ctx context.Context, dir string) {
	pf, err := openPids(dir)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			log.G(ctx).WithError(err).Warn("envlet: fork bombs will be contained but not reported")
		}
		return
	}
	defer pf.close()
	var st pidsState
	t := time.NewTimer(pidsIdleTick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			refused, atLimit, err := pf.read()
			t.Reset(envlet.UntilTick(now, pidsIdleTick))
			if refused > st.refused || atLimit {
				t.Reset(pidsTick)
			}
			if err != nil {
				if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENODEV) {
					return // the cgroup went with the task
				}
				log.G(ctx).WithError(err).Warn("envlet: read pids events")
				continue
			}
			var bomb bool
			if st, bomb = decidePids(st, refused, atLimit, now, g.grace); bomb {
				g.fail(envlet.Failure{
					Env: g.env, Reason: envlet.ReasonPidsExhausted, Cap: g.limits.pids,
					Requested: int64(refused),
					Message: fmt.Sprintf("forks refused at the pids limit %d for %s (%d refused in all)",
						g.limits.pids, now.Sub(st.since).Round(time.Millisecond), refused),
				})
				return
			}
		}
	}
}

// pidsFiles keeps a pids cgroup's files open and reads them with pread:
// opening and closing three files twice a second was, after the arbiter
// reports, the largest part of an idle shim's CPU.
type pidsFiles struct {
	dir                  string
	events, current, max *os.File
	buf                  [256]byte
}

func openPids(dir string) (*pidsFiles, error) {
	p := &pidsFiles{dir: dir}
	for _, f := range []struct {
		name string
		dst  **os.File
	}{{"pids.events", &p.events}, {"pids.current", &p.current}, {"pids.max", &p.max}} {
		fd, err := os.Open(filepath.Join(dir, f.name))
		if err != nil {
			p.close()
			return nil, err
		}
		*f.dst = fd
	}
	return p, nil
}

func (p *pidsFiles) close() {
	for _, f := range []*os.File{p.events, p.current, p.max} {
		if f != nil {
			f.Close()
		}
	}
}

func (p *pidsFiles) readAt(f *os.File) ([]byte, error) {
	n, err := f.ReadAt(p.buf[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read %s: %w", f.Name(), err)
	}
	return p.buf[:n], nil
}

// read returns the refused-fork count of the pids cgroup and whether it
// is at its limit.
func (p *pidsFiles) read() (refused uint64, atLimit bool, err error) {
	b, err := p.readAt(p.events)
	if err != nil {
		return 0, false, err
	}
	found := false
	for line := range bytes.Lines(b) {
		if v, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("max ")); ok {
			if refused, err = strconv.ParseUint(string(v), 10, 64); err != nil {
				return 0, false, fmt.Errorf("parse %s/pids.events: %w", p.dir, err)
			}
			found = true
		}
	}
	if !found {
		return 0, false, fmt.Errorf("%s/pids.events has no max line", p.dir)
	}
	cur, err := p.readAt(p.current)
	if err != nil {
		return 0, false, err
	}
	c, cerr := strconv.ParseUint(string(bytes.TrimSpace(cur)), 10, 64)
	limit, err := p.readAt(p.max)
	if err != nil {
		return 0, false, err
	}
	l, lerr := strconv.ParseUint(string(bytes.TrimSpace(limit)), 10, 64) // "max" (none) fails: never at a limit
	return refused, cerr == nil && lerr == nil && c >= l, nil
}

// relay puts a counting copy between runc's IO and dst, the fifo
// containerd's client reads, and returns the fifo runc must write
// instead (created under dir). Past the output cap the copy writes a
// notice, drops the rest (the writer is drained, never blocked) and fails
// the environment. Only plain fifo paths are relayed: a binary:// or
// file:// logger gets dst unchanged and no cap.
func (g *guard) relay(ctx context.Context, dir, name, dst string) (string, error) {
	if dst == "" || g.limits.output <= 0 {
		return dst, nil
	}
	if fi, err := os.Stat(dst); err != nil || fi.Mode()&os.ModeNamedPipe == 0 {
		log.G(ctx).WithField("stdio", dst).Warn("envlet: output cap not applied to a non-fifo stdio")
		return dst, nil
	}
	p := filepath.Join(dir, name)
	r, err := fifo.OpenFifo(ctx, p, unix.O_RDONLY|unix.O_CREAT|unix.O_NONBLOCK, 0o600)
	if err != nil {
		return "", fmt.Errorf("create output relay %s: %w", p, err)
	}
	go g.copyOut(ctx, r, dst)
	return p, nil
}

func (g *guard) copyOut(ctx context.Context, r io.ReadCloser, dst string) {
	defer r.Close()
	w, err := fifo.OpenFifo(ctx, dst, unix.O_WRONLY, 0)
	if err != nil {
		log.G(ctx).WithError(err).WithField("stdio", dst).Error("envlet: open output fifo")
		w = nil
	}
	buf := make([]byte, 32<<10)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			total := g.written.Add(int64(n))
			keep := n
			if over := total - g.limits.output; over > 0 {
				keep = max(0, n-int(min(over, int64(n))))
			}
			if w != nil && keep > 0 {
				if _, err := w.Write(buf[:keep]); err != nil {
					w.Close()
					w = nil
				}
			}
			if keep < n {
				if w != nil && total-int64(n) <= g.limits.output {
					// The first chunk past the cap (it may start right
					// at the cap, when the output before it filled it
					// exactly): say why the output ends, in the output
					// itself.
					fmt.Fprintf(w, "\n[envlet: output cap of %d bytes reached; the rest is dropped and the environment fails: %s]\n",
						g.limits.output, envlet.ReasonOutputCapExceeded)
				}
				g.fail(envlet.Failure{
					Env: g.env, Reason: envlet.ReasonOutputCapExceeded, Cap: g.limits.output, Requested: total,
					Message: fmt.Sprintf("stdout and stderr reached the output cap of %d bytes", g.limits.output),
				})
			}
		}
		if rerr != nil {
			break
		}
	}
	if w != nil {
		w.Close()
	}
}
