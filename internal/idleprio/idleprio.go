//go:build linux

// Package idleprio runs the daemon's background work (the background
// fill, native layer copies) on OS threads at idle CPU and I/O priority,
// so that it takes only what the node's other work leaves of the CPU and
// the disk, however busy the node is, instead of waiting for a core to be
// measured idle.
//
// A Job runs its function on a thread of its own, locked to its goroutine
// and never unlocked: the Go runtime then ends the thread with the
// goroutine, so the lowered priority never passes to other goroutines,
// and threads it creates meanwhile come from its template thread, not
// from a lowered one. The thread is lowered three ways:
//
//   - SCHED_IDLE: below every SCHED_OTHER thread of its cgroup, and
//     preempted at once by any waking one on its core;
//   - I/O class idle (ioprio_set): served when no other I/O is pending,
//     by the I/O schedulers that have classes (BFQ, mq-deadline);
//   - on a cgroup v1 cpu hierarchy, the thread moves to a cgroup of its
//     own at the hierarchy's top, BackgroundCgroup, with cpu.shares 2,
//     where it competes with the node's top-level groups (the containers'
//     included) at the least weight there is. SCHED_IDLE alone ranks a
//     thread only against its own cgroup's threads. On cgroup v2 a thread
//     cannot leave its process's cgroup, so there the daemon's work is
//     idle against the daemon's other threads (the file-system requests
//     it serves) and yields the core to any waking thread, but shares
//     with an environment that stays runnable by the two cgroups' weights.
//
// Boost raises a job back to the daemon's priority: a foreground read
// that waits on background work (a read joining a fill's fetch) must not
// wait at idle priority.
//
// A thread that the kernel does not run holds its Go P (the runtime takes
// a P back only from a thread in a system call), so at most Slots jobs
// run lowered at once and GOMAXPROCS is raised by Slots when the first
// one starts: starved background threads never leave the daemon's
// foreground goroutines fewer Ps than the node has cores. It also
// holds up every stop-the-world phase of the process's garbage
// collector until it next runs; RunProcess lowers a child process
// instead, with the same turns and Boost, for work that needs the CPU
// more than it waits.
package idleprio

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/opencontainers/cgroups"
	"golang.org/x/sys/unix"
)

const (
	// Slots bounds the jobs that run lowered at once: a fill of a few
	// layers (a request of each in flight) and a native copy.
	Slots = 4
	// BackgroundCgroup is the cgroup v1 cpu group lowered threads move
	// to, below the top of the hierarchy.
	BackgroundCgroup = "envsnap-background"
	// backgroundShares is the least cpu.shares v1 accepts.
	backgroundShares = 2
)

// ioprio_set(2) values (linux/ioprio.h): x/sys has the system call number
// only.
const (
	ioprioWhoProcess = 1 // a thread, by its id
	ioprioClassShift = 13
	ioprioClassIdle  = 3
)

var (
	slots    = make(chan struct{}, Slots)
	procsFor sync.Once
)

// Job is one piece of background work. Create it with NewJob, run it
// once with Run; Boost may come from any goroutine at any time.
type Job struct {
	mu      sync.Mutex
	boosted bool
	boost   chan struct{} // closed by Boost
	th      *lowered      // the lowered thread running the job, while it does
}

// NewJob returns a job that has not run.
func NewJob() *Job { return &Job{boost: make(chan struct{})} }

// Run runs fn at idle priority on a thread of its own and returns when fn
// does. It waits for one of the Slots; a job boosted before it runs
// (Boost) runs fn on the calling goroutine at once instead.
func (j *Job) Run(fn func()) {
	select {
	case slots <- struct{}{}:
	case <-j.boost:
		fn()
		return
	}
	defer func() { <-slots }()
	procsFor.Do(func() { runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + Slots) })
	// On the floor's list before the thread is lowered: a lowered thread
	// on a saturated node may not run again before its first turn.
	floor.add(j)
	defer floor.remove(j)
	onOwnThread(func(tid int) {
		j.mu.Lock()
		if !j.boosted {
			j.th = lower(tid, false)
		}
		j.mu.Unlock()
	}, fn, func() {
		// The thread ends at the daemon's priority: it has to run to
		// end, and the job's waiter waits for that.
		j.mu.Lock()
		th := j.th
		j.th = nil
		j.mu.Unlock()
		if th != nil {
			th.raise()
		}
	})
}

