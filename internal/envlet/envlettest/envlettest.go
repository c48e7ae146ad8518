// Package envlettest holds helpers for tests that run envlet against real
// cgroups: scratch v1 cgroups that are removed on cleanup, and a workload
// child (the test binary re-executed in helper mode) that burns CPU and
// allocates memory on command.
package envlettest

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
	"github.com/envsnap/envsnap/internal/prereq"
)

const helperEnv = "ENVLET_TEST_HELPER"

// HelperMain turns the process into the workload child when it was started
// by Start. Call it first in TestMain.
func HelperMain() {
	if os.Getenv(helperEnv) == "" {
		return
	}
	runHelper(os.Stdin, os.Stdout)
	os.Exit(0)
}

// runHelper executes line commands from in, answering each with one line:
//
//	threads N DUTY   run N busy threads at DUTY percent (0 stops them)
//	alloc MIB        allocate and touch MIB more MiB, 64 MiB per mapping
//	free             unmap everything allocated
//	work MS N        burn MS core-milliseconds of CPU split over N threads
//
// It exits when in closes.
func runHelper(in io.Reader, out io.Writer) {
	var (
		gen     atomic.Int64
		maps    [][]byte
		threads sync.WaitGroup
	)
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		arg := func(i int) int {
			if i >= len(f) {
				return 0
			}
			v, _ := strconv.Atoi(f[i])
			return v
		}
		start := time.Now()
		switch f[0] {
		case "threads":
			g := gen.Add(1)
			n, duty := arg(1), arg(2)
			for range n {
				threads.Add(1)
				go func() {
					defer threads.Done()
					burnDuty(&gen, g, duty)
				}()
			}
		case "alloc":
			mib := arg(1)
			for mib > 0 {
				chunk := min(mib, 64)
				b, err := syscall.Mmap(-1, 0, chunk<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
				if err != nil {
					fmt.Fprintf(out, "error %v\n", err)
					break
				}
				for i := 0; i < len(b); i += 4096 {
					b[i] = 1
				}
				maps = append(maps, b)
				mib -= chunk
			}
		case "free":
			for _, b := range maps {
				syscall.Munmap(b)
			}
			maps = nil
		case "work":
			ms, n := arg(1), max(arg(2), 1)
			per := time.Duration(ms) * time.Millisecond / time.Duration(n)
			var wg sync.WaitGroup
			for range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					burnCPU(per)
				}()
			}
			wg.Wait()
		}
		fmt.Fprintf(out, "ok %d\n", time.Since(start).Milliseconds())
	}
	gen.Add(1)
	threads.Wait()
}

var sink atomic.Uint64

// burnDuty spins on its own OS thread at duty percent (in 25 ms periods)
// until the generation changes.
func burnDuty(gen *atomic.Int64, g int64, duty int) {
	runtime.LockOSThread()
	const period = 25 * time.Millisecond
	busy := period * time.Duration(duty) / 100
	for gen.Load() == g {
		t0 := time.Now()
		x := uint64(1)
		for time.Since(t0) < busy {
			for i := 0; i < 1000; i++ {
				x = x*6364136223846793005 + 1
			}
		}
		sink.Add(x)
		if duty < 100 {
			time.Sleep(period - busy)
		}
	}
}

// burnCPU consumes d of this thread's CPU time (not wall time, so a
// throttled thread takes longer).
func burnCPU(d time.Duration) {
	runtime.LockOSThread()
	var ts unix.Timespec
	cpu := func() time.Duration {
		unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
		return time.Duration(ts.Nano())
	}
	end := cpu() + d
	x := uint64(1)
	for cpu() < end {
		for i := 0; i < 20000; i++ {
			x = x*6364136223846793005 + 1
		}
	}
	sink.Add(x)
}

