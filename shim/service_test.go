//go:build linux

package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/envlet"
)

// fakeRunc stands in for runc's task service.
type fakeRunc struct {
	taskAPI.TTRPCTaskService
	mu      sync.Mutex
	calls   []string
	kills   []*taskAPI.KillRequest
	updates []*specs.LinuxResources
	exited  chan struct{}
	pid     uint32 // of the created task; default 42
}

func newFakeRunc() *fakeRunc { return &fakeRunc{exited: make(chan struct{})} }

func (f *fakeRunc) record(c string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, c)
}

func (f *fakeRunc) Create(_ context.Context, r *taskAPI.CreateTaskRequest) (*taskAPI.CreateTaskResponse, error) {
	f.record("create " + r.ID)
	if f.pid != 0 {
		return &taskAPI.CreateTaskResponse{Pid: f.pid}, nil
	}
	return &taskAPI.CreateTaskResponse{Pid: 42}, nil
}

func (f *fakeRunc) Start(_ context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	f.record("start " + r.ID)
	return &taskAPI.StartResponse{Pid: 42}, nil
}

func (f *fakeRunc) Kill(_ context.Context, r *taskAPI.KillRequest) (*ptypes.Empty, error) {
	f.mu.Lock()
	f.kills = append(f.kills, r)
	f.mu.Unlock()
	f.record("kill " + r.ID)
	if r.Signal == uint32(unix.SIGKILL) {
		close(f.exited)
	}
	return &ptypes.Empty{}, nil
}

func (f *fakeRunc) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	select {
	case <-f.exited:
		return &taskAPI.WaitResponse{ExitStatus: 137}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (f *fakeRunc) Update(_ context.Context, r *taskAPI.UpdateTaskRequest) (*ptypes.Empty, error) {
	var res specs.LinuxResources
	if err := json.Unmarshal(r.Resources.GetValue(), &res); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.updates = append(f.updates, &res)
	f.mu.Unlock()
	return &ptypes.Empty{}, nil
}

func (f *fakeRunc) Delete(_ context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	f.record("delete " + r.ID)
	return &taskAPI.DeleteResponse{ExitStatus: 137}, nil
}

type published struct {
	topic string
	event events.Event
}

type fakePublisher struct {
	mu  sync.Mutex
	evs []published
}

func (p *fakePublisher) Publish(_ context.Context, topic string, e events.Event) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.evs = append(p.evs, published{topic, e})
	return nil
}

func (p *fakePublisher) Close() error { return nil }

func (p *fakePublisher) topics() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ts []string
	for _, e := range p.evs {
		ts = append(ts, e.topic)
	}
	return ts
}

// fakeArbiter records calls; admit decides admissions.
type fakeArbiter struct {
	mu       sync.Mutex
	admitted map[string]envlet.Resources
	released map[string]string
	tracked  map[string]bool
	admit    func(env string, base envlet.Resources) error
}

func newFakeArbiter() *fakeArbiter {
	return &fakeArbiter{admitted: map[string]envlet.Resources{}, released: map[string]string{}, tracked: map[string]bool{}}
}

func (a *fakeArbiter) Admit(_ context.Context, env string, base envlet.Resources, _ ...envlet.AdmitOpt) error {
	if a.admit != nil {
		if err := a.admit(env, base); err != nil {
			return err
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.admitted[env] = base
	return nil
}
func (a *fakeArbiter) Grow(_ context.Context, env string, want envlet.Resources) (envlet.Resources, error) {
	return want, nil
}
func (a *fakeArbiter) Report(_ context.Context, env string, cur, _ envlet.Resources) (envlet.Resources, error) {
	return cur, nil
}
func (a *fakeArbiter) Release(ctx context.Context, env string) error {
	return a.ReleaseReason(ctx, env, "exited")
}
func (a *fakeArbiter) ReleaseReason(_ context.Context, env, reason string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.released[env]; !ok {
		a.released[env] = reason
	}
	return nil
}
func (a *fakeArbiter) Track(env string, _ arbiter.StatusSource) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.tracked[env] = true
}
func (a *fakeArbiter) releasedReason(env string) (string, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	r, ok := a.released[env]
	return r, ok
}

// fakeController runs until cancelled or until fail is closed.
type fakeController struct {
	cgroup string
	cfg    envlet.Config
	fail   chan *envlet.FailureError
	caps   []envlet.Resources
	// rechecks counts Recheck calls.
	rechecks atomic.Int32
	// kernelKill is what KilledByKernel reports once it is given at least
	// needSeen kills seen elsewhere (0: it counts them itself).
	kernelKill *envlet.Failure
	needSeen   int
	// killedCalls counts KilledByKernel calls.
	killedCalls atomic.Int32
}

func (c *fakeController) Run(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return nil
	case fe := <-c.fail:
		return fe
	}
}
func (c *fakeController) Status() envlet.Status                                     { return envlet.Status{} }
func (c *fakeController) TimelineSince(seq uint64) ([]envlet.TimelinePoint, uint64) { return nil, seq }
func (c *fakeController) SetCap(r envlet.Resources) error                           { c.caps = append(c.caps, r); return nil }
func (c *fakeController) Recheck()                                                  { c.rechecks.Add(1) }
func (c *fakeController) KilledByKernel(seen int) *envlet.Failure {
	c.killedCalls.Add(1)
	if seen < c.needSeen {
		return nil
	}
	return c.kernelKill
}

