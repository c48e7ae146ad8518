//go:build linux

package shim

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/lsm"
)

// LSMPollPeriod is how often the shim reads an environment's LSM denial
// counters; each increase is logged with the environment's id.
const LSMPollPeriod = time.Second

// lsmFallback logs, once per shim process, that environments run without
// BPF LSM rules; each of them also reports it in its status.
var lsmFallback sync.Once

// lsmUnavailable remembers, for the shim process's life, that the kernel
// refused BPF LSM programs (ErrUnavailable: no BPF LSM, or loading them
// denied): every later Create of the group would pay the failed load
// again (0.06-0.3 s here) for the same answer, which changes only with a
// reboot.
var lsmUnavailable struct {
	sync.Mutex
	err error
}

// NodeSockets are the node's unix sockets the shim knows from its
// environment: containerd's gRPC and ttrpc addresses (containerd passes
// them to every shim it starts).
func NodeSockets(getenv func(string) string) []string {
	var out []string
	for _, v := range []string{"GRPC_ADDRESS", "TTRPC_ADDRESS"} {
		if a := strings.TrimPrefix(getenv(v), "unix://"); strings.HasPrefix(a, "/") {
			out = append(out, a)
		}
	}
	return out
}

// lsmEnv is one environment's LSM rules, or their absence.
type lsmEnv struct {
	guard       *lsm.Guard // nil: BPF LSM unavailable, the environment runs without
	unavailable string     // why, when guard is nil

	stop, done chan struct{}
	once       sync.Once
	mu         sync.Mutex
	seen       map[string][2]uint64 // denials per protected path and kind, as last logged
	denied     int
}

// startLSM confines the created (not yet started) container id, whose
// init process is pid: its cgroup may neither connect to the node's
// sockets nor open protected paths. Where the kernel does not run BPF
// LSM programs the environment starts without them, which is logged and
// reported in its status; any other failure fails the Create.
func (s *Service) startLSM(ctx context.Context, id string, pid uint32) error {
	key := s.envKey(id)
	cg, err := lsm.ProcessCgroup(int(pid))
	if err != nil {
		return fmt.Errorf("LSM rules of %s: %w", id, err)
	}
	ps, missing, err := lsm.Resolve(s.opts.Guard.Protected)
	if err != nil {
		return fmt.Errorf("LSM rules of %s: %w", id, err)
	}
	l := &lsmEnv{stop: make(chan struct{}), done: make(chan struct{}), seen: map[string][2]uint64{}}
	lsmUnavailable.Lock()
	err = lsmUnavailable.err
	lsmUnavailable.Unlock()
	if err == nil {
		l.guard, err = lsm.New(cg, ps)
		if errors.Is(err, lsm.ErrUnavailable) {
			lsmUnavailable.Lock()
			lsmUnavailable.err = err
			lsmUnavailable.Unlock()
		}
	}
	switch {
	case errors.Is(err, lsm.ErrUnavailable):
		l.unavailable = err.Error()
		close(l.done)
		lsmFallback.Do(func() {
			log.G(ctx).WithError(err).Warn("lsm: environments run without BPF LSM rules on this node (sockets and protected paths are kept out of their mount namespaces only)")
		})
		log.G(ctx).WithField("env", key).Info("lsm: no BPF LSM rules")
	case errors.Is(err, lsm.ErrHookFull):
		return fmt.Errorf("LSM rules of %s: %w; [guard] lsm = \"off\" in the envlet config runs environments without them: %w", id, err, errdefs.ErrResourceExhausted)
	case err != nil:
		return fmt.Errorf("LSM rules of %s: %w", id, err)
	default:
		var paths []string
		for _, p := range ps {
			paths = append(paths, p.Path)
		}
		log.G(ctx).WithField("env", key).WithField("cgroup", cg.Dir).WithField("protected", paths).
			WithField("absent", missing).Info("lsm: rules attached")
		go l.run(log.WithLogger(context.WithoutCancel(s.ctx), log.G(s.ctx).WithField("env", key)))
	}
	s.mu.Lock()
	if old := s.lsm[id]; old != nil {
		defer old.close()
	}
	s.lsm[id] = l
	s.mu.Unlock()
	return nil
}

func (l *lsmEnv) run(ctx context.Context) {
	defer close(l.done)
	t := time.NewTimer(envlet.UntilTick(time.Now(), LSMPollPeriod))
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			l.poll(ctx)
			return
		case <-t.C:
			t.Reset(envlet.UntilTick(time.Now(), LSMPollPeriod))
			l.poll(ctx)
		}
	}
}

// poll logs every protected path whose denials grew since the last read.
func (l *lsmEnv) poll(ctx context.Context) {
	now, err := l.guard.Denials()
	if err != nil {
		log.G(ctx).WithError(err).Debug("lsm: read denials")
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	total := 0
	for path, c := range now {
		was := l.seen[path]
		for k, n := range c {
			total += int(n)
			if n > was[k] {
				log.G(ctx).WithField("kind", lsm.Kind(k).String()).WithField("path", path).
					WithField("denied", n-was[k]).WithField("total", n).Warn("lsm: denied")
			}
		}
		l.seen[path] = c
	}
	l.denied = total
}

func (l *lsmEnv) status(st *envlet.Status) {
	if l.guard == nil {
		st.LSMUnavailable = true
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	st.LSMDenied = l.denied
}

// close reads the counters a last time and detaches the programs.
func (l *lsmEnv) close() {
	l.once.Do(func() {
		if l.guard == nil {
			return
		}
		close(l.stop)
		<-l.done
		if err := l.guard.Close(); err != nil {
			log.G(context.Background()).WithError(err).Warn("lsm: detach")
		}
	})
}

// stopLSM detaches id's rules.
func (s *Service) stopLSM(id string) {
	s.mu.Lock()
	l := s.lsm[id]
	delete(s.lsm, id)
	s.mu.Unlock()
	if l != nil {
		l.close()
	}
}

// lsmStatus adds the environment's LSM denials, or the rules' absence, to
// its status (envlet_status_lsm_denied, envlet_status_lsm_unavailable at
// the arbiter).
type lsmStatus struct {
	Controller
	l *lsmEnv
}

func (w lsmStatus) Status() envlet.Status {
	st := w.Controller.Status()
	w.l.status(&st)
	return st
}
