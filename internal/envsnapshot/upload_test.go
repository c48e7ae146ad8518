//go:build linux

package envsnapshot

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/internal/registry"
)

// uploadRig is a real registry behind the harness's proxy, which records
// the upload requests and lets a test answer some of them itself.
type uploadRig struct {
	reg   *devenv.Registry
	hosts docker.RegistryHosts
	mu    sync.Mutex
	seen  []string // "METHOD content-range"
}

func newUploadRig(t *testing.T) *uploadRig {
	t.Helper()
	if _, err := devenv.Tool("registry"); err != nil {
		prereq.Missing(t, "registry binary: %v", err)
	}
	reg, err := devenv.StartRegistry(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(reg.Close)
	return &uploadRig{reg: reg, hosts: registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true})}
}

// intercept records every upload request and hands it to f, which
// answers it (true) or lets the registry do so.
func (r *uploadRig) intercept(f func(w http.ResponseWriter, req *http.Request, n int) bool) {
	r.reg.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
		if !strings.Contains(req.URL.Path, "/blobs/uploads/") {
			return false
		}
		r.mu.Lock()
		r.seen = append(r.seen, req.Method+" "+req.Header.Get("Content-Range"))
		n := len(r.seen)
		r.mu.Unlock()
		return f != nil && f(w, req, n)
	})
}

func (r *uploadRig) requests() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}

// has reports whether the registry serves blob dgst in repo.
func (r *uploadRig) has(t *testing.T, repo string, dgst digest.Digest) bool {
	t.Helper()
	resp, err := http.Head("http://" + r.reg.Host + "/v2/" + repo + "/blobs/" + dgst.String())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// writeInPieces writes b in uneven pieces, as the encoder's buffered
// writer does.
func writeInPieces(u *blobUpload, b []byte) error {
	for len(b) > 0 {
		n := min(len(b), 100_003)
		if _, err := u.Write(b[:n]); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

func randomBlob(t *testing.T, n int) ([]byte, digest.Digest) {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b, digest.FromBytes(b)
}

// TestUploadStreamed streams a blob of two and a half chunks: two PATCHes
// with consecutive ranges, then the PUT with the digest and the rest; the
// registry then serves exactly those bytes.
func TestUploadStreamed(t *testing.T) {
	r := newUploadRig(t)
	r.intercept(nil)
	const chunk = 1 << 20
	b, dgst := randomBlob(t, 2*chunk+chunk/2)
	ref := r.reg.Host + "/up/streamed:1"
	u, err := startUpload(context.Background(), r.hosts, ref, chunk)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeInPieces(u, b); err != nil {
		t.Fatal(err)
	}
	if r.has(t, "up/streamed", dgst) {
		t.Fatal("the blob is visible before the upload was committed")
	}
	if err := u.Commit(dgst, int64(len(b))); err != nil {
		t.Fatal(err)
	}
	want := []string{"POST ", "PATCH 0-1048575", "PATCH 1048576-2097151", "PUT "}
	if got := r.requests(); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("requests %q, want %q", got, want)
	}
	resp, err := http.Get("http://" + r.reg.Host + "/v2/up/streamed/blobs/" + dgst.String())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || !bytes.Equal(got, b) {
		t.Errorf("registry serves %d bytes (%v), want the %d uploaded", len(got), err, len(b))
	}
	if d := r.reg.UploadedDigests(); len(d) != 1 || d[0] != dgst.String() {
		t.Errorf("uploaded digests %v, want [%s]", d, dgst)
	}
}

// TestUploadCommitChecks: a wrong size is caught before the PUT, a wrong
// digest by the registry; neither leaves a blob.
func TestUploadCommitChecks(t *testing.T) {
	r := newUploadRig(t)
	b, dgst := randomBlob(t, 300_000)
	ref := r.reg.Host + "/up/checks:1"
	u, err := startUpload(context.Background(), r.hosts, ref, 128<<10)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeInPieces(u, b); err != nil {
		t.Fatal(err)
	}
	if err := u.Commit(dgst, int64(len(b))+1); err == nil || !strings.Contains(err.Error(), "wrote 300000 bytes for a blob of 300001") {
		t.Errorf("commit with a wrong size: %v", err)
	}
	u.Abort()

	u, err = startUpload(context.Background(), r.hosts, ref, 128<<10)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeInPieces(u, b); err != nil {
		t.Fatal(err)
	}
	wrong := digest.FromString("not the blob")
	err = u.Commit(wrong, int64(len(b)))
	t.Logf("wrong digest: %v", err)
	if err == nil || !strings.Contains(err.Error(), "finish upload of "+wrong.String()) || !strings.Contains(err.Error(), "400") {
		t.Errorf("commit with a wrong digest: %v", err)
	}
	if r.has(t, "up/checks", dgst) || r.has(t, "up/checks", wrong) {
		t.Error("a refused commit left a blob")
	}
}

// TestUploadFaults: a registry refusing a PATCH, and a connection cut in
// the middle of one, fail the upload with an error that says which bytes
// did not get there; no blob appears, and the writer does not hang.
func TestUploadFaults(t *testing.T) {
	const chunk = 256 << 10
	cases := []struct {
		name   string
		answer func(w http.ResponseWriter, req *http.Request)
		want   string
	}{
		{"refused", func(w http.ResponseWriter, req *http.Request) {
			http.Error(w, "injected refusal", http.StatusServiceUnavailable)
		}, "503 Service Unavailable: injected refusal"},
		{"cut", func(w http.ResponseWriter, req *http.Request) {
			// Read part of the chunk, then drop the connection.
			_, _ = io.CopyN(io.Discard, req.Body, chunk/3)
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close()
			}
		}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newUploadRig(t)
			// The second PATCH fails: the first went through.
			r.intercept(func(w http.ResponseWriter, req *http.Request, n int) bool {
				if req.Method == http.MethodPatch && strings.HasPrefix(req.Header.Get("Content-Range"), "262144-") {
					tc.answer(w, req)
					return true
				}
				return false
			})
			b, dgst := randomBlob(t, 4*chunk)
			u, err := startUpload(context.Background(), r.hosts, r.reg.Host+"/up/fault:1", chunk)
			if err != nil {
				t.Fatal(err)
			}
			werr := writeInPieces(u, b)
			cerr := u.Commit(dgst, int64(len(b)))
			u.Abort()
			t.Logf("write: %v; commit: %v", werr, cerr)
			if cerr == nil {
				t.Fatal("the upload succeeded through a failed PATCH")
			}
			if !strings.Contains(cerr.Error(), "upload bytes 262144-524287 to "+r.reg.Host+"/up/fault:1: ") || !strings.Contains(cerr.Error(), tc.want) || strings.Contains(cerr.Error(), "_state") {
				t.Errorf("error %q does not name the failed range and %q", cerr, tc.want)
			}
			if r.has(t, "up/fault", dgst) {
				t.Error("the blob exists after a failed upload")
			}
			for _, req := range r.requests() {
				if strings.HasPrefix(req, "PUT") {
					t.Errorf("the upload was closed (%s) after a failed chunk", req)
				}
			}
		})
	}
}
