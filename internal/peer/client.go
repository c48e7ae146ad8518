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
	"net/http/httptrace"
	"net/textproto"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
)

// Defaults of a Client, all in one place.
//
// Every deadline follows the owner's progress rather than the clock
// alone: on a loaded node an owner can be slow (starved of CPU, or
// waiting on a registry link it shares with every other node) and still
// be alive and working, and giving up on it then costs twice: the
// registry sends the stripe to this node as well as to the owner, and an
// owner marked bad hands its stripes to the next one, which fetches them
// from the registry once more (docs/fetching.md, "Peer tier").
const (
	// DefaultHedgeAfter is the least a read waits for the owner's first
	// sign of life (its "102 Processing", sent as soon as it has checked
	// the request and before it fetches anything, or its answer) before
	// the registry is asked too. The wait itself follows how long that
	// owner's first sign of life took recently (hedgeDelay), as TCP's
	// retransmission timeout follows its round trips; this is its floor.
	// A dead owner refuses at once and needs no hedge, and a hung one is
	// marked bad by the request left running (probe), so the floor is
	// paid only by reads that meet a hung owner within Timeout; a floor
	// too low is paid by the registry, a stripe each time a loaded node's
	// first sign of life crosses it before the estimate has caught up
	// (31 hedges in the 4-node benchmark with a 200 ms floor, 0 with
	// 2 s). One second is TCP's initial retransmission timeout (RFC
	// 6298), where TCP knows nothing of the round trip either.
	DefaultHedgeAfter = time.Second
	// DefaultTimeout is how long a request to a peer may go without
	// progress: no sign of life before the answer, no byte of it after.
	// An owner reports progress every DefaultProgressEvery while it
	// fetches the frames from the registry, so a request lasts as long
	// as the owner keeps working on it (its serveTimeout at most), and a
	// stall, not a slow answer, is what times out. Past it the peer is
	// marked bad and the next owner or the registry serves the read.
	DefaultTimeout = 5 * time.Second
	// DefaultBadFor is how long a peer that failed, stalled or sent a
	// wrong byte is skipped (its stripes go to the next member). A peer
	// that restarted is used again after it.
	DefaultBadFor = 30 * time.Second
	// DefaultPort is the peer server's port when only a host is given.
	DefaultPort = 9168
	// initialHedge is the hedge delay for an owner that has not shown a
	// sign of life yet (RFC 6298's initial timeout): the first requests
	// of a cold start meet owners at their busiest, and a hedge sends the
	// stripe twice.
	initialHedge = time.Second
)