type fixture struct {
	svc   *Service
	runc  *fakeRunc
	pub   *fakePublisher
	arb   *fakeArbiter
	ctrls map[string]*fakeController
}

func newFixture(t *testing.T) *fixture {
	f := &fixture{runc: newFakeRunc(), pub: &fakePublisher{}, arb: newFakeArbiter(), ctrls: map[string]*fakeController{}}
	var mu sync.Mutex
	f.svc = New(context.Background(), f.runc, f.pub, Options{
		Policy:      envlet.DefaultConfig(),
		Node:        envlet.Resources{CPU: 8, Memory: 16 * envlet.GiB},
		Arbiter:     f.arb,
		CheckCgroup: func(string) error { return nil },
		NewController: func(env, cg string, cfg envlet.Config, _ envlet.Arbiter) (Controller, func() error, error) {
			mu.Lock()
			defer mu.Unlock()
			c := &fakeController{cgroup: cg, cfg: cfg, fail: make(chan *envlet.FailureError, 1)}
			f.ctrls[env] = c
			return c, func() error { return nil }, nil
		},
	})
	return f
}

// bundle writes a config.json and returns its directory. A Linux spec
// that lists no namespaces gets a network namespace of its own, as a
// container has by default (TestHostNetwork lists them).
func bundle(t *testing.T, s *specs.Spec) string {
	t.Helper()
	if s.Linux != nil && len(s.Linux.Namespaces) == 0 {
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.NetworkNamespace}}
	}
	dir := t.TempDir()
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

func linuxSpec(id string, ann map[string]string) *specs.Spec {
	return &specs.Spec{Annotations: ann, Linux: &specs.Linux{CgroupsPath: "/test/" + id}}
}

