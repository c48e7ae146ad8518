package peer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
)

// Defaults of a Client, all in one place.
const (
	// DefaultHedgeAfter is how long a read waits for the owner to accept
	// the request (answer headers, sent before it fetches anything)
	// before the registry is asked too: a LAN round trip plus the
	// owner's scheduling. Timing the whole answer instead would hedge
	// whenever the owner waits on the registry for the frames (a round
	// trip of 20 ms on the link we are measured on, more under load), and
	// the registry would send those frames twice.
	DefaultHedgeAfter = 200 * time.Millisecond
	// DefaultTimeout bounds one request to a peer, body included; past
	// it the peer is marked bad and the registry serves the read.
	DefaultTimeout = 5 * time.Second
	// DefaultBadFor is how long a peer that failed, timed out or sent a
	// wrong byte is skipped (its stripes go to the next member). A peer
	// that restarted is used again after it.
	DefaultBadFor = 30 * time.Second
	// DefaultPort is the peer server's port when only a host is given.
	DefaultPort = 9168
)

// Options configure a Client.
type Options struct {
	// Self is this node's address as it appears in the member list. When
	// empty, the member whose host is one of the node's interface
	// addresses and whose port is Port is this node (LocalAddress).
	Self string
	Port int
	// HedgeAfter, Timeout and BadFor default to DefaultHedgeAfter,
	// DefaultTimeout and DefaultBadFor when zero.
	HedgeAfter time.Duration
	Timeout    time.Duration
	BadFor     time.Duration
}

// Client fetches frames from their owners. It is safe for concurrent use.
type Client struct {
	members Members
	auth    Auth
	o       Options
	http    *http.Client
	scheme  string
	metrics *Metrics

	mu      sync.Mutex
	bad     map[string]time.Time // peer -> until
	selfFor []string             // member list selfAddr was computed for
	self    string
}

