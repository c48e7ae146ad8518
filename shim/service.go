//go:build linux

package shim

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/egress"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim/config"
)

// FailedEventTopic is the containerd event topic of a failed environment.
// Its payload is FailureEvent's: a containerd.events.ContainerUpdate with
// the fields of envlet.Failure as labels.
const FailedEventTopic = "/envlet/env/failed"

// ReasonAdmissionRejected is the failure reason of a Create the arbiter
// refused.
const ReasonAdmissionRejected = "ADMISSION_REJECTED"

// Arbiter is what the service needs from the arbiter client: the quota
// protocol, status reporting and releases that say why.
type Arbiter interface {
	envlet.Arbiter
	Track(env string, src arbiter.StatusSource)
	ReleaseReason(ctx context.Context, env, reason string) error
}

// Controller is the part of *envlet.Controller the service drives.
type Controller interface {
	Run(ctx context.Context) error
	Status() envlet.Status
	TimelineSince(seq uint64) ([]envlet.TimelinePoint, uint64)
}

// ControllerFactory builds the controller of one container. The default
// opens the cgroup with envlet.OpenCgroup and calls envlet.NewController.
type ControllerFactory func(env, cgroupsPath string, cfg envlet.Config, arb envlet.Arbiter) (Controller, func() error, error)

// Options configures New.
type Options struct {
	// Disabled runs every container unmanaged.
	Disabled bool
	// Policy is the node's controller configuration before per-container
	// limits and annotations.
	Policy envlet.Config
	// Node caps every environment.
	Node    envlet.Resources
	Arbiter Arbiter
	// NewController defaults to the real controller.
	NewController ControllerFactory
	// ConfigErr, when set, fails every Create: the node configuration
	// could not be loaded.
	ConfigErr error
	// Egress is the node's egress policy; nil confines no container.
	Egress *egress.Node
	// EgressLookup and NodeAddresses default to egress.LookupIP and
	// egress.NodeAddresses.
	EgressLookup  egress.Lookup
	NodeAddresses func() ([]netip.Prefix, error)
	// Guard is what every managed container runs under (seccomp, pids
	// and output caps); the zero value imposes nothing.
	Guard config.GuardLimits
	// CheckCgroup runs at Create on the cgroup runc made; an error fails
	// the Create. Defaults to envlet.CheckCgroup.
	CheckCgroup func(cgroupsPath string) error
	// Linger is how long a shim serving a group (NewManager) stays up
	// after its last container is deleted, so that a container started
	// meanwhile finds it alive; 0 exits at once, as runc's shim does.
	Linger time.Duration
	// Socket is the address of the group's socket this shim listens on
	// (Start's, groupSocketEnv), which a lingering shim removes when it
	// leaves; "" for none.
	Socket string
}

// Service is the envlet task service.
type Service struct {
	taskAPI.TTRPCTaskService // runc's, for everything not overridden

	ctx       context.Context
	ns        string
	publisher events.Publisher
	opts      Options

	mu       sync.Mutex
	creates  int // Create calls so far: a lingering Shutdown waits for quiet
	lingerer bool
	// unlisted: the group's socket is removed (linger); a later start of
	// the group makes a new shim, this one serves only the connections
	// it has.
	unlisted bool
	bundles  map[string]string // every container's bundle, by id
	created  map[string]bool   // every container a Create came for
	logDir   string            // the bundle whose log pipe is our stderr
	envs     map[string]*env
	egress   map[string]*egressEnv
	lsm      map[string]*lsmEnv
}

// env is one managed container.
type env struct {
	id      string // container id
	key     string // the environment's name at the arbiter: namespace/id
	cfg     envlet.Config
	cgroup  string
	termMsg string

	mu      sync.Mutex // guards cfg, ctrl, closeCg, runCtx, cancel (Start vs Update vs exit)
	ctrl    Controller
	closeCg func() error
	runCtx  context.Context // the controller's; ends when the environment does
	cancel  context.CancelFunc
	done    chan struct{} // closed when the controller has stopped
	reason  string        // why it failed; written before done closes
	once    sync.Once
	// cancelPushOut ends the wait for (or the rest of) a paused
	// environment's push-out: Resume calls it. Under mu.
	cancelPushOut context.CancelFunc
	// paused and pushedOut are its status's Paused and PushedOut; the
	// arbiter client reads them under its own lock, hence atomics.
	paused    atomic.Bool
	pushedOut atomic.Int64

	guard       *guard
	upper       string     // the writable layer's directory, "" if unknown
	eval        *evaluator // nil unless the spec holds an evaluator back
	bundle      string
	ioCtx       context.Context    // the output relays' (execs' too)
	ioCancel    context.CancelFunc // ends the relays' waits to open
	guardReason string             // why the guard failed it; under mu
	ending      string             // why finish ends it; under mu
	sigkilled   bool               // its init exited by SIGKILL; under mu
	// oomKills counts the kernel's OOM kills runc's service reported
	// (OOMTap); oomSeen gets a value at the first. Under mu.
	oomKills int
	oomSeen  chan struct{}
	// killAsked: a SIGKILL for the init came through Kill, which explains
	// its exit by SIGKILL. Under mu.
	killAsked bool
}