func TestCreateAdmission(t *testing.T) {
	i64 := func(v int64) *int64 { return &v }
	u64 := func(v uint64) *uint64 { return &v }
	for _, tc := range []struct {
		name      string
		spec      *specs.Spec
		admitted  bool
		wantBase  envlet.Resources
		wantCap   envlet.Resources
		wantError func(error) bool
	}{
		{
			name: "sandbox runs unmanaged",
			spec: linuxSpec("s", map[string]string{"io.kubernetes.cri.container-type": "sandbox"}),
		},
		{
			name: "disabled by annotation",
			spec: linuxSpec("d", map[string]string{AnnDisable: "true"}),
		},
		{
			name:     "defaults capped by the node",
			spec:     linuxSpec("a", nil),
			admitted: true,
			wantBase: envlet.Resources{CPU: 2, Memory: 8 * envlet.GiB},
			wantCap:  envlet.Resources{CPU: 8, Memory: 16 * envlet.GiB},
		},
		{
			name: "annotations override",
			spec: linuxSpec("b", map[string]string{
				"io.envsnap.envlet.initial-cpu": "0.25", "io.envsnap.envlet.initial-memory": "256Mi",
				"io.envsnap.envlet.cap-cpu": "2",
			}),
			admitted: true,
			wantBase: envlet.Resources{CPU: 0.25, Memory: 256 * envlet.MiB},
			wantCap:  envlet.Resources{CPU: 2, Memory: 16 * envlet.GiB},
		},
		{
			name: "spec limits cap",
			spec: &specs.Spec{Linux: &specs.Linux{CgroupsPath: "/test/c", Resources: &specs.LinuxResources{
				CPU:    &specs.LinuxCPU{Quota: i64(150000), Period: u64(100000)},
				Memory: &specs.LinuxMemory{Limit: i64(4 * envlet.GiB)},
			}}},
			admitted: true,
			wantBase: envlet.Resources{CPU: 1.5, Memory: 4 * envlet.GiB},
			wantCap:  envlet.Resources{CPU: 1.5, Memory: 4 * envlet.GiB},
		},
		{
			name: "annotations cannot raise the spec limits",
			spec: &specs.Spec{Annotations: map[string]string{"io.envsnap.envlet.cap-memory": "1Ti", "io.envsnap.envlet.initial-memory": "512Mi"},
				Linux: &specs.Linux{CgroupsPath: "/test/f", Resources: &specs.LinuxResources{
					Memory: &specs.LinuxMemory{Limit: i64(2 * envlet.GiB)},
				}}},
			admitted: true,
			wantBase: envlet.Resources{CPU: 2, Memory: 512 * envlet.MiB},
			wantCap:  envlet.Resources{CPU: 8, Memory: 2 * envlet.GiB},
		},
		{
			name:      "bad annotation",
			spec:      linuxSpec("e", map[string]string{"io.envsnap.envlet.initial-cpu": "lots"}),
			wantError: errdefs.IsInvalidArgument,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			id := strings.ReplaceAll(tc.name, " ", "-")
			_, err := f.svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: id, Bundle: bundle(t, tc.spec)})
			if tc.wantError != nil {
				if !tc.wantError(errgrpc.ToNative(err)) {
					t.Fatalf("create: %v", err)
				}
				if len(f.runc.calls) != 0 {
					t.Fatalf("runc called after a rejected create: %v", f.runc.calls)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			base, admitted := f.arb.admitted[id]
			if admitted != tc.admitted {
				t.Fatalf("admitted = %v, want %v", admitted, tc.admitted)
			}
			if !admitted {
				if f.svc.lookup(id) != nil {
					t.Fatal("unmanaged container tracked")
				}
				return
			}
			if base != tc.wantBase {
				t.Errorf("admitted base %v, want %v", base, tc.wantBase)
			}
			e := f.svc.lookup(id)
			if e.cfg.Cap != tc.wantCap {
				t.Errorf("cap %v, want %v", e.cfg.Cap, tc.wantCap)
			}
			if _, err := f.svc.Start(context.Background(), &taskAPI.StartRequest{ID: id}); err != nil {
				t.Fatal(err)
			}
			if c := f.ctrls[id]; c == nil || c.cgroup != tc.spec.Linux.CgroupsPath {
				t.Fatalf("controller not started on %s: %+v", tc.spec.Linux.CgroupsPath, c)
			}
			if _, err := f.svc.Delete(context.Background(), &taskAPI.DeleteRequest{ID: id}); err != nil {
				t.Fatal(err)
			}
			if r, ok := f.arb.releasedReason(id); !ok || r != "deleted" {
				t.Fatalf("release after delete: %q %v", r, ok)
			}
		})
	}
}

func TestCreateRejected(t *testing.T) {
	f := newFixture(t)
	f.arb.admit = func(string, envlet.Resources) error {
		return errdefs.ErrResourceExhausted
	}
	_, err := f.svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "x", Bundle: bundle(t, linuxSpec("x", nil))})
	err = errgrpc.ToNative(err)
	if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), ReasonAdmissionRejected) {
		t.Fatalf("create on a full node: %v", err)
	}
	if len(f.runc.calls) != 0 {
		t.Fatalf("runc created a rejected container: %v", f.runc.calls)
	}
	if got := f.pub.topics(); len(got) != 1 || got[0] != FailedEventTopic {
		t.Fatalf("events: %v", got)
	}
}

