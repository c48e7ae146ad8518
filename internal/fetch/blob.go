package fetch

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Option configures a BlobReader (and FetchManifest).
type Option func(*blobOptions)

type blobOptions struct {
	timeout        time.Duration
	initialBackoff time.Duration
	maxBackoff     time.Duration
	metrics        *Metrics
}

func defaultBlobOptions() blobOptions {
	return blobOptions{
		timeout:        DefaultTimeout,
		initialBackoff: DefaultInitialBackoff,
		maxBackoff:     DefaultMaxBackoff,
	}
}

// WithTimeout bounds a read whose context has no deadline (default
// DefaultTimeout). Retries stop at the deadline either way.
func WithTimeout(d time.Duration) Option { return func(o *blobOptions) { o.timeout = d } }

// WithBackoff sets the first and the largest wait between retries (defaults
// DefaultInitialBackoff, DefaultMaxBackoff).
func WithBackoff(initial, max time.Duration) Option {
	return func(o *blobOptions) { o.initialBackoff, o.maxBackoff = initial, max }
}

// WithRequestMetrics counts HTTP attempts and their outcome.
func WithRequestMetrics(m *Metrics) Option { return func(o *blobOptions) { o.metrics = m } }

// BlobReader reads byte ranges of one blob of one repository via HTTP Range
// GETs. It is safe for concurrent use.
type BlobReader struct {
	r    *remote
	desc ocispec.Descriptor
	// rangeIgnored is set once a host answered a Range request with the
	// whole blob; the Layer then prefers fetching small blobs whole.
	rangeIgnored atomic.Bool
}

// NewBlobReader prepares reads of desc in the repository of ref (a fully
// qualified reference such as "127.0.0.1:5000/envsnap/base:1"), using the
// hosts configured for ref's registry. No request is sent yet.
func NewBlobReader(hosts docker.RegistryHosts, ref string, desc ocispec.Descriptor, opts ...Option) (*BlobReader, error) {
	o := defaultBlobOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := desc.Digest.Validate(); err != nil {
		return nil, fmt.Errorf("blob reader for %s: %w", ref, errorsJoinInvalid(err))
	}
	if desc.Size <= 0 {
		return nil, fmt.Errorf("blob reader for %s@%s: size %d: %w", ref, desc.Digest, desc.Size, errdefs.ErrInvalidArgument)
	}
	r, err := newRemote(hosts, ref, &o)
	if err != nil {
		return nil, err
	}
	return &BlobReader{r: r, desc: desc}, nil
}

// Descriptor returns the blob's descriptor.
func (b *BlobReader) Descriptor() ocispec.Descriptor { return b.desc }

// Size returns the blob size.
func (b *BlobReader) Size() int64 { return b.desc.Size }

// RangeIgnored reports whether a registry answered a Range request with the
// full blob.
func (b *BlobReader) RangeIgnored() bool { return b.rangeIgnored.Load() }

// ReadRange returns blob bytes [off, off+n). It sends one single-range
// request (never multi-range: registries reject those), follows redirects to
// blob storage keeping the Range header, and retries transient faults until
// ctx's deadline (or the default timeout). It does not verify content: the
// caller checks chunk digests.
func (b *BlobReader) ReadRange(ctx context.Context, off, n int64) ([]byte, error) {
	data, _, err := b.readRange(ctx, off, n, 0, nil, nil)
	return data, err
}

// arrived is told the bytes of a range response received so far, starting
// at blob offset off, each time more arrive; a retried request starts
// again from its first byte.
type arrived func(data []byte, off int64)

// streamStep is the most of a range response read at once before the
// bytes are handed to arrived (each read returns what has arrived): a
// frame (about 1 MiB compressed) is released to its reader when it is in,
// not when the whole read-ahead behind it is.
const streamStep = 256 << 10

