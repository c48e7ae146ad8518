package fetch

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/layerfmt"
)

// fault is what the fake registry does to one blob request.
type fault int

const (
	faultNone fault = iota
	faultReset
	faultTruncate
	fault503
	fault429
	faultCorrupt
	fault404
	faultStall // sends the first half of the body, then waits for unstall
)

func (f fault) String() string {
	return [...]string{"none", "reset", "truncate", "503", "429", "corrupt", "404", "stall"}[f]
}

// fakeRegistry serves blobs and manifests of any repository under /v2/ with
// single-range support and injectable faults, optionally behind a minimal
// bearer token flow (realm on the same server).
type fakeRegistry struct {
	srv *httptest.Server

	mu        sync.Mutex
	blobs     map[digest.Digest][]byte
	manifests map[digest.Digest][]byte
	faults    []fault // consumed by successive blob requests
	always    fault   // applied when faults is empty
	latency   time.Duration
	noRange   bool
	redirect  string // base URL of a storage server blob GETs redirect to
	ranges    []string
	times     []time.Time
	stall     chan struct{} // closed by unstall

	// token auth
	auth       bool
	tokenTTL   int                  // seconds; 0: tokens live until revoked
	tokens     map[string]time.Time // token -> expiry (zero: none)
	denyTokens bool                 // token endpoint refuses (bad credentials)
	tokenCount atomic.Int64
	tokenSeq   atomic.Int64

	blobGets atomic.Int64 // blob GETs that reached the blob handler (after auth)
}

func newFakeRegistry(t testing.TB) *fakeRegistry {
	t.Helper()
	r := &fakeRegistry{
		blobs:     map[digest.Digest][]byte{},
		manifests: map[digest.Digest][]byte{},
		tokens:    map[string]time.Time{},
		stall:     make(chan struct{}),
	}
	r.srv = httptest.NewServer(r)
	t.Cleanup(func() {
		r.srv.Client().CloseIdleConnections()
		r.srv.Close()
	})
	return r
}

func (r *fakeRegistry) host() string {
	u, _ := url.Parse(r.srv.URL)
	return u.Host
}

func (r *fakeRegistry) addBlob(b []byte) ocispec.Descriptor {
	d := digest.FromBytes(b)
	r.mu.Lock()
	r.blobs[d] = b
	r.mu.Unlock()
	return ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: d, Size: int64(len(b))}
}

func (r *fakeRegistry) setFaults(always fault, first ...fault) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.always, r.faults = always, first
}

func (r *fakeRegistry) setLatency(d time.Duration) {
	r.mu.Lock()
	r.latency = d
	r.mu.Unlock()
}

// unstall lets every response held by faultStall finish.
func (r *fakeRegistry) unstall() { close(r.stall) }

func (r *fakeRegistry) requests() int { return int(r.blobGets.Load()) }

func (r *fakeRegistry) resetCounts() {
	r.blobGets.Store(0)
	r.mu.Lock()
	r.ranges, r.times = nil, nil
	r.mu.Unlock()
}

func (r *fakeRegistry) rangeLog() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.ranges...)
}

// revokeTokens makes every issued token invalid, as an expiry mid-run does.
func (r *fakeRegistry) revokeTokens() {
	r.mu.Lock()
	r.tokens = map[string]time.Time{}
	r.mu.Unlock()
}

func (r *fakeRegistry) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path == "/token" {
		r.serveToken(w, req)
		return
	}
	if !strings.HasPrefix(req.URL.Path, "/v2/") {
		http.NotFound(w, req)
		return
	}
	if r.auth && !r.authorized(w, req) {
		return
	}
	rest := strings.TrimPrefix(req.URL.Path, "/v2/")
	if i := strings.LastIndex(rest, "/manifests/"); i >= 0 {
		r.mu.Lock()
		b, ok := r.manifests[digest.Digest(rest[i+len("/manifests/"):])]
		r.mu.Unlock()
		if !ok {
			http.NotFound(w, req)
			return
		}
		w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		w.Write(b)
		return
	}
	i := strings.LastIndex(rest, "/blobs/")
	if i < 0 {
		http.NotFound(w, req)
		return
	}
	r.serveBlob(w, req, digest.Digest(rest[i+len("/blobs/"):]))
}

