// Command agent is the hostile episode's tool inside the container: what
// busybox cannot do from a shell. It prints one line per attempt,
// "<what> <result>", where result is "ok" or the errno's name, and exits 0
// whatever the attempts gave (the test reads the lines).
//
//	agent ioctls SRC DST   clone/dedupe/swap-extent ioctls from SRC onto DST
//	agent connect PATH...  connect to unix sockets
//	agent open PATH...     open files for reading
//	agent tcp ADDR...      TCP connections (host:port), 2 s each
//	agent arbiter PATH...  a forged arbiter request (List) on each socket
//	agent forkbomb         a fork bomb that keeps the pids limit saturated
//	agent swap DIR NAME TARGET N PAD
//	                       in DIR, N directories dI holding a file NAME (and
//	                       0pad, PAD bytes), each exchanged (renameat2
//	                       RENAME_EXCHANGE) in a loop with a symlink
//	                       lI -> TARGET; never returns
//	agent swapfifo DIR N   in DIR, N regular files fI exchanged in a loop
//	                       with FIFOs pI (even I) or listening unix
//	                       sockets pI (odd I); never returns
package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/shim"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == "forkbomb" {
		forkbomb()
		return
	}
	if len(os.Args) == 7 && os.Args[1] == "swap" {
		swap(os.Args[2], os.Args[3], os.Args[4], os.Args[5], os.Args[6])
		return
	}
	if len(os.Args) == 4 && os.Args[1] == "swapfifo" {
		swapFIFO(os.Args[2], os.Args[3])
		return
	}
	if len(os.Args) == 4 && os.Args[1] == "ioctls" {
		ioctls(os.Args[2], os.Args[3])
		return
	}
	if len(os.Args) >= 3 {
		for _, arg := range os.Args[2:] {
			switch os.Args[1] {
			case "connect":
				c, err := net.Dial("unix", arg)
				if err == nil {
					c.Close()
				}
				report("connect "+arg, err)
			case "open":
				f, err := os.Open(arg)
				if err == nil {
					f.Close()
				}
				report("open "+arg, err)
			case "tcp":
				c, err := net.DialTimeout("tcp", arg, 2*time.Second)
				if err == nil {
					c.Close()
				}
				report("tcp "+arg, err)
			case "arbiter":
				report("arbiter "+arg, forge(arg))
			default:
				usage()
			}
		}
		return
	}
	usage()
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: agent forkbomb | ioctls SRC DST | connect PATH... | open PATH... | tcp ADDR... | arbiter PATH... | swap DIR NAME TARGET N PAD | swapfifo DIR N")
	os.Exit(2)
}

// swap is the snapshot race of docs/snapshots.md ("Reading a hostile
// writable layer"): a name the snapshot reads as a directory holding
// name becomes, for a moment, a symlink to target, a host path; a reader
// that resolves the directory by name again follows it onto the host.
// The pad file, read before name in a walk's order, keeps the reader's
// workers busy, so that name's open comes a while after its stat.
func swap(dir, name, target, count, pad string) {
	n := mustCount(count)
	padBytes := bytes.Repeat([]byte("p"), mustCount(pad))
	var pairs [][2]string
	for i := range n {
		d, l := fmt.Sprintf("%s/d%d", dir, i), fmt.Sprintf("%s/l%d", dir, i)
		must(os.MkdirAll(d, 0o755))
		must(os.WriteFile(d+"/0pad", padBytes, 0o644))
		must(os.WriteFile(d+"/"+name, []byte(fmt.Sprintf("inside %d\n", i)), 0o644))
		must(os.Symlink(target, l))
		pairs = append(pairs, [2]string{d, l})
	}
	exchange(pairs)
}

// swapFIFO swaps regular files with FIFOs, which a blocking open waits on
// for a writer that never comes, and with sockets, which cannot be
// opened at all.
func swapFIFO(dir, count string) {
	n := mustCount(count)
	must(os.MkdirAll(dir, 0o755))
	var pairs [][2]string
	for i := range n {
		f, p := fmt.Sprintf("%s/f%d", dir, i), fmt.Sprintf("%s/p%d", dir, i)
		must(os.WriteFile(f, []byte(fmt.Sprintf("regular %d\n", i)), 0o644))
		if i%2 == 0 {
			must(unix.Mkfifo(p, 0o644))
		} else {
			l, err := net.Listen("unix", p)
			must(err)
			defer l.Close()
		}
		pairs = append(pairs, [2]string{f, p})
	}
	exchange(pairs)
}

// exchange swaps each pair's names, round after round, for ever.
func exchange(pairs [][2]string) {
	for {
		for _, p := range pairs {
			if err := unix.Renameat2(unix.AT_FDCWD, p[0], unix.AT_FDCWD, p[1], unix.RENAME_EXCHANGE); err != nil {
				report("renameat2 "+p[0], err)
				os.Exit(1)
			}
		}
	}
}

