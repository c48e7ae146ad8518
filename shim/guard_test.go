//go:build linux

package shim

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/api/types"
	"github.com/containerd/continuity/fs"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/shim/config"
)

func TestDecidePids(t *testing.T) {
	t0 := time.Unix(1000, 0)
	const grace = 2 * time.Second
	type tick struct {
		refused uint64
		atLimit bool
		fail    bool
	}
	for _, tc := range []struct {
		name  string
		ticks []tick
	}{
		{"quiet", []tick{{0, false, false}, {0, false, false}, {0, false, false}, {0, false, false}, {0, false, false}, {0, false, false}}},
		{"refusing every tick", []tick{{5, false, false}, {9, false, false}, {20, false, false}, {21, false, false}, {30, false, true}}},
		{"held at the limit, not forking", []tick{{3, true, false}, {3, true, false}, {3, true, false}, {3, true, false}, {3, true, true}}},
		{"a build that touches the limit and backs off", []tick{{5, false, false}, {9, true, false}, {9, false, false}, {12, false, false}, {12, true, false}, {12, false, false}, {15, false, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var st pidsState
			for i, tk := range tc.ticks {
				var fail bool
				st, fail = decidePids(st, tk.refused, tk.atLimit, t0.Add(time.Duration(i)*pidsTick), grace)
				if fail != tk.fail {
					t.Fatalf("tick %d (%+v): fail %v, want %v", i, tk, fail, tk.fail)
				}
			}
		})
	}
}

func TestComplement32(t *testing.T) {
	deny := make([]uint32, len(DeniedIoctls))
	for i, io := range DeniedIoctls {
		deny[i] = io.Cmd
	}
	rules := complement32(deny)
	if len(rules) > 32*len(deny) {
		t.Fatalf("%d rules for %d values", len(rules), len(deny))
	}
	matches := func(x uint32) int {
		n := 0
		for _, r := range rules {
			if x&r.mask == r.value {
				n++
			}
		}
		return n
	}
	for _, d := range deny {
		if n := matches(d); n != 0 {
			t.Errorf("denied %#x matches %d allow rules", d, n)
		}
	}
	// Neighbours of the denied values (one bit flipped) and random values
	// are allowed by exactly one rule: the rules partition the rest.
	r := rand.New(rand.NewPCG(1, 2))
	var probe []uint32
	for _, d := range deny {
		for b := range 32 {
			probe = append(probe, d^1<<b)
		}
	}
	for range 10000 {
		probe = append(probe, r.Uint32())
	}
	probe = append(probe, 0, 0xffffffff, 0x5451)
	for _, x := range probe {
		if slices.Contains(deny, x) {
			continue
		}
		if n := matches(x); n != 1 {
			t.Fatalf("%#x matches %d allow rules, want 1", x, n)
		}
	}
	if got := complement32(nil); len(got) != 1 || got[0].mask != 0 {
		t.Errorf("empty deny list: %v, want one match-all rule", got)
	}
}

func TestHarden(t *testing.T) {
	spec := func() *specs.Spec {
		return &specs.Spec{Process: &specs.Process{}, Linux: &specs.Linux{}, Annotations: map[string]string{}}
	}
	node := config.GuardLimits{Seccomp: true, Pids: 4096, Output: 1 << 30}

	t.Run("bare spec", func(t *testing.T) {
		s := spec()
		g, err := containerGuard(node, s)
		if err != nil {
			t.Fatal(err)
		}
		changed, err := harden(s, true, g)
		if err != nil {
			t.Fatal(err)
		}
		if want := []string{"seccomp", "pids", "masked-paths", "readonly-paths"}; !slices.Equal(changed, want) {
			t.Errorf("changed %v, want %v", changed, want)
		}
		if *s.Linux.Resources.Pids.Limit != 4096 {
			t.Errorf("pids limit %d", *s.Linux.Resources.Pids.Limit)
		}
		for _, p := range []string{"/proc/keys", "/sys/firmware"} {
			if !slices.Contains(s.Linux.MaskedPaths, p) {
				t.Errorf("%s not masked: %v", p, s.Linux.MaskedPaths)
			}
		}
		if !slices.Contains(s.Linux.ReadonlyPaths, "/proc/sys") {
			t.Errorf("/proc/sys not read-only: %v", s.Linux.ReadonlyPaths)
		}
		var ioctlAllows int
		for _, sc := range s.Linux.Seccomp.Syscalls {
			if !slices.Contains(sc.Names, "ioctl") {
				continue
			}
			if sc.Action != specs.ActAllow || len(sc.Args) != 1 || sc.Args[0].Op != specs.OpMaskedEqual || sc.Args[0].Value > 0xffffffff {
				t.Fatalf("ioctl rule %+v: want only low-32-bit masked allows", sc)
			}
			ioctlAllows++
		}
		if ioctlAllows == 0 {
			t.Error("no ioctl allowed at all")
		}
	})

	t.Run("spec choices kept", func(t *testing.T) {
		s := spec()
		own := &specs.LinuxSeccomp{DefaultAction: specs.ActAllow}
		limit := int64(100)
		s.Linux.Seccomp = own
		s.Linux.Resources = &specs.LinuxResources{Pids: &specs.LinuxPids{Limit: &limit}}
		masked, ro, err := ociDefaultPaths()
		if err != nil {
			t.Fatal(err)
		}
		s.Linux.MaskedPaths, s.Linux.ReadonlyPaths = masked, ro
		changed, err := harden(s, true, guardLimits{pids: 4096})
		if err != nil || len(changed) != 0 {
			t.Fatalf("changed %v err %v", changed, err)
		}
		if s.Linux.Seccomp != own || *s.Linux.Resources.Pids.Limit != 100 {
			t.Error("the spec's own profile or lower pids limit was replaced")
		}
	})

	t.Run("pids above the node are lowered", func(t *testing.T) {
		s := spec()
		limit := int64(1 << 20)
		s.Linux.Resources = &specs.LinuxResources{Pids: &specs.LinuxPids{Limit: &limit}}
		if _, err := harden(s, false, guardLimits{pids: 4096}); err != nil {
			t.Fatal(err)
		}
		if *s.Linux.Resources.Pids.Limit != 4096 || s.Linux.Seccomp != nil {
			t.Errorf("pids %d seccomp %v", *s.Linux.Resources.Pids.Limit, s.Linux.Seccomp)
		}
	})

	t.Run("annotations only lower", func(t *testing.T) {
		for _, tc := range []struct {
			ann     map[string]string
			want    guardLimits
			wantErr bool
		}{
			{map[string]string{AnnPidsLimit: "64", AnnOutputLimit: "1048576"}, guardLimits{pids: 64, output: 1 << 20}, false},
			{map[string]string{AnnPidsLimit: "5000"}, guardLimits{}, true},
			{map[string]string{AnnOutputLimit: "2147483648"}, guardLimits{}, true},
			{map[string]string{AnnPidsLimit: "-1"}, guardLimits{}, true},
			{map[string]string{AnnPidsLimit: "lots"}, guardLimits{}, true},
		} {
			s := spec()
			s.Annotations = tc.ann
			g, err := containerGuard(node, s)
			if (err != nil) != tc.wantErr || (!tc.wantErr && g != tc.want) {
				t.Errorf("%v: %+v %v", tc.ann, g, err)
			}
		}
	})
}

func TestDecideDisk(t *testing.T) {
	g := guardLimits{disk: 100 << 20, inodes: 1000}
	for _, tc := range []struct {
		u    fs.Usage
		want string // substring; "" = within the caps
	}{
		{fs.Usage{Size: 100 << 20, Inodes: 1000}, ""},
		{fs.Usage{Size: 100<<20 + 1, Inodes: 1}, "disk cap"},
		{fs.Usage{Size: 1, Inodes: 1001}, "inode cap"},
	} {
		got := decideDisk(tc.u, g)
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("%+v: %q, want %q", tc.u, got, tc.want)
		}
	}
	if got := decideDisk(fs.Usage{Size: 1 << 50, Inodes: 1 << 40}, guardLimits{}); got != "" {
		t.Errorf("no caps: %q", got)
	}
}

