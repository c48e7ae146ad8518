// Package fetch reads lazy layer bytes from OCI registries and serves
// verified chunks of one layer to the FUSE filesystem: node chunk cache first,
// then the registry through single-range HTTP GETs.
//
// The invariant everything here protects: bytes that do not match the digest
// the TOC names are never returned and never cached. Transient registry
// faults (resets, truncated bodies, 5xx, 429) are retried with backoff until
// the read's deadline; a read that cannot be served in time fails with an
// error that says why, which the FUSE layer turns into EIO.
package fetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	remoteerrors "github.com/containerd/containerd/v2/core/remotes/errors"
	"github.com/containerd/containerd/v2/pkg/reference"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
)

// Defaults of the retry policy. The first retry comes quickly because most
// faults seen in practice (a reset connection, one 502 from a load balancer)
// are momentary; the cap keeps a 30 s read budget worth ~10 attempts.
const (
	DefaultTimeout        = 30 * time.Second
	DefaultInitialBackoff = 50 * time.Millisecond
	DefaultMaxBackoff     = 2 * time.Second
)

// remote is one repository on an ordered list of registry hosts (mirrors
// first, as containerd's resolver orders them) with the pull capability.
type remote struct {
	ref     string
	repo    string
	hosts   []docker.RegistryHost
	initial time.Duration
	max     time.Duration
	timeout time.Duration
	metrics *Metrics
}

func newRemote(hosts docker.RegistryHosts, ref string, o *blobOptions) (*remote, error) {
	spec, err := reference.Parse(ref)
	if err != nil {
		return nil, fmt.Errorf("parse image reference %q: %w", ref, errors.Join(err, errdefs.ErrInvalidArgument))
	}
	host := spec.Hostname()
	repo := strings.TrimPrefix(spec.Locator, host+"/")
	all, err := hosts(host)
	if err != nil {
		return nil, fmt.Errorf("configure registry hosts for %s: %w", host, err)
	}
	var pull []docker.RegistryHost
	for _, h := range all {
		if h.Capabilities.Has(docker.HostCapabilityPull) {
			pull = append(pull, h)
		}
	}
	if len(pull) == 0 {
		return nil, fmt.Errorf("no registry host with pull capability for %s: %w", host, errdefs.ErrNotFound)
	}
	return &remote{
		ref:     ref,
		repo:    repo,
		hosts:   pull,
		initial: o.initialBackoff,
		max:     o.maxBackoff,
		timeout: o.timeout,
		metrics: o.metrics,
	}, nil
}

// observerKey carries a func(error) that do calls with each failed round, so
// that a reader giving up on a shared fetch can say why it was slow.
type observerKey struct{}

func withObserver(ctx context.Context, f func(error)) context.Context {
	return context.WithValue(ctx, observerKey{}, f)
}

// statusError is an unexpected HTTP status from one host.
type statusError struct {
	host       string
	code       int
	retryAfter time.Duration
	body       string
}

func (e *statusError) Error() string {
	s := fmt.Sprintf("%s: unexpected status %d %s", e.host, e.code, http.StatusText(e.code))
	if e.body != "" {
		s += ": " + e.body
	}
	return s
}

func (e *statusError) Unwrap() error {
	switch e.code {
	case http.StatusNotFound:
		return errdefs.ErrNotFound
	case http.StatusUnauthorized, http.StatusForbidden:
		return errdefs.ErrPermissionDenied
	case http.StatusTooManyRequests:
		return errdefs.ErrUnavailable
	}
	return nil
}

