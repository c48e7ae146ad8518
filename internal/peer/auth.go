package peer

import (
	"bytes"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

// DefaultTLSServerName is the name every peer's certificate carries (a DNS
// SAN) when mTLS is used: peers are addressed by pod IP, which a cluster
// CA rarely puts in certificates, so the chain is checked against the CA
// and the name against this fixed one.
const DefaultTLSServerName = "envsnap-peer"

// minTokenLen keeps a typo (an empty or one-word Secret) from becoming the
// cluster's only protection.
const minTokenLen = 16

// Token is a shared bearer token read from a file, as a Kubernetes Secret
// is mounted. The file is read again when it changes, so a rotated Secret
// takes effect without a restart (kubelet swaps the file atomically).
type Token struct {
	path string

	mu    sync.Mutex
	mtime time.Time
	size  int64
	tok   []byte
}

// NewToken reads the token in path.
func NewToken(path string) (*Token, error) {
	t := &Token{path: path}
	if _, err := t.get(); err != nil {
		return nil, err
	}
	return t, nil
}

func (t *Token) get() ([]byte, error) {
	st, err := os.Stat(t.path)
	if err != nil {
		return nil, fmt.Errorf("peer token: %w", err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.tok != nil && st.ModTime().Equal(t.mtime) && st.Size() == t.size {
		return t.tok, nil
	}
	b, err := os.ReadFile(t.path)
	if err != nil {
		return nil, fmt.Errorf("peer token: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) < minTokenLen {
		return nil, fmt.Errorf("peer token %s: %d bytes, want at least %d", t.path, len(b), minTokenLen)
	}
	t.tok, t.mtime, t.size = b, st.ModTime(), st.Size()
	return b, nil
}

// authorize sets the bearer header on a request to a peer.
func (t *Token) authorize(r *http.Request) error {
	tok, err := t.get()
	if err != nil {
		return err
	}
	r.Header.Set("Authorization", "Bearer "+string(tok))
	return nil
}

var errUnauthorized = errors.New("unauthorized")

// check verifies a request's bearer token in constant time.
func (t *Token) check(r *http.Request) error {
	want, err := t.get()
	if err != nil {
		return err
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || subtle.ConstantTimeCompare([]byte(got), want) != 1 {
		return errUnauthorized
	}
	return nil
}

// TLSFiles names the PEM files of mutual TLS between peers: this node's
// certificate and key (used both to serve and as the client certificate)
// and the CA that signs every peer's.
type TLSFiles struct {
	Cert, Key, CA string
	// ServerName is the name checked in the peers' certificates
	// (DefaultTLSServerName when empty).
	ServerName string
}

// configs returns the server and client TLS configurations: both sides
// present a certificate and require one signed by the CA.
func (f TLSFiles) configs() (server, client *tls.Config, err error) {
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("load peer certificate: %w", err)
	}
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, nil, fmt.Errorf("read peer CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("peer CA %s: no certificate found", f.CA)
	}
	name := f.ServerName
	if name == "" {
		name = DefaultTLSServerName
	}
	server = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
	}
	client = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ServerName:   name,
	}
	return server, client, nil
}
