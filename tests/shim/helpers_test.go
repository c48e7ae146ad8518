package shim_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/typeurl/v2"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim"
	"github.com/envsnap/envsnap/tests/testenv"
)

const envletRuntime = "io.containerd.envlet.v2"

var (
	workloadOnce sync.Once
	workloadBin  []byte
	workloadErr  error
)

// workload builds tests/shim/workload as a static binary, once per run.
func workload(t testing.TB) []byte {
	t.Helper()
	workloadOnce.Do(func() {
		dir, err := os.MkdirTemp("", "envlet-workload")
		if err != nil {
			workloadErr = err
			return
		}
		defer os.RemoveAll(dir)
		out := filepath.Join(dir, "workload")
		cmd := exec.Command("go", "build", "-o", out, "./workload")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			workloadErr = fmt.Errorf("build workload: %v\n%s", err, b)
			return
		}
		workloadBin, workloadErr = os.ReadFile(out)
	})
	if workloadErr != nil {
		t.Fatal(workloadErr)
	}
	return workloadBin
}

// node is the capacity the arbiter divides and the shim config.
type node struct {
	cpu, memory string // "" = the machine's
	// overcommit, when set, bounds the sum of initial quotas ("1": admit
	// by request).
	overcommit string
	// hostNetwork allows containers on the node's network ([guard]
	// allow-host-network): a CRI pod has no other on a node without CNI.
	hostNetwork bool
	// groupSize, when set, is [shim] group-size (containers per shim
	// process).
	groupSize string
	// memoryMerge sets [shim] memory-merge.
	memoryMerge bool
}

// suite is one containerd with the envlet runtime, a node arbiter daemon
// and the workload image.
type suite struct {
	env     *testenv.Env
	dir     string
	socket  string
	cfgPath string
	arbiter *testenv.Process
	img     client.Image
}