// An unchanged layer is measured half as often each time, up to
// diskMaxTick, never so rarely that a writer at diskFillRate (or
// diskFileRate) could reach a cap between two measurements; any change
// brings diskTick back.
func TestNextDiskWait(t *testing.T) {
	defaults := guardLimits{disk: 20 << 30, inodes: 2_000_000}
	small := fs.Usage{Size: 64 << 10, Inodes: 12}
	s := time.Second
	for _, tc := range []struct {
		name    string
		last    time.Duration
		prev, u fs.Usage
		g       guardLimits
		want    time.Duration
	}{
		{"first", diskTick, fs.Usage{Size: -1}, small, defaults, diskTick},
		{"changed", 8 * s, small, fs.Usage{Size: small.Size + 1, Inodes: 12}, defaults, diskTick},
		{"one file more", 8 * s, small, fs.Usage{Size: small.Size, Inodes: 13}, defaults, diskTick},
		{"unchanged once", diskTick, small, small, defaults, 4 * s},
		{"unchanged twice", 4 * s, small, small, defaults, 8 * s},
		// 20 GiB at 1 GiB/s is 20 s: 16 s could stretch to 24 s.
		{"default caps hold it at 8 s", 8 * s, small, small, defaults, 8 * s},
		{"no caps", 8 * s, small, small, guardLimits{}, diskMaxTick},
		{"no caps, at the top", diskMaxTick, small, small, guardLimits{}, diskMaxTick},
		{"2 GiB from the disk cap", 8 * s, fs.Usage{Size: 18 << 30}, fs.Usage{Size: 18 << 30}, defaults, diskTick},
		{"300,000 files from the inode cap", 8 * s, fs.Usage{Inodes: 1_700_000}, fs.Usage{Inodes: 1_700_000}, defaults, diskTick},
		{"500,000 files from the inode cap", 8 * s, fs.Usage{Inodes: 1_500_000}, fs.Usage{Inodes: 1_500_000}, defaults, 2 * s},
		{"1,000,000 files from the inode cap", 8 * s, fs.Usage{Inodes: 1_000_000}, fs.Usage{Inodes: 1_000_000}, defaults, 4 * s},
		{"over the cap", 8 * s, fs.Usage{Size: 21 << 30}, fs.Usage{Size: 21 << 30}, defaults, diskTick},
	} {
		got := nextDiskWait(tc.last, tc.prev, tc.u, tc.g)
		if got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
		// Even stretched by UntilTick (1.5 periods), a writer at the
		// assumed rates does not reach a cap before the next measurement.
		if tc.u == tc.prev && got > diskTick && tc.g.disk > 0 {
			if bytes := int64(diskFillRate * (got * 3 / 2).Seconds()); tc.u.Size+bytes > tc.g.disk {
				t.Errorf("%s: %v lets a writer at %d B/s past the disk cap", tc.name, got, diskFillRate)
			}
		}
	}
}

func TestUpperDir(t *testing.T) {
	ov := []*types.Mount{{Type: "overlay", Options: []string{"index=off", "workdir=/s/1/work", "upperdir=/s/1/fs", "lowerdir=/s/0/fs"}}}
	if got := upperDir(ov); got != "/s/1/fs" {
		t.Errorf("overlay: %q", got)
	}
	if got := upperDir([]*types.Mount{{Type: "bind", Source: "/s/1/fs"}}); got != "" {
		t.Errorf("bind: %q", got)
	}
}