// A container whose cgroup envlet cannot limit fails at Create, with an
// error naming the cgroup; runc's container is deleted and the admission
// released, so it never runs unlimited.
func TestCreateCgroupWithoutControllers(t *testing.T) {
	f := newFixture(t)
	f.svc.opts.CheckCgroup = func(p string) error {
		return fmt.Errorf("cgroup v2 /sys/fs/cgroup%s lacks the [memory] controller(s)", p)
	}
	_, err := f.svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "nomem", Bundle: bundle(t, linuxSpec("nomem", nil))})
	err = errgrpc.ToNative(err)
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "/sys/fs/cgroup/test/nomem lacks the [memory]") {
		t.Fatalf("create without the memory controller: %v", err)
	}
	if got := strings.Join(f.runc.calls, ","); got != "create nomem,delete nomem" {
		t.Fatalf("runc calls %q, want the container created and deleted", got)
	}
	if r, ok := f.arb.releasedReason("nomem"); !ok || r != "cgroup unusable" {
		t.Fatalf("admission not released: %q %v", r, ok)
	}
	if f.svc.lookup("nomem") != nil {
		t.Fatal("the container is still tracked")
	}
}

// The refusal names the container and what it asked for once, then what
// the node lacks, as the node arbiter words it.
func TestCreateRejectedMessage(t *testing.T) {
	f := newFixture(t)
	node := envlet.NewNodeArbiter(envlet.Resources{CPU: 0.5, Memory: envlet.GiB}, 0, envlet.WithOvercommit(envlet.Overcommit{CPU: 1, Memory: 1}))
	f.arb.admit = func(env string, base envlet.Resources) error {
		return node.Admit(context.Background(), env, base)
	}
	_, err := f.svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "env-42", Bundle: bundle(t, linuxSpec("env-42", nil))})
	msg := errgrpc.ToNative(err).Error()
	if strings.Count(msg, "env-42") != 1 || strings.Count(msg, "admit") != 1 || !strings.Contains(msg, "node ") {
		t.Fatalf("refusal %q: want the container and 'admit' once, then the node's state", msg)
	}
	ev := f.pub.evs[0].event.(*eventstypes.ContainerUpdate)
	if fl, err := ParseFailureEvent(ev); err != nil || fl.Reason != ReasonAdmissionRejected || strings.Contains(fl.Message, "env-42") {
		t.Fatalf("failure event %+v (%v): want the reason and the node's state", fl, err)
	}
}