// NewClient returns a client of the peers members lists.
func NewClient(members Members, auth Auth, o Options, m *Metrics) (*Client, error) {
	if err := auth.validate(); err != nil {
		return nil, err
	}
	if o.HedgeAfter <= 0 {
		o.HedgeAfter = DefaultHedgeAfter
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.BadFor <= 0 {
		o.BadFor = DefaultBadFor
	}
	if o.Port == 0 {
		o.Port = DefaultPort
	}
	tr := &http.Transport{
		// A dead peer must be noticed well within the hedge delay.
		DialContext:         (&net.Dialer{Timeout: min(o.Timeout, time.Second)}).DialContext,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
		ForceAttemptHTTP2:   false,
	}
	scheme := "http"
	if auth.TLS != nil {
		_, ctls, err := auth.TLS.configs()
		if err != nil {
			return nil, err
		}
		tr.TLSClientConfig = ctls
		scheme = "https"
	}
	return &Client{
		members: members,
		auth:    auth,
		o:       o,
		http:    &http.Client{Transport: tr},
		scheme:  scheme,
		metrics: m,
		bad:     map[string]time.Time{},
	}, nil
}

// live returns the members not marked bad (this node always counts as
// live) and this node's address among them ("" if it is not listed).
func (c *Client) live() (live []string, self string) {
	all := c.members.Members()
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	self = c.o.Self
	if self == "" {
		if !sameList(c.selfFor, all) {
			c.selfFor, c.self = all, ""
			for _, m := range all {
				if LocalAddress(m, c.o.Port) {
					c.self = m
					break
				}
			}
		}
		self = c.self
	}
	live = make([]string, 0, len(all))
	for _, m := range all {
		if until, ok := c.bad[m]; ok && m != self {
			if now.Before(until) {
				continue
			}
			delete(c.bad, m)
		}
		live = append(live, m)
	}
	return live, self
}

func sameList(a, b []string) bool {
	if len(a) != len(b) || len(a) == 0 {
		return false
	}
	return &a[0] == &b[0]
}

// markBad skips peer for BadFor.
func (c *Client) markBad(ctx context.Context, peer string, err error) {
	c.mu.Lock()
	_, already := c.bad[peer]
	c.bad[peer] = time.Now().Add(c.o.BadFor)
	c.mu.Unlock()
	if !already {
		c.metrics.badMark()
		log.G(ctx).WithError(err).WithField("peer", peer).WithField("for", c.o.BadFor).Warn("peer marked bad")
	}
}

// BadPeers returns the peers skipped now.
func (c *Client) BadPeers() []string {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for p, until := range c.bad {
		if now.Before(until) {
			out = append(out, p)
		}
	}
	return out
}

// Members returns the current member list.
func (c *Client) Members() []string { return c.members.Members() }

// Registry fetches frames from the registry, each verified; it is the tier
// below the peers.
type Registry func(ctx context.Context, frames []Frame) ([][]byte, error)

// Fetch returns the compressed bytes of frames (sorted by offset) of layer,
// each verified against its digest: the frames of stripes another member
// owns from that member, hedged with registry; those this node owns (or
// all, when no other member is live) from registry directly.
func (c *Client) Fetch(ctx context.Context, layer digest.Digest, frames []Frame, registry Registry) ([][]byte, error) {
	live, self := c.live()
	out := make([][]byte, len(frames))
	g, gctx := errgroup.WithContext(ctx)
	for start := 0; start < len(frames); {
		key := StripeKey(layer, frames[start].Offset)
		end := start + 1
		for end < len(frames) && StripeKey(layer, frames[end].Offset) == key {
			end++
		}
		group, at := frames[start:end], start
		owner := Owner(key, live)
		g.Go(func() error {
			var (
				data [][]byte
				err  error
			)
			if owner == "" || owner == self {
				data, err = registry(gctx, group)
			} else {
				// An owner that fails hands the stripe to the next one by
				// rendezvous (the one every node will use from now on)
				// rather than the registry: with many requesters meeting
				// a dead owner, the registry would send the stripe once
				// per requester (docs/scale.md).
				failover := func(ctx context.Context, fs []Frame) ([][]byte, error) {
					live, self := c.live()
					if next := Owner(key, live); next != "" && next != self && next != owner {
						return c.hedged(ctx, next, layer, fs, registry, registry)
					}
					return registry(ctx, fs)
				}
				data, err = c.hedged(gctx, owner, layer, group, registry, failover)
			}
			if err != nil {
				return err
			}
			copy(out[at:], data)
			return nil
		})
		start = end
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return out, nil
}

type answer struct {
	data  [][]byte
	err   error
	fromP bool
}

// hedged asks owner for frames and, if it has not answered after
// HedgeAfter, the registry too; the first good answer wins. When the owner
// fails (and is marked bad), failover serves instead.
func (c *Client) hedged(ctx context.Context, owner string, layer digest.Digest, frames []Frame, registry, failover Registry) ([][]byte, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // the loser stops
	ch := make(chan answer, 2)
	pctx, pcancel := context.WithTimeout(ctx, c.o.Timeout)
	defer pcancel()
	accepted := make(chan struct{})
	go func() {
		data, err := c.get(pctx, owner, layer, frames, func() { close(accepted) })
		ch <- answer{data, err, true}
	}()
	regStarted := false
	startRegistry := func(r Registry) {
		regStarted = true
		go func() {
			data, err := r(ctx, frames)
			ch <- answer{data, err, false}
		}()
	}
	hedge := time.NewTimer(c.o.HedgeAfter)
	defer hedge.Stop()
	pending := 1
	var regErr error
	for pending > 0 || !regStarted {
		select {
		case <-accepted:
			// The owner is alive and serving: no hedge, it has Timeout.
			hedge.Stop()
			accepted = nil
		case <-hedge.C:
			if !regStarted {
				c.metrics.hedge()
				startRegistry(registry)
				pending++
			}
		case a := <-ch:
			pending--
			if a.fromP {
				if a.err == nil {
					return a.data, nil
				}
				fallback := registry
				if c.peerFailed(ctx, owner, a.err) {
					fallback = failover
				}
				if !regStarted {
					startRegistry(fallback)
					pending++
				}
				continue
			}
			if a.err == nil {
				return a.data, nil
			}
			regErr = a.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return nil, regErr
}

// peerFailed records why a peer's answer was not used, and marks it bad
// (reporting true) unless the reason was ours (we gave up), it simply
// lacks the layer, or it is busy.
func (c *Client) peerFailed(ctx context.Context, peer string, err error) bool {
	var se *statusError
	switch {
	case ctx.Err() != nil:
		return false
	case errors.Is(err, ErrCorrupt):
		c.metrics.outcome(outcomeCorrupt)
	case errors.As(err, &se) && se.code == http.StatusNotFound:
		c.metrics.outcome(outcomeUnknown)
		return false
	case errors.As(err, &se) && se.code == http.StatusServiceUnavailable:
		// Busy, not broken: its next request may be answered.
		c.metrics.outcome(outcomeBusy)
		return false
	case errors.Is(err, context.DeadlineExceeded):
		c.metrics.outcome(outcomeTimeout)
	default:
		c.metrics.outcome(outcomeError)
	}
	c.markBad(ctx, peer, err)
	return true
}

// ErrCorrupt is a peer's frame whose bytes do not match its digest.
var ErrCorrupt = errors.New("peer sent bytes that do not match their digest")

type statusError struct {
	peer string
	code int
	body string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("peer %s: status %d: %s", e.peer, e.code, e.body)
}

// get asks peer for frames of layer and verifies every one.
// accepted is called once the owner has answered that it will serve.
func (c *Client) get(ctx context.Context, peer string, layer digest.Digest, frames []Frame, accepted func()) ([][]byte, error) {
	c.metrics.request()
	body, err := json.Marshal(request{Layer: layer, Frames: frames})
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.scheme+"://"+peer+FramesPath, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("peer %s: build request: %w", peer, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if c.auth.Token != nil {
		if err := c.auth.Token.authorize(req); err != nil {
			return nil, err
		}
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("peer %s: %w", peer, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
		return nil, &statusError{peer: peer, code: resp.StatusCode, body: string(bytes.TrimSpace(b))}
	}
	var total int64
	for _, f := range frames {
		total += f.Size
	}
	if resp.ContentLength != total {
		return nil, fmt.Errorf("peer %s: %d bytes announced for %d bytes of frames: %w", peer, resp.ContentLength, total, ErrCorrupt)
	}
	accepted()
	out := make([][]byte, len(frames))
	for i, f := range frames {
		b := make([]byte, f.Size)
		if _, err := io.ReadFull(resp.Body, b); err != nil {
			return nil, fmt.Errorf("peer %s: read frame %s: %w", peer, f.Digest, err)
		}
		if got := f.Digest.Algorithm().FromBytes(b); got != f.Digest {
			return nil, fmt.Errorf("peer %s: frame at %d of %s has digest %s, want %s: %w", peer, f.Offset, layer, got, f.Digest, ErrCorrupt)
		}
		out[i] = b
	}
	c.metrics.outcome(outcomeHit)
	c.metrics.fetched(total)
	return out, nil
}

// Port returns the port of a listen address (":9168", "0.0.0.0:9168").
func Port(listen string) (int, error) {
	_, p, err := net.SplitHostPort(listen)
	if err != nil {
		return 0, fmt.Errorf("peer listen address %q: %w", listen, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n > 65535 {
		return 0, fmt.Errorf("peer listen address %q: bad port", listen)
	}
	return n, nil
}
