// Package netshape shapes the link between a benchmark and its registry so
// that lazy and full pulls are compared over a realistic network on one
// machine: a round-trip time added by an in-process TCP proxy (these
// kernels have no netem) and a bandwidth cap from an htb qdisc on a veth
// pair into a private network namespace (or, where htb is missing, a token
// bucket in the proxy).
//
// Invariant: nothing here sends a packet off this machine. The proxy only
// dials the target it is given (a loopback or namespace address), and the
// namespace addresses come from 198.18.0.0/15, the range reserved for
// benchmarking, routed only to a veth that exists while the Link does.
package netshape

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sync/semaphore"
)

// Defaults for a LatencyProxy.
const (
	// DefaultChunkSize is the largest read forwarded as one unit. A delay
	// line holds many chunks in flight, so throughput is not one chunk per
	// round trip.
	DefaultChunkSize = 64 << 10
	// DefaultQueueBytes bounds the bytes in flight in one direction. It
	// must exceed the bandwidth-delay product (1 Gbit/s x 10 ms is
	// 1.25 MB) or the queue, not the link, caps throughput.
	DefaultQueueBytes = 8 << 20
)

// ProxyOpt configures a LatencyProxy.
type ProxyOpt func(*proxyConfig)

type proxyConfig struct {
	oneWay     time.Duration
	rate       int64 // bytes per second per direction; 0 is unlimited
	chunkSize  int
	queueBytes int
}

// WithRTT adds rtt to every round trip: half of it in each direction.
func WithRTT(rtt time.Duration) ProxyOpt {
	return func(c *proxyConfig) { c.oneWay = rtt / 2 }
}

// WithOneWayDelay delays every byte by d in each direction.
func WithOneWayDelay(d time.Duration) ProxyOpt {
	return func(c *proxyConfig) { c.oneWay = d }
}

// WithRateLimit caps each direction of each connection at bitsPerSecond.
// Use it where no htb qdisc can shape the link; a cap in the proxy is per
// connection, not shared by the connections as a real link is.
func WithRateLimit(bitsPerSecond int64) ProxyOpt {
	return func(c *proxyConfig) { c.rate = bitsPerSecond / 8 }
}

// WithChunkSize sets the largest read forwarded as one unit.
func WithChunkSize(n int) ProxyOpt {
	return func(c *proxyConfig) { c.chunkSize = n }
}

// LatencyProxy forwards TCP connections from a loopback listener to a
// target, delaying each direction by a fixed one-way time. It is a delay
// line: every chunk read is stamped with the time it may leave and queued;
// a writer releases chunks when due, so many chunks are in flight at once,
// as on a real link.
type LatencyProxy struct {
	cfg    proxyConfig
	target string
	ln     net.Listener

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{}

	bytesUp   atomic.Int64 // client to target
	bytesDown atomic.Int64 // target to client
	accepted  atomic.Int64
}

// ProxyStats counts what crossed a proxy.
type ProxyStats struct {
	Connections int64
	BytesUp     int64 // client to target
	BytesDown   int64 // target to client
}

// NewLatencyProxy listens on listenAddr (e.g. "127.0.0.1:0") and forwards
// every connection to target. Close stops it and every connection.
func NewLatencyProxy(ctx context.Context, listenAddr, target string, opts ...ProxyOpt) (*LatencyProxy, error) {
	cfg := proxyConfig{chunkSize: DefaultChunkSize, queueBytes: DefaultQueueBytes}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.oneWay < 0 || cfg.rate < 0 || cfg.chunkSize <= 0 {
		return nil, fmt.Errorf("latency proxy: invalid config delay=%v rate=%d chunk=%d", cfg.oneWay, cfg.rate, cfg.chunkSize)
	}
	if cfg.queueBytes < cfg.chunkSize {
		cfg.queueBytes = cfg.chunkSize
	}
	ln, err := net.Listen("tcp", listenAddr)
	if err != nil {
		return nil, fmt.Errorf("latency proxy: listen %s: %w", listenAddr, err)
	}
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p := &LatencyProxy{
		cfg:    cfg,
		target: target,
		ln:     ln,
		ctx:    pctx,
		cancel: cancel,
		conns:  make(map[net.Conn]struct{}),
	}
	p.wg.Add(1)
	go p.acceptLoop()
	log.G(ctx).WithField("listen", ln.Addr().String()).WithField("target", target).
		WithField("one_way_delay", cfg.oneWay).WithField("rate_bytes_per_s", cfg.rate).
		Debug("latency proxy started")
	return p, nil
}

// Addr is the address clients connect to.
func (p *LatencyProxy) Addr() string { return p.ln.Addr().String() }

// OneWayDelay is the delay added in each direction.
func (p *LatencyProxy) OneWayDelay() time.Duration { return p.cfg.oneWay }

// RateLimit is the per-direction cap in bits per second, 0 when unlimited.
func (p *LatencyProxy) RateLimit() int64 { return p.cfg.rate * 8 }

// Stats reports the connections and bytes forwarded so far.
func (p *LatencyProxy) Stats() ProxyStats {
	return ProxyStats{Connections: p.accepted.Load(), BytesUp: p.bytesUp.Load(), BytesDown: p.bytesDown.Load()}
}