// kubeTerminationSpec is container id's spec as CRI writes it for a pod:
// kubelet's termination message file bound at /dev/termination-log; it
// returns the file's host path.
func kubeTerminationSpec(t *testing.T, id string) (*specs.Spec, string) {
	t.Helper()
	termLog := filepath.Join(t.TempDir(), "termination-log")
	if err := os.WriteFile(termLog, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	spec := linuxSpec(id, map[string]string{annKubeTermination: "/dev/termination-log"})
	spec.Mounts = []specs.Mount{{Destination: "/dev/termination-log", Source: termLog, Type: "bind"}}
	return spec, termLog
}

// startKube creates and starts container id with a termination message
// file as kubelet gives one, and returns that file.
func (f *fixture) startKube(t *testing.T, id string) string {
	t.Helper()
	spec, termLog := kubeTerminationSpec(t, id)
	ctx := context.Background()
	if _, err := f.svc.Create(ctx, &taskAPI.CreateTaskRequest{ID: id, Bundle: bundle(t, spec)}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.svc.Start(ctx, &taskAPI.StartRequest{ID: id}); err != nil {
		t.Fatal(err)
	}
	return termLog
}

// waitReleased waits for container id's lease to be released and checks
// the reason it was released with.
func (f *fixture) waitReleased(t *testing.T, id, want string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if r, ok := f.arb.releasedReason(id); ok {
			if r != want {
				t.Fatalf("released with reason %q, want %s", r, want)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("not released after exit")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestFailure: a controller that gives up gets the task killed, after the
// reason is published and written where kubelet reads it.
func TestFailure(t *testing.T) {
	f := newFixture(t)
	termLog := f.startKube(t, "x")
	f.ctrls["x"].fail <- &envlet.FailureError{Failure: envlet.Failure{
		Reason: "MEM_NODE_EXHAUSTED", Requested: 6 * envlet.GiB, Granted: 3 * envlet.GiB,
		Cap: 32 * envlet.GiB, WorkingSet: 3 * envlet.GiB, OOMs: 2, Message: "node granted only 3GiB",
	}}
	select {
	case <-f.runc.exited:
	case <-time.After(10 * time.Second):
		t.Fatal("failed environment not killed")
	}
	k := f.runc.kills[0]
	if k.Signal != uint32(unix.SIGKILL) || !k.All {
		t.Fatalf("kill: %+v", k)
	}
	topics := f.pub.topics()
	if len(topics) != 2 || topics[0] != FailedEventTopic || topics[1] != runtime.TaskOOMEventTopic {
		t.Fatalf("events %v, want failure then oom", topics)
	}
	if oom := f.pub.evs[1].event.(*eventstypes.TaskOOM); oom.ContainerID != "x" {
		t.Fatalf("oom event for %q", oom.ContainerID)
	}
	got, err := ParseFailureEvent(f.pub.evs[0].event.(*eventstypes.ContainerUpdate))
	if err != nil {
		t.Fatal(err)
	}
	want := envlet.Failure{Env: "x", Reason: "MEM_NODE_EXHAUSTED", Requested: 6 * envlet.GiB, Granted: 3 * envlet.GiB,
		Cap: 32 * envlet.GiB, WorkingSet: 3 * envlet.GiB, OOMs: 2, Message: "node granted only 3GiB"}
	if got != want {
		t.Fatalf("failure event %+v, want %+v", got, want)
	}
	msg, _ := os.ReadFile(termLog)
	if !strings.Contains(string(msg), "MEM_NODE_EXHAUSTED") {
		t.Fatalf("termination message %q", msg)
	}
	f.waitReleased(t, "x", "MEM_NODE_EXHAUSTED")
}

// TestKilledByKernel: a task the kernel OOM-killed at its memory cap ends
// the environment by itself (its shell exits 137); the reason the
// controller finds afterwards is published, written where kubelet reads
// it and given to the arbiter, as for a failure the controller caught.
// When the cgroup is gone before the controller can count the kill (the
// systemd driver removes it with its last task), the TaskOOM runc's
// service publishes through the OOMTap counts, also when it comes after
// the exit.
func TestKilledByKernel(t *testing.T) {
	for _, tc := range []struct {
		name     string
		needSeen int // kills the controller must be told of
	}{
		{"counted by the controller", 0},
		{"reported by runc after the exit", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			tap := &OOMTap{Publisher: f.pub}
			tap.Notify(f.svc)
			ctx := context.Background()
			termLog := f.startKube(t, "x")
			f.ctrls["x"].kernelKill = &envlet.Failure{Reason: envlet.ReasonCapExceeded, Cap: 192 << 20, OOMs: 1,
				Message: "the kernel OOM-killed a task at the per-environment memory cap 192.0Mi"}
			f.ctrls["x"].needSeen = tc.needSeen
			close(f.runc.exited) // exit status 137, nobody asked
			want := []string{FailedEventTopic}
			if tc.needSeen > 0 {
				time.Sleep(oomWait / 5)
				if err := tap.Publish(ctx, runtime.TaskOOMEventTopic, &eventstypes.TaskOOM{ContainerID: "x"}); err != nil {
					t.Fatal(err)
				}
				want = []string{runtime.TaskOOMEventTopic, FailedEventTopic}
			}
			f.waitReleased(t, "x", envlet.ReasonCapExceeded)
			if msg, _ := os.ReadFile(termLog); !strings.Contains(string(msg), "MEM_CAP_EXCEEDED: the kernel OOM-killed") {
				t.Fatalf("termination message %q", msg)
			}
			if topics := f.pub.topics(); !slices.Equal(topics, want) {
				t.Fatalf("events %v, want %v", topics, want)
			}
			if len(f.runc.kills) != 0 {
				t.Fatalf("the shim killed an environment that had ended: %+v", f.runc.kills)
			}
		})
	}
}

// TestAskedKillNoOOMWait: a SIGKILL asked through Kill explains the
// init's exit by SIGKILL: the shim asks the controller once whether the
// kernel killed it and does not wait for runc to report an OOM kill; an
// exit by SIGKILL nobody asked for gets the second look after the wait.
func TestAskedKillNoOOMWait(t *testing.T) {
	for _, tc := range []struct {
		name  string
		asked bool
		calls int32
	}{
		{"asked", true, 1},
		{"unexplained", false, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.startKube(t, "x")
			if tc.asked {
				if _, err := f.svc.Kill(context.Background(), &taskAPI.KillRequest{ID: "x", Signal: uint32(unix.SIGKILL)}); err != nil {
					t.Fatal(err)
				}
			} else {
				close(f.runc.exited)
			}
			f.waitReleased(t, "x", "exited")
			if got := f.ctrls["x"].killedCalls.Load(); got != tc.calls {
				t.Fatalf("KilledByKernel called %d times, want %d", got, tc.calls)
			}
		})
	}
}

func TestUpdateMovesCap(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	if _, err := f.svc.Create(ctx, &taskAPI.CreateTaskRequest{ID: "x", Bundle: bundle(t, linuxSpec("x", nil))}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.svc.Start(ctx, &taskAPI.StartRequest{ID: "x"}); err != nil {
		t.Fatal(err)
	}
	quota, period, limit, shares := int64(300000), uint64(100000), int64(2*envlet.GiB), uint64(512)
	// What kubelet's in-place resize sends (containerd's CRI passes the
	// unified keys on).
	res := specs.LinuxResources{
		CPU:    &specs.LinuxCPU{Quota: &quota, Period: &period, Shares: &shares},
		Memory: &specs.LinuxMemory{Limit: &limit},
		Unified: map[string]string{"memory.low": "0", "memory.min": "0", "memory.oom.group": "1", "memory.swap.max": "0",
			"memory.high": "1610612736"},
	}
	b, _ := json.Marshal(&res)
	if _, err := f.svc.Update(ctx, &taskAPI.UpdateTaskRequest{ID: "x", Resources: &ptypes.Any{TypeUrl: "x", Value: b}}); err != nil {
		t.Fatal(err)
	}
	if c := f.ctrls["x"].caps; len(c) != 1 || c[0] != (envlet.Resources{CPU: 3, Memory: 2 * envlet.GiB}) {
		t.Fatalf("controller caps %v", c)
	}
	fwd := f.runc.updates[0]
	if fwd.CPU.Quota != nil || fwd.Memory.Limit != nil || fwd.CPU.Shares == nil || *fwd.CPU.Shares != 512 {
		t.Fatalf("forwarded to runc: %+v %+v", fwd.CPU, fwd.Memory)
	}
	// envlet turns memory.oom.group off and drives memory.high itself.
	if want := map[string]string{"memory.low": "0", "memory.min": "0", "memory.swap.max": "0"}; !maps.Equal(fwd.Unified, want) {
		t.Fatalf("unified resources forwarded to runc %v, want %v", fwd.Unified, want)
	}
	if n := f.ctrls["x"].rechecks.Load(); n != 1 {
		t.Fatalf("controller asked to recheck its limits %d times after the update, want 1", n)
	}
}

func TestConfigErrorFailsCreate(t *testing.T) {
	runc := newFakeRunc()
	svc := New(context.Background(), runc, &fakePublisher{}, Options{ConfigErr: errors.New("envlet.toml: unknown key cpus")})
	_, err := svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "x", Bundle: bundle(t, linuxSpec("x", nil))})
	if err = errgrpc.ToNative(err); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "cpus") {
		t.Fatalf("create with a broken config: %v", err)
	}
	if len(runc.calls) != 0 {
		t.Fatalf("runc called: %v", runc.calls)
	}
}

// TestUpdateUnchangedLimits: an update that resends the limits the
// environment was created with (kubelet's cpuset reconciliation) passes
// even when the controller cannot move its cap.
func TestUpdateUnchangedLimits(t *testing.T) {
	runc := newFakeRunc()
	arb := newFakeArbiter()
	svc := New(context.Background(), runc, &fakePublisher{}, Options{
		Policy: envlet.DefaultConfig(), Arbiter: arb, CheckCgroup: func(string) error { return nil },
		NewController: func(string, string, envlet.Config, envlet.Arbiter) (Controller, func() error, error) {
			return capless{}, nil, nil
		},
	})
	quota, period, limit := int64(400000), uint64(100000), int64(4*envlet.GiB)
	res := specs.LinuxResources{CPU: &specs.LinuxCPU{Quota: &quota, Period: &period}, Memory: &specs.LinuxMemory{Limit: &limit}}
	spec := linuxSpec("x", nil)
	spec.Linux.Resources = &res
	ctx := context.Background()
	if _, err := svc.Create(ctx, &taskAPI.CreateTaskRequest{ID: "x", Bundle: bundle(t, spec)}); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.Start(ctx, &taskAPI.StartRequest{ID: "x"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Delete(ctx, &taskAPI.DeleteRequest{ID: "x"}) })
	cpus := "0-1"
	res.CPU.Cpus = cpus
	b, _ := json.Marshal(&res)
	if _, err := svc.Update(ctx, &taskAPI.UpdateTaskRequest{ID: "x", Resources: &ptypes.Any{Value: b}}); err != nil {
		t.Fatalf("unchanged limits: %v", err)
	}
	if got := runc.updates[0].CPU.Cpus; got != cpus {
		t.Fatalf("cpuset not forwarded: %q", got)
	}
	limit *= 2
	b, _ = json.Marshal(&res)
	_, err := svc.Update(ctx, &taskAPI.UpdateTaskRequest{ID: "x", Resources: &ptypes.Any{Value: b}})
	if !errdefs.IsNotImplemented(errgrpc.ToNative(err)) {
		t.Fatalf("moving the cap of a controller without SetCap: %v, want NotImplemented", err)
	}
}

// capless is a controller without SetCap.
type capless struct{}

func (capless) Run(ctx context.Context) error                             { <-ctx.Done(); return nil }
func (capless) Status() envlet.Status                                     { return envlet.Status{} }
func (capless) TimelineSince(seq uint64) ([]envlet.TimelinePoint, uint64) { return nil, seq }

// TestEnvKeyNamespaced: ids are unique per containerd namespace only, so
// the arbiter knows environments as namespace/id; events keep the id.
func TestEnvKeyNamespaced(t *testing.T) {
	runc, pub, arb := newFakeRunc(), &fakePublisher{}, newFakeArbiter()
	arb.admit = func(env string, _ envlet.Resources) error {
		if env == "team-b/x" {
			return errdefs.ErrResourceExhausted
		}
		return nil
	}
	for _, ns := range []string{"team-a", "team-b"} {
		svc := New(namespaces.WithNamespace(context.Background(), ns), runc, pub, Options{Policy: envlet.DefaultConfig(), Arbiter: arb, CheckCgroup: func(string) error { return nil }})
		_, err := svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "x", Bundle: bundle(t, linuxSpec("x", nil))})
		if ns == "team-a" && err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := arb.admitted["team-a/x"]; !ok || len(arb.admitted) != 1 {
		t.Fatalf("admitted %v, want team-a/x", arb.admitted)
	}
	ev, ok := pub.evs[0].event.(*eventstypes.ContainerUpdate)
	if !ok {
		t.Fatalf("event %T", pub.evs[0].event)
	}
	if f, _ := ParseFailureEvent(ev); f.Env != "x" {
		t.Fatalf("failure event id %q, want the container id", f.Env)
	}
}

