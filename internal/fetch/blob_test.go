package fetch

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/envsnap/envsnap/layerfmt"
)

const testRef = "registry.test/envsnap/base:1"

// fastRetry keeps fault tests quick; the policy shape is the same.
var fastRetry = WithBackoff(5*time.Millisecond, 50*time.Millisecond)

func TestReadRangeFaults(t *testing.T) {
	blob := randBytes(rand.New(rand.NewPCG(3, 4)), 300000)
	tests := []struct {
		name     string
		faults   []fault
		latency  time.Duration
		noRange  bool
		requests int // blob GETs the read must take
		ranges   [][2]int64
	}{
		{name: "clean", requests: 1},
		{name: "added latency", latency: 30 * time.Millisecond, requests: 1},
		{name: "connection reset mid-body", faults: []fault{faultReset}, requests: 2},
		{name: "truncated body", faults: []fault{faultTruncate, faultTruncate}, requests: 3},
		{name: "5xx", faults: []fault{fault503, fault503}, requests: 3},
		{name: "range ignored", noRange: true, requests: 1},
		// The window is past the cut: the whole read must be retried.
		{name: "range ignored and truncated", noRange: true, faults: []fault{faultTruncate}, requests: 2,
			ranges: [][2]int64{{int64(len(blob)) - 7, 7}, {200000, 1000}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkGoroutines(t)
			reg := newFakeRegistry(t)
			desc := reg.addBlob(blob)
			reg.setFaults(faultNone, tt.faults...)
			reg.latency, reg.noRange = tt.latency, tt.noRange
			br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
			if err != nil {
				t.Fatal(err)
			}
			ranges := tt.ranges
			if ranges == nil {
				ranges = [][2]int64{{100000, 5000}, {0, 1}, {int64(len(blob)) - 7, 7}}
			}
			for _, r := range ranges {
				reg.resetCounts()
				reg.setFaults(faultNone, tt.faults...)
				got, err := br.ReadRange(context.Background(), r[0], r[1])
				if err != nil {
					t.Fatalf("ReadRange(%d, %d): %v", r[0], r[1], err)
				}
				if !bytes.Equal(got, blob[r[0]:r[0]+r[1]]) {
					t.Fatalf("ReadRange(%d, %d): wrong bytes", r[0], r[1])
				}
				if n := reg.requests(); n != tt.requests {
					t.Errorf("ReadRange(%d, %d) took %d requests, want %d", r[0], r[1], n, tt.requests)
				}
				for _, h := range reg.rangeLog() {
					if strings.Contains(h, ",") || !strings.HasPrefix(h, "bytes=") {
						t.Errorf("sent Range %q, want one single range", h)
					}
				}
			}
			if br.RangeIgnored() != tt.noRange {
				t.Errorf("RangeIgnored() = %v, want %v", br.RangeIgnored(), tt.noRange)
			}
		})
	}
}

func TestReadRange429HonoursRetryAfter(t *testing.T) {
	checkGoroutines(t)
	reg := newFakeRegistry(t)
	blob := []byte("0123456789abcdef")
	desc := reg.addBlob(blob)
	reg.setFaults(faultNone, fault429)
	br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
	if err != nil {
		t.Fatal(err)
	}
	got, err := br.ReadRange(context.Background(), 4, 4)
	if err != nil || string(got) != "4567" {
		t.Fatalf("ReadRange = %q, %v", got, err)
	}
	reg.mu.Lock()
	times := reg.times
	reg.mu.Unlock()
	if len(times) != 2 {
		t.Fatalf("%d requests, want 2", len(times))
	}
	// The server asked for one second; our own backoff is 5 ms.
	if gap := times[1].Sub(times[0]); gap < time.Second {
		t.Errorf("retried %s after a 429 with Retry-After: 1", gap)
	}

	// When Retry-After is past the deadline, fail now instead of waiting.
	reg.setFaults(fault429)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = br.ReadRange(ctx, 0, 4)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "429") {
		t.Fatalf("429 past deadline: %v", err)
	}
	if ctx.Err() != nil {
		t.Errorf("gave up only at the deadline instead of right away")
	}
}

func TestReadRangeDeadline(t *testing.T) {
	tests := []struct {
		name    string
		always  fault
		latency time.Duration
		reason  string
	}{
		{"persistent 503", fault503, 0, "503"},
		{"persistent resets", faultReset, 0, "reset"},
		{"registry slower than deadline", faultNone, 3 * time.Second, "deadline"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkGoroutines(t)
			reg := newFakeRegistry(t)
			desc := reg.addBlob(randBytes(rand.New(rand.NewPCG(5, 6)), 10000))
			reg.setFaults(tt.always)
			reg.latency = tt.latency
			br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
			defer cancel()
			got, err := br.ReadRange(ctx, 10, 100)
			if err == nil || got != nil {
				t.Fatalf("ReadRange succeeded against %s", tt.name)
			}
			if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), tt.reason) {
				t.Fatalf("error %q: want deadline exceeded mentioning %q", err, tt.reason)
			}
		})
	}
}

