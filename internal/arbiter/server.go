package arbiter

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/envsnap/envsnap/internal/envlet"
)

// Defaults of the server's bookkeeping.
const (
	// DefaultTimelinePoints bounds the timeline kept per environment: one
	// hour of 200 ms samples.
	DefaultTimelinePoints = 18000
	// DefaultEndedEnvs is how many ended environments stay listed.
	DefaultEndedEnvs = 256
)

// Server exposes a NodeArbiter as the ttrpc service ServiceName and keeps
// what the shims report about their environments for listings and metrics.
type Server struct {
	arb  *envlet.NodeArbiter
	boot string

	mu      sync.Mutex
	envs    map[string]*record
	ended   []*record // oldest first, at most DefaultEndedEnvs
	rejects map[string]float64

	// Ledger (UseLedger): the file, the last content taken for it
	// without usage and with, and the environments restored from it
	// that no shim has confirmed yet, with the time their grants lapse.
	ledger        string
	lastLedger    []byte
	lastLedgerUse []byte
	ledgerAt      time.Time
	// The newest ledger content taken (persistLocked) and its number;
	// ledgerDone is the number of the newest written (or whose write
	// failed, logged), and ledgerWrite serialises the writes, which run
	// outside mu.
	ledgerNext  []byte
	ledgerSeq   uint64
	ledgerDone  atomic.Uint64
	ledgerWrite sync.Mutex
	restored    map[string]time.Time
	grace       time.Duration
	stale       time.Duration // DefaultStaleAfter
}

type record struct {
	info     EnvInfo
	timeline []json.RawMessage
}

// NewServer wraps arb. Each Server has a fresh boot identity, so clients
// notice a restarted arbiter and re-register.
func NewServer(arb *envlet.NodeArbiter) *Server {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return &Server{
		arb:      arb,
		boot:     hex.EncodeToString(b[:]),
		envs:     make(map[string]*record),
		rejects:  make(map[string]float64),
		restored: make(map[string]time.Time),
		grace:    DefaultLedgerGrace,
		stale:    DefaultStaleAfter,
	}
}

// node is the arbiter's view of the node, sent with every answer to Admit.
func (s *Server) node() *NodeInfo {
	capacity, reserve := s.arb.Capacity()
	return &NodeInfo{Capacity: toWire(capacity), Reserve: reserve}
}

// Register adds the arbiter service to a ttrpc server.
func (s *Server) Register(srv *ttrpc.Server) {
	srv.RegisterService(ServiceName, &ttrpc.ServiceDesc{Methods: map[string]ttrpc.Method{
		methodAdmit:    handler(s.admit),
		methodGrow:     handler(s.grow),
		methodReport:   handler(s.report),
		methodRelease:  handler(s.release),
		methodList:     handler(s.list),
		methodTimeline: handler(s.timelineOf),
		methodStart:    handler(s.startRank),
	}})
}

// handler adapts a typed JSON method to ttrpc, mapping errors to gRPC codes
// so clients recover their errdefs kind.
func handler[Req, Resp any](fn func(context.Context, *Req) (*Resp, error)) ttrpc.Method {
	return func(ctx context.Context, unmarshal func(any) error) (any, error) {
		var in wrapperspb.BytesValue
		if err := unmarshal(&in); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("%w: %v", errdefs.ErrInvalidArgument, err))
		}
		var req Req
		if err := decode(&in, &req); err != nil {
			return nil, errgrpc.ToGRPC(fmt.Errorf("%w: %v", errdefs.ErrInvalidArgument, err))
		}
		resp, err := fn(ctx, &req)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		out, err := encode(resp)
		if err != nil {
			return nil, errgrpc.ToGRPC(err)
		}
		return out, nil
	}
}