// envArbiter is the arbiter as one environment's controller sees it. The
// controller releases its lease when it stops, which is when finish
// stops it, before finish could release with the reason itself: the
// release names the reason finish ends the environment with (a guard's
// PIDS_EXHAUSTED, say, which the controller cannot know), so the
// arbiter's listing of ended environments shows it. With no reason of
// ours ("exited") the client takes the controller's own failure.
type envArbiter struct {
	Arbiter
	e *env
}

// Capacity passes the node's size through (envlet.NodeSizer), which the
// controller asks of its arbiter by a type assertion the wrapper would
// otherwise hide.
func (a envArbiter) Capacity() (envlet.Resources, float64) {
	if ns, ok := a.Arbiter.(envlet.NodeSizer); ok {
		return ns.Capacity()
	}
	return envlet.Resources{}, 0
}

// StartRank passes the node's start queue through (envlet.StartQueue),
// which the controller also finds by a type assertion.
func (a envArbiter) StartRank(ctx context.Context, env string, done bool) (int, error) {
	if q, ok := a.Arbiter.(envlet.StartQueue); ok {
		return q.StartRank(ctx, env, done)
	}
	return 0, fmt.Errorf("start rank %s: %w", env, errdefs.ErrNotImplemented)
}

func (a envArbiter) Release(ctx context.Context, env string) error {
	a.e.mu.Lock()
	// A guard kill can end the cgroup, and with it the controller,
	// before finish runs.
	reason := cmp.Or(a.e.ending, a.e.guardReason, "exited")
	a.e.mu.Unlock()
	return a.Arbiter.ReleaseReason(ctx, env, reason)
}

var _ taskAPI.TTRPCTaskService = (*Service)(nil)

// New wraps inner, runc's task service. ctx is the shim's context (it
// carries the namespace events are published in).
func New(ctx context.Context, inner taskAPI.TTRPCTaskService, publisher events.Publisher, opts Options) *Service {
	if opts.NewController == nil {
		opts.NewController = newController
	}
	if opts.CheckCgroup == nil {
		opts.CheckCgroup = envlet.CheckCgroup
	}
	ns, _ := namespaces.Namespace(ctx)
	// The shim runs in the bundle of the container it was started for,
	// whose log pipe pkg/shim made its stderr.
	logDir, _ := os.Getwd()
	return &Service{
		logDir:           logDir,
		TTRPCTaskService: inner,
		ctx:              ctx,
		ns:               ns,
		publisher:        publisher,
		opts:             opts,
		envs:             make(map[string]*env),
		bundles:          make(map[string]string),
		created:          make(map[string]bool),
		egress:           make(map[string]*egressEnv),
		lsm:              make(map[string]*lsmEnv),
	}
}

// envKey names a container at the arbiter. Container ids are unique per
// containerd namespace only, and one arbiter serves every namespace.
func (s *Service) envKey(id string) string {
	if s.ns == "" {
		return id
	}
	return s.ns + "/" + id
}

func newController(id, cgroupsPath string, cfg envlet.Config, arb envlet.Arbiter) (Controller, func() error, error) {
	cg, err := envlet.OpenCgroup(cgroupsPath)
	if err != nil {
		return nil, nil, fmt.Errorf("open cgroup %s: %w", cgroupsPath, err)
	}
	c, err := envlet.NewController(id, cg, cfg, arb)
	if err != nil {
		cg.Close()
		return nil, nil, err
	}
	return c, cg.Close, nil
}

// RegisterTTRPC serves this service, not the wrapped one, as the task API.
func (s *Service) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, s)
	return nil
}

func (s *Service) lookup(id string) *env {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.envs[id]
}