// Proc is a running workload child.
type Proc struct {
	Cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// Start re-executes the test binary as a workload child. It is killed and
// reaped on cleanup.
func Start(t testing.TB) *Proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1", "GOMAXPROCS=16", "GODEBUG=updatemaxprocs=0")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &Proc{Cmd: cmd, in: in, out: bufio.NewReader(outp)}
	t.Cleanup(func() {
		in.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	return p
}

// Pid is the child's pid.
func (p *Proc) Pid() int { return p.Cmd.Process.Pid }

// Do sends one command and waits for its answer, returning the
// milliseconds it took in the child.
func (p *Proc) Do(cmd string) (time.Duration, error) {
	if _, err := fmt.Fprintln(p.in, cmd); err != nil {
		return 0, fmt.Errorf("send %q: %w", cmd, err)
	}
	line, err := p.out.ReadString('\n')
	if err != nil {
		return 0, fmt.Errorf("%q: child died: %w", cmd, err)
	}
	f := strings.Fields(line)
	if len(f) != 2 || f[0] != "ok" {
		return 0, fmt.Errorf("%q: %s", cmd, strings.TrimSpace(line))
	}
	ms, _ := strconv.Atoi(f[1])
	return time.Duration(ms) * time.Millisecond, nil
}

// V1 is a scratch cgroup in the v1 cpu, cpuacct and memory hierarchies.
type V1 struct {
	Mounts cgroupfs.V1Mounts
	Path   string // relative to each mount, e.g. /envlet-test-123-1
}

var seq atomic.Int64

// RequireV1 skips unless running as root with the v1 cpu, cpuacct and
// memory hierarchies mounted.
func RequireV1(t testing.TB) cgroupfs.V1Mounts {
	t.Helper()
	prereq.RequireRoot(t) // to create cgroups
	m, err := cgroupfs.FindV1Mounts()
	if err != nil {
		prereq.Skip(t, prereq.NoCgroupV1, "%v", err)
	}
	return m
}

// NewV1 creates /sys/fs/cgroup/{cpu,cpuacct,memory}/envlet-test-<pid>-<n>;
// cleanup kills what is left in it (only our children go there) and
// removes it.
func NewV1(t testing.TB, m cgroupfs.V1Mounts) *V1 {
	t.Helper()
	cg := &V1{Mounts: m, Path: fmt.Sprintf("/envlet-test-%d-%d", os.Getpid(), seq.Add(1))}
	for _, d := range cg.dirs() {
		if err := os.Mkdir(d, 0o755); err != nil && !os.IsExist(err) {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, d := range cg.dirs() {
			b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, s := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(s); err == nil {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		for _, d := range cg.dirs() {
			var err error
			for range 50 {
				if err = os.Remove(d); err == nil || os.IsNotExist(err) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err != nil && !os.IsNotExist(err) {
				t.Errorf("remove cgroup %s: %v", d, err)
			}
		}
	})
	return cg
}

func (cg *V1) dirs() []string {
	ds := []string{filepath.Join(cg.Mounts.CPU, cg.Path), filepath.Join(cg.Mounts.CPUAcct, cg.Path), filepath.Join(cg.Mounts.Memory, cg.Path)}
	if ds[0] == ds[1] {
		ds = ds[1:]
	}
	return ds
}

// Add moves pid into the cgroup in every hierarchy.
func (cg *V1) Add(t testing.TB, pid int) {
	t.Helper()
	for _, d := range cg.dirs() {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// Read returns a control file's content, e.g. Read(t, "memory", "memory.oom_control").
func (cg *V1) Read(t testing.TB, hier, file string) string {
	t.Helper()
	dir := map[string]string{"cpu": cg.Mounts.CPU, "cpuacct": cg.Mounts.CPUAcct, "memory": cg.Mounts.Memory}[hier]
	b, err := os.ReadFile(filepath.Join(dir, cg.Path, file))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// OOMKills returns memory.oom_control oom_kill.
func (cg *V1) OOMKills(t testing.TB) int {
	for _, line := range strings.Split(cg.Read(t, "memory", "memory.oom_control"), "\n") {
		if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return -1
}
