package peer

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The requester's deadlines follow the owner's progress: these owners are
// slow or stuck in each of the ways a loaded or broken node is, and each
// test checks who served the read and whether the owner was held against.
// Timeouts are seconds and the owners' pace tenths of a second, so that a
// test process starved for a while does not turn progress into a stall;
// no test asserts how long anything took.

// fetchAll fetches the test blob's frames through c and checks the bytes.
func fetchAll(t *testing.T, ctx context.Context, c *Client, reg *atomic.Int64) {
	t.Helper()
	layer, blob, frames := testBlob()
	got, err := c.Fetch(ctx, layer, frames, registryOf(blob, reg))
	if err != nil {
		t.Fatalf("fetch: %v", err)
	}
	for i, f := range frames {
		if !bytes.Equal(got[i], blob[f.Offset:f.Offset+f.Size]) {
			t.Fatalf("frame %d wrong", i)
		}
	}
}

// httpOwner is a peer served by handler on a real HTTP server.
func httpOwner(t *testing.T, handler http.HandlerFunc) *testPeer {
	t.Helper()
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	return &testPeer{addr: strings.TrimPrefix(srv.URL, "http://")}
}

// An owner whose own fetch of the frames (from the registry, on a busy
// link) takes longer than the timeout, but that reports progress while
// it fetches, serves the read: no hedge, no registry read, no bad mark.
// With a timeout on the whole answer it was given up and marked bad.
func TestOwnerFetchingSlowlyServes(t *testing.T) {
	layer, blob, _ := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	src := &memSource{layer: layer, blob: blob, fetching: 5 * time.Second}
	p := startPeer(t, src, Auth{Token: tok}, WithProgressEvery(100*time.Millisecond))
	// No hedge can happen within the test: what is checked is the timeout.
	c, m := clientTo(t, p, Auth{Token: tok}, Options{HedgeAfter: time.Hour, Timeout: 2 * time.Second})
	var reg atomic.Int64
	fetchAll(t, context.Background(), c, &reg)
	s := m.Stats(2)
	if reg.Load() != 0 || s.Outcomes[outcomeHit] != 1 || s.Outcomes[outcomeTimeout] != 0 || s.BadMarks != 0 {
		t.Errorf("%d registry reads, %+v: want the owner to serve, no timeout, no bad mark", reg.Load(), s)
	}
}

// An owner that sends its answer slowly but steadily, for longer than the
// timeout in all, serves the read: the timeout counts time without bytes.
func TestTricklingOwnerServes(t *testing.T) {
	_, blob, _ := testBlob()
	p := httpOwner(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(blob)))
		w.WriteHeader(http.StatusOK)
		// 50 pieces, a tenth of a second apart: 5 s in all.
		const piece = 60
		for off := 0; off < len(blob); off += piece {
			if _, err := w.Write(blob[off : off+piece]); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			time.Sleep(100 * time.Millisecond)
		}
	})
	c, m := clientTo(t, p, Auth{Token: writeToken(t, "a-token-of-enough-length")}, Options{HedgeAfter: time.Hour, Timeout: 2 * time.Second})
	var reg atomic.Int64
	fetchAll(t, context.Background(), c, &reg)
	s := m.Stats(2)
	if reg.Load() != 0 || s.Outcomes[outcomeHit] != 1 || s.BadMarks != 0 {
		t.Errorf("%d registry reads, %+v: want the trickling owner to serve, no bad mark", reg.Load(), s)
	}
}

// An owner that stops sending in the middle of its answer, its
// connection open, is given up after the timeout without progress: the
// registry serves the read and the owner is marked bad.
func TestOwnerStalledMidAnswerBypassed(t *testing.T) {
	_, blob, _ := testBlob()
	release := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	p := httpOwner(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(blob)))
		w.WriteHeader(http.StatusOK)
		w.Write(blob[:1500])
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	c, m := clientTo(t, p, Auth{Token: writeToken(t, "a-token-of-enough-length")}, Options{HedgeAfter: time.Hour, Timeout: time.Second})
	// Bounds the test if the stall were never noticed.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var reg atomic.Int64
	fetchAll(t, ctx, c, &reg)
	s := m.Stats(2)
	if reg.Load() != 1 || s.Outcomes[outcomeTimeout] != 1 || s.BadMarks != 1 {
		t.Errorf("%d registry reads, %+v: want one stall, read from the registry, the owner marked bad", reg.Load(), s)
	}
	if bad := c.BadPeers(); len(bad) != 1 || bad[0] != p.addr {
		t.Errorf("bad peers %v, want [%s]", bad, p.addr)
	}
}