// Options configure a Client.
type Options struct {
	// Self is this node's address as it appears in the member list. When
	// empty, the member whose host is one of the node's interface
	// addresses and whose port is Port is this node (LocalAddress).
	Self string
	Port int
	// HedgeAfter (the least hedge delay), Timeout (the longest a request
	// may go without progress) and BadFor default to DefaultHedgeAfter,
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
	life    map[string]*lifeTime // peer -> how long it takes to show life
	selfFor []string             // member list selfAddr was computed for
	self    string
	keptFor []string // member list bad and life were last pruned to
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
		life:    map[string]*lifeTime{},
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
	if !sameList(c.keptFor, all) {
		c.keptFor = all
		c.forgetOthers(all)
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

// forgetOthers drops what the client remembers of peers that are no
// longer members: with members discovered by DNS, every pod a node ever
// saw (each rollout brings new addresses) would otherwise stay in bad and
// life for the daemon's lifetime. Called with c.mu held.
func (c *Client) forgetOthers(members []string) {
	for p := range c.bad {
		if !slices.Contains(members, p) {
			delete(c.bad, p)
		}
	}
	for p := range c.life {
		if !slices.Contains(members, p) {
			delete(c.life, p)
		}
	}
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

// Owns reports whether this node reads the stripe of layer holding offset
// from the registry itself, as Fetch would now: it owns the stripe among
// the live members, or no other member is live.
func (c *Client) Owns(layer digest.Digest, offset int64) bool {
	live, self := c.live()
	owner := Owner(StripeKey(layer, offset), live)
	return owner == "" || owner == self
}

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
	data [][]byte
	err  error
}

// lifeTime estimates how long an owner takes to show a first sign of life,
// as TCP estimates round trips (RFC 6298): a smoothed mean and a smoothed
// mean deviation.
type lifeTime struct{ mean, dev time.Duration }

// observe records that peer showed a first sign of life d after a request
// was sent.
func (c *Client) observe(peer string, d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	l, ok := c.life[peer]
	if !ok {
		c.life[peer] = &lifeTime{mean: d, dev: d / 2}
		return
	}
	diff := l.mean - d
	if diff < 0 {
		diff = -diff
	}
	l.dev = (3*l.dev + diff) / 4
	l.mean = (7*l.mean + d) / 8
}

// hedgeDelay is how long a read waits for peer's first sign of life before
// it asks the registry too: past what that peer's first signs of life
// took lately (twice the mean, or the mean and four deviations, whichever
// is longer: starvation delays come in bursts), never less than
// HedgeAfter, and at most half of Timeout, so that the registry is asked
// well before a silent owner is given up.
func (c *Client) hedgeDelay(peer string) time.Duration {
	d := initialHedge
	c.mu.Lock()
	if l, ok := c.life[peer]; ok {
		d = max(2*l.mean, l.mean+4*l.dev)
	}
	c.mu.Unlock()
	return min(max(d, c.o.HedgeAfter), max(c.o.HedgeAfter, c.o.Timeout/2))
}

// hedged asks owner for frames and, if the owner has shown no sign of life
// after hedgeDelay, the registry too; the first good answer wins. When the
// owner fails (and is marked bad), failover serves instead.
func (c *Client) hedged(ctx context.Context, owner string, layer digest.Digest, frames []Frame, registry, failover Registry) ([][]byte, error) {
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel() // a registry read that lost stops
	// The owner's request may outlive the read (see probe), so it does
	// not end with ctx; every return below but that one cancels it.
	pctx, pcancel := context.WithCancel(context.WithoutCancel(ctx))
	alive := make(chan struct{})
	pch := make(chan answer, 1)
	go func() {
		data, err := c.get(pctx, owner, layer, frames, func() { close(alive) })
		pch <- answer{data, err}
	}()
	probing := false
	defer func() {
		if probing {
			go c.probe(context.WithoutCancel(ctx), owner, alive, pch, pcancel)
		} else {
			pcancel()
		}
	}()
	rch := make(chan answer, 1)
	regStarted, regPending, peerPending := false, false, true
	startRegistry := func(r Registry) {
		regStarted, regPending = true, true
		go func() {
			data, err := r(rctx, frames)
			rch <- answer{data, err}
		}()
	}
	hedge := time.NewTimer(c.hedgeDelay(owner))
	defer hedge.Stop()
	waitAlive := alive
	var regErr error
	for peerPending || regPending {
		select {
		case <-waitAlive:
			// The owner is alive and working: no hedge; from now on
			// only a stall (Timeout without progress) gives it up.
			hedge.Stop()
			waitAlive = nil
		case <-hedge.C:
			if waitAlive != nil {
				select {
				case <-waitAlive:
					// Both were ready: a starved requester must not
					// hedge an owner that answered in time.
					waitAlive = nil
					continue
				default:
				}
			}
			if !regStarted {
				c.metrics.hedge()
				startRegistry(registry)
			}
		case a := <-pch:
			peerPending = false
			if a.err == nil {
				return a.data, nil
			}
			fallback := registry
			if c.peerFailed(ctx, owner, a.err) {
				fallback = failover
			}
			if !regStarted {
				startRegistry(fallback)
			}
		case a := <-rch:
			regPending = false
			if a.err == nil {
				select {
				case <-alive:
				default:
					probing = peerPending
				}
				return a.data, nil
			}
			regErr = a.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return nil, regErr
}

// probe follows a request whose read the registry served before the owner
// showed any sign of life. An owner that shows one later was slow, not
// gone: its answer is not needed any more, and it is not held against it.
// One that stays silent until the request stalls (Timeout) is hung: it is
// marked bad, so that later reads do not each wait a hedge delay for it,
// as they would if the request ended with the read.
func (c *Client) probe(ctx context.Context, owner string, alive <-chan struct{}, pch <-chan answer, cancel context.CancelFunc) {
	defer cancel()
	select {
	case <-alive:
	case a := <-pch:
		if a.err != nil {
			c.peerFailed(ctx, owner, a.err)
		}
	}
}

// peerFailed records why a peer's answer was not used, and marks it bad
// (reporting true) unless the reason was ours (we gave up), it simply
// lacks the layer, it is busy, or its own registry fetch failed: only a
// peer that is unreachable, cuts its answer short, stalls or sends wrong
// bytes is skipped.
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
	case errors.As(err, &se) && se.code == http.StatusBadGateway:
		// Alive, and it tried: the registry failed it (this node's
		// read now tries the registry itself, with its own retries).
		c.metrics.outcome(outcomeUpstream)
		return false
	case errors.Is(err, errStalled):
		c.metrics.outcome(outcomeTimeout)
	default:
		c.metrics.outcome(outcomeError)
	}
	c.markBad(ctx, peer, err)
	return true
}

// ErrCorrupt is a peer's frame whose bytes do not match its digest.
var ErrCorrupt = errors.New("peer sent bytes that do not match their digest")

// errStalled is a request to a peer cut because the peer made no progress
// for Timeout.
var errStalled = errors.New("no progress")

type statusError struct {
	peer string
	code int
	body string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("peer %s: status %d: %s", e.peer, e.code, e.body)
}

// progressReader reports every read that returns bytes.
type progressReader struct {
	r        io.Reader
	progress func()
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 {
		p.progress()
	}
	return n, err
}

// get asks peer for frames of layer and verifies every one. alive is
// called at the owner's first sign of life: an interim response (the
// owner checked the request and is fetching) or its answer. The request
// is cut when the owner makes no progress, interim responses and answer
// bytes alike, for Timeout.
func (c *Client) get(ctx context.Context, peer string, layer digest.Digest, frames []Frame, alive func()) ([][]byte, error) {
	c.metrics.request()
	body, err := json.Marshal(request{Layer: layer, Frames: frames})
	if err != nil {
		return nil, err
	}
	ctx, stall := context.WithCancelCause(ctx)
	defer stall(nil)
	watchdog := time.AfterFunc(c.o.Timeout, func() { stall(errStalled) })
	defer watchdog.Stop()
	progress := func() { watchdog.Reset(c.o.Timeout) }
	sent := time.Now()
	var once sync.Once
	life := func() {
		progress()
		once.Do(func() {
			c.observe(peer, time.Since(sent))
			alive()
		})
	}
	failed := func(what string, err error) error {
		if context.Cause(ctx) == errStalled {
			return fmt.Errorf("peer %s: %s: %w for %s", peer, what, errStalled, c.o.Timeout)
		}
		return fmt.Errorf("peer %s: %s: %w", peer, what, err)
	}
	trace := &httptrace.ClientTrace{Got1xxResponse: func(int, textproto.MIMEHeader) error {
		life()
		return nil
	}}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, c.scheme+"://"+peer+FramesPath, bytes.NewReader(body))
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
		return nil, failed("request", err)
	}
	defer resp.Body.Close()
	life()
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
	r := &progressReader{r: resp.Body, progress: progress}
	out := make([][]byte, len(frames))
	for i, f := range frames {
		b := make([]byte, f.Size)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, failed("read frame "+f.Digest.String(), err)
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