func mustCount(s string) int {
	var n int
	if _, err := fmt.Sscan(s, &n); err != nil || n < 1 {
		fmt.Fprintf(os.Stderr, "bad count %q\n", s)
		os.Exit(2)
	}
	return n
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// forkbomb lights busybox's fork bomb and then keeps the pids limit
// saturated until it is killed. busybox's bomb alone is not a steady
// load: ash exits on a refused fork, so the bomb's frontier dies at the
// limit and the whole tree can go extinct within a second or two, before
// the shim's grace is over. This process retries refused forks, as bash's
// fork does, and never reaps what it started (a zombie keeps its pid),
// which is the bomb a guard has to end.
func forkbomb() {
	// The Go runtime needs threads to hand off its Ps; one it cannot
	// create at the limit is fatal. Threads made now stay idle for it.
	var locked, release sync.WaitGroup
	release.Add(1)
	for range 4 {
		locked.Add(1)
		go func() {
			runtime.LockOSThread()
			locked.Done()
			release.Wait()
			runtime.UnlockOSThread()
		}()
	}
	locked.Wait()
	release.Done()

	attr := &syscall.ProcAttr{Files: []uintptr{0, 1, 2}}
	if _, err := syscall.ForkExec("/bin/sh", []string{"sh", "-c", "f() { f | f & }; f"}, attr); err != nil {
		report("forkbomb sh", err)
		os.Exit(1)
	}
	for {
		_, err := syscall.ForkExec("/bin/sleep", []string{"sleep", "3600"}, attr)
		switch {
		case err == nil:
		case errors.Is(err, syscall.EAGAIN):
			time.Sleep(20 * time.Millisecond)
		default:
			report("forkbomb sleep", err)
			os.Exit(1)
		}
	}
}

// forge sends the arbiter's List request, which the shims use to find
// the node's environments, on socket: what an agent would try first.
func forge(socket string) error {
	conn, err := net.Dial("unix", socket)
	if err != nil {
		return err
	}
	c := ttrpc.NewClient(conn)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var resp wrapperspb.BytesValue
	if err := c.Call(ctx, arbiter.ServiceName, "List", &wrapperspb.BytesValue{Value: []byte("{}")}, &resp); err != nil {
		return err
	}
	fmt.Printf("arbiter %s answered %d bytes\n", socket, len(resp.Value))
	return nil
}

// ioctls issues every denied ioctl with a well-formed argument naming src
// (so that a kernel reached would act, not reject the argument), the
// FICLONE command with high bits set (the kernel truncates cmd to 32
// bits), and one harmless ioctl that must still work.
func ioctls(src, dst string) {
	s, err := os.Open(src)
	if err != nil {
		fmt.Println("open-src", err)
		return
	}
	defer s.Close()
	d, err := os.OpenFile(dst, os.O_RDWR, 0)
	if err != nil {
		fmt.Println("open-dst", err)
		return
	}
	defer d.Close()
	// 256 zeroed bytes cover every argument struct; the first field that
	// names a file gets src's fd where the struct has one.
	var arg [256]byte
	sfd := uint64(s.Fd())
	for _, io := range shim.DeniedIoctls {
		clear(arg[:])
		p := uintptr(unsafe.Pointer(&arg[0]))
		switch io.Name {
		case "FICLONE":
			p = uintptr(sfd)
		case "FICLONERANGE": // struct file_clone_range: src_fd first
			*(*int64)(unsafe.Pointer(&arg[0])) = int64(sfd)
		case "XFS_IOC_SWAPEXT": // sx_fdtarget, sx_fdtmp
			*(*int64)(unsafe.Pointer(&arg[8])) = int64(d.Fd())
			*(*int64)(unsafe.Pointer(&arg[16])) = int64(sfd)
		case "XFS_IOC_EXCHANGE_RANGE", "EXT4_IOC_MOVE_EXT": // file1_fd / donor_fd
			*(*uint32)(unsafe.Pointer(&arg[4])) = uint32(sfd)
		}
		report(io.Name, ioctl(d.Fd(), uint64(io.Cmd), p))
	}
	report("FICLONE-high-bits", ioctl(d.Fd(), 1<<32|uint64(unix.FICLONE), uintptr(sfd)))
	var flags int
	report("FS_IOC_GETFLAGS", ioctl(d.Fd(), unix.FS_IOC_GETFLAGS, uintptr(unsafe.Pointer(&flags))))
	report("FIOCLEX", ioctl(d.Fd(), 0x5451, 0)) // asm-generic FIOCLEX
}

func ioctl(fd uintptr, cmd uint64, arg uintptr) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, uintptr(cmd), arg); e != 0 {
		return e
	}
	return nil
}

func report(what string, err error) {
	if err == nil {
		fmt.Println(what, "ok")
		return
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		fmt.Println(what, unix.ErrnoName(e))
		return
	}
	var te interface{ Timeout() bool }
	if errors.As(err, &te) && te.Timeout() {
		fmt.Println(what, "timeout")
		return
	}
	fmt.Println(what, err)
}
