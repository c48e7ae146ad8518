package peer

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
)

// Frame names one compressed frame of a layer blob: where it is and the
// digest of its bytes.
type Frame struct {
	Offset int64         `json:"offset"`
	Size   int64         `json:"size"`
	Digest digest.Digest `json:"digest"`
}

// Source is what a peer server serves from: the node's open layers and its
// chunk cache (fetch.Flights implements it).
type Source interface {
	// Frames checks that frames are frames of a layer the node has open
	// and returns the function that gets their compressed bytes, each
	// verified against its digest, fetching those the node lacks from
	// the registry once however many peers ask at the same time (never
	// from another peer). The check fails with an error wrapping
	// errdefs.ErrNotFound when the node has no open layer with that
	// digest or a frame is not one of the layer's. The split lets the
	// server tell the requester at once that it will serve, and keep
	// telling it while get runs: the requester then knows the owner is
	// alive and working, and neither hedges nor gives up while it
	// fetches.
	Frames(ctx context.Context, layer digest.Digest, frames []Frame) (get func() ([][]byte, error), err error)
}

// Limits of one request: what one coalesced read or fill batch asks for,
// with room to spare.
const (
	// MaxRequestBytes bounds the frame bytes one request may ask for.
	MaxRequestBytes = 64 << 20
	maxFrames       = 4096
	maxBody         = 1 << 20
	// FramesPath is the only resource a peer serves.
	FramesPath = "/v1/frames"
	// serveTimeout bounds the work one request may cause on the owner
	// (a registry fetch with its retries).
	serveTimeout = 30 * time.Second
	// DefaultMaxServing is how many requests an owner answers at once;
	// past it a request is refused at once (503) and the requester reads
	// from the registry instead of waiting. 64 stripes of 4 MiB are 2.1 s
	// of a 1 Gbit/s uplink, within a requester's DefaultTimeout. Without
	// a bound, a stripe every node needs at the start of an iteration is
	// asked of its one owner by all of them, which then sends each
	// answer at 1/N of its uplink: none completes within the timeout,
	// and every requester marks a healthy owner bad (docs/scale.md).
	DefaultMaxServing = 64
	// DefaultProgressEvery is how often an owner tells a requester that
	// it is still fetching the frames asked for (an interim "102
	// Processing" response), from when it has checked the request until
	// it answers: the requester's timeout (DefaultTimeout) counts time
	// without progress, and a fetch from a registry behind a busy link
	// can take longer than it. Many times within that timeout, so that
	// an owner whose scheduling is delayed by a loaded node still reports
	// in time.
	DefaultProgressEvery = 500 * time.Millisecond
)

type request struct {
	Layer  digest.Digest `json:"layer"`
	Frames []Frame       `json:"frames"`
}

// Auth is how peers prove they belong to the cluster: a shared bearer
// token, mutual TLS, or both. At least one is required.
type Auth struct {
	Token *Token
	TLS   *TLSFiles
}

func (a Auth) validate() error {
	if a.Token == nil && a.TLS == nil {
		return errors.New("peers need a token file or TLS files: an open peer port would serve layer bytes to anyone")
	}
	return nil
}

// Server answers peers' frame requests from a Source.
type Server struct {
	src     Source
	auth    Auth
	tls     *tls.Config
	metrics *Metrics
	// serving holds a token per request being answered.
	serving chan struct{}
	every   time.Duration // between interim responses
}

// ServerOption configures a Server.
type ServerOption func(*Server)

// WithMaxServing bounds the requests answered at once (default
// DefaultMaxServing); n < 1 keeps the default.
func WithMaxServing(n int) ServerOption {
	return func(s *Server) {
		if n >= 1 {
			s.serving = make(chan struct{}, n)
		}
	}
}

// WithProgressEvery sets how often an owner reports that it is still
// fetching (default DefaultProgressEvery); d <= 0 keeps the default.
func WithProgressEvery(d time.Duration) ServerOption {
	return func(s *Server) {
		if d > 0 {
			s.every = d
		}
	}
}

