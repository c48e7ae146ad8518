package arbiter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/envsnap/envsnap/internal/envlet"
)

// Fallback policies: what a client grants while the node arbiter cannot be
// reached.
const (
	// FallbackDegraded is the default: admissions are decided by a local
	// NodeArbiter sized to the node, by request (it cannot see the other
	// shims' use), grows fail with errdefs.ErrUnavailable
	// so the controller's policy for a lost arbiter applies (CPU fails open
	// to 2 x base, memory fails closed). A shim that cannot see the others
	// cannot oversubscribe the node's memory.
	FallbackDegraded = "degraded"
	// FallbackLocal arbitrates everything with an in-process NodeArbiter
	// sized to the whole node: right for a node running a single shim and
	// no arbiter daemon.
	FallbackLocal = "local"
)

// Client defaults.
const (
	// DefaultTimeout is envlet's default arbiter-timeout: the deadline a
	// crowded node can meet (envlet.Config.ArbiterTimeout says why).
	DefaultTimeout = 3 * time.Second
	// redialInterval keeps a down arbiter from costing every controller
	// tick a connect attempt; a lost connection is redialled this often
	// until the arbiter answers again.
	redialInterval = time.Second
)

// ClientConfig configures a Client.
type ClientConfig struct {
	// Socket of the node arbiter; DefaultSocket when empty.
	Socket string
	// Timeout of connects and of the per-tick calls (Grow, Report);
	// DefaultTimeout when zero. Admit and Release get ten times as long:
	// they are off the controller's hot path.
	Timeout time.Duration
	// Node is the capacity the fallback NodeArbiter assumes, Reserve its
	// admission reserve (fraction of the node).
	Node    envlet.Resources
	Reserve float64
	// Fallback is FallbackDegraded (default) or FallbackLocal.
	Fallback string
	// Owner names this client in the arbiter's listings.
	Owner string
}

// StatusSource is what a client reports about an environment besides its
// limits and usage: *envlet.Controller implements it. TimelineSince
// returns the points recorded from the seq-th on and the seq of the next.
type StatusSource interface {
	Status() envlet.Status
	TimelineSince(seq uint64) ([]envlet.TimelinePoint, uint64)
}

// Client implements envlet.Arbiter against the node arbiter, falling back
// to local decisions when the arbiter is absent or slow. It is safe for
// concurrent use by the controllers of one shim.
type Client struct {
	cfg ClientConfig

	mu       sync.Mutex
	conn     *ttrpc.Client
	dialFail time.Time
	boot     string
	envs     map[string]*envState
	// unsent holds the releases the arbiter did not get (it was away):
	// they go out on the next connection, so an ended environment's grant
	// does not stay held until the arbiter's stale limit, and the listing
	// of ended environments says why it ended.
	unsent    map[string]*ReleaseRequest
	local     *envlet.NodeArbiter // nil while connected
	localEnvs map[string]bool
	node      *NodeInfo // the arbiter's view of the node, from Admit

	// gaps counts the times the arbiter stopped answering (a lost
	// connection, or a run of failed calls, between two answers), failed
	// the calls that failed; both go to the arbiter with every report,
	// for its metrics.
	gaps, failed int
	inGap        bool

	// redialing: a goroutine reconnects (redial); closed: Close was
	// called.
	redialing, closed bool
}

type envState struct {
	base, current envlet.Resources
	priority      int
	tier          envlet.Tier
	src           StatusSource
	nextPoint     uint64 // the first timeline point not reported yet
	admitted      time.Time
}

var _ envlet.Arbiter = (*Client)(nil)

// NewClient returns a client; it connects lazily.
func NewClient(cfg ClientConfig) *Client {
	if cfg.Socket == "" {
		cfg.Socket = DefaultSocket
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Fallback == "" {
		cfg.Fallback = FallbackDegraded
	}
	if cfg.Owner == "" {
		cfg.Owner = fmt.Sprintf("pid %d", os.Getpid())
	}
	return &Client{cfg: cfg, envs: make(map[string]*envState), unsent: make(map[string]*ReleaseRequest)}
}

// Track attaches the controller whose status and timeline go with the
// environment's reports.
func (c *Client) Track(env string, src StatusSource) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if st, ok := c.envs[env]; ok {
		st.src, st.nextPoint = src, 0
	}
}

