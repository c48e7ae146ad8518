//go:build linux

// Package lsm confines one environment with BPF LSM programs: its
// processes cannot connect to the node's unix sockets nor open protected
// files, whatever their capabilities, however the path reached them (a
// bind mount, /proc/PID/root, a hard link to a socket). The rules name
// files by inode, not by path, and a directory protects everything below
// it on the same file system.
//
// Two programs are loaded per environment, on the unix_stream_connect and
// file_post_open hooks (file_open before Linux 6.9; see prog.go). They are node-wide LSM programs
// that return at once for any process outside the environment's cgroup
// (cgroup v2, the unified hierarchy on a hybrid host), not BPF_LSM_CGROUP
// programs: cilium/ebpf v0.22 cannot load the latter (it does not resolve
// their hook's BTF id). They stay attached while the Guard is open, i.e.
// as long as the shim that holds it.
//
// The programs only run where the kernel has the bpf LSM in its active
// list (lsm= on the kernel command line, or CONFIG_LSM); Active says.
package lsm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// ErrUnavailable is returned by New where the kernel does not run BPF LSM
// programs for us: the bpf LSM is not in its active list, or the kernel
// refuses to load LSM programs (measured on the development machines:
// EPERM before verification, although bpf is active there).
var ErrUnavailable = errors.New("BPF LSM unavailable")

// ErrHookFull is returned by New when the kernel holds no more programs
// on an LSM hook: it attaches at most 38 BPF programs to one hook
// (BPF_MAX_TRAMP_LINKS on x86-64), every guard adds one to each of its
// two hooks, and every other program on them (systemd's, a security
// agent's) counts too. So at most 38 environments have rules on a node.
var ErrHookFull = errors.New("the kernel's BPF LSM hook is full")

// lsmIDBPF is the bpf LSM's id in lsm_list_modules (include/uapi/linux/lsm.h).
const lsmIDBPF = 109

// securityfsList is the list of active LSMs where securityfs is mounted.
const securityfsList = "/sys/kernel/security/lsm"

// Active reports whether the kernel runs BPF LSM programs, and the list
// of active LSMs it read (for the log). It asks the kernel
// (lsm_list_modules, Linux 6.8) and falls back to securityfs.
func Active() (bool, string, error) {
	ids := make([]uint64, 64)
	size := uint32(len(ids) * 8)
	n, _, errno := unix.Syscall(unix.SYS_LSM_LIST_MODULES, uintptr(unsafe.Pointer(&ids[0])), uintptr(unsafe.Pointer(&size)), 0)
	if errno == 0 {
		var names []string
		on := false
		for _, id := range ids[:n] {
			names = append(names, fmt.Sprint(id))
			on = on || id == lsmIDBPF
		}
		return on, "ids " + strings.Join(names, ","), nil
	}
	if errno != unix.ENOSYS {
		return false, "", fmt.Errorf("lsm_list_modules: %w", errno)
	}
	b, err := os.ReadFile(securityfsList)
	if err != nil {
		return false, "", fmt.Errorf("list active LSMs: lsm_list_modules not implemented, and %w", err)
	}
	list := strings.TrimSpace(string(b))
	for _, name := range strings.Split(list, ",") {
		if name == "bpf" {
			return true, list, nil
		}
	}
	return false, list, nil
}

// Kind is what a protected inode was protected against.
type Kind int

const (
	Connect Kind = iota // connect(2) to a unix socket
	Open                // open(2), openat(2), execve(2) ...
	numKinds
)

func (k Kind) String() string {
	switch k {
	case Connect:
		return "connect"
	case Open:
		return "open"
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// Protected is one protected path.
type Protected struct {
	Path string
	key  inodeKey
}

// inodeKey is the protected map's key: an inode as the kernel names it.
// Its layout is what the programs write on their stack.
type inodeKey struct {
	Ino uint64
	Dev uint64 // the super block's s_dev (kernel encoding), zero-extended
}

// counts is the protected map's value: denials per Kind.
type counts [numKinds]uint64

// Resolve names the protected paths by inode. A path that does not exist
// is left out and returned in missing (a daemon that is not installed has
// no socket to protect); any other error fails.
func Resolve(paths []string) (ps []Protected, missing []string, err error) {
	for _, p := range paths {
		if !filepath.IsAbs(p) {
			return nil, nil, fmt.Errorf("protected path %q: must be absolute", p)
		}
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			if errors.Is(err, unix.ENOENT) {
				missing = append(missing, p)
				continue
			}
			return nil, nil, fmt.Errorf("protected path %s: %w", p, err)
		}
		ps = append(ps, Protected{Path: p, key: inodeKey{Ino: st.Ino, Dev: kernelDev(st.Dev)}})
	}
	return ps, missing, nil
}

// kernelDev converts a userspace dev_t to the kernel's internal encoding
// (MKDEV: major in the bits above 20), which super_block.s_dev holds.
func kernelDev(dev uint64) uint64 {
	return uint64(unix.Major(dev))<<20 | uint64(unix.Minor(dev))
}

// Cgroup is the cgroup v2 directory the rules apply to, with everything
// below it.
type Cgroup struct {
	ID    uint64 // the kernel's cgroup id: the directory's inode number
	Level int    // its depth below the hierarchy's root (level 0)
	Dir   string
}

// ProcessCgroup returns the cgroup v2 directory of process pid: its "0::"
// line in /proc/PID/cgroup under the cgroup2 mount (/sys/fs/cgroup on a
// unified host, /sys/fs/cgroup/unified on a hybrid one, where runc places
// containers in the unified hierarchy too).
func ProcessCgroup(pid int) (Cgroup, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return Cgroup{}, fmt.Errorf("cgroup of process %d: %w", pid, err)
	}
	var rel string
	found := false
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			rel, found = p, true
		}
	}
	if !found {
		return Cgroup{}, fmt.Errorf("cgroup of process %d: not in a cgroup v2 hierarchy", pid)
	}
	root, err := cgroup2Mount()
	if err != nil {
		return Cgroup{}, err
	}
	return OpenCgroup(root, rel)
}