// Create admits the container with the arbiter before runc creates it, so
// a rejected container never exists.
func (s *Service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (*taskAPI.CreateTaskResponse, error) {
	s.mu.Lock()
	s.creates++
	s.bundles[r.ID] = r.Bundle
	s.created[r.ID] = true
	if s.logDir == "" {
		// A lingering shim whose containers were all deleted has no
		// log pipe containerd reads: this container's is.
		if err := s.attachLog(r.Bundle); err != nil {
			log.G(ctx).WithError(err).WithField("id", r.ID).Warn("envlet: log through the new container's log pipe")
		}
	}
	s.mu.Unlock()
	ph := phases{t: time.Now()}
	if s.opts.ConfigErr != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet shim: %v: %w", s.opts.ConfigErr, errdefs.ErrFailedPrecondition))
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	if !s.opts.Disabled {
		if err := checkHostNetwork(spec, s.opts.Guard.HostNetwork); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: %s: %w", r.ID, err))
		}
	}
	eg, err := s.egressPolicy(ctx, spec)
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("egress policy of %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument))
	}
	if eg != nil {
		if err := prepareEgress(r.Bundle, spec); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("%s: %w", r.ID, err))
		}
	}
	if !managed(spec, s.opts.Disabled) {
		if _, ok := spec.Annotations[AnnEvaluatorLayers]; ok {
			// Held-back evaluator layers need the managed path; running
			// without it would show the answers.
			return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: %s names evaluator layers but runs unmanaged: %w", r.ID, errdefs.ErrFailedPrecondition))
		}
		resp, err := s.TTRPCTaskService.Create(ctx, r)
		if err == nil && eg != nil {
			if err = s.startEgress(ctx, r.ID, resp.Pid, eg); err != nil {
				s.abortCreate(ctx, r.ID)
				return nil, errgrpc.ToGRPC(err)
			}
		}
		return resp, err
	}
	cfg, err := envConfig(s.opts.Policy, s.opts.Node, spec)
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet configuration of %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument))
	}
	e := &env{id: r.ID, key: s.envKey(r.ID), cfg: cfg, cgroup: cgroupsPath(spec), termMsg: terminationMessageFile(spec), done: make(chan struct{}), oomSeen: make(chan struct{}, 1)}
	if e.cgroup == "" {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: container %s has no cgroupsPath: %w", r.ID, errdefs.ErrInvalidArgument))
	}
	limits, err := containerGuard(s.opts.Guard, spec)
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet guard of %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument))
	}
	changed, err := harden(spec, s.opts.Guard.Seccomp, limits)
	if err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: harden spec of %s: %w", r.ID, err))
	}
	fwd := proto.Clone(r).(*taskAPI.CreateTaskRequest)
	e.upper = upperDir(fwd.Rootfs)
	if e.eval, err = holdBackEvaluator(spec, fwd.Rootfs, r.Bundle); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument))
	}
	if e.eval != nil {
		changed = append(changed, "evaluator held back")
	}
	createFailed := func() {
		if e.eval != nil {
			if err := e.eval.unmount(); err != nil {
				log.G(ctx).WithError(err).WithField("id", r.ID).Warn("envlet: unmount evaluator after failed create")
			}
		}
	}
	if len(changed) > 0 {
		if err := writeSpec(r.Bundle, spec); err != nil {
			createFailed()
			return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: %s: %w", r.ID, err))
		}
		log.G(ctx).WithField("id", r.ID).WithField("added", changed).Info("envlet: spec hardened")
	}
	e.guard = &guard{env: r.ID, limits: limits, grace: s.opts.Guard.PidsGrace, trip: func(f envlet.Failure) { s.guardFail(e, f) }}
	ph.mark("spec")
	if err := s.opts.Arbiter.Admit(ctx, e.key, cfg.Initial, envlet.WithPriority(cfg.Priority), envlet.WithTier(cfg.Tier)); err != nil {
		createFailed()
		if errdefs.IsResourceExhausted(err) {
			f := envlet.Failure{
				Env: r.ID, Reason: ReasonAdmissionRejected,
				Requested: cfg.Initial.Memory, Cap: cfg.Cap.Memory,
				Message: err.Error(),
			}
			s.publishFailure(f)
			return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: %s: admit %s with %v: %w", ReasonAdmissionRejected, r.ID, cfg.Initial, err))
		}
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: admit %s: %w", r.ID, err))
	}
	ph.mark("admit")
	ioCtx, ioCancel := context.WithCancel(log.WithLogger(context.WithoutCancel(s.ctx), log.G(s.ctx).WithField("env", e.id)))
	e.bundle, e.ioCtx, e.ioCancel = r.Bundle, ioCtx, ioCancel
	if err := e.relayStdio(ioCtx, r.Bundle, "", &fwd.Stdout, &fwd.Stderr); err != nil {
		ioCancel()
		createFailed()
		if rerr := s.opts.Arbiter.ReleaseReason(ctx, e.key, "create failed"); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("id", r.ID).Warn("envlet: release after failed create")
		}
		return nil, errgrpc.ToGRPC(err)
	}
	ph.mark("relay")
	resp, err := s.TTRPCTaskService.Create(ctx, fwd)
	ph.mark("runc")
	if err != nil {
		ioCancel()
		createFailed()
		if rerr := s.opts.Arbiter.ReleaseReason(ctx, e.key, "create failed"); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("id", r.ID).Warn("envlet: release after failed create")
		}
		return nil, err
	}
	// runc has made the container; from here a failure deletes it, ends
	// its stdio relay and returns its admission.
	failCreated := func(reason string, err error) (*taskAPI.CreateTaskResponse, error) {
		s.abortCreate(ctx, r.ID)
		ioCancel()
		createFailed()
		if rerr := s.opts.Arbiter.ReleaseReason(ctx, e.key, reason); rerr != nil {
			log.G(ctx).WithError(rerr).WithField("id", r.ID).Warn("envlet: release after failed create")
		}
		return nil, errgrpc.ToGRPC(err)
	}
	// A container envlet cannot limit (a delegated subtree without the
	// cpu or memory controller) must not run at all, rather than run
	// unlimited.
	if err := s.opts.CheckCgroup(e.cgroup); err != nil {
		return failCreated("cgroup unusable", fmt.Errorf("envlet: container %s: cgroup %s: %v: %w", r.ID, e.cgroup, err, errdefs.ErrFailedPrecondition))
	}
	ph.mark("cgroup")
	if eg != nil {
		// The init process waits for Start: no user code has run yet.
		if err := s.startEgress(ctx, r.ID, resp.Pid, eg); err != nil {
			return failCreated("egress policy failed", err)
		}
		ph.mark("egress")
	}
	if s.opts.Guard.LSM {
		if err := s.startLSM(ctx, r.ID, resp.Pid); err != nil {
			s.stopEgress(r.ID)
			return failCreated("lsm rules failed", err)
		}
		ph.mark("lsm")
	}
	s.mu.Lock()
	s.envs[r.ID] = e
	s.mu.Unlock()
	log.G(ctx).WithField("id", r.ID).WithField("phases", ph.String()).Info("envlet: created")
	return resp, nil
}

