package cgroupfs

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// cfile is a pre-opened cgroup control file read and written at offset 0.
type cfile struct {
	fd   int
	path string
}

func openFile(path string, flag int) (cfile, error) {
	for {
		fd, err := unix.Open(path, flag|unix.O_CLOEXEC, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return cfile{fd: -1, path: path}, classify(&os.PathError{Op: "open", Path: path, Err: err})
		}
		return cfile{fd: fd, path: path}, nil
	}
}

// openOptional opens a file that older kernels or other modes may lack
// (cfs_burst_us, memsw, memory.reclaim); a missing file gives fd -1.
func openOptional(path string, flag int) (cfile, error) {
	f, err := openFile(path, flag)
	if err != nil && errors.Is(err, syscall.ENOENT) {
		if _, serr := os.Stat(parentDir(path)); serr == nil {
			return cfile{fd: -1, path: path}, nil
		}
	}
	return f, err
}

func parentDir(p string) string {
	if i := strings.LastIndexByte(p, '/'); i > 0 {
		return p[:i]
	}
	return "/"
}

func (f cfile) ok() bool { return f.fd >= 0 }

func (f cfile) read(buf []byte) ([]byte, error) {
	for {
		n, err := unix.Pread(f.fd, buf, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, classify(&os.PathError{Op: "read", Path: f.path, Err: err})
		}
		return buf[:n], nil
	}
}

func (f cfile) readUint(buf []byte) (uint64, error) {
	b, err := f.read(buf)
	if err != nil {
		return 0, err
	}
	v, ok := parseUint(b)
	if !ok {
		return 0, fmt.Errorf("parse %s: %q", f.path, b)
	}
	return v, nil
}

// write sets the file's value to b, ended by a newline as echo(1) writes
// it. cgroupfs replaces the whole value with each write and strips the
// newline; what it shows afterwards is one line. Ending the write in one
// keeps that true of any file: a longer value written before leaves bytes
// behind in a regular file only after the first line.
func (f cfile) write(b []byte) error {
	var buf [64]byte
	v := append(append(buf[:0], b...), '\n')
	for {
		_, err := unix.Pwrite(f.fd, v, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return classify(&os.PathError{Op: "write", Path: f.path, Err: err})
		}
		return nil
	}
}

func (f *cfile) close() {
	if f.fd >= 0 {
		unix.Close(f.fd)
		f.fd = -1
	}
}

// V1Mounts are the mount points of the v1 hierarchies envlet uses. On most
// hosts cpu and cpuacct share one mount ("cpu,cpuacct"); here they are
// separate, so each is resolved on its own.
type V1Mounts struct {
	CPU, CPUAcct, Memory string
	// Pids is the pids hierarchy, when mounted (the shim's fork-bomb
	// guard reads it; the controller does not need it).
	Pids string
}

// FindV1Mounts reads /proc/self/mountinfo for the cpu, cpuacct and memory
// hierarchies (required) and the pids hierarchy (optional).
func FindV1Mounts() (V1Mounts, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return V1Mounts{}, fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	var m V1Mounts
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// 32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
		pre, post, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 || qf[0] != "cgroup" {
			continue
		}
		for _, opt := range strings.Split(qf[2], ",") {
			switch opt {
			case "cpu":
				m.CPU = pf[4]
			case "cpuacct":
				m.CPUAcct = pf[4]
			case "memory":
				m.Memory = pf[4]
			case "pids":
				m.Pids = pf[4]
			}
		}
	}
	if err := sc.Err(); err != nil {
		return m, fmt.Errorf("read mountinfo: %w", err)
	}
	if m.CPU == "" || m.CPUAcct == "" || m.Memory == "" {
		return m, fmt.Errorf("cgroup v1 cpu/cpuacct/memory hierarchies not all mounted (%+v)", m)
	}
	return m, nil
}