func (r *fakeRegistry) authorized(w http.ResponseWriter, req *http.Request) bool {
	h := req.Header.Get("Authorization")
	tok, isBearer := strings.CutPrefix(h, "Bearer ")
	r.mu.Lock()
	exp, known := r.tokens[tok]
	ok := isBearer && known && (exp.IsZero() || time.Now().Before(exp))
	r.mu.Unlock()
	if ok {
		return true
	}
	challenge := fmt.Sprintf(`Bearer realm="%s/token",service="fake"`, r.srv.URL)
	if h != "" {
		challenge += `,error="invalid_token"`
	}
	w.Header().Set("WWW-Authenticate", challenge)
	http.Error(w, `{"errors":[{"code":"UNAUTHORIZED"}]}`, http.StatusUnauthorized)
	return false
}

func (r *fakeRegistry) serveToken(w http.ResponseWriter, req *http.Request) {
	r.mu.Lock()
	deny := r.denyTokens
	r.mu.Unlock()
	if deny {
		http.Error(w, `{"errors":[{"code":"DENIED"}]}`, http.StatusForbidden)
		return
	}
	if req.URL.Query().Get("service") != "fake" || !strings.Contains(req.URL.Query().Get("scope"), ":pull") {
		http.Error(w, "bad token request "+req.URL.RawQuery, http.StatusBadRequest)
		return
	}
	tok := fmt.Sprintf("tok%d", r.tokenSeq.Add(1))
	r.mu.Lock()
	ttl := r.tokenTTL
	var exp time.Time
	if ttl > 0 {
		exp = time.Now().Add(time.Duration(ttl) * time.Second)
	}
	r.tokens[tok] = exp
	r.mu.Unlock()
	r.tokenCount.Add(1)
	if ttl == 0 {
		ttl = 3600
	}
	json.NewEncoder(w).Encode(map[string]any{"token": tok, "expires_in": ttl})
}

func (r *fakeRegistry) serveBlob(w http.ResponseWriter, req *http.Request, d digest.Digest) {
	r.mu.Lock()
	b, ok := r.blobs[d]
	f := r.always
	if len(r.faults) > 0 {
		f, r.faults = r.faults[0], r.faults[1:]
	}
	latency, noRange, redirect := r.latency, r.noRange, r.redirect
	r.ranges = append(r.ranges, req.Header.Get("Range"))
	r.times = append(r.times, time.Now())
	r.mu.Unlock()
	r.blobGets.Add(1)

	if latency > 0 {
		select {
		case <-time.After(latency):
		case <-req.Context().Done():
			return
		}
	}
	if !ok || f == fault404 {
		http.Error(w, `{"errors":[{"code":"BLOB_UNKNOWN"}]}`, http.StatusNotFound)
		return
	}
	switch f {
	case fault503:
		http.Error(w, "unavailable", http.StatusServiceUnavailable)
		return
	case fault429:
		w.Header().Set("Retry-After", "1")
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}
	if redirect != "" {
		http.Redirect(w, req, redirect+"/storage/"+d.Encoded(), http.StatusTemporaryRedirect)
		return
	}
	serveRange(w, req, b, f, noRange, r.stall)
}