func TestReadRangeRedirectKeepsRange(t *testing.T) {
	checkGoroutines(t)
	reg := newFakeRegistry(t)
	blob := randBytes(rand.New(rand.NewPCG(7, 8)), 50000)
	desc := reg.addBlob(blob)
	storage, hits := storageServer(t, reg)
	reg.redirect = storage.URL
	br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
	if err != nil {
		t.Fatal(err)
	}
	got, err := br.ReadRange(context.Background(), 1234, 4321)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, blob[1234:1234+4321]) || hits.Load() != 1 {
		t.Fatalf("redirected read: equal=%v storage hits=%d", bytes.Equal(got, blob[1234:1234+4321]), hits.Load())
	}
}

func TestMirrorFallback(t *testing.T) {
	blob := randBytes(rand.New(rand.NewPCG(9, 10)), 20000)
	tests := []struct {
		name   string
		mirror fault
	}{
		{"mirror lacks blob", fault404},
		{"mirror down", fault503},
		{"mirror resets", faultReset},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkGoroutines(t)
			mirror, upstream := newFakeRegistry(t), newFakeRegistry(t)
			desc := upstream.addBlob(blob)
			mirror.addBlob(blob)
			mirror.setFaults(tt.mirror)
			br, err := NewBlobReader(hostsFor(nil, mirror, upstream), testRef, desc, fastRetry)
			if err != nil {
				t.Fatal(err)
			}
			got, err := br.ReadRange(context.Background(), 100, 200)
			if err != nil || !bytes.Equal(got, blob[100:300]) {
				t.Fatalf("ReadRange: %v", err)
			}
			if mirror.requests() != 1 || upstream.requests() != 1 {
				t.Errorf("mirror %d, upstream %d requests; want mirror tried first, then upstream", mirror.requests(), upstream.requests())
			}
		})
	}

	t.Run("absent everywhere", func(t *testing.T) {
		a, b := newFakeRegistry(t), newFakeRegistry(t)
		desc := a.addBlob(blob)
		a.setFaults(fault404)
		br, err := NewBlobReader(hostsFor(nil, a, b), testRef, desc, fastRetry)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := br.ReadRange(context.Background(), 0, 10); !errdefs.IsNotFound(err) {
			t.Fatalf("want ErrNotFound, got %v", err)
		}
		if a.requests() != 1 || b.requests() != 1 {
			t.Errorf("not found is not worth retrying: %d+%d requests", a.requests(), b.requests())
		}
	})
}

// TestTokenAuth runs the bearer flow with containerd's authorizer: 401 with a
// challenge, token fetch, then a revocation mid-run (the registry answers
// invalid_token) and a transparent refresh.
func TestTokenAuth(t *testing.T) {
	checkGoroutines(t)
	reg := newFakeRegistry(t)
	reg.auth = true
	blob := randBytes(rand.New(rand.NewPCG(11, 12)), 40000)
	desc := reg.addBlob(blob)
	hosts := config.ConfigureHosts(context.Background(), config.HostOptions{
		DefaultScheme: "http",
	})
	ref := reg.host() + "/envsnap/base:1"
	br, err := NewBlobReader(hosts, ref, desc, fastRetry)
	if err != nil {
		t.Fatal(err)
	}
	read := func(off int64) {
		t.Helper()
		got, err := br.ReadRange(context.Background(), off, 1000)
		if err != nil || !bytes.Equal(got, blob[off:off+1000]) {
			t.Fatalf("ReadRange(%d): %v", off, err)
		}
	}
	read(0)
	read(1000)
	if n := reg.tokenCount.Load(); n != 1 {
		t.Fatalf("%d tokens fetched for two reads, want 1 (cached)", n)
	}
	reg.revokeTokens()
	read(2000)
	read(3000)
	if n := reg.tokenCount.Load(); n != 2 {
		t.Fatalf("%d tokens fetched after expiry, want 2", n)
	}

	// Tokens that expire by time (expires_in) are renewed too.
	reg.mu.Lock()
	reg.tokenTTL = 1
	reg.mu.Unlock()
	reg.revokeTokens()
	read(4000) // token 3, valid for 1 s
	time.Sleep(1100 * time.Millisecond)
	read(5000) // expired: token 4
	if n := reg.tokenCount.Load(); n != 4 {
		t.Fatalf("%d tokens fetched after a timed expiry, want 4", n)
	}

	// A token endpoint refusing us is permanent: fail now, not at the
	// deadline.
	reg.mu.Lock()
	reg.denyTokens = true
	reg.mu.Unlock()
	reg.revokeTokens()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := br.ReadRange(ctx, 0, 10); !errdefs.IsPermissionDenied(err) || ctx.Err() != nil {
		t.Fatalf("refused token: want permission denied before the deadline, got %v", err)
	}

	// Without an authorizer a protected registry is a permanent error.
	noauth, err := NewBlobReader(hostsFor(nil, reg), ref, desc, fastRetry)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := noauth.ReadRange(context.Background(), 0, 10); !errdefs.IsPermissionDenied(err) {
		t.Fatalf("want permission denied, got %v", err)
	}
}