// onOwnThread runs fn on a goroutine locked to a thread that ends with
// it, and waits for it. before runs on the calling goroutine with the
// thread's id before fn starts, after once fn has returned and before
// the thread ends: the job's thread is lowered and raised from there, at
// the daemon's priority, never by itself. A lowered thread that held
// j.mu while it lowered or raised itself could be preempted there and,
// on a saturated node, not run again until a core fell idle, while
// Boost (a foreground read waiting on the job) and the floor's turns
// waited for j.mu: the first turn came seconds late under load.
//
// The runtime does not end the process's main thread at the end of a
// locked goroutine but parks it for good: a goroutine that lands there
// hands the whole run to another one and returns the thread.
func onOwnThread(before func(tid int), fn, after func()) {
	tids := make(chan int)
	start, ran, end, done := make(chan struct{}), make(chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			onOwnThread(before, fn, after) // lands elsewhere: this goroutine holds the main thread
			runtime.UnlockOSThread()
			return
		}
		// Never unlocked: see the package doc.
		tids <- unix.Gettid()
		<-start
		fn()
		close(ran)
		<-end
	}()
	select {
	case tid := <-tids:
		before(tid)
	case <-done:
		return // run in full from the goroutine that landed on the main thread
	}
	close(start)
	<-ran
	after()
	close(end)
	<-done
}

// Boost raises the job to the priority of the daemon's other threads for
// the rest of its run, or has it run at that priority if it has not
// started. Further calls do nothing.
func (j *Job) Boost() {
	if j == nil {
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.boosted {
		return
	}
	j.boosted = true
	close(j.boost)
	if j.th != nil {
		// j.mu keeps the thread alive: Run's goroutine takes it
		// before it ends.
		j.th.raise()
	}
}

// Boosted reports whether Boost was called.
func (j *Job) Boosted() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.boosted
}

// Run runs fn as a job nobody boosts (Job.Run).
func Run(fn func()) { NewJob().Run(fn) }

// RunProcess starts cmd, lowers the whole process as Run lowers a job's
// thread (every thread of it, and so the threads they create, with the
// same floor turns and Boost), and waits for it; it returns cmd.Wait's
// error. It takes none of the Slots: a process holds none of the
// daemon's Ps. That is what it is for: a lowered thread of the daemon
// that the kernel does not run stops the daemon's garbage collector at
// its next stop-the-world phase, and with it every goroutine of the
// daemon, the file-system requests it serves included, until the thread
// next runs (BenchmarkGCBesideLoweredJob); a lowered process stops only
// itself. The process runs at the daemon's priority from its start
// until it is lowered, just after.
func (j *Job) RunProcess(cmd *exec.Cmd) error {
	if err := cmd.Start(); err != nil {
		return err
	}
	pid := cmd.Process.Pid
	floor.add(j)
	j.mu.Lock()
	if !j.boosted {
		j.th = lower(pid, true)
	}
	j.mu.Unlock()
	// Waited for without reaping it first: the floor's turns and Boost
	// change the process by its pid, which must not be reused until
	// they let go of it.
	var info unix.Siginfo
	for unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil) == unix.EINTR {
	}
	floor.remove(j)
	j.mu.Lock()
	j.th = nil
	j.mu.Unlock()
	return cmd.Wait()
}

// RunProcess runs cmd as a job nobody boosts (Job.RunProcess).
func RunProcess(cmd *exec.Cmd) error { return NewJob().RunProcess(cmd) }

// lowered is a thread, or every thread of a process, and what it was
// before lower.
type lowered struct {
	id     int             // a thread's id, or a process's
	proc   bool            // id is a process: its threads are listed at every change
	attr   *unix.SchedAttr // nil when the policy could not be changed
	ioprio int             // -1 when the I/O class could not be changed
	cgroup string          // v1 cpu cgroup directory it came from; "" when it did not move
	bg     string          // v1 cpu cgroup directory it moved to
}

// Status is what lowering a thread achieves on this node: logged once at
// the first job, and what tests check.
type Status struct {
	SchedIdle bool   // the thread runs SCHED_IDLE
	IOIdle    bool   // its I/O class is idle
	Cgroup    string // the v1 cpu cgroup directory it moves to; "" on v2 or when none could be made
	Err       error  // what failed, if anything did
}

var (
	statusOnce sync.Once
	status     Status

	bgOnce sync.Once
	bgDir  string // v1 BackgroundCgroup directory, "" when unavailable
	bgErr  error
)