// NewServer returns a server of src's frames, refusing requests that do not
// authenticate with auth.
func NewServer(src Source, auth Auth, m *Metrics, opts ...ServerOption) (*Server, error) {
	if err := auth.validate(); err != nil {
		return nil, err
	}
	s := &Server{src: src, auth: auth, metrics: m, serving: make(chan struct{}, DefaultMaxServing), every: DefaultProgressEvery}
	for _, o := range opts {
		o(s)
	}
	if auth.TLS != nil {
		var err error
		if s.tls, _, err = auth.TLS.configs(); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Serve serves peers on l until ctx ends.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	srv := &http.Server{
		Handler:           s,
		ReadHeaderTimeout: 5 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	if s.tls != nil {
		l = tls.NewListener(l, s.tls)
	}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve peers on %s: %w", l.Addr(), err)
	}
	return nil
}

// ServeHTTP implements http.Handler: POST FramesPath with a JSON request,
// answered with the frames' bytes back to back in the order asked.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.auth.Token != nil {
		if err := s.auth.Token.check(r); err != nil {
			if !errors.Is(err, errUnauthorized) {
				log.G(r.Context()).WithError(err).Error("peer token unreadable; refusing every peer")
			}
			s.metrics.refused()
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
	}
	if r.URL.Path != FramesPath {
		http.NotFound(w, r)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	req, err := decodeRequest(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	select {
	case s.serving <- struct{}{}:
		defer func() { <-s.serving }()
	default:
		// Refused at once, so the requester goes to the registry now
		// rather than waiting out its timeout on a share of our uplink
		// too small to finish in time.
		s.metrics.busy()
		w.Header().Set("Retry-After", "1")
		http.Error(w, fmt.Sprintf("busy: answering %d requests", cap(s.serving)), http.StatusServiceUnavailable)
		return
	}
	// The owner's fetch fills its own cache too: a requester that gives
	// up (its hedge won) does not cancel it for the others waiting.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), serveTimeout)
	defer cancel()
	get, err := s.src.Frames(ctx, req.Layer, req.Frames)
	if err != nil {
		code := http.StatusBadGateway
		switch {
		case errdefs.IsNotFound(err):
			code = http.StatusNotFound
		case errdefs.IsInvalidArgument(err):
			code = http.StatusBadRequest
		}
		if code != http.StatusNotFound {
			log.G(ctx).WithError(err).WithField("layer", req.Layer).Warn("serve frames to a peer")
		}
		http.Error(w, err.Error(), code)
		return
	}
	// The frames may have to come from the registry first. Until they
	// are here the requester hears "102 Processing" every s.every: it
	// shows the owner alive and working, so the requester neither hedges
	// nor gives up on a fetch that is slow but progressing. The final
	// status waits for the bytes, so a failed fetch is a 502 (the
	// requester reads from the registry and does not hold it against this
	// node) rather than an answer cut short.
	stop := s.processing(r.Context(), ctx, w)
	data, err := get()
	stop()
	if err != nil {
		log.G(ctx).WithError(err).WithField("layer", req.Layer).Warn("serve frames to a peer")
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	var n int64
	for i, f := range req.Frames {
		if len(data) != len(req.Frames) || int64(len(data[i])) != f.Size {
			log.G(ctx).WithField("layer", req.Layer).Error("source returned a frame of the wrong size")
			http.Error(w, "internal error", http.StatusInternalServerError)
			return
		}
		n += f.Size
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	w.WriteHeader(http.StatusOK)
	for _, b := range data {
		if _, err := w.Write(b); err != nil {
			return
		}
	}
	s.metrics.servedFrames(n)
}

// processing sends "102 Processing" to the requester now and every s.every
// until stop is called, the requester is gone, or the owner's work is
// over its time (serve ends): past that, silence lets the requester's
// timeout cut a fetch that hangs.
func (s *Server) processing(requester, serve context.Context, w http.ResponseWriter) (stop func()) {
	w.WriteHeader(http.StatusProcessing)
	done, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(s.every)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				// The handler does not touch w until stop has
				// returned, after this goroutine has.
				w.WriteHeader(http.StatusProcessing)
			case <-done:
				return
			case <-requester.Done():
				return
			case <-serve.Done():
				return
			}
		}
	}()
	return func() {
		close(done)
		<-exited
	}
}

// decodeRequest parses and bounds a frame request.
func decodeRequest(r io.Reader) (request, error) {
	var req request
	b, err := io.ReadAll(r)
	if err != nil {
		return req, fmt.Errorf("read request: %w", err)
	}
	if len(b) > maxBody {
		return req, fmt.Errorf("request larger than %d bytes", maxBody)
	}
	if err := json.Unmarshal(b, &req); err != nil {
		return req, fmt.Errorf("parse request: %w", err)
	}
	if err := req.Layer.Validate(); err != nil {
		return req, fmt.Errorf("layer digest: %w", err)
	}
	if len(req.Frames) == 0 || len(req.Frames) > maxFrames {
		return req, fmt.Errorf("%d frames asked for, want 1-%d", len(req.Frames), maxFrames)
	}
	var total int64
	for i, f := range req.Frames {
		if err := f.Digest.Validate(); err != nil {
			return req, fmt.Errorf("frame %d digest: %w", i, err)
		}
		if f.Offset < 0 || f.Size <= 0 || f.Size > MaxRequestBytes {
			return req, fmt.Errorf("frame %d: offset %d size %d", i, f.Offset, f.Size)
		}
		if total += f.Size; total > MaxRequestBytes {
			return req, fmt.Errorf("frames larger than %d bytes in all", MaxRequestBytes)
		}
	}
	return req, nil
}