// OpenCgroup describes the cgroup rel (absolute within the hierarchy)
// of the cgroup2 hierarchy mounted at root.
func OpenCgroup(root, rel string) (Cgroup, error) {
	rel = filepath.Clean("/" + rel)
	dir := filepath.Join(root, rel)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return Cgroup{}, fmt.Errorf("cgroup %s: %w", dir, err)
	}
	level := 0
	if rel != "/" {
		level = strings.Count(rel, "/")
	}
	return Cgroup{ID: st.Ino, Level: level, Dir: dir}, nil
}

func cgroup2Mount() (string, error) {
	for _, dir := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified"} {
		var fs unix.Statfs_t
		if err := unix.Statfs(dir, &fs); err == nil && fs.Type == unix.CGROUP2_SUPER_MAGIC {
			return dir, nil
		}
	}
	return "", errors.New("no cgroup2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified")
}

// Guard is one environment's loaded and attached programs.
type Guard struct {
	protected *ebpf.Map
	progs     []*ebpf.Program
	links     []link.Link
	paths     []Protected
}

// New loads the programs for cg and attaches them: from then on the
// processes of cg and its descendants cannot connect to a unix socket at
// or under ps, nor open a file at or under ps. It returns ErrInactive
// (wrapped) where the bpf LSM is not active (programs would load and
// attach there and never run) or the kernel refuses to load them.
func New(cg Cgroup, ps []Protected) (*Guard, error) {
	return newGuard(cg, ps, kernelTypes())
}

// newGuard is New with the kernel's BTF from types.
func newGuard(cg Cgroup, ps []Protected, types *btf.Cache) (_ *Guard, err error) {
	if cg.Level == 0 {
		// Every task descends from the root: that would confine the node.
		return nil, fmt.Errorf("LSM rules for the root cgroup %s: refused", cg.Dir)
	}
	on, list, err := Active()
	if err != nil {
		return nil, err
	}
	if !on {
		return nil, fmt.Errorf("%w: the bpf LSM is not active (active LSMs: %s)", ErrUnavailable, list)
	}
	off, err := kernelOffsets()
	if err != nil {
		return nil, err
	}
	g := &Guard{paths: ps}
	defer func() {
		if err != nil {
			g.Close()
		}
	}()
	g.protected, err = ebpf.NewMap(&ebpf.MapSpec{
		Name:       "envsnap_protect",
		Type:       ebpf.Hash,
		KeySize:    uint32(unsafe.Sizeof(inodeKey{})),
		ValueSize:  uint32(unsafe.Sizeof(counts{})),
		MaxEntries: uint32(max(len(ps), 1)),
	})
	if err != nil {
		return nil, fmt.Errorf("create protected-inode map: %w", err)
	}
	for _, p := range ps {
		if err := g.protected.Update(p.key, counts{}, ebpf.UpdateNoExist); err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
			return nil, fmt.Errorf("protect %s: %w", p.Path, err)
		}
	}
	specs := []*ebpf.ProgramSpec{
		connectProgram(cg, g.protected.FD(), off),
		openProgram(cg, g.protected.FD(), off),
	}
	cs := &ebpf.CollectionSpec{Programs: map[string]*ebpf.ProgramSpec{}}
	for _, spec := range specs {
		cs.Programs[spec.Name] = spec
	}
	coll, err := ebpf.NewCollectionWithOptions(cs, ebpf.CollectionOptions{Cache: types})
	if errors.Is(err, unix.EPERM) {
		return nil, fmt.Errorf("%w: the kernel refuses to load the LSM programs (%w)", ErrUnavailable, unix.EPERM)
	}
	if err != nil {
		return nil, fmt.Errorf("load LSM programs: %+v", err)
	}
	defer coll.Close()
	for _, spec := range specs {
		prog := coll.DetachProgram(spec.Name)
		if prog == nil {
			return nil, fmt.Errorf("load LSM program %s: not in its collection", spec.Name)
		}
		g.progs = append(g.progs, prog)
		l, err := link.AttachLSM(link.LSMOptions{Program: prog})
		if errors.Is(err, unix.E2BIG) {
			return nil, fmt.Errorf("attach LSM program %s to %s: %w: at most 38 programs per hook, one per guarded environment (%w)", spec.Name, spec.AttachTo, ErrHookFull, err)
		}
		if err != nil {
			return nil, fmt.Errorf("attach LSM program %s: %w", spec.Name, err)
		}
		g.links = append(g.links, l)
	}
	return g, nil
}

// Denials returns how often each protected path was denied, per Kind.
func (g *Guard) Denials() (map[string][numKinds]uint64, error) {
	out := make(map[string][numKinds]uint64, len(g.paths))
	for _, p := range g.paths {
		var c counts
		if err := g.protected.Lookup(p.key, &c); err != nil {
			return nil, fmt.Errorf("read denials of %s: %w", p.Path, err)
		}
		out[p.Path] = c
	}
	return out, nil
}

// Close detaches the programs and frees them.
func (g *Guard) Close() error {
	var errs []error
	for _, l := range g.links {
		errs = append(errs, l.Close())
	}
	for _, p := range g.progs {
		errs = append(errs, p.Close())
	}
	if g.protected != nil {
		errs = append(errs, g.protected.Close())
	}
	g.links, g.progs, g.protected = nil, nil, nil
	return errors.Join(errs...)
}
