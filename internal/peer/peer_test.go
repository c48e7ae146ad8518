package peer

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
)

func TestOwnerIndependentOfOrder(t *testing.T) {
	a := []string{"10.0.0.1:9167", "10.0.0.2:9167", "10.0.0.3:9167", "10.0.0.4:9167"}
	b := []string{a[2], a[0], a[3], a[1]}
	for i := range 200 {
		k := fmt.Sprintf("sha256:abc/%d", i)
		if Owner(k, a) != Owner(k, b) {
			t.Fatalf("key %s: owner depends on the member order", k)
		}
	}
	if Owner("k", nil) != "" {
		t.Fatal("owner of an empty cluster")
	}
}

// Rendezvous hashing spreads keys evenly and moves only the keys of a
// member that leaves.
func TestOwnerBalanceAndMovement(t *testing.T) {
	var members []string
	for i := range 10 {
		members = append(members, fmt.Sprintf("10.0.0.%d:9167", i+1))
	}
	const keys = 20000
	count := map[string]int{}
	before := make([]string, keys)
	for i := range keys {
		before[i] = Owner(StripeKey(digest.FromString("layer"), int64(i)*StripeSize), members)
		count[before[i]]++
	}
	for m, n := range count {
		if n < keys/10*8/10 || n > keys/10*12/10 {
			t.Errorf("member %s owns %d of %d keys, want %d +-20%%", m, n, keys, keys/10)
		}
	}
	gone := members[3]
	rest := append(append([]string(nil), members[:3]...), members[4:]...)
	for i := range keys {
		after := Owner(StripeKey(digest.FromString("layer"), int64(i)*StripeSize), rest)
		if before[i] != gone && after != before[i] {
			t.Fatalf("key %d moved from %s to %s though its owner stayed", i, before[i], after)
		}
	}
}

func TestStripeKey(t *testing.T) {
	d := digest.FromString("x")
	if StripeKey(d, 0) != StripeKey(d, StripeSize-1) || StripeKey(d, 0) == StripeKey(d, StripeSize) {
		t.Fatal("stripes are not StripeSize bytes")
	}
}

