package envsnapshot

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	remoteerrors "github.com/containerd/containerd/v2/core/remotes/errors"
	"github.com/containerd/containerd/v2/pkg/reference"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
)

// DefaultUploadChunk is the size of the PATCH requests of a streamed
// upload. Above the 5 MiB some registries require of every chunk but the
// last; small enough that the first chunk leaves while the encoder is
// still on the rest.
const DefaultUploadChunk = 8 << 20

// maxUploadChunk bounds the chunk size a registry can ask for.
const maxUploadChunk = 256 << 20

// blobUpload streams a blob whose digest is not known yet to a registry,
// with the chunked upload of the OCI distribution spec: POST opens an
// upload session, each chunk is a PATCH with its Content-Range, and the
// PUT ?digest= that closes the session (carrying the last, partial
// chunk) is sent once the writer knows the digest. containerd's pusher
// cannot do this: it needs the digest before the first byte (its PUT
// URL carries it).
//
// Write buffers one chunk while the previous one is on the wire, so the
// encoder never waits for the registry unless the registry is the slower
// of the two. Nothing is visible in the repository until Commit: a blob
// upload that is aborted, or that fails, leaves at most an upload session
// the registry expires (Abort cancels it when the registry still
// answers).
type blobUpload struct {
	ctx    context.Context // carries the push scope for the authorizer
	host   docker.RegistryHost
	ns     string // ?ns= when the host is a mirror of the reference's registry
	target string

	buf   []byte
	sent  int64 // bytes handed to the sender
	queue chan []byte
	free  chan []byte
	done  chan struct{}

	mu  sync.Mutex
	err error
	// location is where the next request of the session goes; the
	// sender's until done is closed.
	location *url.URL
	closed   bool
}

// startUpload opens an upload session in target's repository on the
// first push host hosts name for it.
func startUpload(ctx context.Context, hosts docker.RegistryHosts, target string, chunk int) (*blobUpload, error) {
	spec, err := reference.Parse(target)
	if err != nil {
		return nil, fmt.Errorf("target %s: %w", target, err)
	}
	all, err := hosts(spec.Hostname())
	if err != nil {
		return nil, fmt.Errorf("registry hosts of %s: %w", spec.Hostname(), err)
	}
	var host *docker.RegistryHost
	for i := range all {
		if all[i].Capabilities.Has(docker.HostCapabilityPush) {
			host = &all[i]
			break
		}
	}
	if host == nil {
		return nil, fmt.Errorf("no push host for %s: %w", spec.Hostname(), errdefs.ErrNotFound)
	}
	sctx, err := docker.ContextWithRepositoryScope(ctx, spec, true)
	if err != nil {
		return nil, err
	}
	u := &blobUpload{ctx: sctx, host: *host, target: target, done: make(chan struct{})}
	if host.Host != spec.Hostname() {
		u.ns = spec.Hostname()
	}
	scheme := host.Scheme
	if scheme == "" {
		scheme = "https"
	}
	repo := strings.TrimPrefix(spec.Locator, spec.Hostname()+"/")
	start, err := url.Parse(scheme + "://" + host.Host + host.Path + "/" + repo + "/blobs/uploads/")
	if err != nil {
		return nil, fmt.Errorf("upload URL for %s: %w", target, err)
	}
	resp, err := u.do(sctx, http.MethodPost, start, nil, nil, http.StatusAccepted)
	if err != nil {
		return nil, fmt.Errorf("start upload to %s: %w", target, err)
	}
	if u.location, err = u.next(resp); err != nil {
		return nil, fmt.Errorf("start upload to %s: %w", target, err)
	}
	// A registry may ask for larger chunks (OCI distribution spec,
	// OCI-Chunk-Min-Length); two chunks are held in memory, so a demand
	// past maxUploadChunk is refused rather than allocated.
	if v, err := strconv.Atoi(resp.Header.Get("OCI-Chunk-Min-Length")); err == nil && v > chunk {
		if v > maxUploadChunk {
			return nil, fmt.Errorf("start upload to %s: the registry wants chunks of at least %d bytes, over the %d this holds in memory: %w", target, v, maxUploadChunk, errdefs.ErrNotImplemented)
		}
		chunk = v
	}
	u.buf = make([]byte, 0, chunk)
	u.queue, u.free = make(chan []byte, 1), make(chan []byte, 2)
	u.free <- make([]byte, 0, chunk)
	go u.send()
	return u, nil
}

// Write queues p for the upload. It fails as soon as a chunk has failed.
func (u *blobUpload) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		k := copy(u.buf[len(u.buf):cap(u.buf)], p)
		u.buf, p, n = u.buf[:len(u.buf)+k], p[k:], n+k
		if len(u.buf) == cap(u.buf) {
			if err := u.failed(); err != nil {
				return n, err
			}
			u.queue <- u.buf
			u.sent += int64(len(u.buf))
			u.buf = (<-u.free)[:0]
		}
	}
	return n, u.failed()
}

// send PATCHes the queued chunks in order. After a failure it only
// recycles the chunks, so that Write never blocks on a dead upload.
func (u *blobUpload) send() {
	defer close(u.done)
	var off int64
	for b := range u.queue {
		if u.failed() == nil {
			if err := u.patch(off, b); err != nil {
				u.fail(fmt.Errorf("upload bytes %d-%d to %s: %w", off, off+int64(len(b))-1, u.target, err))
			}
		}
		off += int64(len(b))
		u.free <- b
	}
}