// Close drops the connection, after one last try at the releases the
// arbiter has not had yet (a shim exits right after its last container).
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.unsent) > 0 {
		_ = c.connectLocked(context.Background())
	}
	c.closed = true
	c.dropLocked()
	return nil
}

// Connected reports whether the last exchange with the arbiter succeeded.
func (c *Client) Connected() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn != nil
}

// errUnreachable marks failures of the transport, not answers.
// It wraps errdefs.ErrUnavailable, which is what the controller sees.
var errUnreachable = fmt.Errorf("node arbiter unreachable: %w", errdefs.ErrUnavailable)

// isAnswer tells an arbiter's decision apart from a failure to get one.
func isAnswer(err error) bool {
	return errdefs.IsResourceExhausted(err) || errdefs.IsNotFound(err) ||
		errdefs.IsInvalidArgument(err) || errdefs.IsAlreadyExists(err) ||
		errdefs.IsFailedPrecondition(err) || errdefs.IsNotImplemented(err)
}

func (c *Client) dropLocked() {
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
}

// lostLocked starts redial unless it runs: the connection is gone, and
// with environments idle a heartbeat apart (envlet.IdleReportPeriod) no
// call may come to reconnect before the arbiter's grace for restored
// leases (DefaultLedgerGrace) or its stale limit (DefaultStaleAfter)
// runs out.
func (c *Client) lostLocked() {
	if c.redialing || c.closed || len(c.envs)+len(c.unsent) == 0 {
		return
	}
	c.redialing = true
	go c.redial()
}

// redial reconnects, and so re-registers every environment, every
// redialInterval until it succeeds, a call reconnects first, or nothing
// is left to speak for.
func (c *Client) redial() {
	ctx := context.Background()
	for {
		time.Sleep(redialInterval)
		c.mu.Lock()
		if c.conn != nil || c.closed || len(c.envs)+len(c.unsent) == 0 {
			c.redialing = false
			c.mu.Unlock()
			return
		}
		err := c.dialLocked(ctx)
		if err == nil {
			c.redialing = false
		}
		c.mu.Unlock()
		if err == nil {
			return
		}
	}
}

// closedRemotely is the ttrpc client's close callback: a connection the
// arbiter closed (it exited or restarted) is a gap, and is redialled
// without waiting for a call.
func (c *Client) closedRemotely(tc *ttrpc.Client) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != tc {
		return // dropped by us
	}
	c.conn = nil
	if !c.inGap {
		c.inGap = true
		c.gaps++
	}
	c.lostLocked()
}

// connectLocked dials the arbiter and, on a new connection, re-registers
// every environment this client holds: the arbiter may have restarted, or
// environments may have been admitted locally while it was away.
func (c *Client) connectLocked(ctx context.Context) error {
	if c.conn != nil {
		return nil
	}
	if !c.dialFail.IsZero() && time.Since(c.dialFail) < redialInterval {
		return errUnreachable
	}
	if err := c.dialLocked(ctx); err != nil {
		c.noteFailureLocked()
		c.lostLocked()
		return err
	}
	return nil
}