// lower lowers thread id, or every thread of process id, as far as the
// node allows; what fails is logged once, and the job runs anyway.
func lower(id int, proc bool) *lowered {
	th := &lowered{id: id, proc: proc, ioprio: -1}
	var st Status
	var errs []error
	// A process's id is its first thread's: what every thread of it
	// started with.
	if a, err := unix.SchedGetAttr(id, 0); err != nil {
		errs = append(errs, fmt.Errorf("read scheduling policy: %w", err))
	} else if err := th.each(setIdle); err != nil {
		errs = append(errs, err)
	} else {
		th.attr, st.SchedIdle = a, true
	}
	if p, _, e := unix.Syscall(unix.SYS_IOPRIO_GET, ioprioWhoProcess, uintptr(id), 0); e != 0 {
		errs = append(errs, fmt.Errorf("read I/O priority: %w", e))
	} else if err := th.each(setIOIdle); err != nil {
		errs = append(errs, err)
	} else {
		th.ioprio, st.IOIdle = int(p), true
	}
	if dir, err := backgroundCgroup(); err != nil {
		errs = append(errs, err)
	} else if dir != "" {
		from, err := th.cpuCgroup()
		if err == nil {
			err = th.move(dir)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("move to %s: %w", dir, err))
		} else {
			th.cgroup, th.bg, st.Cgroup = from, dir, dir
		}
	}
	st.Err = errors.Join(errs...)
	statusOnce.Do(func() {
		status = st
		e := log.G(context.TODO()).WithField("sched_idle", st.SchedIdle).WithField("io_idle", st.IOIdle).WithField("cgroup", st.Cgroup)
		if st.Err != nil {
			e.WithError(st.Err).Warn("background work runs at idle priority only in part")
			return
		}
		e.Info("background work runs at idle priority")
	})
	return th
}

func setIdle(tid int) error {
	if err := unix.SchedSetAttr(tid, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
		return fmt.Errorf("set SCHED_IDLE: %w", err)
	}
	return nil
}

func setIOIdle(tid int) error {
	if _, _, e := unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(tid), ioprioClassIdle<<ioprioClassShift); e != 0 {
		return fmt.Errorf("set I/O class idle: %w", e)
	}
	return nil
}

// each applies set to the thread, or to every thread of the process. A
// process's threads are listed again until a listing finds no thread not
// yet set: one created meanwhile by a thread not yet set inherits the
// old setting, one created by a thread already set the new. Threads of a
// process that end meanwhile are not errors, nor is the process ending.
func (th *lowered) each(set func(tid int) error) error {
	if !th.proc {
		return set(th.id)
	}
	done := map[int]bool{}
	for {
		tids, err := processThreads(th.id)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		fresh := false
		var errs []error
		for _, tid := range tids {
			if done[tid] {
				continue
			}
			done[tid], fresh = true, true
			if err := set(tid); err != nil && !errors.Is(err, unix.ESRCH) {
				errs = append(errs, fmt.Errorf("thread %d: %w", tid, err))
			}
		}
		if !fresh || len(errs) > 0 {
			return errors.Join(errs...)
		}
	}
}

// processThreads lists the threads of process pid.
func processThreads(pid int) ([]int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, fmt.Errorf("list the threads of process %d: %w", pid, err)
	}
	tids := make([]int, 0, len(ents))
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// move moves the thread, or the whole process, into the v1 cgroup dir.
func (th *lowered) move(dir string) error {
	if !th.proc {
		return os.WriteFile(filepath.Join(dir, "tasks"), []byte(strconv.Itoa(th.id)), 0)
	}
	err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(th.id)), 0)
	if errors.Is(err, unix.ESRCH) {
		return nil // it ended
	}
	return err
}

// lowerAgain lowers a raised thread or process again, as lower did.
func (th *lowered) lowerAgain() {
	var errs []error
	if th.attr != nil {
		errs = append(errs, th.each(setIdle))
	}
	if th.ioprio >= 0 {
		errs = append(errs, th.each(setIOIdle))
	}
	if th.bg != "" {
		errs = append(errs, th.move(th.bg))
	}
	if err := errors.Join(errs...); err != nil {
		log.G(context.TODO()).WithError(err).Warn("lowering background work again")
	}
}

// raise undoes lower; errors are logged, the job goes on either way.
func (th *lowered) raise() {
	var errs []error
	if th.cgroup != "" {
		if err := th.move(th.cgroup); err != nil {
			errs = append(errs, fmt.Errorf("move back to %s: %w", th.cgroup, err))
		}
	}
	if th.ioprio >= 0 {
		errs = append(errs, th.each(func(tid int) error {
			if _, _, e := unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, uintptr(tid), uintptr(th.ioprio)); e != 0 {
				return fmt.Errorf("restore I/O priority: %w", e)
			}
			return nil
		}))
	}
	if th.attr != nil {
		a := *th.attr
		a.Size = unix.SizeofSchedAttr
		errs = append(errs, th.each(func(tid int) error {
			if err := unix.SchedSetAttr(tid, &a, 0); err != nil {
				return fmt.Errorf("restore scheduling policy: %w", err)
			}
			return nil
		}))
	}
	if err := errors.Join(errs...); err != nil {
		log.G(context.TODO()).WithError(err).Warn("boosting background work")
	}
}

