package reliability_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestReadinessAfterCrash: after a SIGKILL the daemon's socket files are
// left behind. A new daemon removes them as it starts, so the gRPC socket
// exists only while something listens on it; while it restores its layer
// mounts (made slow here: a cold cache and a slow registry) its status
// socket already answers /healthz with 503 and the reason, then 200. A
// second daemon on the same socket fails with a clear error and leaves the
// first one's sockets alone.
func TestReadinessAfterCrash(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := testenv.RandomFile("/data/f.bin", 1<<20, 51)
	img := pushLazy(t, env, "rel/ready:1", []testenv.File{f})
	env.Pull(t, img.Ref, "envsnap")

	var slow atomic.Bool
	env.Registry.Intercept(func(w http.ResponseWriter, r *http.Request) bool {
		if slow.Load() && r.Method == http.MethodGet {
			time.Sleep(time.Second)
		}
		return false
	})
	env.Envsnap.Kill()
	sock := env.SnapshotterSocket
	for _, p := range []string{sock, daemon.StatusSocket(sock)} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%s does not survive a SIGKILL (the test proves nothing): %v", p, err)
		}
	}
	// The restore must ask the registry for every manifest and TOC.
	if err := os.RemoveAll(filepath.Join(env.EnvsnapRoot, "cache")); err != nil {
		t.Fatal(err)
	}
	slow.Store(true)
	started := make(chan error, 1)
	go func() {
		_, err := env.Env.StartEnvsnap()
		started <- err
	}()

	hc := unixHTTPClient(daemon.StatusSocket(sock))
	var (
		answered   bool // the new daemon's status socket answered once
		restoring  int  // 503s with the restore as reason
		violations []string
	)
	deadline := time.Now().Add(2 * time.Minute)
	for done := false; !done; {
		select {
		case err := <-started:
			if err != nil {
				t.Fatal(err)
			}
			done = true
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the daemon did not become ready")
		}
		// The socket first, then /healthz: a socket present while the
		// daemon says it is restoring was there while nothing listened.
		// Only once the new daemon's status socket has answered: it
		// removes the killed one's stale sockets before it listens, so a
		// stat just before that removal sees the old socket file.
		up := answered
		_, serr := os.Stat(sock)
		code, body, herr := healthz(hc)
		switch {
		case herr == nil:
			answered = true
		case answered:
			violations = append(violations, "status socket stopped answering: "+herr.Error())
		}
		if code == http.StatusServiceUnavailable && strings.Contains(body, "restoring") {
			restoring++
			if up && serr == nil {
				violations = append(violations, "gRPC socket present while restoring")
			}
		}
		if up && serr == nil && code != http.StatusOK {
			violations = append(violations, "gRPC socket present while /healthz answers "+body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	slow.Store(false)
	if restoring == 0 {
		t.Errorf("/healthz never answered 503 while the daemon restored its layers")
	}
	if len(violations) > 0 {
		t.Errorf("readiness contradicted: %v", violations)
	}
	if code, body, err := healthz(hc); err != nil || code != http.StatusOK {
		t.Errorf("/healthz once ready: %d %q %v", code, body, err)
	}
	t.Logf("%d answers 503 while restoring", restoring)

	// A second daemon on the same address fails and leaves the first
	// one's sockets alone.
	second := testenv.StartProcess(t, t.TempDir(), "envsnap-second", nil, testenv.Binary(t, "containerd-envsnap"),
		"serve", "--root", t.TempDir(), "--address", sock, "--hosts-dir", env.HostsDir)
	for {
		if exited, _ := second.Exited(); exited {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a second daemon on the same socket kept running")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !second.LogContains("another containerd-envsnap serves " + sock) {
		t.Errorf("second daemon's error does not say why:\n%s", second.LogTail(10))
	}
	if code, _, err := healthz(hc); err != nil || code != http.StatusOK {
		t.Errorf("first daemon after the second one failed: %d %v", code, err)
	}
	if c, err := net.Dial("unix", sock); err != nil {
		t.Errorf("first daemon's gRPC socket after the second one failed: %v", err)
	} else {
		c.Close()
	}
}

func unixHTTPClient(sock string) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}}
}

func healthz(hc *http.Client) (int, string, error) {
	resp, err := hc.Get("http://envsnap/healthz")
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b)), err
}
