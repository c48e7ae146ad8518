// Package pause parks an idle environment: it freezes the environment's
// cgroup, pushes its memory out through memory.reclaim (to the node's
// swap: compressed in RAM when that swap is zram, or zswap in front of a
// swap device), and thaws it on demand; the pages come back as the tasks
// touch them. cgroup v2 only (memory.reclaim, kernel >= 5.19).
//
// Without swap a pause frees only the page cache: anonymous memory, most
// of an agent process, has nowhere to go. Pause reports what it freed
// rather than failing then; SwapTotal says what the node can take.
package pause

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
)

// Report is what one Pause did to the cgroup.
type Report struct {
	// Before and After are the cgroup's memory.current around the
	// reclaim; SwapAfter its memory.swap.current after (0 when the
	// kernel has no swap accounting); ZswapAfter its memory.zswap.current
	// (kernel >= 5.19): zswap's compressed copies are charged to the
	// cgroup, so with zswap After still holds them.
	Before, After, SwapAfter, ZswapAfter int64
	// Freeze is the time to a frozen cgroup, Reclaim the time the
	// reclaim writes took.
	Freeze, Reclaim time.Duration
}

// Freed is the memory the cgroup no longer holds.
func (r Report) Freed() int64 { return r.Before - r.After }

// PushedOut is the memory that left the cgroup's RAM uncompressed: what
// it freed plus the compressed copies zswap charges back to it.
func (r Report) PushedOut() int64 { return r.Freed() + r.ZswapAfter }

// reclaimRounds bounds the reclaim writes: the kernel answers EAGAIN
// when a round reclaimed less than asked, and a frozen cgroup's pages
// stop moving after a few rounds.
const reclaimRounds = 16

// Pause freezes the cgroup at dir and reclaims all it can of its memory.
// The cgroup stays frozen (its tasks use no CPU) until Resume. On an
// error after the freeze, the cgroup is thawed: a failed pause leaves the
// environment running.
func Pause(ctx context.Context, dir string) (_ Report, retErr error) {
	var r Report
	if _, err := os.Stat(filepath.Join(dir, "memory.reclaim")); err != nil {
		return r, fmt.Errorf("pause %s: no memory.reclaim (cgroup v2, kernel >= 5.19): %w", dir, err)
	}
	f, err := cgroupfs.OpenFreezer(dir)
	if err != nil {
		return r, fmt.Errorf("pause %s: %w", dir, err)
	}
	start := time.Now()
	if err := f.Freeze(); err != nil {
		return r, fmt.Errorf("pause: %w", err)
	}
	r.Freeze = time.Since(start)
	defer func() {
		if retErr != nil {
			_ = f.Thaw()
		}
	}()
	if r.Before, err = readInt(dir, "memory.current"); err != nil {
		return r, fmt.Errorf("pause: %w", err)
	}
	start = time.Now()
	cur := r.Before
	for range reclaimRounds {
		if err := ctx.Err(); err != nil {
			return r, fmt.Errorf("pause %s: %w", dir, err)
		}
		err := cgroupfs.ReclaimDir(dir, cur)
		if err != nil && !errors.Is(err, unix.EAGAIN) {
			return r, fmt.Errorf("pause: reclaim %d bytes from %s: %w", cur, dir, err)
		}
		next, rerr := readInt(dir, "memory.current")
		if rerr != nil {
			return r, fmt.Errorf("pause: %w", rerr)
		}
		// Done when everything went (no EAGAIN) or a round moved less
		// than a MiB: what stays is not reclaimable now (no swap room,
		// kernel memory, pages pinned).
		progress := cur - next
		cur = next
		if err == nil || progress < 1<<20 {
			break
		}
	}
	r.Reclaim = time.Since(start)
	r.After = cur
	if swap, err := readInt(dir, "memory.swap.current"); err == nil {
		r.SwapAfter = swap
	}
	if z, err := readInt(dir, "memory.zswap.current"); err == nil {
		r.ZswapAfter = z
	}
	return r, nil
}

// Resume thaws the cgroup at dir and returns how long the thaw took (the
// write and the kernel's confirmation); the tasks' pages come back from
// swap as they touch them.
func Resume(dir string) (time.Duration, error) {
	f, err := cgroupfs.OpenFreezer(dir)
	if err != nil {
		return 0, fmt.Errorf("resume %s: %w", dir, err)
	}
	start := time.Now()
	if err := f.Thaw(); err != nil {
		return 0, fmt.Errorf("resume: %w", err)
	}
	return time.Since(start), nil
}

// Swap is the node's swap: SwapTotal and SwapFree of /proc/meminfo, in
// bytes, and the devices of /proc/swaps with their type (a zram device
// is compressed RAM; zswap, when enabled, compresses in front of any).
type Swap struct {
	Total, Free int64
	Devices     []string
	Zswap       bool
}

// NodeSwap reads the node's swap.
func NodeSwap() (Swap, error) {
	var s Swap
	mi, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return s, fmt.Errorf("node swap: %w", err)
	}
	for _, line := range strings.Split(string(mi), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "SwapTotal":
			s.Total = kb << 10
		case "SwapFree":
			s.Free = kb << 10
		}
	}
	if b, err := os.ReadFile("/proc/swaps"); err == nil {
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		for _, l := range lines[1:] {
			if f := strings.Fields(l); len(f) >= 2 {
				s.Devices = append(s.Devices, f[0]+" ("+f[1]+")")
			}
		}
	}
	if b, err := os.ReadFile("/sys/module/zswap/parameters/enabled"); err == nil {
		s.Zswap = strings.TrimSpace(string(b)) == "Y"
	}
	return s, nil
}

func readInt(dir, name string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s/%s: %w", dir, name, err)
	}
	return v, nil
}