// capacityArbiter is a fakeArbiter that knows the node's size.
type capacityArbiter struct{ *fakeArbiter }

func (capacityArbiter) Capacity() (envlet.Resources, float64) {
	return envlet.Resources{CPU: 3, Memory: 5 * envlet.GiB}, 0.2
}

// TestEnvArbiter: the controller's release names why the shim ends the
// environment (finish's reason, else the guard's, else "exited", which
// lets the client take the controller's own failure), and the wrapper
// still tells the controller the node's size.
func TestEnvArbiter(t *testing.T) {
	for _, tc := range []struct{ ending, guard, want string }{
		{"", "", "exited"},
		{"", envlet.ReasonPidsExhausted, envlet.ReasonPidsExhausted},
		{envlet.ReasonOutputCapExceeded, "", envlet.ReasonOutputCapExceeded},
		{"deleted", "", "deleted"},
	} {
		arb := newFakeArbiter()
		a := envArbiter{arb, &env{ending: tc.ending, guardReason: tc.guard}}
		if err := a.Release(context.Background(), "x"); err != nil {
			t.Fatal(err)
		}
		if got, _ := arb.releasedReason("x"); got != tc.want {
			t.Errorf("ending %q, guard %q: released with %q, want %q", tc.ending, tc.guard, got, tc.want)
		}
	}
	var ns envlet.Arbiter = envArbiter{capacityArbiter{newFakeArbiter()}, &env{}}
	sizer, ok := ns.(envlet.NodeSizer)
	if !ok {
		t.Fatal("the wrapper hides envlet.NodeSizer")
	}
	if r, reserve := sizer.Capacity(); r.Memory != 5*envlet.GiB || reserve != 0.2 {
		t.Errorf("Capacity = %v %v, want the inner arbiter's", r, reserve)
	}
}
