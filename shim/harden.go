//go:build linux

package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/containerd/containerd/v2/contrib/seccomp"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/shim/config"
)

// Per-container annotations that lower the node's guard limits (they can
// never raise them: the workload's owner writes them).
const (
	AnnPidsLimit   = ShimAnnotationPrefix + "pids-limit"
	AnnOutputLimit = ShimAnnotationPrefix + "output-limit"
	AnnDiskLimit   = ShimAnnotationPrefix + "disk-limit"
	AnnInodeLimit  = ShimAnnotationPrefix + "inode-limit"
)

// Ioctl is a file ioctl the shim's seccomp rules refuse.
type Ioctl struct {
	Name string
	Cmd  uint32
}

// DeniedIoctls are the file ioctls that act on two files at once: they
// move or share extents between the file named by the fd and another one,
// so whoever holds a writable fd can change, or read through, a file that
// access control would not let them open that way (DSec saw XFS
// swap-extents used exactly so). Nothing an agent needs depends on them:
// copy_file_range and plain copies do the same work under the normal
// checks. The values are the 64-bit Linux encodings (asm-generic ioctl
// numbers: amd64 and arm64 agree).
var DeniedIoctls = []Ioctl{
	{"FICLONE", unix.FICLONE},
	{"FICLONERANGE", unix.FICLONERANGE},
	{"FIDEDUPERANGE", unix.FIDEDUPERANGE},
	{"XFS_IOC_SWAPEXT", 0xc0c0586d},        // _IOWR('X', 109, struct xfs_swapext), 192 bytes
	{"XFS_IOC_EXCHANGE_RANGE", 0x40285881}, // _IOW('X', 129, struct xfs_exchange_range), 40 bytes
	{"EXT4_IOC_MOVE_EXT", 0xc028660f},      // _IOWR('f', 15, struct move_extent), 40 bytes
}

// guardLimits are the limits one container runs with.
type guardLimits struct {
	pids   int64
	output int64
	disk   int64
	inodes int64
}

// containerGuard returns the node's limits lowered by the container's
// annotations; an annotation above the node's limit is an error, as is a
// malformed one.
func containerGuard(node config.GuardLimits, s *specs.Spec) (guardLimits, error) {
	g := guardLimits{pids: node.Pids, output: node.Output, disk: node.Disk, inodes: node.Inodes}
	for _, a := range []struct {
		key string
		dst *int64
	}{{AnnPidsLimit, &g.pids}, {AnnOutputLimit, &g.output}, {AnnDiskLimit, &g.disk}, {AnnInodeLimit, &g.inodes}} {
		v, ok := s.Annotations[a.key]
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n <= 0 {
			return g, fmt.Errorf("annotation %s=%q: want a positive integer", a.key, v)
		}
		if *a.dst > 0 && n > *a.dst {
			return g, fmt.Errorf("annotation %s=%d is above the node's limit %d", a.key, n, *a.dst)
		}
		*a.dst = n
	}
	return g, nil
}

// harden applies the guard to the spec runc is about to run: the
// default seccomp profile with the ioctl deny list where the spec has no
// profile, the pids limit, and the OCI default masked and read-only paths
// where the spec lacks them. It reports what it changed (for the log).
func harden(s *specs.Spec, seccompOn bool, g guardLimits) ([]string, error) {
	if s.Linux == nil {
		return nil, nil
	}
	var changed []string
	if seccompOn && s.Linux.Seccomp == nil {
		s.Linux.Seccomp = defaultSeccomp(s)
		changed = append(changed, "seccomp")
	}
	if g.pids > 0 {
		if s.Linux.Resources == nil {
			s.Linux.Resources = &specs.LinuxResources{}
		}
		p := s.Linux.Resources.Pids
		if p == nil || p.Limit == nil || *p.Limit <= 0 || *p.Limit > g.pids {
			limit := g.pids
			s.Linux.Resources.Pids = &specs.LinuxPids{Limit: &limit}
			changed = append(changed, "pids")
		}
	}
	masked, ro, err := ociDefaultPaths()
	if err != nil {
		return changed, err
	}
	if missing := missingPaths(s.Linux.MaskedPaths, masked); len(missing) > 0 {
		s.Linux.MaskedPaths = append(s.Linux.MaskedPaths, missing...)
		changed = append(changed, "masked-paths")
	}
	if missing := missingPaths(s.Linux.ReadonlyPaths, ro); len(missing) > 0 {
		s.Linux.ReadonlyPaths = append(s.Linux.ReadonlyPaths, missing...)
		changed = append(changed, "readonly-paths")
	}
	return changed, nil
}