func newSuite(t testing.TB, n node, opts ...testenv.Option) *suite {
	t.Helper()
	testenv.RequireRoot(t)
	bin := workload(t)
	dir, err := os.MkdirTemp("", "envlet-e2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &suite{dir: dir, socket: filepath.Join(dir, "arbiter.sock"), cfgPath: filepath.Join(dir, "envlet.toml")}
	// The machine is shared and loaded: give the arbiter calls room, or a
	// slow answer reads as an outage and memory fails closed.
	cfg := fmt.Sprintf("[policy]\narbiter-timeout = \"1s\"\n[node]\n")
	if n.cpu != "" {
		cfg += fmt.Sprintf("cpu = %q\n", n.cpu)
	}
	if n.memory != "" {
		cfg += fmt.Sprintf("memory = %q\n", n.memory)
	}
	if n.overcommit != "" {
		cfg += fmt.Sprintf("[node.overcommit]\ncpu = %s\nmemory = %s\n", n.overcommit, n.overcommit)
	}
	cfg += fmt.Sprintf("[arbiter]\nsocket = %q\ntimeout = \"1s\"\n", s.socket)
	if n.hostNetwork {
		cfg += "[guard]\nallow-host-network = true\n"
	}
	if n.groupSize != "" || n.memoryMerge {
		cfg += "[shim]\n"
	}
	if n.groupSize != "" {
		cfg += fmt.Sprintf("group-size = %s\n", n.groupSize)
	}
	if n.memoryMerge {
		cfg += "memory-merge = true\n"
	}
	if err := os.WriteFile(s.cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	s.startArbiter(t)
	s.env = testenv.New(t, append([]testenv.Option{testenv.WithContainerdEnv("ENVLET_CONFIG=" + s.cfgPath)}, opts...)...)
	ref := s.env.PushImage(t, "envlet/workload:1", []testenv.File{{Path: "/workload", Mode: 0o755, Data: bin}}).Ref
	s.img = s.env.Pull(t, ref, "overlayfs")
	return s
}

// startArbiter starts `containerd-envsnap arbiter` and waits for its socket.
func (s *suite) startArbiter(t testing.TB) {
	t.Helper()
	_ = os.Remove(s.socket)
	s.arbiter = testenv.StartProcess(t, s.dir, "arbiter", nil, testenv.Binary(t, "containerd-envsnap"), "arbiter", "--config", s.cfgPath)
	deadline := time.Now().Add(10 * time.Second)
	for {
		// The socket file exists from bind(2), before listen(2): dial.
		if c, err := net.Dial("unix", s.socket); err == nil {
			c.Close()
			return
		}
		if exited, err := s.arbiter.Exited(); exited || time.Now().After(deadline) {
			t.Fatalf("arbiter did not start (exited %v: %v)\n%s", exited, err, s.arbiter.LogTail(20))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// envsnap runs the containerd-envsnap CLI against the suite's arbiter.
func (s *suite) envsnap(t testing.TB, args ...string) string {
	t.Helper()
	cmd := exec.Command(testenv.Binary(t, "containerd-envsnap"), args...)
	cmd.Env = append(os.Environ(), "ENVLET_CONFIG="+s.cfgPath)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("containerd-envsnap %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// ctr is a running container.
type ctr struct {
	id      string
	ns      string
	task    client.Task
	statusC <-chan client.ExitStatus
	out     *syncBuffer
	start   time.Time
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// ctrCount numbers containers (tests start some from several goroutines).
var ctrCount atomic.Int64

// runOpts selects how a container runs.
type runOpts struct {
	runtime  string            // default the envlet runtime
	ann      map[string]string // envlet knobs, without the annotation prefix
	specOpts []oci.SpecOpts
}

// run creates and starts a container of the workload image with the
// envlet runtime and annotations ann (envlet knobs).
func (s *suite) run(t testing.TB, ann map[string]string, args ...string) (*ctr, error) {
	return s.runWith(t, runOpts{ann: ann}, args...)
}

// runWith creates and starts a container of the workload image.
func (s *suite) runWith(t testing.TB, o runOpts, args ...string) (*ctr, error) {
	t.Helper()
	runtime, ann := o.runtime, o.ann
	if runtime == "" {
		runtime = envletRuntime
	}
	ctx := s.env.Context()
	id := fmt.Sprintf("%s-%d", strings.ToLower(strings.NewReplacer("/", "-", "_", "-", " ", "-").Replace(t.Name())), ctrCount.Add(1))
	a := map[string]string{}
	for k, v := range ann {
		a[envlet.AnnotationPrefix+k] = v
	}
	c, err := s.env.Client.NewContainer(ctx, id,
		client.WithSnapshotter("overlayfs"),
		client.WithNewSnapshot(id+"-snap", s.img),
		client.WithRuntime(runtime, nil),
		client.WithNewSpec(append([]oci.SpecOpts{oci.WithImageConfig(s.img),
			oci.WithProcessArgs(append([]string{"/workload"}, args...)...), oci.WithAnnotations(a)}, o.specOpts...)...),
	)
	if err != nil {
		t.Fatalf("create container %s: %v", id, err)
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(s.env.Context(), 30*time.Second)
		defer cancel()
		_ = c.Delete(dctx, client.WithSnapshotCleanup)
	})
	out := &syncBuffer{}
	task, err := c.NewTask(ctx, cio.NewCreator(cio.WithStreams(nil, out, out)))
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(s.env.Context(), 30*time.Second)
		defer cancel()
		_, _ = task.Delete(dctx, client.WithProcessKill)
	})
	statusC, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatalf("start %s: %v", id, err)
	}
	return &ctr{id: id, ns: s.env.Namespace, task: task, statusC: statusC, out: out, start: time.Now()}, nil
}

// wait returns the exit status, failing the test after timeout.
func (c *ctr) wait(t testing.TB, timeout time.Duration) uint32 {
	t.Helper()
	select {
	case st := <-c.statusC:
		if tio := c.task.IO(); tio != nil {
			tio.Wait()
		}
		return st.ExitCode()
	case <-time.After(timeout):
		_ = c.task.Kill(context.Background(), syscall.SIGKILL)
		t.Fatalf("container %s still running after %s; output:\n%s", c.id, timeout, c.out.String())
		return 0
	}
}

// stamp returns the time the workload printed for phase.
func (c *ctr) stamp(t testing.TB, phase string) time.Time {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(c.out.String()))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == phase {
			ns, err := strconv.ParseInt(f[1], 10, 64)
			if err == nil {
				return time.Unix(0, ns)
			}
		}
	}
	t.Fatalf("workload of %s printed no %q; output:\n%s", c.id, phase, c.out.String())
	return time.Time{}
}

// waitStamp waits until the workload prints phase.
func (c *ctr) waitStamp(t testing.TB, phase string, timeout time.Duration) time.Time {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !strings.Contains(c.out.String(), phase+" ") {
		if time.Now().After(deadline) {
			t.Fatalf("workload of %s did not reach %q within %s; output:\n%s", c.id, phase, timeout, c.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return c.stamp(t, phase)
}

// limits reads the container's CPU quota (cores; 0 = unlimited) and memory
// limit from its cgroup: v1 (cpu, memory hierarchies) or v2.
func (c *ctr) limits() (cpu float64, mem int64, err error) {
	rel := filepath.Join(c.ns, c.id)
	readInt := func(p string) (int64, error) {
		b, err := os.ReadFile(p)
		if err != nil {
			return 0, err
		}
		return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	}
	if _, err := os.Stat(filepath.Join("/sys/fs/cgroup/cpu", rel)); err == nil {
		q, err := readInt(filepath.Join("/sys/fs/cgroup/cpu", rel, "cpu.cfs_quota_us"))
		if err != nil {
			return 0, 0, err
		}
		p, err := readInt(filepath.Join("/sys/fs/cgroup/cpu", rel, "cpu.cfs_period_us"))
		if err != nil {
			return 0, 0, err
		}
		if q > 0 {
			cpu = float64(q) / float64(p)
		}
		mem, err = readInt(filepath.Join("/sys/fs/cgroup/memory", rel, "memory.limit_in_bytes"))
		return cpu, mem, err
	}
	dir := filepath.Join("/sys/fs/cgroup", rel)
	b, err := os.ReadFile(filepath.Join(dir, "cpu.max"))
	if err != nil {
		return 0, 0, err
	}
	f := strings.Fields(string(b))
	if len(f) == 2 && f[0] != "max" {
		q, _ := strconv.ParseFloat(f[0], 64)
		p, _ := strconv.ParseFloat(f[1], 64)
		cpu = q / p
	}
	// envlet's grant on v2 is memory.high (memory.max is the cap).
	b, err = os.ReadFile(filepath.Join(dir, "memory.high"))
	if err != nil {
		return cpu, 0, err
	}
	if s := strings.TrimSpace(string(b)); s != "max" {
		mem, err = strconv.ParseInt(s, 10, 64)
	}
	return cpu, mem, err
}

// sample is one reading of the limits.
type sample struct {
	t   time.Time
	cpu float64
	mem int64
}

// sampler polls the container's limits every 20 ms until stopped.
type sampler struct {
	mu   sync.Mutex
	s    []sample
	stop chan struct{}
	done chan struct{}
}

func (c *ctr) sample(t testing.TB) *sampler {
	sp := &sampler{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(sp.done)
		tk := time.NewTicker(20 * time.Millisecond)
		defer tk.Stop()
		for {
			if cpu, mem, err := c.limits(); err == nil {
				sp.mu.Lock()
				sp.s = append(sp.s, sample{time.Now(), cpu, mem})
				sp.mu.Unlock()
			}
			select {
			case <-sp.stop:
				return
			case <-tk.C:
			}
		}
	}()
	t.Cleanup(sp.Stop)
	return sp
}

// Stop ends sampling (idempotent) and returns the samples.
func (sp *sampler) Stop() {
	select {
	case <-sp.stop:
	default:
		close(sp.stop)
	}
	<-sp.done
}

func (sp *sampler) samples() []sample {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	return append([]sample(nil), sp.s...)
}

// event is one containerd event seen by watch.
type event struct {
	topic   string
	id      string // container id
	failure *envlet.Failure
}

// watch collects /envlet/env/failed and /tasks/oom events of the suite's
// namespace.
func (s *suite) watch(t testing.TB) func() []event {
	ctx, cancel := context.WithCancel(s.env.Context())
	t.Cleanup(cancel)
	ch, errs := s.env.Client.Subscribe(ctx, `topic=="`+shim.FailedEventTopic+`"`, `topic=="/tasks/oom"`)
	var mu sync.Mutex
	var evs []event
	go func() {
		for {
			select {
			case e := <-ch:
				if e == nil || e.Namespace != s.env.Namespace {
					continue
				}
				v, err := typeurl.UnmarshalAny(e.Event)
				if err != nil {
					t.Logf("undecodable %s event: %v", e.Topic, err)
					continue
				}
				ev := event{topic: e.Topic}
				switch x := v.(type) {
				case *eventstypes.ContainerUpdate:
					f, err := shim.ParseFailureEvent(x)
					if err != nil {
						t.Logf("bad failure event: %v", err)
						continue
					}
					ev.failure, ev.id = &f, f.Env
				case interface{ GetContainerID() string }:
					ev.id = x.GetContainerID()
				}
				mu.Lock()
				evs = append(evs, ev)
				mu.Unlock()
			case <-errs:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return func() []event {
		mu.Lock()
		defer mu.Unlock()
		return append([]event(nil), evs...)
	}
}

// prioritize raises the CPU weight of the container and of its namespace's
// parent cgroup to the maximum: the test machines are shared with other
// builds, and a container that cannot get CPU time below its quota shows
// the controller no demand ("host starvation"). The weight
// only orders contention; the quota under test still applies.
func (c *ctr) prioritize(t testing.TB) {
	t.Helper()
	for _, d := range []string{filepath.Join(c.ns), filepath.Join(c.ns, c.id)} {
		v1 := filepath.Join("/sys/fs/cgroup/cpu", d, "cpu.shares")
		if _, err := os.Stat(v1); err == nil {
			if err := os.WriteFile(v1, []byte("262144"), 0o644); err != nil {
				t.Fatalf("raise cpu.shares of %s: %v", d, err)
			}
			continue
		}
		v2 := filepath.Join("/sys/fs/cgroup", d, "cpu.weight")
		if err := os.WriteFile(v2, []byte("10000"), 0o644); err != nil {
			t.Logf("raise cpu.weight of %s: %v", d, err)
		}
	}
}

// cpuWeight reads the container's CPU weight: v1 cpu.shares or v2
// cpu.weight, with the default the runtime leaves there.
func (c *ctr) cpuWeight() (w, dflt uint64, err error) {
	rel := filepath.Join(c.ns, c.id)
	p, dflt := filepath.Join("/sys/fs/cgroup/cpu", rel, "cpu.shares"), uint64(1024)
	if _, err := os.Stat(p); err != nil {
		p, dflt = filepath.Join("/sys/fs/cgroup", rel, "cpu.weight"), 100
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, dflt, err
	}
	w, err = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return w, dflt, err
}

// waitWeight waits up to timeout for the container's CPU weight to be want.
func (c *ctr) waitWeight(t testing.TB, want uint64, timeout time.Duration) {
	t.Helper()
	var w uint64
	var err error
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if w, _, err = c.cpuWeight(); err == nil && w == want {
			return
		}
	}
	t.Fatalf("%s: CPU weight %d (%v) after %v, want %d", c.id, w, err, timeout, want)
}