// readRange is ReadRange that, when the registry answers with the whole blob
// and the blob is at most keepWhole bytes, returns all of it: data then
// starts at blob offset base 0 instead of off.
// Partial responses are reported to progress, when not nil, as they arrive.
// A range is received into a buffer from alloc, when not nil: every attempt
// at the request takes a new one (the bytes of an earlier attempt may
// already be in the hands of readers).
func (b *BlobReader) readRange(ctx context.Context, off, n, keepWhole int64, progress arrived, alloc func(int64) []byte) (data []byte, base int64, err error) {
	if off < 0 || n <= 0 || off+n > b.desc.Size {
		return nil, 0, fmt.Errorf("read %s range %d+%d of %d bytes: %w", b.desc.Digest, off, n, b.desc.Size, errdefs.ErrInvalidArgument)
	}
	what := fmt.Sprintf("fetch %s range %d-%d", b.desc.Digest, off, off+n-1)
	hdr := http.Header{}
	hdr.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+n-1))
	err = b.r.do(ctx, what, "/blobs/"+b.desc.Digest.String(), hdr, func(resp *http.Response) error {
		var err error
		data, base, err = b.readBody(ctx, resp, off, n, keepWhole, progress, alloc)
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	return data, base, nil
}

func (b *BlobReader) readBody(ctx context.Context, resp *http.Response, off, n, keepWhole int64, progress arrived, alloc func(int64) []byte) ([]byte, int64, error) {
	host := resp.Request.URL.Host
	switch resp.StatusCode {
	case http.StatusPartialContent:
		start, _, total, err := parseContentRange(resp.Header.Get("Content-Range"))
		if err != nil {
			return nil, 0, permanent(fmt.Errorf("%s: %w", host, err))
		}
		if start != off || (total >= 0 && total != b.desc.Size) {
			return nil, 0, permanent(fmt.Errorf("%s: asked for bytes %d- of a %d byte blob, got Content-Range %q",
				host, off, b.desc.Size, resp.Header.Get("Content-Range")))
		}
	case http.StatusOK:
		// The server (or a proxy in front of it) ignored Range and sends
		// the whole blob.
		if resp.ContentLength >= 0 && resp.ContentLength != b.desc.Size {
			return nil, 0, permanent(fmt.Errorf("%s: Range ignored and body is %d bytes, blob is %d",
				host, resp.ContentLength, b.desc.Size))
		}
		if !b.rangeIgnored.Swap(true) {
			log.G(ctx).WithField("host", host).WithField("digest", b.desc.Digest).
				Warn("registry ignores Range requests; reading windows out of full-blob responses")
		}
		if b.desc.Size <= keepWhole {
			buf := make([]byte, b.desc.Size)
			if got, err := io.ReadFull(resp.Body, buf); err != nil {
				return nil, 0, fmt.Errorf("%s: read full-blob response: got %d of %d bytes: %w", host, got, b.desc.Size, unexpectedEOF(err))
			}
			return buf, 0, nil
		}
		if skipped, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
			return nil, 0, fmt.Errorf("%s: skip to %d in full-blob response: got %d bytes: %w", host, off, skipped, unexpectedEOF(err))
		}
	default:
		return nil, 0, permanent(fmt.Errorf("%s: unexpected status %d for a range request", host, resp.StatusCode))
	}
	var buf []byte
	if alloc != nil {
		buf = alloc(n)
	} else {
		buf = make([]byte, n)
	}
	if progress == nil {
		if got, err := io.ReadFull(resp.Body, buf); err != nil {
			// A reset or truncated body: transient, the whole range is retried.
			return nil, 0, fmt.Errorf("%s: read body: got %d of %d bytes: %w", host, got, n, unexpectedEOF(err))
		}
		return buf, off, nil
	}
	for got := int64(0); got < n; {
		m, err := resp.Body.Read(buf[got:min(got+streamStep, n)])
		got += int64(m)
		if m > 0 {
			progress(buf[:got], off)
		}
		if err != nil && got < n {
			return nil, 0, fmt.Errorf("%s: read body: got %d of %d bytes: %w", host, got, n, unexpectedEOF(err))
		}
	}
	return buf, off, nil
}

func unexpectedEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// parseContentRange parses "bytes first-last/total" (total may be "*").
func parseContentRange(v string) (first, last, total int64, err error) {
	rest, ok := strings.CutPrefix(v, "bytes ")
	if !ok {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	rng, tot, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	a, z, ok := strings.Cut(rng, "-")
	if !ok {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	if first, err = strconv.ParseInt(a, 10, 64); err != nil {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	if last, err = strconv.ParseInt(z, 10, 64); err != nil || last < first {
		return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
	}
	total = -1
	if tot != "*" {
		if total, err = strconv.ParseInt(tot, 10, 64); err != nil || total <= last {
			return 0, 0, 0, fmt.Errorf("bad Content-Range %q", v)
		}
	}
	return first, last, total, nil
}

// ReaderAt adapts the blob to io.ReaderAt for layerfmt.ReadTOC; every ReadAt
// is one ReadRange under ctx.
func (b *BlobReader) ReaderAt(ctx context.Context) io.ReaderAt { return readerAt{ctx, b} }

type readerAt struct {
	ctx context.Context
	b   *BlobReader
}

func (r readerAt) ReadAt(p []byte, off int64) (int, error) {
	size := r.b.desc.Size
	if off < 0 {
		return 0, fmt.Errorf("read at negative offset %d: %w", off, errdefs.ErrInvalidArgument)
	}
	if off >= size {
		return 0, io.EOF
	}
	n := min(int64(len(p)), size-off)
	if n == 0 {
		return 0, nil
	}
	data, err := r.b.ReadRange(r.ctx, off, n)
	if err != nil {
		return 0, err
	}
	copy(p, data)
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// maxManifestSize bounds what FetchManifest reads: a manifest of thousands of
// layers is still far below it.
const maxManifestSize = 4 << 20

// manifestAccept lists the media types we can use; registries pick by Accept.
var manifestAccept = strings.Join([]string{
	ocispec.MediaTypeImageManifest,
	ocispec.MediaTypeImageIndex,
	"application/vnd.docker.distribution.manifest.v2+json",
	"application/vnd.docker.distribution.manifest.list.v2+json",
	"*/*",
}, ", ")

// FetchManifest fetches the manifest (or index) dgst from the repository of
// ref and returns its bytes, verified against dgst.
func FetchManifest(ctx context.Context, hosts docker.RegistryHosts, ref string, dgst digest.Digest, opts ...Option) ([]byte, error) {
	if err := dgst.Validate(); err != nil {
		return nil, fmt.Errorf("fetch manifest of %s: %w", ref, errorsJoinInvalid(err))
	}
	o := defaultBlobOptions()
	for _, opt := range opts {
		opt(&o)
	}
	r, err := newRemote(hosts, ref, &o)
	if err != nil {
		return nil, err
	}
	hdr := http.Header{}
	hdr.Set("Accept", manifestAccept)
	var out []byte
	what := fmt.Sprintf("fetch manifest %s of %s", dgst, ref)
	err = r.do(ctx, what, "/manifests/"+dgst.String(), hdr, func(resp *http.Response) error {
		b, err := io.ReadAll(io.LimitReader(resp.Body, maxManifestSize+1))
		if err != nil {
			return fmt.Errorf("%s: read manifest: %w", resp.Request.URL.Host, err)
		}
		if len(b) > maxManifestSize {
			return permanent(fmt.Errorf("%s: manifest larger than %d bytes", resp.Request.URL.Host, maxManifestSize))
		}
		if got := dgst.Algorithm().FromBytes(b); got != dgst {
			// Not retried on this host: the registry (or a mirror) serves
			// wrong content; another host may still have the right one.
			log.G(ctx).WithField("host", resp.Request.URL.Host).WithField("digest", dgst).WithField("got", got).
				Error("manifest digest mismatch")
			return permanent(fmt.Errorf("%s: manifest has digest %s, want %s", resp.Request.URL.Host, got, dgst))
		}
		out = b
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func errorsJoinInvalid(err error) error {
	return fmt.Errorf("%w: %w", errdefs.ErrInvalidArgument, err)
}