func TestReaderAtReadsTOC(t *testing.T) {
	checkGoroutines(t)
	reg := newFakeRegistry(t)
	blob, toc := testLayer(t, 64<<10, standardFiles()...)
	desc := reg.addBlob(blob)
	br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc)
	if err != nil {
		t.Fatal(err)
	}
	got, err := layerfmt.ReadTOC(context.Background(), br.ReaderAt(context.Background()), desc.Size, "")
	if err != nil {
		t.Fatal(err)
	}
	if got.Len() != toc.Len() {
		t.Fatalf("TOC over HTTP has %d entries, want %d", got.Len(), toc.Len())
	}
	if n := reg.requests(); n > 2 {
		t.Errorf("ReadTOC took %d range requests, want <= 2", n)
	}
	// io.ReaderAt contract at the end of the blob.
	p := make([]byte, 10)
	n, err := br.ReaderAt(context.Background()).ReadAt(p, desc.Size-4)
	if n != 4 || err != io.EOF || !bytes.Equal(p[:4], blob[len(blob)-4:]) {
		t.Fatalf("ReadAt at tail: n=%d err=%v", n, err)
	}
}

func TestFetchManifest(t *testing.T) {
	checkGoroutines(t)
	reg := newFakeRegistry(t)
	m := []byte(`{"schemaVersion":2,"layers":[]}`)
	d := digest.FromBytes(m)
	reg.manifests[d] = m
	got, err := FetchManifest(context.Background(), hostsFor(nil, reg), testRef, d)
	if err != nil || !bytes.Equal(got, m) {
		t.Fatalf("FetchManifest: %q, %v", got, err)
	}
	// A registry serving other bytes under the digest is caught.
	bad := digest.FromString("something else")
	reg.manifests[bad] = m
	if _, err := FetchManifest(context.Background(), hostsFor(nil, reg), testRef, bad); err == nil || !strings.Contains(err.Error(), "want "+bad.String()) {
		t.Fatalf("mismatching manifest accepted: %v", err)
	}
	if _, err := FetchManifest(context.Background(), hostsFor(nil, reg), testRef, digest.FromString("absent")); !errdefs.IsNotFound(err) {
		t.Fatalf("absent manifest: %v", err)
	}
}

func TestRequestMetrics(t *testing.T) {
	reg := newFakeRegistry(t)
	desc := reg.addBlob([]byte("metrics blob"))
	m, err := NewMetrics(prometheus.NewPedanticRegistry())
	if err != nil {
		t.Fatal(err)
	}
	reg.setFaults(faultNone, fault503)
	br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry, WithRequestMetrics(m))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := br.ReadRange(context.Background(), 0, 4); err != nil {
		t.Fatal(err)
	}
	if ok, tr := testutil.ToFloat64(m.requests.WithLabelValues("ok")), testutil.ToFloat64(m.requests.WithLabelValues("transient")); ok != 1 || tr != 1 {
		t.Fatalf("requests ok=%v transient=%v, want 1 and 1", ok, tr)
	}
}

var _ docker.RegistryHosts = hostsFor(nil)

func FuzzParseContentRange(f *testing.F) {
	for _, s := range []string{"bytes 0-99/100", "bytes 5-9/*", "bytes 9-5/10", "bytes -1-2/3", "items 0-1/2", "bytes 0-99/100/1", "bytes 0-1/-5", "bytes 0-9/5", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		first, last, total, err := parseContentRange(v)
		if err != nil {
			return
		}
		if first < 0 || last < first || (total != -1 && total <= last) {
			t.Fatalf("%q parsed to %d-%d/%d", v, first, last, total)
		}
	})
}