// serveRange answers a GET of blob b honouring one "bytes=a-b" range.
func serveRange(w http.ResponseWriter, req *http.Request, b []byte, f fault, noRange bool, stall <-chan struct{}) {
	start, end := int64(0), int64(len(b))-1
	status := http.StatusOK
	if rng := req.Header.Get("Range"); rng != "" && !noRange {
		spec, ok := strings.CutPrefix(rng, "bytes=")
		a, z, ok2 := strings.Cut(spec, "-")
		s, err1 := strconv.ParseInt(a, 10, 64)
		e, err2 := strconv.ParseInt(z, 10, 64)
		if !ok || !ok2 || strings.Contains(spec, ",") || err1 != nil || err2 != nil || s > e || s >= int64(len(b)) {
			http.Error(w, "bad range "+rng, http.StatusRequestedRangeNotSatisfiable)
			return
		}
		start, end = s, min(e, int64(len(b))-1)
		status = http.StatusPartialContent
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end, len(b)))
	}
	body := append([]byte(nil), b[start:end+1]...)
	if f == faultCorrupt {
		body[len(body)/2] ^= 0xff
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	switch f {
	case faultTruncate:
		w.WriteHeader(status)
		w.Write(body[:len(body)/2])
		// Returning with fewer bytes than Content-Length makes the server
		// close the connection: the client sees an unexpected EOF.
		return
	case faultStall:
		w.WriteHeader(status)
		w.Write(body[:len(body)/2])
		w.(http.Flusher).Flush()
		select {
		case <-stall:
		case <-req.Context().Done():
			return
		}
		w.Write(body[len(body)/2:])
		return
	case faultReset:
		w.WriteHeader(status)
		w.Write(body[:len(body)/2])
		w.(http.Flusher).Flush()
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			if tc, ok := conn.(*net.TCPConn); ok {
				tc.SetLinger(0) // RST instead of FIN
			}
			conn.Close()
		}
		return
	}
	w.WriteHeader(status)
	w.Write(body)
}

// storageServer plays blob storage behind a registry redirect.
func storageServer(t *testing.T, reg *fakeRegistry) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		n.Add(1)
		enc := strings.TrimPrefix(req.URL.Path, "/storage/")
		reg.mu.Lock()
		b, ok := reg.blobs[digest.NewDigestFromEncoded(digest.SHA256, enc)]
		reg.mu.Unlock()
		if !ok {
			http.NotFound(w, req)
			return
		}
		if req.Header.Get("Range") == "" {
			// Storage that received no Range would send everything: make
			// a lost Range header visible to the test.
			http.Error(w, "range header lost in redirect", http.StatusBadRequest)
			return
		}
		serveRange(w, req, b, faultNone, false, nil)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

// hostsFor returns a RegistryHosts resolving every name to the given fake
// registries in order (first = mirror), plain HTTP.
func hostsFor(authz docker.Authorizer, regs ...*fakeRegistry) docker.RegistryHosts {
	return func(string) ([]docker.RegistryHost, error) {
		var hs []docker.RegistryHost
		for _, r := range regs {
			hs = append(hs, docker.RegistryHost{
				Client:       r.srv.Client(),
				Authorizer:   authz,
				Host:         r.host(),
				Scheme:       "http",
				Path:         "/v2",
				Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve,
			})
		}
		return hs, nil
	}
}

func randBytes(r *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

type testFile struct {
	name string
	data []byte
}

// testLayer converts a tar of files into an envsnap layer with small chunks.
func testLayer(t testing.TB, chunkSize int, files ...testFile) ([]byte, *layerfmt.TOC) {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.data)), Typeflag: tar.TypeReg, ModTime: time.Unix(1e9, 0)}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(f.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	res, err := layerfmt.Convert(context.Background(), &out, &tb, layerfmt.WithChunkSize(chunkSize))
	if err != nil {
		t.Fatal(err)
	}
	blob := out.Bytes()
	toc, err := layerfmt.ReadTOC(context.Background(), bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	if err != nil {
		t.Fatal(err)
	}
	return blob, toc
}

// standardFiles: incompressible contents so chunk sizes are predictable.
func standardFiles() []testFile {
	r := rand.New(rand.NewPCG(1, 2))
	return []testFile{
		{"big.bin", randBytes(r, 8*64<<10)}, // 8 chunks of 64 KiB
		{"a.txt", randBytes(r, 3000)},
		{"b.txt", randBytes(r, 70000)},
		{"empty", nil},
		{"c.bin", randBytes(r, 200000)},
	}
}

// checkGoroutines fails the test if goroutines started during it are still
// running after its cleanups (registered earlier run later, so call this
// first).
func checkGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= before {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("goroutine leak: %d before, %d after\n%s", before, n, buf)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}