// phases times the steps of a Create for its log line, which is how
// BenchmarkStartOverhead attributes the shim's time to them.
type phases struct {
	t   time.Time
	out []string
}

func (p *phases) mark(name string) {
	now := time.Now()
	p.out = append(p.out, fmt.Sprintf("%s=%.1fms", name, float64(now.Sub(p.t).Microseconds())/1000))
	p.t = now
}

func (p *phases) String() string { return strings.Join(p.out, " ") }

// abortCreate deletes a container created by runc whose Create fails
// afterwards: it never ran user code.
func (s *Service) abortCreate(ctx context.Context, id string) {
	if _, err := s.TTRPCTaskService.Delete(ctx, &taskAPI.DeleteRequest{ID: id}); err != nil {
		log.G(ctx).WithError(err).WithField("id", id).Error("envlet: delete after failed create")
	}
}

// Start starts the controller on the container's cgroup (created by runc
// in Create) just before the container's process runs.
func (s *Service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	e := s.lookup(r.ID)
	if r.ExecID != "" || e == nil {
		return s.TTRPCTaskService.Start(ctx, r)
	}
	e.mu.Lock()
	if e.ctrl != nil {
		e.mu.Unlock()
		return s.TTRPCTaskService.Start(ctx, r)
	}
	ctrl, closeCg, err := s.opts.NewController(e.key, e.cgroup, e.cfg, envArbiter{s.opts.Arbiter, e})
	if err != nil {
		e.mu.Unlock()
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: controller for %s: %w", r.ID, err))
	}
	var src Controller = ctrl
	s.mu.Lock()
	if eg := s.egress[e.id]; eg != nil {
		src = egressStatus{src, eg}
	}
	if l := s.lsm[e.id]; l != nil {
		src = lsmStatus{src, l}
	}
	s.mu.Unlock()
	src = pauseStatus{src, e}
	s.opts.Arbiter.Track(e.key, src)
	runCtx, cancel := context.WithCancel(log.WithLogger(context.WithoutCancel(s.ctx), log.G(s.ctx).WithField("env", e.id)))
	e.ctrl, e.closeCg, e.runCtx, e.cancel = ctrl, closeCg, runCtx, cancel
	e.mu.Unlock()
	go s.runController(runCtx, e, ctrl)
	if e.guard.limits.pids > 0 {
		if dir, err := envlet.PidsDir(e.cgroup); err != nil {
			// The limit holds; only its report is missing.
			log.G(runCtx).WithError(err).Warn("envlet: fork bombs will be contained but not reported")
		} else {
			go e.guard.watchPids(runCtx, dir)
		}
	}
	go e.guard.watchWritable(runCtx, e.upper)

	resp, err := s.TTRPCTaskService.Start(ctx, r)
	if err != nil {
		s.finish(e, "start failed")
		return nil, err
	}
	// The init process's exit ends the environment, whether or not
	// anybody deletes the task soon.
	go func() {
		w, err := s.TTRPCTaskService.Wait(context.WithoutCancel(s.ctx), &taskAPI.WaitRequest{ID: e.id})
		if err == nil && w.ExitStatus == 128+uint32(unix.SIGKILL) {
			e.mu.Lock()
			e.sigkilled = true
			e.mu.Unlock()
		}
		s.finish(e, "exited")
	}()
	return resp, nil
}

func (s *Service) runController(ctx context.Context, e *env, ctrl Controller) {
	defer close(e.done)
	err := ctrl.Run(ctx)
	var fe *envlet.FailureError
	switch {
	case errors.As(err, &fe):
		e.reason = fe.Reason
		s.fail(ctx, e, fe)
	case err != nil && ctx.Err() == nil:
		// The controller stopped on its own (the cgroup vanished with the
		// task, typically); the task runs on at its last limits.
		log.G(ctx).WithError(err).Error("envlet: controller stopped")
	}
}