func (e *statusError) transient() bool {
	switch e.code {
	case http.StatusRequestTimeout, http.StatusTooManyRequests,
		http.StatusInternalServerError, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// permanentError marks a failure that retrying the same request cannot fix
// (a protocol violation, a blob of the wrong size, bad credentials).
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

func permanent(err error) error { return &permanentError{err} }

// classify reports whether err may go away on retry, and the minimum wait the
// server asked for.
func classify(err error) (transient bool, after time.Duration) {
	var pe *permanentError
	if errors.As(err, &pe) {
		return false, 0
	}
	var se *statusError
	if errors.As(err, &se) {
		return se.transient(), se.retryAfter
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false, 0
	}
	if errors.Is(err, docker.ErrInvalidAuthorization) {
		return false, 0
	}
	// Connection refused or reset, truncated bodies, TLS handshake
	// timeouts: the network, worth another try.
	return true, 0
}

// parseRetryAfter understands both forms of RFC 9110 Retry-After.
func parseRetryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && s >= 0 {
		return time.Duration(s) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		if d := time.Until(t); d > 0 {
			return d
		}
	}
	return 0
}

// backoff returns the wait before retry number attempt (0-based): exponential
// with "equal jitter" (half fixed, half random) so that many readers hitting
// the same failing registry do not retry in lockstep.
func (r *remote) backoff(attempt int) time.Duration {
	d := r.initial << min(attempt, 20)
	if d > r.max || d <= 0 {
		d = r.max
	}
	return d/2 + rand.N(d/2+1)
}

// do sends GET <host.Path>/<repo><path> to each host in order until one
// accepts the response, retrying transient failures with backoff until ctx
// ends. accept consumes a 2xx response; an error it returns is classified
// like any other (wrap it with permanent() if a retry cannot help).
func (r *remote) do(ctx context.Context, what, path string, header http.Header, accept func(*http.Response) error) error {
	if _, ok := ctx.Deadline(); !ok && r.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.timeout)
		defer cancel()
	}
	// Bearer tokens are requested for the scopes in the context, as
	// containerd's own fetcher does.
	ctx = docker.ContextWithAppendPullRepositoryScope(ctx, r.repo)

	// prevErr keeps the last registry error of earlier rounds: when the
	// deadline cuts a request short, it is the reason worth reporting.
	var prevErr error
	for attempt := 0; ; attempt++ {
		var (
			errs      []error
			retry     bool
			wait      time.Duration
			allAbsent = true
		)
		for _, h := range r.hosts {
			err := r.try(ctx, h, path, header, accept)
			r.metrics.request(err)
			if err == nil {
				return nil
			}
			if ctx.Err() != nil {
				if prevErr != nil {
					err = prevErr
				}
				return fmt.Errorf("%s: %w (last error: %w)", what, ctx.Err(), err)
			}
			errs = append(errs, err)
			if !errdefs.IsNotFound(err) {
				allAbsent = false
			}
			if t, after := classify(err); t {
				retry = true
				wait = max(wait, after)
			}
		}
		lastErr := errors.Join(errs...)
		prevErr = lastErr
		if obs, ok := ctx.Value(observerKey{}).(func(error)); ok {
			obs(lastErr)
		}
		if allAbsent {
			return fmt.Errorf("%s: %w", what, lastErr)
		}
		if !retry {
			return fmt.Errorf("%s: %w", what, lastErr)
		}
		d := max(r.backoff(attempt), wait)
		if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < d {
			// Sleeping past the deadline only to fail later would hold the
			// reader for nothing: fail now with the reason.
			return fmt.Errorf("%s: giving up after %d attempts, next retry in %s is past the deadline: %w: %w",
				what, attempt+1, d.Round(time.Millisecond), context.DeadlineExceeded, lastErr)
		}
		log.G(ctx).WithError(lastErr).WithField("attempt", attempt+1).WithField("backoff", d).
			Warnf("%s: transient registry error, retrying", what)
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%s: %w (last error: %w)", what, ctx.Err(), lastErr)
		case <-t.C:
		}
	}
}

func (r *remote) try(ctx context.Context, h docker.RegistryHost, path string, header http.Header, accept func(*http.Response) error) error {
	scheme := h.Scheme
	if scheme == "" {
		scheme = "https"
	}
	u := scheme + "://" + h.Host + h.Path + "/" + r.repo + path
	client := h.Client
	if client == nil {
		client = http.DefaultClient
	}
	for authRetried := false; ; authRetried = true {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return permanent(fmt.Errorf("build request %s: %w", u, err))
		}
		for k, v := range h.Header {
			req.Header[k] = append([]string(nil), v...)
		}
		for k, v := range header {
			req.Header[k] = append([]string(nil), v...)
		}
		if h.Authorizer != nil {
			if err := h.Authorizer.Authorize(ctx, req); err != nil {
				err = fmt.Errorf("%s: authorize: %w", h.Host, err)
				// A token endpoint refusing our credentials will refuse
				// them again; one that is down or slow may recover.
				if se, ok := errors.AsType[remoteerrors.ErrUnexpectedStatus](err); ok && se.StatusCode >= 400 && se.StatusCode < 500 && se.StatusCode != http.StatusTooManyRequests && se.StatusCode != http.StatusRequestTimeout {
					return permanent(errors.Join(err, errdefs.ErrPermissionDenied))
				}
				return err
			}
		}
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("%s: %w", h.Host, err)
		}
		if resp.StatusCode == http.StatusUnauthorized && h.Authorizer != nil && !authRetried {
			// A challenge: first contact, or the token expired mid-run. The
			// authorizer fetches a fresh token; retry once with it.
			err := h.Authorizer.AddResponses(ctx, []*http.Response{resp})
			drain(resp)
			if err != nil {
				return permanent(fmt.Errorf("%s: handle auth challenge: %w", h.Host, err))
			}
			continue
		}
		err = handle(h.Host, resp, accept)
		drain(resp)
		return err
	}
}

func handle(host string, resp *http.Response, accept func(*http.Response) error) error {
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return accept(resp)
	}
	se := &statusError{host: host, code: resp.StatusCode, retryAfter: parseRetryAfter(resp.Header.Get("Retry-After"))}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
	se.body = strings.TrimSpace(string(b))
	return se
}

// drain lets the connection be reused when the rest of the body is small.
func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
}