// valid rejects amounts no shim can mean; a negative base would mint
// capacity for everyone else.
func valid(rs ...Resources) error {
	for _, r := range rs {
		if r.CPU < 0 || r.Memory < 0 || math.IsInf(r.CPU, 0) {
			return fmt.Errorf("invalid resources %+v: %w", r, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func (s *Server) admit(ctx context.Context, r *AdmitRequest) (*EmptyResponse, error) {
	if r.Env == "" {
		return nil, fmt.Errorf("admit: empty env: %w", errdefs.ErrInvalidArgument)
	}
	cur := Resources{}
	if r.Current != nil {
		cur = *r.Current
	}
	if err := valid(r.Base, cur); err != nil {
		return nil, fmt.Errorf("admit %s: %w", r.Env, err)
	}
	if r.Tier != "" {
		if _, err := envlet.ParseTier(r.Tier); err != nil {
			return nil, fmt.Errorf("admit %s: %w: %w", r.Env, err, errdefs.ErrInvalidArgument)
		}
	}
	defer s.lockForChange(ctx)()
	s.expireLocked(ctx, time.Now())
	s.confirmLocked(r.Env)
	rec, known := s.envs[r.Env]
	if !known {
		if err := s.arb.Admit(ctx, r.Env, fromWire(r.Base), envlet.WithPriority(r.Priority), envlet.WithTier(envlet.Tier(r.Tier))); err != nil {
			if errdefs.IsResourceExhausted(err) {
				s.rejects["admission"]++
			}
			// The arbiter's error says what the node lacks; the caller
			// names the environment.
			return nil, err
		}
		now := time.Now()
		rec = &record{info: EnvInfo{Env: r.Env, Base: r.Base, Current: r.Base, Admitted: now, Updated: now, Priority: r.Priority, Tier: r.Tier}}
		s.envs[r.Env] = rec
	}
	// An Admit for a known env is a retry or a re-registration: idempotent,
	// but it restores the grant the shim says it holds.
	rec.info.Owner = r.Owner
	rec.info.Updated = time.Now()
	if r.Current != nil && (r.Current.CPU > rec.info.Current.CPU || r.Current.Memory > rec.info.Current.Memory) {
		got, err := s.arb.Grow(ctx, r.Env, fromWire(*r.Current))
		if err != nil {
			log.G(ctx).WithError(err).WithField("env", r.Env).Warn("arbiter: restoring grant of re-registered env")
		} else {
			rec.info.Current = toWire(got)
		}
	}
	return &EmptyResponse{Boot: s.boot, Node: s.node()}, nil
}

func (s *Server) grow(ctx context.Context, r *GrowRequest) (*ResourcesResponse, error) {
	if err := valid(r.Want); err != nil {
		return nil, fmt.Errorf("grow %s: %w", r.Env, err)
	}
	defer s.lockForChange(ctx)()
	s.expireLocked(ctx, time.Now())
	rec, ok := s.envs[r.Env]
	if !ok {
		return nil, fmt.Errorf("grow %s: %w", r.Env, errdefs.ErrNotFound)
	}
	s.confirmLocked(r.Env)
	got, err := s.arb.Grow(ctx, r.Env, fromWire(r.Want))
	if err != nil {
		return nil, fmt.Errorf("grow %s: %w", r.Env, err)
	}
	// A field at or below the grant is not being grown (envlet.Arbiter).
	if r.Want.CPU > got.CPU {
		s.rejects["grow_cpu"]++
	}
	if r.Want.Memory > got.Memory {
		s.rejects["grow_memory"]++
	}
	rec.info.Current = toWire(got)
	rec.info.Updated = time.Now()
	return &ResourcesResponse{Boot: s.boot, Resources: toWire(got)}, nil
}

func (s *Server) startRank(ctx context.Context, r *StartRequest) (*StartResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.envs[r.Env]; !ok {
		return nil, fmt.Errorf("start rank %s: %w", r.Env, errdefs.ErrNotFound)
	}
	s.confirmLocked(r.Env)
	rank, err := s.arb.StartRank(ctx, r.Env, r.Done)
	if err != nil {
		return nil, fmt.Errorf("start rank %s: %w", r.Env, err)
	}
	return &StartResponse{Boot: s.boot, Rank: rank}, nil
}

func (s *Server) report(ctx context.Context, r *ReportRequest) (*ResourcesResponse, error) {
	if err := valid(r.Current, r.Used); err != nil {
		return nil, fmt.Errorf("report %s: %w", r.Env, err)
	}
	defer s.lockForChange(ctx)()
	s.expireLocked(ctx, time.Now())
	rec, ok := s.envs[r.Env]
	if !ok {
		return nil, fmt.Errorf("report %s: %w", r.Env, errdefs.ErrNotFound)
	}
	s.confirmLocked(r.Env)
	limit, err := s.arb.Report(ctx, r.Env, fromWire(r.Current), fromWire(r.Used))
	var evict string
	if ev := (*envlet.EvictionError)(nil); errors.As(err, &ev) {
		evict, err = ev.Message, nil
	}
	if err != nil {
		return nil, fmt.Errorf("report %s: %w", r.Env, err)
	}
	rec.info.Current = r.Current
	rec.info.Used = r.Used
	rec.info.Updated = time.Now()
	if len(r.Status) > 0 {
		rec.info.Status = r.Status
	}
	if r.Gaps != nil {
		rec.info.Gaps = r.Gaps
	}
	rec.timeline = append(rec.timeline, r.Timeline...)
	if n := len(rec.timeline) - DefaultTimelinePoints; n > 0 {
		rec.timeline = append(rec.timeline[:0:0], rec.timeline[n:]...)
	}
	return &ResourcesResponse{Boot: s.boot, Resources: toWire(limit), Evict: evict}, nil
}

func (s *Server) release(ctx context.Context, r *ReleaseRequest) (*EmptyResponse, error) {
	defer s.lockForChange(ctx)()
	s.confirmLocked(r.Env)
	reason := r.Reason
	if reason == "" {
		reason = "released"
	}
	rec, ok := s.envs[r.Env]
	switch {
	case ok:
		if err := s.endLocked(ctx, r.Env, reason); err != nil {
			return nil, fmt.Errorf("release %s: %w", r.Env, err)
		}
		if !r.Ended.IsZero() {
			rec.info.Ended = r.Ended
		}
	case !r.Admitted.IsZero():
		// A late release: the client could not send it when env ended.
		if rec := s.endedSinceLocked(r.Env, r.Admitted); rec != nil {
			// This arbiter ended it meanwhile for want of reports; the
			// shim knows why it really ended.
			rec.info.Reason, rec.info.Ended = reason, r.Ended
			break
		}
		// Admitted while this arbiter was away: it holds no grant here,
		// but it ran on the node.
		info := EnvInfo{Env: r.Env, Admitted: r.Admitted, Updated: r.Ended, Ended: r.Ended, Reason: reason}
		if r.Base != nil {
			info.Base, info.Current = *r.Base, *r.Base
		}
		s.appendEndedLocked(&record{info: info})
	default:
		// Releasing twice (exit, then delete) is normal.
	}
	return &EmptyResponse{Boot: s.boot}, nil
}

// endedSinceLocked returns the latest listing of env as ended after since.
func (s *Server) endedSinceLocked(env string, since time.Time) *record {
	for i := len(s.ended) - 1; i >= 0; i-- {
		if rec := s.ended[i]; rec.info.Env == env && rec.info.Ended.After(since) {
			return rec
		}
	}
	return nil
}

func (s *Server) appendEndedLocked(rec *record) {
	s.ended = append(s.ended, rec)
	if n := len(s.ended) - DefaultEndedEnvs; n > 0 {
		s.ended = append(s.ended[:0:0], s.ended[n:]...)
	}
}

// endLocked returns env's grant and lists it as ended with reason.
func (s *Server) endLocked(ctx context.Context, env, reason string) error {
	rec, ok := s.envs[env]
	if !ok {
		return nil
	}
	if err := s.arb.Release(ctx, env); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	delete(s.envs, env)
	rec.info.Ended = time.Now()
	rec.info.Reason = reason
	s.appendEndedLocked(rec)
	return nil
}

func (s *Server) list(ctx context.Context, r *ListRequest) (*ListResponse, error) {
	defer s.lockForChange(ctx)()
	s.expireLocked(ctx, time.Now())
	resp := &ListResponse{Boot: s.boot, Envs: make([]EnvInfo, 0, len(s.envs))}
	for _, rec := range s.envs {
		resp.Envs = append(resp.Envs, rec.info)
	}
	sort.Slice(resp.Envs, func(i, j int) bool { return resp.Envs[i].Env < resp.Envs[j].Env })
	if r.Ended {
		for _, rec := range s.ended {
			resp.Envs = append(resp.Envs, rec.info)
		}
	}
	return resp, nil
}

func (s *Server) timelineOf(_ context.Context, r *TimelineRequest) (*TimelineResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// An exact name first, then a bare container id (shims name
	// environments namespace/id); live before the most recent ended one.
	var rec *record
	for _, match := range []func(string) bool{
		func(n string) bool { return n == r.Env },
		func(n string) bool { return strings.HasSuffix(n, "/"+r.Env) },
	} {
		if rec != nil {
			break
		}
		for name, l := range s.envs {
			if match(name) {
				rec = l
				break
			}
		}
		for i := len(s.ended) - 1; rec == nil && i >= 0; i-- {
			if match(s.ended[i].info.Env) {
				rec = s.ended[i]
			}
		}
	}
	if rec == nil {
		return nil, fmt.Errorf("timeline of %s: %w", r.Env, errdefs.ErrNotFound)
	}
	return &TimelineResponse{Boot: s.boot, Points: append([]json.RawMessage(nil), rec.timeline...)}, nil
}

// ServeOpt configures Serve.
type ServeOpt func(*serveConfig)

type serveConfig struct {
	metricsAddr string
	ledger      string
}

// WithLedger persists the leases at path and restores them at start
// (Server.UseLedger); "" keeps the arbiter's state in memory only.
func WithLedger(path string) ServeOpt {
	return func(c *serveConfig) { c.ledger = path }
}

// WithMetricsAddress also serves Prometheus metrics (per-environment quota,
// usage and controller status) over HTTP at addr, path /metrics, and
// nothing else there. A port without a host (":9167") listens on
// 127.0.0.1 only: the metrics name every environment on the node, and on
// a host-network pod any other address is reachable from the node's
// containers. Give the host ("0.0.0.0:9167") to listen everywhere.
func WithMetricsAddress(addr string) ServeOpt {
	return func(c *serveConfig) { c.metricsAddr = MetricsListenAddress(addr) }
}

// MetricsListenAddress is addr with an empty host replaced by 127.0.0.1.
func MetricsListenAddress(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host != "" {
		return addr // net.Listen reports a malformed one
	}
	return net.JoinHostPort("127.0.0.1", port)
}

// Serve runs the arbiter for arb on a unix socket at socketPath until ctx
// is cancelled. A socket file nobody serves (a dead arbiter's) is replaced;
// a live one is an error: two arbiters would each hand out the whole node.
func Serve(ctx context.Context, socketPath string, arb *envlet.NodeArbiter, opts ...ServeOpt) error {
	var cfg serveConfig
	for _, o := range opts {
		o(&cfg)
	}
	if err := os.MkdirAll(filepath.Dir(socketPath), 0o700); err != nil {
		return fmt.Errorf("arbiter socket dir: %w", err)
	}
	if c, err := net.DialTimeout("unix", socketPath, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("arbiter socket %s: another arbiter is serving it: %w", socketPath, errdefs.ErrAlreadyExists)
	}
	if err := os.Remove(socketPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale arbiter socket: %w", err)
	}
	// The ledger is read before the socket exists: no shim gets an answer
	// from an arbiter that does not yet know what the node has promised.
	s := NewServer(arb)
	if cfg.ledger != "" {
		if err := s.UseLedger(ctx, cfg.ledger); err != nil {
			return err
		}
	}
	l, err := net.Listen("unix", socketPath)
	if err != nil {
		return fmt.Errorf("listen on arbiter socket %s: %w", socketPath, err)
	}
	// Only root may talk to the arbiter: a forged Admit, Grow or Release
	// would move another environment's quota. The mode does not depend on
	// the umask or on who created the directory.
	if err := os.Chmod(socketPath, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("restrict arbiter socket %s: %w", socketPath, err)
	}
	defer os.Remove(socketPath)

	srv, err := ttrpc.NewServer()
	if err != nil {
		l.Close()
		return fmt.Errorf("ttrpc server: %w", err)
	}
	s.Register(srv)

	var httpSrv *http.Server
	if cfg.metricsAddr != "" {
		reg := prometheus.NewRegistry()
		reg.MustRegister(s.Collector())
		ml, err := net.Listen("tcp", cfg.metricsAddr)
		if err != nil {
			l.Close()
			return fmt.Errorf("listen for metrics on %s: %w", cfg.metricsAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := httpSrv.Serve(ml); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.G(ctx).WithError(err).Error("arbiter metrics server")
			}
		}()
	}

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ctx, l) }()
	log.G(ctx).WithField("socket", socketPath).Info("arbiter serving")
	select {
	case <-ctx.Done():
	case err := <-errc:
		if err != nil && !errors.Is(err, ttrpc.ErrServerClosed) {
			return fmt.Errorf("serve arbiter: %w", err)
		}
	}
	if httpSrv != nil {
		httpSrv.Close()
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	s.flushLedger(sctx)
	return nil
}