func TestParseMembers(t *testing.T) {
	got, err := ParseMembers([]byte("# peers\n10.0.0.1:9167\n\n  node-b.example:9167  \n[fd00::1]:9167\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.1:9167", "node-b.example:9167", "[fd00::1]:9167"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for _, bad := range []string{"10.0.0.1", "10.0.0.1:0", "10.0.0.1:x", ":9167", "http://a:1/", "a b:1"} {
		if _, err := ParseMembers([]byte(bad + "\n")); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func FuzzParseMembers(f *testing.F) {
	f.Add([]byte("10.0.0.1:9167\n# c\n[::1]:1\n"))
	f.Add([]byte("a:65536"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ms, err := ParseMembers(b)
		if err != nil {
			return
		}
		for _, m := range ms {
			if _, err := ValidateAddress(m); err != nil {
				t.Fatalf("accepted %q: %v", m, err)
			}
		}
	})
}

func FuzzDecodeRequest(f *testing.F) {
	f.Add([]byte(`{"layer":"sha256:` + strings.Repeat("a", 64) + `","frames":[{"offset":0,"size":10,"digest":"sha256:` + strings.Repeat("b", 64) + `"}]}`))
	f.Add([]byte(`{"layer":"x","frames":[]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		req, err := decodeRequest(bytes.NewReader(b))
		if err != nil {
			return
		}
		var total int64
		for _, fr := range req.Frames {
			if fr.Size <= 0 || fr.Offset < 0 {
				t.Fatalf("accepted frame %+v", fr)
			}
			total += fr.Size
		}
		if total > MaxRequestBytes || len(req.Frames) == 0 {
			t.Fatalf("accepted %d frames of %d bytes", len(req.Frames), total)
		}
	})
}

// A watched member file is read again on change; a broken rewrite keeps
// the last good list.
func TestWatchFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "peers")
	// Written in place (truncate, then write), as an editor or a
	// careless script would: the watcher may read it empty in between.
	write := func(s string) {
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("10.0.0.2:1\n10.0.0.1:1\n")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w, err := Watch(ctx, 10*time.Millisecond, "file", func(context.Context) ([]string, error) { return ReadMembersFile(path) })
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(w.Members()); got != "[10.0.0.1:1 10.0.0.2:1]" {
		t.Fatalf("members %s", got)
	}
	write("10.0.0.3:1\n")
	waitFor(t, func() bool { return fmt.Sprint(w.Members()) == "[10.0.0.3:1]" })
	for _, broken := range []string{"garbage\n", "# nobody\n"} {
		write(broken)
		time.Sleep(50 * time.Millisecond)
		if got := fmt.Sprint(w.Members()); got != "[10.0.0.3:1]" {
			t.Fatalf("file %q replaced the list: %s", broken, got)
		}
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for range 500 {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("condition not met in 5 s")
}

func TestLocalAddress(t *testing.T) {
	if !LocalAddress("127.0.0.1:9167", 9167) {
		t.Error("loopback not local")
	}
	if LocalAddress("127.0.0.1:9168", 9167) || LocalAddress("192.0.2.1:9167", 9167) || LocalAddress("name:9167", 9167) {
		t.Error("a foreign address taken for this node")
	}
}

// memSource serves frames of one layer from memory, after an optional
// delay before accepting (delay) and another while getting the frames
// (fetching, as an owner's registry fetch), or failing to (fetchErr).
type memSource struct {
	layer    digest.Digest
	blob     []byte
	delay    time.Duration
	fetching time.Duration
	fetchErr error
	corrupt  atomic.Bool
	calls    atomic.Int64
}

func (s *memSource) Frames(ctx context.Context, layer digest.Digest, frames []Frame) (func() ([][]byte, error), error) {
	s.calls.Add(1)
	time.Sleep(s.delay)
	if layer != s.layer {
		return nil, fmt.Errorf("layer %s: %w", layer, errdefs.ErrNotFound)
	}
	return func() ([][]byte, error) {
		time.Sleep(s.fetching)
		if s.fetchErr != nil {
			return nil, s.fetchErr
		}
		out := make([][]byte, len(frames))
		for i, f := range frames {
			b := append([]byte(nil), s.blob[f.Offset:f.Offset+f.Size]...)
			if s.corrupt.Load() {
				b[0] ^= 1
			}
			out[i] = b
		}
		return out, nil
	}, nil
}

func corrupting(s *memSource) *memSource {
	s.corrupt.Store(true)
	return s
}

type testPeer struct {
	addr string
	src  *memSource
	m    *Metrics
}

func writeToken(t *testing.T, tok string) *Token {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte(tok), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := NewToken(p)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func startPeer(t *testing.T, src *memSource, auth Auth, opts ...ServerOption) *testPeer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := NewMetrics()
	srv, err := NewServer(src, auth, m, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); srv.Serve(ctx, l) }()
	t.Cleanup(func() { cancel(); <-done })
	return &testPeer{addr: l.Addr().String(), src: src, m: m}
}

func testBlob() (digest.Digest, []byte, []Frame) {
	blob := make([]byte, 3000)
	for i := range blob {
		blob[i] = byte(i * 7)
	}
	var fs []Frame
	for off := int64(0); off < 3000; off += 1000 {
		fs = append(fs, Frame{Offset: off, Size: 1000, Digest: digest.FromBytes(blob[off : off+1000])})
	}
	return digest.FromBytes(blob), blob, fs
}

// registryOf serves frames from blob and counts calls.
func registryOf(blob []byte, calls *atomic.Int64) Registry {
	return func(ctx context.Context, frames []Frame) ([][]byte, error) {
		calls.Add(1)
		out := make([][]byte, len(frames))
		for i, f := range frames {
			out[i] = append([]byte(nil), blob[f.Offset:f.Offset+f.Size]...)
		}
		return out, nil
	}
}

// clientTo returns a client of a two-member cluster whose other member is
// p, so p owns every stripe.
func clientTo(t *testing.T, p *testPeer, auth Auth, o Options) (*Client, *Metrics) {
	t.Helper()
	o.Self = "127.0.0.1:1" // this node: listed, never asked
	m := NewMetrics()
	// Rendezvous picks the owner; a cluster of p and a self whose
	// weight loses for stripe 0 is what the tests need.
	self := ""
	for port := 1; port < 1000; port++ {
		s := fmt.Sprintf("127.0.0.1:%d", port)
		layer, _, _ := testBlob()
		if Owner(StripeKey(layer, 0), []string{s, p.addr}) == p.addr {
			self = s
			break
		}
	}
	o.Self = self
	c, err := NewClient(Static{self, p.addr}, auth, o, m)
	if err != nil {
		t.Fatal(err)
	}
	return c, m
}

func TestFetchFromOwner(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	p := startPeer(t, &memSource{layer: layer, blob: blob}, Auth{Token: tok})
	c, m := clientTo(t, p, Auth{Token: tok}, Options{})
	var reg atomic.Int64
	got, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg))
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range frames {
		if !bytes.Equal(got[i], blob[f.Offset:f.Offset+f.Size]) {
			t.Fatalf("frame %d wrong", i)
		}
	}
	if reg.Load() != 0 {
		t.Errorf("registry asked %d times though the owner served", reg.Load())
	}
	if s := m.Stats(2); s.FetchedBytes != 3000 || s.Outcomes[outcomeHit] != 1 || s.HitRatio != 1 {
		t.Errorf("stats %+v", s)
	}
	if s := p.m.Stats(2); s.ServedBytes != 3000 {
		t.Errorf("owner stats %+v", s)
	}
}

// Without the token, or with a wrong one, a peer answers 401 and nothing
// else, and never consults its source.
func TestUnauthenticatedRefused(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	src := &memSource{layer: layer, blob: blob}
	p := startPeer(t, src, Auth{Token: tok})
	body := fmt.Sprintf(`{"layer":%q,"frames":[{"offset":0,"size":1000,"digest":%q}]}`, layer, frames[0].Digest)
	for name, hdr := range map[string]string{"none": "", "wrong": "Bearer a-token-of-enough-lengtX", "basic": "Basic a-token-of-enough-length"} {
		req, _ := http.NewRequest(http.MethodPost, "http://"+p.addr+FramesPath, strings.NewReader(body))
		if hdr != "" {
			req.Header.Set("Authorization", hdr)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || len(b) != 0 {
			t.Errorf("%s: status %d, %d body bytes; want 401 and nothing", name, resp.StatusCode, len(b))
		}
	}
	if src.calls.Load() != 0 || p.m.Stats(0).Refused != 3 {
		t.Errorf("source asked %d times, %d refusals counted", src.calls.Load(), p.m.Stats(0).Refused)
	}
	// A client with another cluster's token is refused too, and reads
	// from the registry.
	c, _ := clientTo(t, p, Auth{Token: writeToken(t, "another-clusters-token")}, Options{})
	var reg atomic.Int64
	if _, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg)); err != nil || reg.Load() != 1 {
		t.Errorf("refused client: err %v, %d registry reads", err, reg.Load())
	}
}

func TestTokenTooShort(t *testing.T) {
	p := filepath.Join(t.TempDir(), "token")
	os.WriteFile(p, []byte("short\n"), 0o600)
	if _, err := NewToken(p); err == nil {
		t.Fatal("a 5-byte token accepted")
	}
	if _, err := NewServer(&memSource{}, Auth{}, nil); err == nil {
		t.Fatal("a server without authentication")
	}
}

// An owner that does not accept within the hedge delay is raced by the
// registry, which wins.
func TestHedgeSlowOwner(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	p := startPeer(t, &memSource{layer: layer, blob: blob, delay: 2 * time.Second}, Auth{Token: tok})
	c, m := clientTo(t, p, Auth{Token: tok}, Options{HedgeAfter: 50 * time.Millisecond, Timeout: 10 * time.Second})
	var reg atomic.Int64
	got, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg))
	if err != nil || !bytes.Equal(got[0], blob[:1000]) {
		t.Fatalf("fetch: %v", err)
	}
	if s := m.Stats(2); s.Hedges != 1 || reg.Load() != 1 || s.FetchedBytes != 0 {
		t.Errorf("stats %+v, %d registry reads; want one hedge won by the registry", s, reg.Load())
	}
}

// An owner answering as many requests as it may refuses the next at
// once: that requester reads from the registry without waiting for a
// hedge or a timeout, and does not mark the owner bad, so its next read
// is the owner's again.
func TestBusyOwnerRefusesAtOnce(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	src := &memSource{layer: layer, blob: blob, delay: time.Second}
	p := startPeer(t, src, Auth{Token: tok}, WithMaxServing(1))
	// Neither a hedge nor a timeout can happen within the test.
	o := Options{HedgeAfter: time.Hour, Timeout: time.Hour}
	first, _ := clientTo(t, p, Auth{Token: tok}, o)
	second, m := clientTo(t, p, Auth{Token: tok}, o)
	var reg atomic.Int64
	done := make(chan error, 1)
	go func() {
		_, err := first.Fetch(context.Background(), layer, frames, registryOf(blob, &reg))
		done <- err
	}()
	waitFor(t, func() bool { return src.calls.Load() == 1 }) // the owner is busy with it
	got, err := second.Fetch(context.Background(), layer, frames, registryOf(blob, &reg))
	if err != nil || !bytes.Equal(got[2], blob[2000:]) {
		t.Fatalf("fetch while the owner is busy: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s := m.Stats(2)
	if reg.Load() != 1 || s.Outcomes[outcomeBusy] != 1 || s.Hedges != 0 || s.BadMarks != 0 || p.m.Stats(2).Busy != 1 {
		t.Errorf("%d registry reads, requester %+v, owner busy %d: want one busy refusal read from the registry, no hedge, no bad mark",
			reg.Load(), s, p.m.Stats(2).Busy)
	}
	// Free again, the owner serves the same requester.
	if _, err := second.Fetch(context.Background(), layer, frames, registryOf(blob, &reg)); err != nil {
		t.Fatal(err)
	}
	if s := m.Stats(2); reg.Load() != 1 || s.Outcomes[outcomeHit] != 1 {
		t.Errorf("after the busy spell: %d registry reads, %+v", reg.Load(), s)
	}
}

// An owner that is gone, one that sends wrong bytes, and one that lacks
// the layer: the registry serves each read; the first two are marked bad
// (so the next read does not ask them), the last is not.
func TestOwnerFailures(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	for _, tc := range []struct {
		name    string
		src     *memSource
		dead    bool
		bad     bool
		outcome string
	}{
		{name: "dead", src: &memSource{layer: layer, blob: blob}, dead: true, bad: true, outcome: outcomeError},
		{name: "corrupt", src: corrupting(&memSource{layer: layer, blob: blob}), bad: true, outcome: outcomeCorrupt},
		{name: "unknown layer", src: &memSource{layer: digest.FromString("other"), blob: blob}, outcome: outcomeUnknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPeer(t, tc.src, Auth{Token: tok})
			if tc.dead {
				// A closed port: what a killed daemon leaves.
				l, _ := net.Listen("tcp", "127.0.0.1:0")
				p.addr = l.Addr().String()
				l.Close()
			}
			c, m := clientTo(t, p, Auth{Token: tok}, Options{})
			var reg atomic.Int64
			for range 2 {
				got, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg))
				if err != nil || !bytes.Equal(got[2], blob[2000:]) {
					t.Fatalf("fetch: %v", err)
				}
			}
			s := m.Stats(2)
			if s.Outcomes[tc.outcome] == 0 || reg.Load() != 2 {
				t.Errorf("stats %+v, %d registry reads", s, reg.Load())
			}
			if bad := c.BadPeers(); (len(bad) == 1) != tc.bad {
				t.Errorf("bad peers %v", bad)
			}
			if tc.bad && s.Requests != 1 {
				t.Errorf("%d requests to a peer marked bad after the first", s.Requests)
			}
		})
	}
}

// A peer marked bad is asked again once BadFor has passed: a restarted
// daemon rejoins.
func TestBadPeerRejoins(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	src := corrupting(&memSource{layer: layer, blob: blob})
	p := startPeer(t, src, Auth{Token: tok})
	c, m := clientTo(t, p, Auth{Token: tok}, Options{BadFor: 100 * time.Millisecond})
	var reg atomic.Int64
	if _, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg)); err != nil {
		t.Fatal(err)
	}
	src.corrupt.Store(false)
	waitFor(t, func() bool { return len(c.BadPeers()) == 0 })
	if _, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg)); err != nil {
		t.Fatal(err)
	}
	if s := m.Stats(2); s.Outcomes[outcomeHit] != 1 {
		t.Errorf("peer not used again after BadFor: %+v", s)
	}
}

// With mutual TLS a client without a certificate of the cluster's CA gets
// no connection at all; one with it is served.
func TestMutualTLS(t *testing.T) {
	layer, blob, frames := testBlob()
	dir := t.TempDir()
	ca, caKey := newCA(t)
	files := TLSFiles{Cert: filepath.Join(dir, "cert.pem"), Key: filepath.Join(dir, "key.pem"), CA: filepath.Join(dir, "ca.pem")}
	writePEM(t, files.CA, "CERTIFICATE", ca.Raw)
	issue(t, ca, caKey, DefaultTLSServerName, files.Cert, files.Key)
	src := &memSource{layer: layer, blob: blob}
	p := startPeer(t, src, Auth{TLS: &files})

	c, m := clientTo(t, p, Auth{TLS: &files}, Options{})
	var reg atomic.Int64
	if _, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg)); err != nil || reg.Load() != 0 || m.Stats(2).FetchedBytes != 3000 {
		t.Fatalf("mTLS client not served: %v, %d registry reads", err, reg.Load())
	}

	// Trusting the server but presenting no certificate.
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: DefaultTLSServerName}}}
	resp, err := hc.Post("https://"+p.addr+FramesPath, "application/json", strings.NewReader("{}"))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("a client without a certificate got status %d", resp.StatusCode)
	}
	// A certificate from another CA.
	other, otherKey := newCA(t)
	of := TLSFiles{Cert: filepath.Join(dir, "o.pem"), Key: filepath.Join(dir, "ok.pem"), CA: files.CA}
	issue(t, other, otherKey, DefaultTLSServerName, of.Cert, of.Key)
	c2, _ := clientTo(t, p, Auth{TLS: &of}, Options{})
	if _, err := c2.Fetch(context.Background(), layer, frames, registryOf(blob, &reg)); err != nil || reg.Load() != 1 {
		t.Fatalf("foreign certificate: %v, %d registry reads (want the registry to serve)", err, reg.Load())
	}
	if src.calls.Load() != 1 {
		t.Errorf("source asked %d times, want only for the cluster's client", src.calls.Load())
	}
}

func newCA(t *testing.T) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return ca, key
}

func issue(t *testing.T, ca *x509.Certificate, caKey *ecdsa.PrivateKey, name, certPath, keyPath string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, certPath, "CERTIFICATE", der)
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, keyPath, "EC PRIVATE KEY", kb)
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// A dead owner hands the read to the next owner by rendezvous, not to the
// registry.
func TestFailoverToNextOwner(t *testing.T) {
	layer, blob, frames := testBlob()
	tok := writeToken(t, "a-token-of-enough-length")
	good := startPeer(t, &memSource{layer: layer, blob: blob}, Auth{Token: tok})
	key := StripeKey(layer, 0)
	var dead, self string
	for port := 1; port < 5000 && self == ""; port++ {
		// A closed port: what a killed daemon leaves.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		d := l.Addr().String()
		l.Close()
		s := fmt.Sprintf("127.0.0.1:%d", port)
		if Owner(key, []string{s, d, good.addr}) == d && Owner(key, []string{s, good.addr}) == good.addr {
			dead, self = d, s
		}
	}
	if self == "" {
		t.Fatal("no member set with the wanted ranking")
	}
	m := NewMetrics()
	c, err := NewClient(Static{self, dead, good.addr}, Auth{Token: tok}, Options{Self: self}, m)
	if err != nil {
		t.Fatal(err)
	}
	var reg atomic.Int64
	got, err := c.Fetch(context.Background(), layer, frames, registryOf(blob, &reg))
	if err != nil || !bytes.Equal(got[1], blob[1000:2000]) {
		t.Fatalf("fetch: %v", err)
	}
	if s := m.Stats(3); reg.Load() != 0 || s.Outcomes[outcomeHit] != 1 || s.Outcomes[outcomeError] != 1 {
		t.Errorf("stats %+v, %d registry reads: want the next owner to serve", s, reg.Load())
	}
	if bad := c.BadPeers(); len(bad) != 1 || bad[0] != dead {
		t.Errorf("bad peers %v, want [%s]", bad, dead)
	}
}

// changingMembers is a member list the test replaces, as DNS discovery
// does when pods come and go.
type changingMembers struct {
	mu   sync.Mutex
	list []string
}

func (m *changingMembers) Members() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.list
}

func (m *changingMembers) set(list ...string) {
	m.mu.Lock()
	m.list = list
	m.mu.Unlock()
}

// TestClientForgetsFormerMembers: what the client learnt of a peer (its
// bad mark, how long it takes to show life) goes when the peer leaves
// the member list, and stays for peers that remain.
func TestClientForgetsFormerMembers(t *testing.T) {
	members := &changingMembers{}
	members.set("10.0.0.1:9167", "10.0.0.2:9167", "10.0.0.3:9167")
	c, err := NewClient(members, Auth{Token: writeToken(t, "a-token-of-enough-length")}, Options{Self: "10.0.0.1:9167"}, NewMetrics())
	if err != nil {
		t.Fatal(err)
	}
	c.live()
	ctx := context.Background()
	for _, p := range []string{"10.0.0.2:9167", "10.0.0.3:9167"} {
		c.observe(p, 40*time.Millisecond)
		c.markBad(ctx, p, errors.New("refused"))
	}
	members.set("10.0.0.1:9167", "10.0.0.2:9167", "10.0.0.4:9167")
	live, _ := c.live()
	if slices.Contains(live, "10.0.0.2:9167") || !slices.Contains(live, "10.0.0.4:9167") {
		t.Errorf("live %v: want the new member and not the one still marked bad", live)
	}
	c.mu.Lock()
	_, badGone := c.bad["10.0.0.3:9167"]
	_, lifeGone := c.life["10.0.0.3:9167"]
	_, badKept := c.bad["10.0.0.2:9167"]
	_, lifeKept := c.life["10.0.0.2:9167"]
	c.mu.Unlock()
	if badGone || lifeGone {
		t.Errorf("a former member is still remembered: bad %v, life %v", badGone, lifeGone)
	}
	if !badKept || !lifeKept {
		t.Errorf("a member's bad mark (%v) or life time (%v) was forgotten", badKept, lifeKept)
	}
}