// floor keeps background work from stalling on a node whose other work
// keeps every core busy, where an idle thread gets nearly nothing (a few
// microseconds in seconds here, with the cores saturated): every
// FloorEvery, one running job, in turn, runs at the daemon's priority for
// FloorFor. The background as a whole thus costs the node's other work at
// most FloorFor of one core every FloorEvery (5%), and a native copy
// or a fill completes on a saturated node, slowly, instead of never.
var floor = floorTurns{jobs: map[*Job]time.Time{}}

const (
	FloorEvery = time.Second
	FloorFor   = 50 * time.Millisecond
)

// floorTurns is the running jobs, with the end of each one's latest turn;
// its goroutine runs while there are any.
type floorTurns struct {
	mu      sync.Mutex
	jobs    map[*Job]time.Time
	running bool
}

func (f *floorTurns) add(j *Job) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.jobs[j] = time.Now()
	if !f.running {
		f.running = true
		go f.loop()
	}
}

func (f *floorTurns) remove(j *Job) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.jobs, j)
}

// next returns the job whose turn is due the longest, or false when no
// job runs (the loop then ends).
func (f *floorTurns) next() (*Job, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.jobs) == 0 {
		f.running = false
		return nil, false
	}
	var pick *Job
	for j, at := range f.jobs {
		if pick == nil || at.Before(f.jobs[pick]) {
			pick = j
		}
	}
	f.jobs[pick] = time.Now().Add(FloorFor)
	return pick, true
}

// loop gives the turns from a thread of its own that the kernel wakes
// itself (nanosleep): a turn ends when FloorFor is up, not when the Go
// runtime next gets round to a timer, which on a loaded node can be much
// later, all of it at the daemon's priority.
func (f *floorTurns) loop() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for {
		sleepThread(FloorEvery - FloorFor)
		j, ok := f.next()
		if !ok {
			return
		}
		if !j.turn(true) {
			continue
		}
		sleepThread(FloorFor)
		j.turn(false)
	}
}

// sleepThread blocks the calling thread in the kernel for d, across the
// signals the runtime sends it.
func sleepThread(d time.Duration) {
	ts := unix.NsecToTimespec(d.Nanoseconds())
	for unix.Nanosleep(&ts, &ts) == unix.EINTR {
	}
}

// turn raises (up) or lowers again the job's thread for a floor turn; it
// reports whether the thread was raised (a boosted or ended job is not
// touched).
func (j *Job) turn(up bool) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.boosted || j.th == nil {
		return false
	}
	if up {
		j.th.raise()
	} else {
		j.th.lowerAgain()
	}
	return true
}

// Lower reports what lowering a thread achieves on this node, lowering a
// thread of its own to find out the first time.
func Lower() Status {
	Run(func() {})
	return status
}

// backgroundCgroup returns the v1 cpu cgroup lowered threads move to,
// making it the first time: "" with a nil error on cgroup v2 (unified),
// where threads cannot move on their own.
func backgroundCgroup() (string, error) {
	bgOnce.Do(func() {
		if cgroups.IsCgroup2UnifiedMode() {
			return
		}
		// The top of what this process sees of the hierarchy.
		mnt, err := cgroups.FindCgroupMountpoint("", "cpu")
		if err != nil {
			if cgroups.IsNotFound(err) {
				return // no v1 cpu hierarchy: a hybrid host with cpu on v2
			}
			bgErr = fmt.Errorf("find the cgroup v1 cpu hierarchy: %w", err)
			return
		}
		dir := filepath.Join(mnt, BackgroundCgroup)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			bgErr = fmt.Errorf("make cgroup %s: %w", dir, err)
			return
		}
		if err := os.WriteFile(filepath.Join(dir, "cpu.shares"), []byte(strconv.Itoa(backgroundShares)), 0); err != nil {
			bgErr = fmt.Errorf("set cpu.shares of %s: %w", dir, err)
			return
		}
		bgDir = dir
	})
	return bgDir, bgErr
}

// cpuCgroup returns the directory of the v1 cpu cgroup the thread or
// process is in.
func (th *lowered) cpuCgroup() (string, error) {
	file := fmt.Sprintf("/proc/self/task/%d/cgroup", th.id)
	if th.proc {
		file = fmt.Sprintf("/proc/%d/cgroup", th.id)
	}
	m, err := cgroups.ParseCgroupFile(file)
	if err != nil {
		return "", fmt.Errorf("read the cgroups: %w", err)
	}
	own, ok := m["cpu"]
	if !ok {
		return "", fmt.Errorf("no cgroup v1 cpu group (%v)", m)
	}
	mnt, root, err := cgroups.FindCgroupMountpointAndRoot("", "cpu")
	if err != nil {
		return "", fmt.Errorf("find the cgroup v1 cpu hierarchy: %w", err)
	}
	rel := own
	if root != "/" {
		rel = strings.TrimPrefix(own, root)
	}
	return filepath.Join(mnt, rel), nil
}