// dialLocked makes a new connection, re-registers every environment on
// it and sends the releases the arbiter missed.
func (c *Client) dialLocked(ctx context.Context) error {
	d := net.Dialer{Timeout: c.cfg.Timeout}
	conn, err := d.DialContext(ctx, "unix", c.cfg.Socket)
	if err != nil {
		c.dialFail = time.Now()
		return fmt.Errorf("%w: %v", errUnreachable, err)
	}
	var tc *ttrpc.Client
	// The callback takes c.mu, which is held until tc is set.
	tc = ttrpc.NewClient(conn, ttrpc.WithOnClose(func() { c.closedRemotely(tc) }))
	c.conn = tc
	c.dialFail = time.Time{}
	for env, st := range c.envs {
		if err := c.registerLocked(ctx, env, st); err != nil {
			if errors.Is(err, errUnreachable) {
				return err
			}
			log.G(ctx).WithError(err).WithField("env", env).Warn("envlet: re-registering with the arbiter")
		}
	}
	for env, req := range c.unsent {
		var resp EmptyResponse
		err := c.callLocked(ctx, methodRelease, 10*c.cfg.Timeout, req, &resp, &resp.Boot)
		if errors.Is(err, errUnreachable) {
			return err
		}
		if err != nil {
			log.G(ctx).WithError(err).WithField("env", env).Warn("envlet: late release")
		}
		delete(c.unsent, env)
	}
	if c.local != nil {
		log.G(ctx).WithField("socket", c.cfg.Socket).Info("envlet: node arbiter is back; leaving fallback")
		c.local, c.localEnvs = nil, nil
	}
	return nil
}

func (c *Client) registerLocked(ctx context.Context, env string, st *envState) error {
	cur := toWire(st.current)
	var resp EmptyResponse
	err := c.callLocked(ctx, methodAdmit, 10*c.cfg.Timeout,
		&AdmitRequest{Env: env, Base: toWire(st.base), Current: &cur, Owner: c.cfg.Owner, Priority: st.priority, Tier: string(st.tier)}, &resp, &resp.Boot)
	if err == nil && resp.Node != nil {
		c.node = resp.Node
	}
	return err
}

// Capacity is the node as the arbiter last described it, or the
// configured node size before any answer (envlet.NodeSizer).
func (c *Client) Capacity() (envlet.Resources, float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.node != nil {
		return fromWire(c.node.Capacity), c.node.Reserve
	}
	return c.cfg.Node, c.cfg.Reserve
}

// call makes one call. c.mu is held on entry and on return but not while
// the call is in flight: a shim's controllers sample on the same instants
// and each call has its controller's deadline (arbiter-timeout), so
// calls made one at a time would queue and the last ones fail with the
// arbiter answering. What the caller read under c.mu may have changed
// when call returns. Transport failures and timeouts drop the connection
// and return errUnreachable; the arbiter's decisions come back as their
// errdefs kind.
func (c *Client) call(ctx context.Context, method string, timeout time.Duration, req, resp any, boot *string) error {
	return c.roundTrip(ctx, method, timeout, req, resp, boot, true)
}

// callLocked makes one call without letting go of c.mu, for the calls
// made while ranging over c.envs (re-registering on a new connection).
func (c *Client) callLocked(ctx context.Context, method string, timeout time.Duration, req, resp any, boot *string) error {
	return c.roundTrip(ctx, method, timeout, req, resp, boot, false)
}

func (c *Client) roundTrip(ctx context.Context, method string, timeout time.Duration, req, resp any, boot *string, unlock bool) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s: %w", method, err)
	}
	if err := c.connectLocked(ctx); err != nil {
		return err
	}
	in, err := encode(req)
	if err != nil {
		return err
	}
	conn := c.conn
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var out wrapperspb.BytesValue
	if unlock {
		c.mu.Unlock()
	}
	err = conn.Call(cctx, ServiceName, method, in, &out)
	if unlock {
		c.mu.Lock()
	}
	if err != nil {
		nerr := errgrpc.ToNative(err)
		if isAnswer(nerr) {
			c.inGap = false
			return nerr
		}
		if errors.Is(ctx.Err(), context.Canceled) {
			// The caller gave up (its environment is being stopped), not
			// the arbiter: dropping the connection here would send the
			// release that follows to a local fallback, and the arbiter
			// would hold the grant until its stale limit. A deadline
			// (the controller's arbiter-timeout) is the arbiter's.
			return fmt.Errorf("%s: %w", method, ctx.Err())
		}
		if c.conn == conn {
			// Not already dropped (or replaced) by a call that failed
			// beside this one.
			c.dropLocked()
			c.dialFail = time.Now()
		}
		c.noteFailureLocked()
		c.lostLocked()
		return fmt.Errorf("%w: %s: %v", errUnreachable, method, err)
	}
	c.inGap = false
	if err := decode(&out, resp); err != nil {
		return err
	}
	if c.boot != "" && *boot != c.boot {
		// Cannot happen on one connection; kept as a guard so a proxy or
		// a socket handed over to a new arbiter is still noticed.
		c.boot = *boot
		for env, st := range c.envs {
			_ = c.registerLocked(ctx, env, st)
		}
	}
	c.boot = *boot
	return nil
}