// finish stops e's controller and returns its grant, once.
func (s *Service) finish(e *env, reason string) {
	e.once.Do(func() {
		e.mu.Lock()
		if e.guardReason != "" {
			reason = e.guardReason
		}
		e.ending = reason
		cancel, closeCg, ctrl, killed := e.cancel, e.closeCg, e.ctrl, e.sigkilled && e.guardReason == ""
		asked := e.killAsked
		e.mu.Unlock()
		if cancel != nil {
			cancel()
			<-e.done
			if kc, ok := ctrl.(KernelKillReporter); ok && killed && e.reason == "" {
				f := kc.KilledByKernel(e.waitOOMs(0))
				if f == nil && !asked {
					f = kc.KilledByKernel(e.waitOOMs(oomWait))
				}
				if f != nil {
					// The kernel ended it at a limit before the
					// controller could: say so, as fail would have.
					e.reason = f.Reason
					log.G(s.ctx).WithField("id", e.id).WithField("reason", f.Reason).Error("envlet: " + f.Message)
					s.report(context.WithoutCancel(s.ctx), e, *f)
				}
			}
			if closeCg != nil {
				_ = closeCg()
			}
		}
		if e.reason != "" {
			reason = e.reason
		}
		ctx := context.WithoutCancel(s.ctx)
		if err := s.opts.Arbiter.ReleaseReason(ctx, e.key, reason); err != nil {
			log.G(ctx).WithError(err).WithField("id", e.id).Warn("envlet: release")
		}
	})
}

// sawOOM counts a kernel OOM kill in container id (OOMTap).
func (s *Service) sawOOM(id string) {
	e := s.lookup(id)
	if e == nil {
		return
	}
	e.mu.Lock()
	e.oomKills++
	e.mu.Unlock()
	select {
	case e.oomSeen <- struct{}{}:
	default:
	}
}

// oomWait is how long finish waits, after an exit by SIGKILL the
// controller cannot explain, for runc's service to report an OOM kill: it
// reads memory.events when the kernel signals it, which may come after
// the exit is seen.
const oomWait = 250 * time.Millisecond

// Kill notes a SIGKILL asked for an environment's init, so that its exit
// by SIGKILL is not taken for an unexplained one (finish then does not
// wait for an OOM report), and passes the request on.
func (s *Service) Kill(ctx context.Context, r *taskAPI.KillRequest) (*ptypes.Empty, error) {
	if r.ExecID == "" && r.Signal == uint32(unix.SIGKILL) {
		if e := s.lookup(r.ID); e != nil {
			e.mu.Lock()
			e.killAsked = true
			e.mu.Unlock()
		}
	}
	return s.TTRPCTaskService.Kill(ctx, r)
}

// KernelKillReporter is implemented by controllers that can tell, once
// stopped, that the kernel OOM-killed a task of the environment at its
// memory cap or at the controller's own limit
// (envlet.Controller.KilledByKernel).
type KernelKillReporter interface {
	// KilledByKernel gets the OOM kills the shim saw reported.
	KilledByKernel(seen int) *envlet.Failure
}