// Close stops accepting, closes every open connection and waits for the
// forwarding goroutines to end.
func (p *LatencyProxy) Close() error {
	p.cancel()
	err := p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (p *LatencyProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *LatencyProxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

func (p *LatencyProxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if p.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				log.G(p.ctx).WithError(err).Warn("latency proxy: accept")
			}
			return
		}
		p.accepted.Add(1)
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *LatencyProxy) serve(client net.Conn) {
	defer p.wg.Done()
	if !p.track(client) {
		client.Close()
		return
	}
	defer p.untrack(client)
	var d net.Dialer
	upstream, err := d.DialContext(p.ctx, "tcp", p.target)
	if err != nil {
		log.G(p.ctx).WithError(err).WithField("target", p.target).Warn("latency proxy: dial target")
		return
	}
	if !p.track(upstream) {
		upstream.Close()
		return
	}
	defer p.untrack(upstream)

	var fwd sync.WaitGroup
	fwd.Add(2)
	go func() {
		defer fwd.Done()
		p.pipe(client, upstream, &p.bytesUp)
	}()
	go func() {
		defer fwd.Done()
		p.pipe(upstream, client, &p.bytesDown)
	}()
	fwd.Wait()
}

// chunk is one read travelling through the delay line.
type chunk struct {
	buf []byte
	due time.Time
	err error // io.EOF or a read error: the last chunk of a direction
}

// pipe forwards src to dst through a delay line. The reader stamps each
// chunk with the time it may leave; the writer sleeps until then. With a
// rate limit the leave time is also pushed back so that chunks leave no
// faster than the rate (serialisation delay), measured on a virtual clock
// so that timer slack does not accumulate into a lower rate.
//
// Bytes in flight are bounded by queueBytes, counted in bytes rather than
// chunks: on a busy machine reads return small pieces, and a bound in
// chunks would then hold less than the bandwidth-delay product and cap
// throughput below the link's rate.
func (p *LatencyProxy) pipe(src, dst net.Conn, counter *atomic.Int64) {
	inflight := semaphore.NewWeighted(int64(p.cfg.queueBytes))
	queue := make(chan chunk, 1024)
	pool := &sync.Pool{New: func() any { return make([]byte, p.cfg.chunkSize) }}
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.writeLoop(dst, src, queue, inflight, pool, counter)
	}()
	defer func() {
		close(queue)
		<-done
	}()

	size := int64(p.cfg.chunkSize)
	for {
		if err := inflight.Acquire(p.ctx, size); err != nil {
			return
		}
		buf := pool.Get().([]byte)
		n, err := src.Read(buf)
		now := time.Now()
		inflight.Release(size - int64(n))
		if n > 0 {
			queue <- chunk{buf: buf[:n], due: now.Add(p.cfg.oneWay)}
		} else {
			pool.Put(buf)
		}
		if err != nil {
			queue <- chunk{due: now.Add(p.cfg.oneWay), err: err}
			return
		}
	}
}

// writeLoop releases queued chunks to dst when due. After a failure it
// keeps draining the queue so the reader never blocks on it.
func (p *LatencyProxy) writeLoop(dst, src net.Conn, queue <-chan chunk, inflight *semaphore.Weighted, pool *sync.Pool, counter *atomic.Int64) {
	var next time.Time // virtual clock of the rate limiter
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	failed := false
	fail := func() {
		failed = true
		src.Close()
		dst.Close()
	}
	for c := range queue {
		if len(c.buf) > 0 {
			release := func() {
				inflight.Release(int64(len(c.buf)))
				pool.Put(c.buf[:cap(c.buf)])
			}
			if failed {
				release()
				continue
			}
			due := c.due
			if p.cfg.rate > 0 {
				// A chunk starts leaving when it is due and the previous
				// one has left; it has left after len/rate.
				if next.Before(due) {
					next = due
				}
				next = next.Add(time.Duration(int64(len(c.buf)) * int64(time.Second) / p.cfg.rate))
				due = next
			}
			if !p.sleepUntil(timer, due) {
				fail()
				release()
				continue
			}
			// Counted when released, so a reader that has the bytes also
			// sees them in Stats.
			counter.Add(int64(len(c.buf)))
			_, err := dst.Write(c.buf)
			release()
			if err != nil {
				fail()
			}
			continue
		}
		if c.err == nil || failed {
			continue
		}
		if !p.sleepUntil(timer, c.due) {
			fail()
			continue
		}
		// Pass the end of the stream on as a half close so that
		// request/response protocols see it; on a read error close both
		// ends.
		if errors.Is(c.err, io.EOF) {
			if cw, ok := dst.(interface{ CloseWrite() error }); ok {
				cw.CloseWrite()
				continue
			}
		}
		fail()
	}
}

// sleepUntil waits for t; false when the proxy is closing.
func (p *LatencyProxy) sleepUntil(timer *time.Timer, t time.Time) bool {
	wait := time.Until(t)
	if wait <= 0 {
		return p.ctx.Err() == nil
	}
	timer.Reset(wait)
	select {
	case <-timer.C:
		return true
	case <-p.ctx.Done():
		return false
	}
}
