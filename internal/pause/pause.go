// Package pause parks an idle environment: it freezes the environment's
// cgroup, pushes its memory out through memory.reclaim (to the node's
// swap: compressed in RAM when that swap is zram, or zswap in front of a
// swap device), and thaws it on demand; the pages come back as the tasks
// touch them. Pause is cgroup v2 only (memory.reclaim, kernel >= 5.19);
// PushOut, for a cgroup someone else froze (runc, for the envlet shim),
// also takes a v1 memory cgroup (memory.force_empty).
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

// Pause freezes the v2 cgroup at dir and pushes out all it can of its
// memory (PushOut). The cgroup stays frozen (its tasks use no CPU) until
// Resume. On an error after the freeze, the cgroup is thawed: a failed
// pause leaves the environment running.
func Pause(ctx context.Context, dir string) (_ Report, retErr error) {
	if _, err := os.Stat(filepath.Join(dir, "memory.reclaim")); err != nil {
		return Report{}, fmt.Errorf("pause %s: no memory.reclaim (cgroup v2, kernel >= 5.19): %w", dir, err)
	}
	f, err := cgroupfs.OpenFreezer(dir)
	if err != nil {
		return Report{}, fmt.Errorf("pause %s: %w", dir, err)
	}
	start := time.Now()
	if err := f.Freeze(); err != nil {
		return Report{}, fmt.Errorf("pause: %w", err)
	}
	freeze := time.Since(start)
	defer func() {
		if retErr != nil {
			_ = f.Thaw()
		}
	}()
	r, err := PushOut(ctx, dir)
	r.Freeze = freeze
	return r, err
}

// PushOut reclaims all it can of the memory of the cgroup at dir: a v2
// cgroup through memory.reclaim, a v1 memory cgroup through
// memory.force_empty. Anonymous memory goes to the node's swap; without
// swap only page cache leaves. It is meant for a frozen cgroup: running
// tasks fault their pages straight back. Report.Freeze is left zero.
func PushOut(ctx context.Context, dir string) (Report, error) {
	if _, err := os.Stat(filepath.Join(dir, "memory.reclaim")); err == nil {
		return pushOutV2(ctx, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "memory.force_empty")); err == nil {
		return pushOutV1(ctx, dir)
	}
	return Report{}, fmt.Errorf("push out the memory of %s: neither memory.reclaim (cgroup v2, kernel >= 5.19) nor memory.force_empty (cgroup v1) there", dir)
}

func pushOutV2(ctx context.Context, dir string) (Report, error) {
	var r Report
	var err error
	if r.Before, err = readInt(dir, "memory.current"); err != nil {
		return r, fmt.Errorf("push out: %w", err)
	}
	start := time.Now()
	cur := r.Before
	for range reclaimRounds {
		if err := ctx.Err(); err != nil {
			return r, fmt.Errorf("push out %s: %w", dir, err)
		}
		err := cgroupfs.ReclaimDir(dir, cur)
		if err != nil && !errors.Is(err, unix.EAGAIN) {
			return r, fmt.Errorf("push out: reclaim %d bytes from %s: %w", cur, dir, err)
		}
		next, rerr := readInt(dir, "memory.current")
		if rerr != nil {
			return r, fmt.Errorf("push out: %w", rerr)
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

// pushOutV1 is one force_empty write: the kernel loops until the group is
// empty or its reclaim stops making progress. It cannot be cancelled once
// written; ctx is checked before.
func pushOutV1(ctx context.Context, dir string) (Report, error) {
	var r Report
	var err error
	if err := ctx.Err(); err != nil {
		return r, fmt.Errorf("push out %s: %w", dir, err)
	}
	if r.Before, err = readInt(dir, "memory.usage_in_bytes"); err != nil {
		return r, fmt.Errorf("push out: %w", err)
	}
	start := time.Now()
	if err := cgroupfs.ForceEmptyDir(dir); err != nil {
		return r, fmt.Errorf("push out: %w", err)
	}
	r.Reclaim = time.Since(start)
	if r.After, err = readInt(dir, "memory.usage_in_bytes"); err != nil {
		return r, fmt.Errorf("push out: %w", err)
	}
	// memsw counts memory and swap together; it exists only where the
	// kernel accounts swap (swapaccount).
	if memsw, err := readInt(dir, "memory.memsw.usage_in_bytes"); err == nil && memsw > r.After {
		r.SwapAfter = memsw - r.After
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
