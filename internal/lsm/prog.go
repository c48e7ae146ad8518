//go:build linux

package lsm

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"
)

// The programs are written with cilium/ebpf's asm package: there is no
// clang on the build machines. They read kernel structures through the
// typed pointers a BTF-typed LSM program receives as its arguments; the
// verifier checks every load against the kernel's BTF. Field offsets come
// from the running kernel's BTF at load time (kernelOffsets), which is
// what a CO-RE relocation would do for a compiled program.

// maxDepth bounds the walk from a file to its file system's root. A file
// deeper than this below its root is refused rather than let through
// unchecked: a process that can create directories could otherwise move
// a protected file out of the walk's reach.
const maxDepth = 128

// offsets are the kernel structure fields the programs read.
type offsets struct {
	fileDentry     int16 // file.f_path.dentry
	unixPathDentry int16 // unix_sock.path.dentry
	dentryInode    int16 // dentry.d_inode
	dentryParent   int16 // dentry.d_parent
	inodeIno       int16 // inode.i_ino
	inodeSb        int16 // inode.i_sb
	sbDev          int16 // super_block.s_dev
	// openHook is file_post_open (Linux 6.9) where the kernel has it,
	// file_open before.
	openHook string
}

// kernelBTF keeps the running kernel's BTF decoded between program loads:
// each load finds its attach target in it. ebpf.NewProgram decodes it
// anew for every program (a fresh btf.Cache per call), two per container,
// about 20 ms each here and 0.4% of the node's CPU while 48 environments
// started at once; New loads its programs as a collection sharing this
// cache. Decoded, it holds about 4 MiB of heap, which an idle shim should
// not keep: it is dropped btfKeep after its last use, so a crowd of
// starts decodes it once and a shim between crowds holds none of it.
var kernelBTF struct {
	sync.Mutex
	cache *btf.Cache
	drop  *time.Timer
}

// btfKeep is how long kernelBTF outlives its last use.
var btfKeep = time.Minute

// kernelTypes returns the shared cache of the kernel's BTF and keeps it
// for btfKeep more.
func kernelTypes() *btf.Cache {
	kernelBTF.Lock()
	defer kernelBTF.Unlock()
	if kernelBTF.cache == nil {
		kernelBTF.cache = btf.NewCache()
	}
	if kernelBTF.drop != nil {
		kernelBTF.drop.Reset(btfKeep)
		return kernelBTF.cache
	}
	var t *time.Timer
	t = time.AfterFunc(btfKeep, func() {
		kernelBTF.Lock()
		defer kernelBTF.Unlock()
		// A Reset that raced this run re-armed t; its next run must not
		// drop a cache made since.
		if kernelBTF.drop == t {
			kernelBTF.cache, kernelBTF.drop = nil, nil
		}
	})
	kernelBTF.drop = t
	return kernelBTF.cache
}

var (
	offsetsOnce sync.Once
	offsetsVal  offsets
	offsetsErr  error
)

// Warm reads what New needs from the kernel's BTF ahead of the first New.
// Parsing the kernel's BTF took most of the 0.11-0.13 s a container's
// rules cost on its shim's Create path here, once per shim process: a
// shim warms it in the background when it starts, while containerd and
// runc create the container.
func Warm() { _, _ = kernelOffsets() }

func kernelOffsets() (offsets, error) {
	offsetsOnce.Do(func() {
		spec, err := kernelTypes().Kernel()
		if err != nil {
			offsetsErr = fmt.Errorf("kernel BTF: %w", err)
			return
		}
		o := &offsetsVal
		o.openHook = "file_post_open"
		var fn *btf.Func
		if err := spec.TypeByName("bpf_lsm_file_post_open", &fn); err != nil {
			o.openHook = "file_open"
		}
		for _, f := range []struct {
			dst          *int16
			typ, members string
		}{
			{&o.fileDentry, "file", "f_path.dentry"},
			{&o.unixPathDentry, "unix_sock", "path.dentry"},
			{&o.dentryInode, "dentry", "d_inode"},
			{&o.dentryParent, "dentry", "d_parent"},
			{&o.inodeIno, "inode", "i_ino"},
			{&o.inodeSb, "inode", "i_sb"},
			{&o.sbDev, "super_block", "s_dev"},
		} {
			var s *btf.Struct
			if err := spec.TypeByName(f.typ, &s); err != nil {
				offsetsErr = fmt.Errorf("kernel BTF: struct %s: %w", f.typ, err)
				return
			}
			off, err := memberOffset(s, strings.Split(f.members, "."))
			if err != nil {
				offsetsErr = fmt.Errorf("kernel BTF: %s.%s: %w", f.typ, f.members, err)
				return
			}
			*f.dst = int16(off)
		}
	})
	return offsetsVal, offsetsErr
}

// memberOffset is the byte offset of the member path in t, looking
// through anonymous structs and unions (file.f_path sits in one since
// Linux 6.12).
func memberOffset(t btf.Type, path []string) (uint32, error) {
	if len(path) == 0 {
		return 0, nil
	}
	var members []btf.Member
	switch c := btf.UnderlyingType(t).(type) {
	case *btf.Struct:
		members = c.Members
	case *btf.Union:
		members = c.Members
	default:
		return 0, fmt.Errorf("%s is not a struct or union", t)
	}
	for _, m := range members {
		if m.Name == path[0] {
			rest, err := memberOffset(m.Type, path[1:])
			return m.Offset.Bytes() + rest, err
		}
		if m.Name == "" {
			if rest, err := memberOffset(m.Type, path); err == nil {
				return m.Offset.Bytes() + rest, nil
			}
		}
	}
	return 0, errors.New("no member " + path[0])
}

