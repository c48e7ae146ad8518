package reliability_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envsnap/envsnap/tests/testenv"
)

// tokenGate demands short-lived bearer tokens for GETs of one blob, like a
// registry behind an auth server whose tokens expire mid-run.
type tokenGate struct {
	realm, path string
	ttl         time.Duration // how long a token is accepted
	advertised  time.Duration // expires_in sent with it

	mu     sync.Mutex
	issued map[string]time.Time // token -> expiry

	tokens, rejected, expired atomic.Int64
}

func (g *tokenGate) handle(w http.ResponseWriter, r *http.Request) bool {
	if r.URL.Path == "/token" {
		n := g.tokens.Add(1)
		tok := fmt.Sprintf("tok-%d", n)
		g.mu.Lock()
		g.issued[tok] = time.Now().Add(g.ttl)
		g.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]any{"token": tok, "expires_in": int(g.advertised / time.Second), "issued_at": time.Now().UTC().Format(time.RFC3339)})
		return true
	}
	if r.Method != http.MethodGet || !strings.HasSuffix(r.URL.Path, g.path) {
		return false
	}
	tok, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	g.mu.Lock()
	exp, known := g.issued[tok]
	g.mu.Unlock()
	if known && time.Now().Before(exp) {
		return false // authorized: the real registry answers
	}
	if known {
		g.expired.Add(1)
	}
	g.rejected.Add(1)
	challenge := fmt.Sprintf(`Bearer realm=%q,service="test",scope="repository:rel/token:pull"`, g.realm)
	if tok != "" {
		// As distribution's token auth answers a token it no longer
		// accepts (RFC 6750).
		challenge += `,error="invalid_token"`
	}
	w.Header().Set("WWW-Authenticate", challenge)
	http.Error(w, `{"errors":[{"code":"UNAUTHORIZED"}]}`, http.StatusUnauthorized)
	return true
}

// TestTokenExpiresMidRun: blob reads need a bearer token that stops
// being accepted after a second, either as announced (expires_in) or
// earlier than announced (revoked, clock skew). Reads after the expiry get
// a fresh token and the right bytes; no read fails.
func TestTokenExpiresMidRun(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false", "--read-timeout", "10s"))
	var files []testenv.File
	for i := range 4 {
		files = append(files, testenv.RandomFile(fmt.Sprintf("/data/t%d.bin", i), 1<<20, int64(500+i)))
	}
	img := pushLazy(t, env, "rel/token:1", files)
	image := env.Pull(t, img.Ref, "envsnap")
	data := img.Layers[len(img.Layers)-1]

	for i, tc := range []struct {
		name       string
		advertised time.Duration
	}{
		{"announced expiry", time.Second},
		{"revoked before its announced expiry", time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &tokenGate{realm: "http://" + env.Registry.Host + "/token", path: "/blobs/" + data.Digest.String(),
				ttl: time.Second, advertised: tc.advertised, issued: map[string]time.Time{}}
			env.Registry.Intercept(g.handle)
			defer env.Registry.Intercept(nil)
			for _, f := range files[2*i : 2*i+2] {
				res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
				if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
					t.Fatalf("read %s: exit %d stdout %q stderr %q\n%s", f.Path, res.ExitCode, res.Stdout, res.Stderr, env.Envsnap.LogTail(20))
				}
				time.Sleep(2 * g.ttl) // the token in hand expires
			}
			t.Logf("tokens issued %d, requests rejected %d (with an expired token %d)", g.tokens.Load(), g.rejected.Load(), g.expired.Load())
			if g.tokens.Load() < 2 {
				t.Errorf("one token served reads %s apart although it expired after %s", 2*g.ttl, g.ttl)
			}
			if tc.advertised > g.ttl && g.expired.Load() == 0 {
				t.Errorf("the daemon never presented the revoked token: the test proves nothing")
			}
		})
	}
}
