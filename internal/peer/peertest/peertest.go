// Package peertest has helpers for tests of the peer tier.
package peertest

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
)

// CorruptingProxy listens on ip (any free port) and forwards to the peer
// server at target, flipping one byte of every 200 answer: a peer, or a
// path to one, that sends wrong bytes. It returns the proxy's host:port;
// the proxy stops when tb ends.
func CorruptingProxy(tb testing.TB, ip, target string) string {
	tb.Helper()
	u, err := url.Parse("http://" + target)
	if err != nil {
		tb.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		if resp.StatusCode != http.StatusOK {
			return nil
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		if len(b) > 0 {
			b[len(b)/2] ^= 0x55
		}
		resp.Body = io.NopCloser(bytes.NewReader(b))
		return nil
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		tb.Fatal(err)
	}
	srv := &httptest.Server{Listener: ln, Config: &http.Server{Handler: rp}}
	srv.Start()
	tb.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}