// noteFailureLocked counts a call that got no answer, and a gap when it
// is the first since an answer.
func (c *Client) noteFailureLocked() {
	c.failed++
	if !c.inGap {
		c.inGap = true
		c.gaps++
	}
}

// Gaps returns how many times the arbiter stopped answering this client,
// and how many of its calls got no answer.
func (c *Client) Gaps() (gaps, failedCalls int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gaps, c.failed
}

// Admit asks the arbiter to admit env with base. When the arbiter cannot
// be reached the fallback arbiter decides.
func (c *Client) Admit(ctx context.Context, env string, base envlet.Resources, opts ...envlet.AdmitOpt) error {
	var ad envlet.Admission
	for _, o := range opts {
		o(&ad)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	st, known := c.envs[env]
	if !known {
		st = &envState{base: base, current: base, admitted: time.Now()}
		delete(c.unsent, env) // the same name again: the old end is moot
	}
	// Admitting a known env again (the shim at Create, then the controller
	// in Run) is idempotent here and at the arbiter.
	st.base, st.priority, st.tier = base, ad.Priority, ad.Tier
	cur := toWire(st.current)
	var resp EmptyResponse
	err := c.call(ctx, methodAdmit, 10*c.cfg.Timeout,
		&AdmitRequest{Env: env, Base: toWire(base), Current: &cur, Owner: c.cfg.Owner, Priority: ad.Priority, Tier: string(ad.Tier)}, &resp, &resp.Boot)
	if err == nil {
		if resp.Node != nil {
			c.node = resp.Node
		}
		c.envs[env] = st
		return nil
	}
	if !errors.Is(err, errUnreachable) {
		return err
	}
	c.enterFallbackLocked(ctx, err)
	if err := c.local.Admit(ctx, env, base, opts...); err != nil {
		return fmt.Errorf("admit %s (arbiter unreachable, local fallback): %w", env, err)
	}
	c.localEnvs[env] = true
	c.envs[env] = st
	return nil
}

// enterFallbackLocked builds the local arbiter from the node size and the
// grants this client holds.
func (c *Client) enterFallbackLocked(ctx context.Context, cause error) {
	if c.local != nil {
		return
	}
	log.G(ctx).WithError(cause).WithField("policy", c.cfg.Fallback).Warn("envlet: node arbiter unreachable; deciding locally")
	var opts []envlet.NodeOpt
	if c.cfg.Fallback != FallbackLocal {
		// A shim that cannot see the others' use must not admit by use.
		opts = append(opts, envlet.WithOvercommit(envlet.Overcommit{CPU: 1, Memory: 1}))
	}
	c.local = envlet.NewNodeArbiter(c.cfg.Node, c.cfg.Reserve, opts...)
	c.localEnvs = make(map[string]bool)
	for env, st := range c.envs {
		c.ensureLocalLocked(ctx, env, st)
	}
}

func (c *Client) ensureLocalLocked(ctx context.Context, env string, st *envState) {
	if c.localEnvs[env] {
		return
	}
	if err := c.local.Admit(ctx, env, st.base, envlet.WithPriority(st.priority), envlet.WithTier(st.tier)); err != nil {
		log.G(ctx).WithError(err).WithField("env", env).Warn("envlet: local fallback arbiter rejects env")
		return
	}
	if st.current.CPU > st.base.CPU || st.current.Memory > st.base.Memory {
		_, _ = c.local.Grow(ctx, env, st.current)
	}
	c.localEnvs[env] = true
}

// Grow asks for env's limits to become want and returns the grant.
func (c *Client) Grow(ctx context.Context, env string, want envlet.Resources) (envlet.Resources, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st, ok := c.envs[env]
	if !ok {
		return envlet.Resources{}, fmt.Errorf("grow %s: not admitted: %w", env, errdefs.ErrNotFound)
	}
	var resp ResourcesResponse
	req := &GrowRequest{Env: env, Want: toWire(want)}
	err := c.call(ctx, methodGrow, c.cfg.Timeout, req, &resp, &resp.Boot)
	if errdefs.IsNotFound(err) {
		// The arbiter lost us (restart under the same connection is not
		// possible, but an operator may have released us): re-register.
		if err = c.registerLocked(ctx, env, st); err == nil {
			err = c.call(ctx, methodGrow, c.cfg.Timeout, req, &resp, &resp.Boot)
		}
	}
	if err == nil {
		st.current = fromWire(resp.Resources)
		return st.current, nil
	}
	if !errors.Is(err, errUnreachable) {
		return envlet.Resources{}, err
	}
	if c.cfg.Fallback != FallbackLocal {
		// The controller's own policy for an arbiter it cannot reach
		// applies (CPU fails open to 2 x base, memory fails closed).
		return envlet.Resources{}, fmt.Errorf("grow %s: %w", env, err)
	}
	c.enterFallbackLocked(ctx, err)
	c.ensureLocalLocked(ctx, env, st)
	if !c.localEnvs[env] {
		return envlet.Resources{}, fmt.Errorf("grow %s: local fallback rejects env: %w", env, err)
	}
	got, lerr := c.local.Grow(ctx, env, want)
	if lerr != nil {
		return envlet.Resources{}, fmt.Errorf("grow %s (local fallback): %w", env, lerr)
	}
	st.current = got
	return got, nil
}

// Report sends env's heartbeat with the controller's status and new
// timeline points; it returns the limit env must keep to.
func (c *Client) Report(ctx context.Context, env string, current, used envlet.Resources) (envlet.Resources, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st, ok := c.envs[env]
	if !ok {
		return current, fmt.Errorf("report %s: not admitted: %w", env, errdefs.ErrNotFound)
	}
	st.current = current
	req := &ReportRequest{Env: env, Current: toWire(current), Used: toWire(used),
		Gaps: &Gaps{Gaps: c.gaps, FailedCalls: c.failed}}
	var next uint64
	if st.src != nil {
		if b, err := json.Marshal(st.src.Status()); err == nil {
			req.Status = b
		}
		var pts []envlet.TimelinePoint
		pts, next = st.src.TimelineSince(st.nextPoint)
		req.Timeline = encodePoints(pts)
	}
	var resp ResourcesResponse
	err := c.call(ctx, methodReport, c.cfg.Timeout, req, &resp, &resp.Boot)
	if errdefs.IsNotFound(err) {
		if err = c.registerLocked(ctx, env, st); err == nil {
			err = c.call(ctx, methodReport, c.cfg.Timeout, req, &resp, &resp.Boot)
		}
	}
	if err == nil {
		if st.src != nil {
			st.nextPoint = next
		}
		if resp.Evict != "" {
			return fromWire(resp.Resources), &envlet.EvictionError{Message: resp.Evict}
		}
		return fromWire(resp.Resources), nil
	}
	if !errors.Is(err, errUnreachable) {
		return current, err
	}
	c.enterFallbackLocked(ctx, err)
	if c.cfg.Fallback == FallbackLocal {
		c.ensureLocalLocked(ctx, env, st)
		if c.localEnvs[env] {
			if lim, lerr := c.local.Report(ctx, env, current, used); lerr == nil {
				return lim, nil
			}
		}
	}
	// Nobody else can be admitted through us while the arbiter is away,
	// so there is nothing to reclaim for.
	return current, nil
}

// StartRank implements envlet.StartQueue against the node arbiter. While
// the arbiter is away every start goes first: the local fallback sees
// only this shim's environments, not the node's crowd. An arbiter older
// than the start queue answers ErrNotImplemented.
func (c *Client) StartRank(ctx context.Context, env string, done bool) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st, ok := c.envs[env]
	if !ok {
		return 0, fmt.Errorf("start rank %s: not admitted: %w", env, errdefs.ErrNotFound)
	}
	req := &StartRequest{Env: env, Done: done}
	var resp StartResponse
	err := c.call(ctx, methodStart, c.cfg.Timeout, req, &resp, &resp.Boot)
	if errdefs.IsNotFound(err) {
		if err = c.registerLocked(ctx, env, st); err == nil {
			err = c.call(ctx, methodStart, c.cfg.Timeout, req, &resp, &resp.Boot)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("start rank %s: %w", env, err)
	}
	return resp.Rank, nil
}

// encodePoints encodes timeline points as the protocol carries them.
func encodePoints(pts []envlet.TimelinePoint) []json.RawMessage {
	if len(pts) == 0 {
		return nil
	}
	out := make([]json.RawMessage, 0, len(pts))
	for _, p := range pts {
		b, err := json.Marshal(p)
		if err != nil {
			return nil
		}
		out = append(out, b)
	}
	return out
}

// Release returns env's grant to the node.
func (c *Client) Release(ctx context.Context, env string) error {
	return c.ReleaseReason(ctx, env, "exited")
}

// ReleaseReason releases env and records why it ended.
func (c *Client) ReleaseReason(ctx context.Context, env, reason string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	st, ok := c.envs[env]
	if !ok {
		return nil
	}
	// Flush the last status and timeline points so the ended environment
	// keeps its full history in the arbiter; a controller that failed the
	// environment says why in its status.
	if st.src != nil && c.local == nil {
		status := st.src.Status()
		if f := status.Failure; f != nil && (reason == "" || reason == "exited") {
			reason = f.Reason
		}
		req := &ReportRequest{Env: env, Current: toWire(st.current),
			Used: Resources{CPU: status.CPUUsed, Memory: status.WorkingSet}}
		if b, err := json.Marshal(status); err == nil {
			req.Status = b
		}
		pts, _ := st.src.TimelineSince(st.nextPoint)
		req.Timeline = encodePoints(pts)
		var resp ResourcesResponse
		_ = c.call(ctx, methodReport, 10*c.cfg.Timeout, req, &resp, &resp.Boot)
	}
	delete(c.envs, env)
	if c.local != nil && c.localEnvs[env] {
		delete(c.localEnvs, env)
		_ = c.local.Release(ctx, env)
	}
	req := &ReleaseRequest{Env: env, Reason: reason}
	var resp EmptyResponse
	err := c.call(ctx, methodRelease, 10*c.cfg.Timeout, req, &resp, &resp.Boot)
	if errors.Is(err, errUnreachable) || ctx.Err() != nil {
		// The arbiter may never have heard of env (admitted by the
		// fallback): what it needs to list it as ended goes along.
		base := toWire(st.base)
		req.Base, req.Admitted, req.Ended = &base, st.admitted, time.Now()
		c.unsent[env] = req
		c.lostLocked()
		return nil
	}
	if err != nil {
		return fmt.Errorf("release %s: %w", env, err)
	}
	return nil
}

// List returns the environments the arbiter knows, with recently ended
// ones when ended is set. Unlike the quota calls it does not fall back.
func (c *Client) List(ctx context.Context, ended bool) ([]EnvInfo, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var resp ListResponse
	if err := c.call(ctx, methodList, 10*c.cfg.Timeout, &ListRequest{Ended: ended}, &resp, &resp.Boot); err != nil {
		return nil, fmt.Errorf("list environments at %s: %w", c.cfg.Socket, err)
	}
	return resp.Envs, nil
}

// Timeline returns env's recorded timeline points as the controller's JSON.
func (c *Client) Timeline(ctx context.Context, env string) ([]json.RawMessage, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var resp TimelineResponse
	if err := c.call(ctx, methodTimeline, 10*c.cfg.Timeout, &TimelineRequest{Env: env}, &resp, &resp.Boot); err != nil {
		return nil, fmt.Errorf("timeline of %s at %s: %w", env, c.cfg.Socket, err)
	}
	return resp.Points, nil
}