// defaultSeccomp is containerd's default profile for s (it depends on the
// process's capabilities) with DeniedIoctls refused with EPERM.
//
// The profile allows ioctl unconditionally, and libseccomp keeps an
// unconditional action over conditional rules of another action for the
// same syscall (measured: with errno rules added for the denied commands
// every one of them still reached the kernel). So ioctl leaves the
// unconditional allow, and is allowed instead by masked equalities that
// together cover every command outside the deny list; a denied command
// matches none of them and takes the profile's default action, EPERM.
// They compare the low 32 bits only: the kernel truncates cmd to an
// unsigned int, so a test on the whole register would let a caller set
// the high bits and slip past.
func defaultSeccomp(s *specs.Spec) *specs.LinuxSeccomp {
	if s.Process == nil || s.Process.Capabilities == nil {
		// DefaultProfile reads the bounding set; none means no
		// capabilities, so no syscalls allowed for them.
		c := *s
		c.Process = &specs.Process{Capabilities: &specs.LinuxCapabilities{}}
		s = &c
	}
	p := seccomp.DefaultProfile(s)
	for i := range p.Syscalls {
		sc := &p.Syscalls[i]
		if sc.Action == specs.ActAllow && len(sc.Args) == 0 {
			sc.Names = slices.DeleteFunc(sc.Names, func(n string) bool { return n == "ioctl" })
		}
	}
	deny := make([]uint32, len(DeniedIoctls))
	for i, io := range DeniedIoctls {
		deny[i] = io.Cmd
	}
	for _, m := range complement32(deny) {
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{
			Names:  []string{"ioctl"},
			Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{
				Index: 1, Op: specs.OpMaskedEqual,
				Value: uint64(m.mask), ValueTwo: uint64(m.value),
			}},
		})
	}
	return p
}

// maskedValue matches x when x&mask == value.
type maskedValue struct{ mask, value uint32 }

// complement32 returns masked equalities whose union is exactly the
// 32-bit values not in deny: walking the binary trie of deny from the top
// bit, every branch with no denied value below it becomes one prefix
// match. At most 32 per denied value (fewer where they share a prefix).
func complement32(deny []uint32) []maskedValue {
	var out []maskedValue
	var walk func(mask, value uint32, bit int, set []uint32)
	walk = func(mask, value uint32, bit int, set []uint32) {
		if bit < 0 {
			return // a denied value itself
		}
		b := uint32(1) << bit
		var zero, one []uint32
		for _, d := range set {
			if d&b == 0 {
				zero = append(zero, d)
			} else {
				one = append(one, d)
			}
		}
		for _, half := range []struct {
			v   uint32
			set []uint32
		}{{0, zero}, {b, one}} {
			if len(half.set) == 0 {
				out = append(out, maskedValue{mask | b, value | half.v})
			} else {
				walk(mask|b, value|half.v, bit-1, half.set)
			}
		}
	}
	if len(deny) == 0 {
		return []maskedValue{{0, 0}}
	}
	walk(0, 0, 31, deny)
	return out
}

// ociDefaultPaths are the masked and read-only paths of containerd's
// default spec: the reference the final spec is checked against.
func ociDefaultPaths() (masked, ro []string, err error) {
	ctx := namespaces.WithNamespace(context.Background(), "envlet")
	d, err := oci.GenerateSpecWithPlatform(ctx, nil, "linux", &containers.Container{ID: "envlet"})
	if err != nil {
		return nil, nil, fmt.Errorf("containerd default spec: %w", err)
	}
	return d.Linux.MaskedPaths, d.Linux.ReadonlyPaths, nil
}

func missingPaths(have, want []string) []string {
	var out []string
	for _, p := range want {
		if !slices.Contains(have, p) {
			out = append(out, p)
		}
	}
	return out
}

// writeSpec replaces the bundle's config.json with s, atomically.
func writeSpec(bundle string, s *specs.Spec) error {
	b, err := json.Marshal(s)
	if err != nil {
		return fmt.Errorf("encode bundle spec: %w", err)
	}
	p := filepath.Join(bundle, "config.json")
	tmp := p + ".envlet"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write bundle spec: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write bundle spec: %w", err)
	}
	return nil
}