// waitOOMs returns the OOM kills reported for e, waiting up to d for a
// first one.
func (e *env) waitOOMs(d time.Duration) int {
	e.mu.Lock()
	n := e.oomKills
	e.mu.Unlock()
	if n > 0 || d <= 0 {
		return n
	}
	select {
	case <-e.oomSeen:
	case <-time.After(d):
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.oomKills
}

// report publishes e's failure and writes it to the termination message.
func (s *Service) report(ctx context.Context, e *env, f envlet.Failure) {
	f.Env = e.id
	s.publishFailure(f)
	if e.termMsg != "" {
		msg := fmt.Sprintf("envlet: %s: %s\n", f.Reason, f.Message)
		if err := os.WriteFile(e.termMsg, []byte(msg), 0o644); err != nil {
			log.G(ctx).WithError(err).Warn("envlet: write termination message")
		}
	}
}

// fail ends an environment loudly, in the order a client can rely on: the
// reason is published and written to the termination message before the
// task dies, so whoever sees the exit can already read why.
func (s *Service) fail(ctx context.Context, e *env, fe *envlet.FailureError) {
	log.G(ctx).WithField("reason", fe.Reason).WithField("requested", fe.Requested).
		WithField("granted", fe.Granted).WithField("ooms", fe.OOMs).Error("envlet: environment failed; killing it")
	f := fe.Failure
	if f.Message == "" {
		f.Message = fe.Error()
	}
	s.report(ctx, e, f)
	// CRI reports Reason=OOMKilled only after /tasks/oom; the kernel may
	// not have OOM-killed anything (v1 refuses, or the task was paused), so
	// say it ourselves. A guard failure is not about memory.
	if envlet.IsMemoryReason(f.Reason) {
		if err := s.publisher.Publish(s.ctx, runtime.TaskOOMEventTopic, &eventstypes.TaskOOM{ContainerID: e.id}); err != nil {
			log.G(ctx).WithError(err).Warn("envlet: publish oom event")
		}
	}
	kctx, cancel := context.WithTimeout(context.WithoutCancel(s.ctx), 10*time.Second)
	defer cancel()
	if _, err := s.TTRPCTaskService.Kill(kctx, &taskAPI.KillRequest{ID: e.id, Signal: uint32(unix.SIGKILL), All: true}); err != nil {
		log.G(ctx).WithError(err).Error("envlet: kill failed environment")
	}
}

// FailureEvent encodes f as the payload of FailedEventTopic: a
// containerd.events.ContainerUpdate (containerd's own event type, which
// every containerd client registers, so `ctr events` prints it) whose
// labels carry the fields of envlet.Failure under their JSON names (id is
// the event's ID). A google.protobuf.Struct would be the natural type,
// but ctr does not link it and prints "cannot unmarshal an event from
// Any" instead of the reason.
func FailureEvent(f envlet.Failure) *eventstypes.ContainerUpdate {
	return &eventstypes.ContainerUpdate{ID: f.Env, Labels: map[string]string{
		"reason":    f.Reason,
		"message":   f.Message,
		"requested": strconv.FormatInt(f.Requested, 10),
		"granted":   strconv.FormatInt(f.Granted, 10),
		"cap":       strconv.FormatInt(f.Cap, 10),
		"ws":        strconv.FormatInt(f.WorkingSet, 10),
		"ooms":      strconv.Itoa(f.OOMs),
	}}
}

// ParseFailureEvent decodes a FailedEventTopic payload.
func ParseFailureEvent(ev *eventstypes.ContainerUpdate) (envlet.Failure, error) {
	l := ev.GetLabels()
	f := envlet.Failure{Env: ev.GetID(), Reason: l["reason"], Message: l["message"]}
	if f.Reason == "" {
		return f, fmt.Errorf("failure event for %s has no reason: %w", f.Env, errdefs.ErrInvalidArgument)
	}
	for _, n := range []struct {
		key string
		dst *int64
	}{{"requested", &f.Requested}, {"granted", &f.Granted}, {"cap", &f.Cap}, {"ws", &f.WorkingSet}} {
		v, err := strconv.ParseInt(l[n.key], 10, 64)
		if err != nil {
			return f, fmt.Errorf("failure event for %s: label %s=%q: %w", f.Env, n.key, l[n.key], errdefs.ErrInvalidArgument)
		}
		*n.dst = v
	}
	ooms, err := strconv.Atoi(l["ooms"])
	if err != nil {
		return f, fmt.Errorf("failure event for %s: label ooms=%q: %w", f.Env, l["ooms"], errdefs.ErrInvalidArgument)
	}
	f.OOMs = ooms
	return f, nil
}

func (s *Service) publishFailure(f envlet.Failure) {
	if err := s.publisher.Publish(s.ctx, FailedEventTopic, FailureEvent(f)); err != nil {
		log.G(s.ctx).WithError(err).WithField("id", f.Env).Error("envlet: publish failure event")
	}
}

// Update applies kubelet's resource changes. The controller owns the CPU
// quota and memory limit, so new limits become the environment's cap
// instead of being written to the cgroup; everything else goes to runc.
func (s *Service) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*ptypes.Empty, error) {
	e := s.lookup(r.ID)
	if e == nil || r.Resources == nil {
		return s.TTRPCTaskService.Update(ctx, r)
	}
	var res specs.LinuxResources
	if err := json.Unmarshal(r.Resources.GetValue(), &res); err != nil {
		return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: decode resources of %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument))
	}
	limits := specLimits(&res)
	if res.CPU != nil {
		res.CPU.Quota, res.CPU.Period = nil, nil
	}
	if res.Memory != nil {
		res.Memory.Limit, res.Memory.Swap = nil, nil
	}
	// The files envlet drives are its own; kubelet sends
	// memory.oom.group=1 with every update, which envlet turns off.
	for _, k := range envletFiles {
		delete(res.Unified, k)
	}
	if limits.CPU > 0 || limits.Memory > 0 {
		if err := s.updateBounds(ctx, e, limits); err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
	}
	b, err := json.Marshal(&res)
	if err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	fwd := &taskAPI.UpdateTaskRequest{
		ID:          r.ID,
		Resources:   &ptypes.Any{TypeUrl: r.Resources.GetTypeUrl(), Value: b},
		Annotations: r.Annotations,
	}
	resp, err := s.TTRPCTaskService.Update(ctx, fwd)
	// Whatever runc did, with its systemd driver systemd now rewrites the
	// cgroup from the scope's properties: memory.high back to max,
	// memory.max and the CPU quota to the container's creation values
	// (kubelet's in-place resize lost 3 of 10 pods to a kernel OOM kill
	// at the old limit in tests/kube). The controller puts its limits
	// back.
	e.mu.Lock()
	ctrl := e.ctrl
	e.mu.Unlock()
	if rc, ok := ctrl.(LimitRechecker); ok {
		rc.Recheck()
	}
	return resp, err
}

// envletFiles are the cgroup files envlet drives; an Update's unified
// resources do not reach them.
var envletFiles = []string{"memory.high", "memory.max", "memory.oom.group", "cpu.max", "cpu.max.burst"}

// LimitRechecker is implemented by controllers that can check that their
// limits are still in force (envlet.Controller.Recheck).
type LimitRechecker interface {
	Recheck()
}

// BoundsSetter is implemented by controllers whose cap can move while
// they run (kubelet's in-place resize).
type BoundsSetter interface {
	SetCap(envlet.Resources) error
}

