//go:build linux

package idleprio

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/cgroups"

	"github.com/envsnap/envsnap/internal/prereq"
	"golang.org/x/sys/unix"
)

// priority is what a thread runs at.
type priority struct {
	policy uint32
	class  int    // I/O class
	cgroup string // v1 cpu cgroup directory; "" on v2
}

func threadPriority(t *testing.T, tid int) priority {
	t.Helper()
	return priorityOf(t, &lowered{id: tid})
}

// priorityOf reads what th's first thread runs at.
func priorityOf(t *testing.T, th *lowered) priority {
	t.Helper()
	tid := th.id
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		t.Fatal(err)
	}
	p, _, e := unix.Syscall(unix.SYS_IOPRIO_GET, ioprioWhoProcess, uintptr(tid), 0)
	if e != 0 {
		t.Fatal(e)
	}
	pr := priority{policy: a.Policy, class: int(p) >> ioprioClassShift}
	if !cgroups.IsCgroup2UnifiedMode() {
		if pr.cgroup, err = th.cpuCgroup(); err != nil {
			t.Fatal(err)
		}
	}
	return pr
}

// wantV1Cgroup is the cgroup a lowered thread must be in: the background
// one where a v1 cpu hierarchy is mounted.
func wantV1Cgroup(t *testing.T) string {
	if cgroups.IsCgroup2UnifiedMode() {
		return ""
	}
	mnt, err := cgroups.FindCgroupMountpoint("", "cpu")
	if err != nil {
		return ""
	}
	return filepath.Join(mnt, BackgroundCgroup)
}

func TestJobRunsLowered(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	before := threadPriority(t, unix.Gettid())
	asked, resume := make(chan int), make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		Run(func() {
			asked <- unix.Gettid()
			<-resume
		})
	}()
	tid := <-asked
	// Looked at from outside a few times: a floor turn runs the job at
	// the daemon's priority for FloorFor of every FloorEvery.
	want := priority{policy: unix.SCHED_IDLE, class: ioprioClassIdle, cgroup: wantV1Cgroup(t)}
	var seen []priority
	for range 10 {
		seen = append(seen, threadPriority(t, tid))
		time.Sleep(20 * time.Millisecond)
	}
	close(resume)
	<-done
	if !slices.Contains(seen, want) {
		t.Fatalf("job ran at %+v, want %+v (status %+v)", seen, want, Lower())
	}
	if tid == unix.Gettid() {
		t.Fatal("the job ran on the caller's thread")
	}
	// The lowered thread ends with the job, just after it: no other
	// goroutine runs on it.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid))
		if os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("thread %d of the job still exists 10 s after it: %v", tid, err)
		}
	}
	if after := threadPriority(t, unix.Gettid()); after != before {
		t.Fatalf("the caller's thread went from %+v to %+v", before, after)
	}
	if st := Lower(); st.Err != nil || !st.SchedIdle || !st.IOIdle {
		t.Fatalf("status %+v", st)
	}
	// No lowered thread outlives its job, the process's main thread
	// included (the runtime parks that one for good instead of ending
	// it): run enough jobs that some goroutine lands there.
	for range 20 {
		Run(func() {})
	}
	for _, tid := range idleThreads(t) {
		t.Errorf("thread %d (main thread: %v) still idle after its job", tid, tid == unix.Getpid())
	}
}

// idleThreads returns the threads of this process that run SCHED_IDLE.
func idleThreads(t *testing.T) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	var idle []int
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if a, err := unix.SchedGetAttr(tid, 0); err == nil && a.Policy == unix.SCHED_IDLE {
			idle = append(idle, tid)
		}
	}
	return idle
}

func TestBoost(t *testing.T) {
	runtime.LockOSThread()
	normal := threadPriority(t, unix.Gettid())
	runtime.UnlockOSThread()

	j := NewJob()
	started, boosted := make(chan struct{}), make(chan struct{})
	var after priority
	go func() {
		<-started
		j.Boost()
		j.Boost() // a second call does nothing
		close(boosted)
	}()
	j.Run(func() {
		close(started)
		<-boosted
		after = threadPriority(t, unix.Gettid())
	})
	if after != normal {
		t.Fatalf("boosted job runs at %+v, want the daemon's %+v", after, normal)
	}

	// Boosted before it runs: it runs on the caller at once, without a
	// slot, even when every slot is taken.
	release := make(chan struct{})
	var wg sync.WaitGroup
	var running atomic.Int32
	for range Slots {
		wg.Add(1)
		go func() {
			defer wg.Done()
			Run(func() { running.Add(1); <-release })
		}()
	}
	for running.Load() < Slots {
		time.Sleep(time.Millisecond)
	}
	j = NewJob()
	j.Boost()
	runtime.LockOSThread()
	caller := unix.Gettid()
	var ranOn int
	j.Run(func() { ranOn = unix.Gettid() })
	runtime.UnlockOSThread()
	close(release)
	wg.Wait()
	if ranOn != caller {
		t.Fatalf("a job boosted before it ran ran on thread %d, not the caller's %d", ranOn, caller)
	}
}