// Stack slots of the map key (inodeKey).
const (
	keyIno = -16
	keyDev = -8
)

// prologue leaves the hook's context in R6 and returns at once (allowing)
// unless the current task is in cg or below it: its ancestor at cg's
// level is cg. This is all a process outside the environment pays.
func prologue(cg Cgroup) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.Mov.Imm(asm.R1, int32(cg.Level)),
		asm.FnGetCurrentAncestorCgroupId.Call(),
		asm.LoadImm(asm.R1, int64(cg.ID), asm.DWord),
		asm.JNE.Reg(asm.R0, asm.R1, "allow"),
	}
}

// walk looks the dentry in R7 and each of its parents up in the
// protected map, up to its file system's root. It jumps to "deny" with
// R0 pointing at the matching entry's counters, to "allow" at the root,
// and falls through to a refusal past maxDepth.
func walk(protected int, off offsets) asm.Instructions {
	var insns asm.Instructions
	for range maxDepth {
		insns = append(insns,
			// A negative dentry (no inode) cannot be protected.
			asm.LoadMem(asm.R1, asm.R7, off.dentryInode, asm.DWord),
			asm.JEq.Imm(asm.R1, 0, "allow"),
			asm.LoadMem(asm.R2, asm.R1, off.inodeIno, asm.DWord),
			asm.StoreMem(asm.RFP, keyIno, asm.R2, asm.DWord),
			asm.LoadMem(asm.R2, asm.R1, off.inodeSb, asm.DWord),
			asm.LoadMem(asm.R2, asm.R2, off.sbDev, asm.Word),
			asm.StoreMem(asm.RFP, keyDev, asm.R2, asm.DWord),
			asm.LoadMapPtr(asm.R1, protected),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, keyIno),
			asm.FnMapLookupElem.Call(),
			asm.JNE.Imm(asm.R0, 0, "deny"),
			// The root of a file system is its own parent.
			asm.LoadMem(asm.R1, asm.R7, off.dentryParent, asm.DWord),
			asm.JEq.Reg(asm.R1, asm.R7, "allow"),
			asm.Mov.Reg(asm.R7, asm.R1),
		)
	}
	return append(insns,
		// Deeper than maxDepth: refused, uncounted.
		asm.Mov.Imm(asm.R0, -int32(unix.EPERM)),
		asm.Return(),
	)
}

// epilogue is the two exits: allow, or count the denial under kind in
// the matching entry (R0) and refuse with EPERM.
func epilogue(kind Kind) asm.Instructions {
	return asm.Instructions{
		asm.Mov.Imm(asm.R0, 0).WithSymbol("allow"),
		asm.Return(),
		asm.Add.Imm(asm.R0, int32(kind)*8).WithSymbol("deny"),
		asm.Mov.Imm(asm.R1, 1),
		asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, -int32(unix.EPERM)),
		asm.Return(),
	}
}

// connectProgram runs on unix_stream_connect(sock, other, newsk), where
// the kernel has already found the listening socket other, whatever path
// or link named it: the walk starts at the file other is bound to.
// Abstract sockets have no file and belong to the network namespace,
// which the environment does not share with the node. Datagram sockets
// are not checked: the node's daemons listen on stream sockets, which a
// datagram cannot reach.
func connectProgram(cg Cgroup, protected int, off offsets) *ebpf.ProgramSpec {
	insns := prologue(cg)
	insns = append(insns,
		asm.LoadMem(asm.R1, asm.R6, 8, asm.DWord), // other
		asm.FnSkcToUnixSock.Call(),
		asm.JEq.Imm(asm.R0, 0, "allow"),
		asm.LoadMem(asm.R7, asm.R0, off.unixPathDentry, asm.DWord),
		asm.JEq.Imm(asm.R7, 0, "allow"), // abstract or unbound
	)
	insns = append(insns, walk(protected, off)...)
	insns = append(insns, epilogue(Connect)...)
	return &ebpf.ProgramSpec{
		Name: "envsnap_connect", Type: ebpf.LSM, AttachType: ebpf.AttachLSMMac,
		AttachTo: "unix_stream_connect", License: "GPL", Instructions: insns,
	}
}

// openProgram runs on file_post_open(file, mask): every open that comes
// through open(2), openat(2), openat2(2), open_by_handle_at(2) or
// execve(2), once the file is open and before the caller gets it (and
// before O_TRUNC truncates it). Not file_open where file_post_open
// exists: overlayfs opens each file of the container's rootfs a second
// time, on the layer below, in the caller's context, and those internal
// opens do not pass file_post_open. Kernels before 6.9 only have
// file_open, where a protected directory must not hold the layers of a
// container's rootfs (the defaults do not).
func openProgram(cg Cgroup, protected int, off offsets) *ebpf.ProgramSpec {
	insns := prologue(cg)
	insns = append(insns,
		asm.LoadMem(asm.R1, asm.R6, 0, asm.DWord), // file, both hooks' first argument
		asm.LoadMem(asm.R7, asm.R1, off.fileDentry, asm.DWord),
	)
	insns = append(insns, walk(protected, off)...)
	insns = append(insns, epilogue(Open)...)
	return &ebpf.ProgramSpec{
		Name: "envsnap_open", Type: ebpf.LSM, AttachType: ebpf.AttachLSMMac,
		AttachTo: off.openHook, License: "GPL", Instructions: insns,
	}
}