// updateBounds makes limits (zero fields unchanged, never above the node)
// the environment's new cap.
func (s *Service) updateBounds(ctx context.Context, e *env, limits envlet.Resources) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	next := e.cfg.Cap
	if limits.CPU > 0 {
		next.CPU = limits.CPU
	}
	if limits.Memory > 0 {
		next.Memory = limits.Memory
	}
	if s.opts.Node.CPU > 0 {
		next.CPU = min(next.CPU, s.opts.Node.CPU)
	}
	if s.opts.Node.Memory > 0 {
		next.Memory = min(next.Memory, s.opts.Node.Memory)
	}
	if next == e.cfg.Cap {
		// kubelet resends unchanged limits with every update (e.g. the
		// CPU manager's cpuset reconciliation): nothing moves.
		return nil
	}
	if e.ctrl == nil {
		// Not started yet: the controller will be built with the new cap.
		e.cfg.Cap = next
		e.cfg.Initial.CPU = min(e.cfg.Initial.CPU, next.CPU)
		e.cfg.Initial.Memory = min(e.cfg.Initial.Memory, next.Memory)
		return nil
	}
	bs, ok := e.ctrl.(BoundsSetter)
	if !ok {
		return fmt.Errorf("envlet: %s: changing the cpu/memory limits of a running environment: %w", e.id, errdefs.ErrNotImplemented)
	}
	if err := bs.SetCap(next); err != nil {
		return fmt.Errorf("envlet: %s: set cap %v: %w", e.id, next, err)
	}
	log.G(ctx).WithField("id", e.id).WithField("cap", next.String()).Info("envlet: cap updated")
	e.cfg.Cap = next
	return nil
}

// Shutdown ends the shim once it serves no container (runc's decides).
// A shared shim waits for Linger without a Create first: containerd sends
// Shutdown after deleting each container, and between a later
// container's `start` finding this shim's socket alive and its Create
// arriving, an immediate exit would fail that Create.
func (s *Service) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*ptypes.Empty, error) {
	if s.opts.Linger <= 0 {
		return s.TTRPCTaskService.Shutdown(ctx, r)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.lingerer {
		s.lingerer = true
		go s.linger(context.WithoutCancel(ctx), r)
	}
	return &ptypes.Empty{}, nil
}

// linger asks runc's service to shut down after Linger without a Create.
// Before it does, it removes the group's socket under the group's lock
// (a start of the group then makes a new shim instead of joining one
// that is leaving), unless a start has returned this shim for a
// container whose Create has not come yet.
func (s *Service) linger(ctx context.Context, r *taskAPI.ShutdownRequest) {
	s.mu.Lock()
	seen := s.creates
	s.mu.Unlock()
	for {
		time.Sleep(s.opts.Linger)
		s.mu.Lock()
		if s.creates != seen {
			seen = s.creates
			s.mu.Unlock()
			continue
		}
		empty := len(s.bundles) == 0
		s.mu.Unlock()
		// Only a shim that serves no container leaves: with containers
		// left (a pod's sandbox), runc's Shutdown below returns at once.
		if empty && s.opts.Socket != "" && !s.unlisted && !s.unlist(ctx, seen) {
			s.mu.Lock()
			seen = s.creates
			s.mu.Unlock()
			continue
		}
		s.mu.Lock()
		if s.creates != seen {
			seen = s.creates
			s.mu.Unlock()
			continue
		}
		s.lingerer = false
		s.mu.Unlock()
		// Returns without exiting while runc still holds a container; the
		// next delete's Shutdown starts another wait.
		if _, err := s.TTRPCTaskService.Shutdown(ctx, r); err != nil {
			log.G(ctx).WithError(err).Warn("envlet: shutdown")
		}
		return
	}
}

// joinPatience is how long a leaving shim waits for the Create of a
// container whose start returned it: containerd sends it within
// milliseconds on an idle node, seconds on a crowded one, never if it
// gave the container up.
const joinPatience = 30 * time.Second

// unlist removes the group's socket, under the group's lock, when no
// Create came since seen, no container is left and every start that
// returned this shim has had its Create (or gave up, joinPatience); it
// reports whether it did. A start holds the same lock while it finds the
// socket alive and records its join, so none can return this shim after
// the socket is gone: the next one makes a new shim.
func (s *Service) unlist(ctx context.Context, seen int) bool {
	unlock, err := lockGroupSocket(s.opts.Socket)
	if err != nil {
		log.G(ctx).WithError(err).Warn("envlet: leaving shim keeps its socket")
		return true
	}
	defer unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.creates != seen || len(s.bundles) > 0 {
		return false
	}
	pending, last, err := pendingJoins(s.opts.Socket, s.created)
	if err != nil {
		log.G(ctx).WithError(err).Warn("envlet: leaving shim keeps its socket")
		return false
	}
	if len(pending) > 0 {
		if time.Since(last) < joinPatience {
			return false
		}
		log.G(ctx).WithField("ids", pending).Warn("envlet: leaving shim: containers joined it and never came")
	}
	if err := os.Remove(joinsPath(s.opts.Socket)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.G(ctx).WithError(err).Warn("envlet: remove the group's joins")
	}
	if err := shim.RemoveSocket(s.opts.Socket); err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.G(ctx).WithError(err).Warn("envlet: remove the group's socket")
	}
	s.unlisted = true
	return true
}