// patch sends one chunk at offset off.
func (u *blobUpload) patch(off int64, b []byte) error {
	end := off + int64(len(b)) - 1
	resp, err := u.do(u.ctx, http.MethodPatch, u.location, b, func(h http.Header) {
		h.Set("Content-Range", fmt.Sprintf("%d-%d", off, end))
	}, http.StatusAccepted)
	if err != nil {
		return err
	}
	// The registry says how much of the blob it holds; anything else than
	// all of it so far means bytes were lost.
	if r := resp.Header.Get("Range"); r != "" && r != fmt.Sprintf("0-%d", end) && r != fmt.Sprintf("bytes=0-%d", end) {
		return fmt.Errorf("registry holds range %s after a chunk ending at %d", r, end)
	}
	loc, err := u.next(resp)
	if err != nil {
		return err
	}
	u.location = loc
	return nil
}

// Commit sends what is left and closes the session as blob dgst of size
// bytes; the registry checks both.
func (u *blobUpload) Commit(dgst digest.Digest, size int64) error {
	u.close()
	if err := u.failed(); err != nil {
		return err
	}
	if got := u.sent + int64(len(u.buf)); got != size {
		return fmt.Errorf("upload to %s: wrote %d bytes for a blob of %d", u.target, got, size)
	}
	loc := *u.location
	q := loc.Query()
	q.Set("digest", dgst.String())
	loc.RawQuery = q.Encode()
	resp, err := u.do(u.ctx, http.MethodPut, &loc, u.buf, nil, http.StatusCreated)
	if err != nil {
		return fmt.Errorf("finish upload of %s to %s: %w", dgst, u.target, err)
	}
	if got := resp.Header.Get("Docker-Content-Digest"); got != "" && got != dgst.String() {
		return fmt.Errorf("finish upload of %s to %s: the registry stored %s", dgst, u.target, got)
	}
	return nil
}

// Abort stops the upload and cancels the session, best effort: a
// registry that does not answer expires it.
func (u *blobUpload) Abort() {
	u.close()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(u.ctx), 10*time.Second)
	defer cancel()
	if _, err := u.do(ctx, http.MethodDelete, u.location, nil, nil, http.StatusNoContent); err != nil {
		log.G(ctx).WithError(err).WithField("target", u.target).Debug("cancel blob upload")
	}
}

// close stops the sender and waits for it; it may be called more than
// once.
func (u *blobUpload) close() {
	if !u.closed {
		u.closed = true
		close(u.queue)
	}
	<-u.done
}

func (u *blobUpload) failed() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.err
}

func (u *blobUpload) fail(err error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.err == nil {
		u.err = err
	}
}

// do sends one request of the session and returns its response, drained
// and closed, when it has status want. It answers an auth challenge once
// (first contact, or a token that expired mid-upload).
func (u *blobUpload) do(ctx context.Context, method string, loc *url.URL, body []byte, header func(http.Header), want int) (*http.Response, error) {
	target := *loc
	if u.ns != "" {
		q := target.Query()
		q.Set("ns", u.ns)
		target.RawQuery = q.Encode()
	}
	client := u.host.Client
	if client == nil {
		client = http.DefaultClient
	}
	for retried := false; ; retried = true {
		req, err := http.NewRequestWithContext(ctx, method, target.String(), bytes.NewReader(body))
		if err != nil {
			return nil, err
		}
		req.ContentLength = int64(len(body))
		if len(body) == 0 {
			req.Body = http.NoBody
		}
		for k, v := range u.host.Header {
			req.Header[k] = append([]string(nil), v...)
		}
		req.Header.Set("Content-Type", "application/octet-stream")
		if header != nil {
			header(req.Header)
		}
		if u.host.Authorizer != nil {
			if err := u.host.Authorizer.Authorize(ctx, req); err != nil {
				return nil, fmt.Errorf("authorize: %w", err)
			}
		}
		resp, err := client.Do(req)
		if err != nil {
			if ue, ok := errors.AsType[*url.Error](err); ok {
				ue.URL = redact(req.URL)
			}
			return nil, err
		}
		if resp.StatusCode == http.StatusUnauthorized && u.host.Authorizer != nil && !retried {
			err := u.host.Authorizer.AddResponses(ctx, []*http.Response{resp})
			drain(resp)
			if err != nil {
				return nil, fmt.Errorf("auth challenge: %w", err)
			}
			continue
		}
		if resp.StatusCode != want {
			err := remoteerrors.NewUnexpectedStatusErr(resp)
			drain(resp)
			if se, ok := err.(remoteerrors.ErrUnexpectedStatus); ok {
				se.RequestURL = redact(req.URL)
				if body := strings.TrimSpace(string(se.Body)); body != "" {
					return nil, fmt.Errorf("%w: %.300s", se, body)
				}
				return nil, se
			}
			return nil, err
		}
		drain(resp)
		return resp, nil
	}
}

// next is the session's next URL from a response's Location header,
// which may be relative to the request's. A location on another host
// gets no credentials (as containerd's pusher does).
func (u *blobUpload) next(resp *http.Response) (*url.URL, error) {
	loc := resp.Header.Get("Location")
	if loc == "" {
		return nil, errors.New("registry answered without a Location for the upload")
	}
	l, err := resp.Request.URL.Parse(loc)
	if err != nil {
		return nil, fmt.Errorf("upload location %q: %w", loc, err)
	}
	if l.Host != resp.Request.URL.Host || l.Scheme != resp.Request.URL.Scheme {
		u.host.Authorizer = nil
	}
	return l, nil
}

// redact drops the query of an upload URL from errors: it is the
// registry's opaque session state, long and of no use to a reader.
func redact(u *url.URL) string {
	r := *u
	r.RawQuery = ""
	return r.String()
}

// drain lets the connection be reused when the rest of the body is small.
func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
}
