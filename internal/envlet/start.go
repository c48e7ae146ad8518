package envlet

import (
	"context"
	"errors"
	"time"

	"github.com/containerd/errdefs"
)

// startOrder is an environment's place in the node's start queue while it
// starts: the controller asks the arbiter for its rank every other sample
// and sets its CPU weight to StartWeight of it, until the start ends at
// the head of the queue (Config.StartOrder).
type startOrder struct {
	q           StartQueue
	cg          startWeighter
	base, least uint64 // the weight the runtime set, the least the kernel takes
	weight      uint64 // in force
	rank        int
	began       time.Time
	asked       time.Time // the last rank asked, and demand read
	headSince   time.Time // at rank 0 since; zero while behind
}

// beginStart joins the start queue, where the arbiter and the cgroup
// support it, and applies the first rank at once: the start it orders is
// happening now.
func (c *Controller) beginStart(ctx context.Context, now time.Time) {
	if !c.cfg.StartOrder || (c.cfg.Tier != TierStandard && c.cfg.Tier != "") {
		return
	}
	q, ok := c.arb.(StartQueue)
	if !ok {
		return
	}
	cg, ok := c.cg.(startWeighter)
	if !ok {
		return
	}
	base, least, err := cg.CPUWeight()
	if err == nil {
		_, err = cg.Demand() // the baseline the first window is measured from
	}
	if err != nil {
		c.logger(ctx).WithError(err).Warn("envlet: start not ordered: cannot read the cgroup's CPU weight or demand")
		return
	}
	c.start = &startOrder{q: q, cg: cg, base: base, least: least, weight: base, began: now}
	c.startRank(ctx, now)
}

// startTick runs every other sample while the environment starts. At
// the head of the queue, a window with demand under IdleUtil of the limit
// ends the start (its agent waits on the model: nothing is left to
// order), and so does StartMax there; behind the head, the rank is asked
// again. Only the head may end its start: a start behind it gets little
// CPU, and one waiting on lazily fetched files shows no demand either,
// which at the head costs nothing (the head runs at its own weight
// anyway) but behind it would put a start back among the others.
func (c *Controller) startTick(ctx context.Context, now time.Time) {
	s := c.start
	dt := now.Sub(s.asked)
	// Samples fall on a grid (UntilTick): the one two periods after the
	// last ask can come a little sooner than two periods of real time.
	if dt < startAskEvery*c.cfg.SamplePeriod-c.cfg.SamplePeriod/2 {
		return
	}
	ns, err := s.cg.Demand()
	switch {
	case errors.Is(err, ErrVanished):
		c.start = nil
		return
	case err != nil:
		c.logger(ctx).WithError(err).Warn("envlet: read CPU demand; start no longer ordered")
		c.endStart(ctx, now, "demand unreadable")
		return
	}
	if s.rank == 0 {
		if demand := float64(ns) / 1e9 / dt.Seconds(); demand < c.cfg.IdleUtil*c.st.Limit.CPU {
			c.endStart(ctx, now, "idle")
			return
		}
		if now.Sub(s.headSince) >= c.cfg.StartMax {
			c.endStart(ctx, now, "busy at the head of the start queue for "+c.cfg.StartMax.String())
			return
		}
	}
	c.startRank(ctx, now)
}

// startAskEvery is how many samples apart a start asks for its rank:
// every ask is an arbiter call, and a crowd of starts is when the node
// has the least CPU to spare for them.
const startAskEvery = 2

func (c *Controller) startRank(ctx context.Context, now time.Time) {
	s := c.start
	s.asked = now
	qctx, cancel := context.WithTimeout(ctx, c.cfg.ArbiterTimeout)
	rank, err := s.q.StartRank(qctx, c.env, false)
	cancel()
	if errdefs.IsNotImplemented(err) {
		c.endStart(ctx, now, "arbiter has no start queue")
		return
	}
	if err != nil {
		// No order without the node's view: a start is not held back
		// by an arbiter that does not answer.
		rank = 0
	}
	if rank == 0 && s.headSince.IsZero() {
		s.headSince = now
	}
	s.rank = rank
	c.weigh(ctx, s, rank)
	c.mu.Lock()
	c.status.Starting, c.status.StartRank = true, rank
	c.mu.Unlock()
}

// endStart leaves the start queue and gives the environment its own
// weight back.
func (c *Controller) endStart(ctx context.Context, now time.Time, why string) {
	s := c.start
	c.start = nil
	qctx, cancel := context.WithTimeout(ctx, c.cfg.ArbiterTimeout)
	_, err := s.q.StartRank(qctx, c.env, true)
	cancel()
	if err != nil && !errdefs.IsNotImplemented(err) {
		c.logger(ctx).WithError(err).Debug("envlet: tell the arbiter the start is over")
	}
	c.weigh(ctx, s, 0)
	c.mu.Lock()
	c.status.Starting, c.status.StartRank = false, 0
	c.mu.Unlock()
	l := c.logger(ctx).WithField("why", why).WithField("took", now.Sub(s.began).Round(time.Millisecond))
	if !s.headSince.IsZero() {
		l = l.WithField("at_head", now.Sub(s.headSince).Round(time.Millisecond))
	}
	l.Info("envlet: start over")
}

// weigh sets the weight of rank (StartWeight; the base at rank 0). A
// weight in force that is not the one last written was set by someone
// else (kubelet's in-place resize, an operator): it becomes the base,
// and the end of the start leaves it there.
func (c *Controller) weigh(ctx context.Context, s *startOrder, rank int) {
	if cur, _, err := s.cg.CPUWeight(); err == nil && cur != s.weight {
		s.base, s.weight = cur, cur
	}
	w := StartWeight(s.base, s.least, rank)
	if w == s.weight {
		return
	}
	if err := s.cg.SetCPUWeight(w); err != nil {
		if !errors.Is(err, ErrVanished) {
			c.logger(ctx).WithError(err).Warn("envlet: set the CPU weight of a start")
		}
		return
	}
	s.weight = w
}