// Delete stops the controller of an init process's container before runc
// deletes it.
func (s *Service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	resp, err := s.TTRPCTaskService.Delete(ctx, r)
	if err != nil || r.ExecID != "" {
		return resp, err
	}
	s.handOverLog(ctx, r.ID)
	s.stopEgress(r.ID)
	s.stopLSM(r.ID)
	s.mu.Lock()
	e := s.envs[r.ID]
	delete(s.envs, r.ID)
	s.mu.Unlock()
	if e != nil {
		s.finish(e, "deleted")
		e.ioCancel()
		if e.eval != nil {
			if err := e.eval.unmount(); err != nil {
				log.G(ctx).WithError(err).WithField("id", r.ID).Warn("envlet: unmount evaluator")
			}
		}
	}
	return resp, nil
}

// handOverLog moves the shim's log (its stderr) to the log pipe of
// another container it serves when the container id, whose pipe it is,
// is deleted: containerd reads a container's pipe only until it deletes
// the container, and a shared shim serves the others on. With none left,
// the next container's Create takes the log (a lingering shim).
func (s *Service) handOverLog(ctx context.Context, id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	gone := s.bundles[id]
	delete(s.bundles, id)
	if gone == "" || gone != s.logDir {
		return
	}
	s.logDir = ""
	for next, dir := range s.bundles {
		if err := s.attachLog(dir); err != nil {
			log.G(ctx).WithError(err).WithField("id", next).Warn("envlet: open the log pipe of another container")
			continue
		}
		log.G(ctx).WithField("from", id).WithField("to", next).Info("envlet: shim log moved")
		return
	}
}

// attachLog makes the log pipe of bundle dir the shim's stderr, where
// its log goes. containerd opens a bundle's pipe for reading before it
// starts or joins the shim for the container, and keeps it open while
// the container lives, so the open does not block. Called with s.mu held.
func (s *Service) attachLog(dir string) error {
	fd, err := unix.Open(filepath.Join(dir, "log"), unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// Blocking writes, as on the pipe we were started with.
	_ = unix.SetNonblock(fd, false)
	if err := unix.Dup3(fd, int(os.Stderr.Fd()), 0); err != nil {
		return fmt.Errorf("move the shim's log: %w", err)
	}
	s.logDir = dir
	return nil
}

// Exec relays the new process's output through the environment's output
// cap, and mounts the held-back evaluator before the first evaluator
// process (EvaluatorEnv) runs.
func (s *Service) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (*ptypes.Empty, error) {
	e := s.lookup(r.ID)
	if e == nil {
		return s.TTRPCTaskService.Exec(ctx, r)
	}
	if e.eval != nil && r.Spec != nil {
		isEval, err := isEvaluatorExec(r.Spec.GetValue())
		if err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: exec %s in %s: %v: %w", r.ExecID, r.ID, err, errdefs.ErrInvalidArgument))
		}
		if isEval {
			if err := e.eval.mount(); err != nil {
				return nil, errgrpc.ToGRPC(fmt.Errorf("envlet: evaluator exec %s in %s: %w", r.ExecID, r.ID, err))
			}
			log.G(ctx).WithField("id", r.ID).WithField("exec", r.ExecID).Info("envlet: evaluator mounted")
		}
	}
	fwd := proto.Clone(r).(*taskAPI.ExecProcessRequest)
	if err := e.relayStdio(e.ioCtx, e.bundle, r.ExecID+"-", &fwd.Stdout, &fwd.Stderr); err != nil {
		return nil, errgrpc.ToGRPC(err)
	}
	return s.TTRPCTaskService.Exec(ctx, fwd)
}

// relayStdio replaces stdout and stderr with the guard's counting relays.
func (e *env) relayStdio(ctx context.Context, dir, prefix string, stdout, stderr *string) error {
	var err error
	if *stdout, err = e.guard.relay(ctx, dir, "envlet-"+prefix+"stdout", *stdout); err != nil {
		return fmt.Errorf("envlet: %s: %w", e.id, err)
	}
	if *stderr, err = e.guard.relay(ctx, dir, "envlet-"+prefix+"stderr", *stderr); err != nil {
		return fmt.Errorf("envlet: %s: %w", e.id, err)
	}
	return nil
}

// guardFail ends e for a guard limit, once, the way the controller ends it
// for memory.
func (s *Service) guardFail(e *env, f envlet.Failure) {
	e.mu.Lock()
	if e.guardReason == "" {
		e.guardReason = f.Reason
	}
	e.mu.Unlock()
	ctx := log.WithLogger(context.WithoutCancel(s.ctx), log.G(s.ctx).WithField("env", e.id))
	s.fail(ctx, e, &envlet.FailureError{Failure: f})
}
