package shim

import (
	"context"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	ptypes "github.com/containerd/containerd/v2/pkg/protobuf/types"
	"github.com/containerd/log"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/pause"
)

// Pause freezes the container (runc's Pause). An environment that stays
// paused for its pause-push-out-after then has its memory pushed out to
// the node's swap, so a parked environment holds little RAM; a shorter
// pause (an inspection, a checkpoint) costs nothing more than the freeze
// and does not fault its memory back in after.
func (s *Service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	resp, err := s.TTRPCTaskService.Pause(ctx, r)
	if err != nil {
		return resp, err
	}
	if e := s.lookup(r.ID); e != nil {
		e.paused.Store(true)
		s.pushOutLater(e)
	}
	return resp, nil
}

// Resume stops a push-out that is waiting or under way, then thaws the
// container (runc's Resume). The pages pushed out come back as its tasks
// touch them.
func (s *Service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	e := s.lookup(r.ID)
	if e != nil {
		e.mu.Lock()
		if e.cancelPushOut != nil {
			e.cancelPushOut()
			e.cancelPushOut = nil
		}
		e.mu.Unlock()
	}
	resp, err := s.TTRPCTaskService.Resume(ctx, r)
	if err == nil && e != nil {
		e.paused.Store(false)
	}
	return resp, err
}

// pushOutLater pushes e's memory out once it has been paused for its
// PausePushOutAfter, unless Resume or its end comes first.
func (s *Service) pushOutLater(e *env) {
	e.mu.Lock()
	after, runCtx := e.cfg.PausePushOutAfter, e.runCtx
	if after <= 0 || runCtx == nil || e.cancelPushOut != nil {
		e.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(runCtx)
	e.cancelPushOut = cancel
	e.mu.Unlock()

	go func() {
		t := time.NewTimer(after)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		l := log.G(ctx)
		dir, err := envlet.MemoryDir(e.cgroup)
		if err != nil {
			l.WithError(err).Warn("envlet: paused environment: memory not pushed out")
			return
		}
		rep, err := pause.PushOut(ctx, dir)
		if err != nil {
			if ctx.Err() == nil {
				l.WithError(err).Warn("envlet: paused environment: memory not pushed out")
			}
			return
		}
		e.pushedOut.Store(rep.PushedOut())
		l.WithFields(log.Fields{
			"before": envlet.FormatBytes(rep.Before),
			"after":  envlet.FormatBytes(rep.After),
			"swap":   envlet.FormatBytes(rep.SwapAfter),
			"zswap":  envlet.FormatBytes(rep.ZswapAfter),
			"took":   rep.Reclaim.Round(time.Millisecond).String(),
		}).Info("envlet: paused environment's memory pushed out")
	}()
}

// pauseStatus adds whether the environment is paused, and what its last
// pause pushed out, to its status (envlet_status_paused,
// envlet_status_pushed_out at the arbiter).
type pauseStatus struct {
	Controller
	e *env
}

func (w pauseStatus) Status() envlet.Status {
	st := w.Controller.Status()
	st.Paused, st.PushedOut = w.e.paused.Load(), w.e.pushedOut.Load()
	return st
}