// An owner that accepts connections and never answers (a hung daemon, or
// a host whose kernel still completes handshakes): the hedge serves the
// first read from the registry, and the request, left to run, marks the
// owner bad once it has shown no sign of life for the timeout, so later
// reads go to the registry without waiting for it. When a request ended
// with its read, a hung owner was never marked bad and every read waited
// a hedge delay.
func TestHungOwnerMarkedBad(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c) // held open, never read nor answered
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	p := &testPeer{addr: l.Addr().String()}
	c, m := clientTo(t, p, Auth{Token: writeToken(t, "a-token-of-enough-length")}, Options{HedgeAfter: 50 * time.Millisecond, Timeout: time.Second})
	var reg atomic.Int64
	fetchAll(t, context.Background(), c, &reg)
	if s := m.Stats(2); reg.Load() != 1 || s.Hedges != 1 {
		t.Fatalf("%d registry reads, %+v: want the hedge to serve the first read", reg.Load(), s)
	}
	waitFor(t, func() bool { return len(c.BadPeers()) == 1 })
	fetchAll(t, context.Background(), c, &reg)
	s := m.Stats(2)
	if reg.Load() != 2 || s.Requests != 1 || s.Hedges != 1 || s.Outcomes[outcomeTimeout] != 1 {
		t.Errorf("%d registry reads, %+v: want the second read from the registry without asking the hung owner", reg.Load(), s)
	}
}

// An owner whose own registry fetch fails answers 502: the requester
// reads from the registry at once and does not mark the owner bad (it is
// alive, and the registry failed it), so the next read asks it again.
func TestOwnerRegistryFailureNotHeldAgainst(t *testing.T) {
	layer, blob, _ := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	src := &memSource{layer: layer, blob: blob, fetchErr: errors.New("registry: 503 slow down")}
	p := startPeer(t, src, Auth{Token: tok})
	c, m := clientTo(t, p, Auth{Token: tok}, Options{HedgeAfter: time.Hour})
	var reg atomic.Int64
	for range 2 {
		fetchAll(t, context.Background(), c, &reg)
	}
	s := m.Stats(2)
	if reg.Load() != 2 || s.Requests != 2 || s.Outcomes[outcomeUpstream] != 2 || s.BadMarks != 0 || len(c.BadPeers()) != 0 {
		t.Errorf("%d registry reads, %+v, bad %v: want both reads to ask the owner, then the registry, no bad mark", reg.Load(), s, c.BadPeers())
	}
}

// An owner that always takes longer than HedgeAfter to show life (a
// starved node): the hedge delay follows what its first signs of life
// took, so reads wait for it instead of each asking the registry too.
func TestHedgeDelayFollowsOwner(t *testing.T) {
	layer, blob, _ := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	p := startPeer(t, &memSource{layer: layer, blob: blob, delay: 500 * time.Millisecond}, Auth{Token: tok})
	c, m := clientTo(t, p, Auth{Token: tok}, Options{HedgeAfter: 50 * time.Millisecond, Timeout: 10 * time.Second})
	var reg atomic.Int64
	const reads = 6
	for range reads {
		fetchAll(t, context.Background(), c, &reg)
	}
	// A fixed 50 ms delay hedges every read; one that follows the owner
	// hedges none unless the machine stalls the owner well past its
	// usual delay.
	if s := m.Stats(2); s.Hedges > 2 || s.Outcomes[outcomeHit] < reads-2 || s.BadMarks != 0 {
		t.Errorf("%d registry reads, %+v: want the owner to serve nearly every read unhedged", reg.Load(), s)
	}
	if d := c.hedgeDelay(p.addr); d < 500*time.Millisecond || d > 5*time.Second {
		t.Errorf("hedge delay %v after an owner showing life after 500 ms, want between that and half the timeout", d)
	}
}