// TestProcessRunsLowered: RunProcess lowers the process, Boost raises
// it back, and the floor lets go of it when it ends.
func TestProcessRunsLowered(t *testing.T) {
	runtime.LockOSThread()
	normal := threadPriority(t, unix.Gettid())
	runtime.UnlockOSThread()

	stdin, toChild, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer toChild.Close()
	fromChild, stdout, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer fromChild.Close()
	// The shell says who it is and waits to be told to end.
	cmd := exec.Command("/bin/sh", "-c", `echo $$; read end`)
	cmd.Stdin, cmd.Stdout = stdin, stdout
	j := NewJob()
	done := make(chan error, 1)
	go func() { done <- j.RunProcess(cmd) }()
	line, err := bufio.NewReader(fromChild).ReadString('\n')
	if err != nil {
		t.Fatalf("the shell said nothing: %v", err)
	}
	shell, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatal(err)
	}
	want := priority{policy: unix.SCHED_IDLE, class: ioprioClassIdle, cgroup: wantV1Cgroup(t)}
	// Looked at until seen lowered: lowering follows the start, and a
	// floor turn raises it for FloorFor of every FloorEvery.
	var seen []priority
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		seen = append(seen, priorityOf(t, &lowered{id: shell, proc: true}))
		if seen[len(seen)-1] == want {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the process ran at %+v, want %+v", seen, want)
		}
	}
	j.Boost()
	if got := priorityOf(t, &lowered{id: shell, proc: true}); got != normal {
		t.Fatalf("boosted process runs at %+v, want the daemon's %+v", got, normal)
	}
	if _, err := toChild.WriteString("\n"); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("RunProcess: %v", err)
	}
	stdin.Close()
	stdout.Close()
	floor.mu.Lock()
	_, listed := floor.jobs[j]
	floor.mu.Unlock()
	if listed {
		t.Fatal("the floor still lists the job of a process that ended")
	}
}

// TestIdleShare: a job spinning while every core spins at normal priority
// gets a small share of the CPU of each of those, about its floor turns
// (FloorFor every FloorEvery): the foreground is not
// slowed by background work, and the background does not stall. The
// foreground is processes of their own, as an environment's are, one
// more of them than there are cores, so that no core falls idle
// while the kernel balances them: what a SCHED_IDLE job takes of an idle
// core costs nobody, and with one per core, other load on the machine
// left the job such moments (0.27x of a foreground process's CPU once,
// all but a fifth of it outside its turns). The shares are CPU times of
// one run, so other load on the machine affects both sides.
func TestIdleShare(t *testing.T) {
	n := runtime.NumCPU() + 1
	const spin = 3 * time.Second
	fg := startSpinners(t, n)
	stop := make(chan struct{})
	var bg time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		Run(func() { bg = spinUntil(stop) })
	}()
	time.Sleep(spin)
	close(stop)
	for _, c := range fg {
		if err := c.Process.Kill(); err != nil {
			t.Fatal(err)
		}
	}
	<-done
	var least time.Duration = -1
	for _, c := range fg {
		c.Wait() // killed: the error says so
		if d := c.ProcessState.UserTime() + c.ProcessState.SystemTime(); least < 0 || d < least {
			least = d
		}
	}
	t.Logf("%d foreground processes: least CPU %v; background job: %v", n, least, bg)
	if least <= 0 {
		t.Fatal("the foreground processes did not run")
	}
	// Its floor turns are FloorFor of every FloorEvery (5%) at the
	// foreground's priority; a thread just raised is often run first, so
	// allow it up to a quarter of a foreground process's CPU. At equal
	// priority it would get as much as one.
	if r, most := float64(bg)/float64(least), 0.25; r > most {
		t.Errorf("background job got %.3fx the CPU of a foreground process; want at most %.2fx", r, most)
	}
	if bg < time.Millisecond {
		t.Errorf("background job got %v of CPU in %v: its floor turns did not run it", bg, spin)
	}
}

// startSpinners starts n processes that keep a core busy each until the
// test ends (or are killed earlier).
func startSpinners(t testing.TB, n int) []*exec.Cmd {
	t.Helper()
	fg := make([]*exec.Cmd, n)
	for i := range fg {
		fg[i] = exec.Command("/bin/sh", "-c", "while :; do :; done")
		if err := fg[i].Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { fg[i].Process.Kill(); fg[i].Wait() })
	}
	return fg
}

// spinUntil burns the CPU until stop is closed and returns the calling
// thread's CPU time over it.
func spinUntil(stop chan struct{}) time.Duration {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	start := ts.Nano()
	for {
		select {
		case <-stop:
			unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
			return time.Duration(ts.Nano() - start)
		default:
		}
		for i := 0; i < 1e5; i++ {
			_ = i * i
		}
	}
}

// threadNice returns thread tid's nice value, and false when the thread
// is gone.
func threadNice(t *testing.T, tid int) (int, bool) {
	t.Helper()
	// getpriority returns 20 - nice for PRIO_PROCESS on Linux.
	p, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if errors.Is(err, unix.ESRCH) {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return 20 - p, true
}

func TestRaiseForeground(t *testing.T) {
	prereq.RequireRoot(t) // a negative nice value needs CAP_SYS_NICE
	t.Cleanup(func() {
		if err := RaiseForeground(0); err != nil {
			t.Error(err)
		}
	})
	const nice = -5
	if err := RaiseForeground(nice); err != nil {
		t.Fatal(err)
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range tasks {
		tid, _ := strconv.Atoi(e.Name())
		// The runtime ends threads at any time (a job's, with its
		// goroutine): one listed may be gone.
		if n, ok := threadNice(t, tid); ok && n != nice {
			t.Errorf("thread %d at nice %d, want %d", tid, n, nice)
		}
	}
	// A job's thread, started afterwards and lowered (TestJobRunsLowered),
	// has it when boosted.
	j := NewJob()
	asked, boosted, done := make(chan int), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		j.Run(func() {
			asked <- unix.Gettid()
			<-boosted
		})
	}()
	tid := <-asked
	j.Boost()
	if n, ok := threadNice(t, tid); !ok || n != nice {
		t.Errorf("boosted job thread at nice %d (there: %v), want %d", n, ok, nice)
	}
	close(boosted)
	<-done
}
