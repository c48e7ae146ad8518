//go:build linux

package layerstore

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/snapshotter"
)

// fakeRegistry serves manifests and blobs by digest (with Range).
type fakeRegistry struct {
	blobs map[digest.Digest][]byte
	srv   *httptest.Server

	mu       sync.Mutex
	requests map[digest.Digest]int
	delay    time.Duration // added to every blob response
}

func (r *fakeRegistry) requestsFor(d digest.Digest) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests[d]
}

func newFakeRegistry(t *testing.T) *fakeRegistry { return newFakeRegistryB(t) }

func newFakeRegistryB(t testing.TB) *fakeRegistry {
	r := &fakeRegistry{blobs: map[digest.Digest][]byte{}, requests: map[digest.Digest]int{}}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		i := strings.LastIndex(req.URL.Path, "/")
		r.mu.Lock()
		r.requests[digest.Digest(req.URL.Path[i+1:])]++
		delay := r.delay
		r.mu.Unlock()
		time.Sleep(delay)
		b, ok := r.blobs[digest.Digest(req.URL.Path[i+1:])]
		if !ok {
			http.NotFound(w, req)
			return
		}
		if strings.Contains(req.URL.Path, "/manifests/") {
			w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		}
		w.Header().Set("Docker-Content-Digest", req.URL.Path[i+1:])
		http.ServeContent(w, req, "", time.Time{}, bytes.NewReader(b))
	}))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *fakeRegistry) host() string { return strings.TrimPrefix(r.srv.URL, "http://") }

func (r *fakeRegistry) add(b []byte) digest.Digest {
	d := digest.FromBytes(b)
	r.blobs[d] = b
	return d
}

// addLazyLayer converts tarStream to an envsnap layer, stores it and
// returns its descriptor and blob.
func (r *fakeRegistry) addLazyLayer(tb testing.TB, tarStream []byte) (ocispec.Descriptor, []byte) {
	tb.Helper()
	var blob bytes.Buffer
	res, err := layerfmt.Convert(context.Background(), &blob, bytes.NewReader(tarStream))
	if err != nil {
		tb.Fatal(err)
	}
	return ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: r.add(blob.Bytes()), Size: res.Size, Annotations: res.Annotations()}, blob.Bytes()
}

// addManifest stores an image manifest of layers (empty config) and
// returns the labels a snapshotter Prepare of each layer would carry for
// the image name (a path under the registry).
func (r *fakeRegistry) addManifest(tb testing.TB, name string, layers ...ocispec.Descriptor) []map[string]string {
	tb.Helper()
	mb, err := json.Marshal(ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: r.add([]byte("{}")), Size: 2},
		Layers:    layers,
	})
	if err != nil {
		tb.Fatal(err)
	}
	mdgst := r.add(mb)
	var out []map[string]string
	for _, l := range layers {
		out = append(out, map[string]string{
			snapshotter.LabelImageRef:       r.host() + "/" + name,
			snapshotter.LabelManifestDigest: mdgst.String(),
			snapshotter.LabelLayerDigest:    l.Digest.String(),
		})
	}
	return out
}

func tarOfB(t testing.TB, name string, data []byte) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	tw.Write(data)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func tarOf(t *testing.T, files map[string]string) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, data := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(data))
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// testImage pushes a manifest with one envsnap layer, one layer whose TOC
// annotation is wrong, and one plain layer, and returns the labels of each.
func testImage(t *testing.T, r *fakeRegistry) (lazy, badTOC, plain map[string]string) {
	lazyDesc, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"hello.txt": "hello, lazy world\n"}))

	badDesc, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"other.txt": "x"}))
	badDesc.Annotations[layerfmt.AnnotationTOCDigest] = digest.FromString("not the TOC").String()

	plainBytes := tarOf(t, map[string]string{"plain.txt": "plain"})
	plainDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: r.add(plainBytes), Size: int64(len(plainBytes))}

	labels := r.addManifest(t, "test/app:1", lazyDesc, badDesc, plainDesc)
	return labels[0], labels[1], labels[2]
}

func newTestStore(t *testing.T) *Store { return newStoreB(t) }

// unmountAtCleanup unmounts the layer at mp when tb ends, failing tb if
// that fails: a mount left behind dies with the test binary and stays as a
// dead FUSE mount. A layer the test unmounted itself is not an error.
func unmountAtCleanup(tb testing.TB, s *Store, mp string) {
	tb.Cleanup(func() {
		if err := s.Unmount(context.Background(), mp); err != nil && !errdefs.IsNotFound(err) {
			tb.Errorf("unmount layer at %s: %v", mp, err)
		}
	})
}

func newStoreB(t testing.TB) *Store {
	cache, err := chunkcache.Open(t.TempDir(), 256<<20)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{
		Hosts: registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true}),
		Cache: cache,
		Fill:  true,
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestMountTrustChain(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	lazy, badTOC, plain := testImage(t, r)
	s := newTestStore(t)
	ctx := t.Context()

	mp := t.TempDir()
	if err := s.Mount(ctx, mp, lazy); err != nil {
		t.Fatalf("Mount: %v", err)
	}
	unmountAtCleanup(t, s, mp)
	b, err := os.ReadFile(filepath.Join(mp, "hello.txt"))
	if err != nil || string(b) != "hello, lazy world\n" {
		t.Fatalf("read through the mount: %q, %v", b, err)
	}
	if err := s.Check(ctx, mp, lazy); err != nil {
		t.Fatalf("Check of a live mount: %v", err)
	}
	if err := s.Mount(ctx, mp, lazy); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second Mount on the same mountpoint: %v", err)
	}
	st := s.Status()[mp]
	if st.Digest.String() != lazy[snapshotter.LabelLayerDigest] || st.TotalBytes == 0 || st.Environments != 0 {
		t.Fatalf("status %+v", st)
	}
	s.NoteEnvironment(mp)
	s.NoteEnvironment(t.TempDir()) // not a layer of the store: ignored
	if n := s.Status()[mp].Environments; n != 1 {
		t.Fatalf("one environment noted: status says %d", n)
	}
	if err := s.Unmount(ctx, mp); err != nil {
		t.Fatal(err)
	}
	if err := s.Check(ctx, mp, lazy); err == nil {
		t.Fatal("Check passed after Unmount")
	}

	for _, tc := range []struct {
		name   string
		labels map[string]string
		check  func(error) bool
	}{
		{"plain layer is not ours", plain, errdefs.IsNotImplemented},
		{"TOC digest mismatch", badTOC, func(err error) bool { return errors.Is(err, layerfmt.ErrDigestMismatch) }},
		{"layer not in manifest", map[string]string{
			snapshotter.LabelImageRef:       lazy[snapshotter.LabelImageRef],
			snapshotter.LabelManifestDigest: lazy[snapshotter.LabelManifestDigest],
			snapshotter.LabelLayerDigest:    digest.FromString("elsewhere").String(),
		}, errdefs.IsNotFound},
		{"manifest unknown", map[string]string{
			snapshotter.LabelImageRef:       lazy[snapshotter.LabelImageRef],
			snapshotter.LabelManifestDigest: digest.FromString("no manifest").String(),
			snapshotter.LabelLayerDigest:    lazy[snapshotter.LabelLayerDigest],
		}, func(err error) bool { return err != nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mp := t.TempDir()
			err := s.Mount(ctx, mp, tc.labels)
			if err == nil {
				unmountAtCleanup(t, s, mp)
				t.Fatal("mounted")
			}
			if !tc.check(err) {
				t.Fatalf("unexpected error kind: %v", err)
			}
			if len(s.Status()) != 0 {
				t.Fatalf("failed mount left state: %+v", s.Status())
			}
		})
	}
}

// TestTOCPrefetch: the first Mount of an image reads the TOCs of all its
// lazy layers at once, and later Mounts use them without a registry trip.
func TestTOCPrefetch(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	var layers []ocispec.Descriptor
	for i := range 3 {
		d, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"f": strings.Repeat("x", i+1)}))
		layers = append(layers, d)
	}
	labels := map[digest.Digest]map[string]string{}
	for i, l := range r.addManifest(t, "test/app:1", layers...) {
		labels[layers[i].Digest] = l
	}
	s := newTestStore(t)
	s.cfg.Fill = false
	ctx := t.Context()
	mount := func(d digest.Digest) {
		mp := t.TempDir()
		if err := s.Mount(ctx, mp, labels[d]); err != nil {
			t.Fatal(err)
		}
		unmountAtCleanup(t, s, mp)
	}

	mount(layers[0].Digest)
	deadline := time.Now().Add(10 * time.Second)
	for r.requestsFor(layers[1].Digest) == 0 || r.requestsFor(layers[2].Digest) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the other layers' TOCs were not prefetched")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, l := range layers[1:] {
		s.mu.Lock()
		f := s.tocs[l.Digest]
		s.mu.Unlock()
		<-f.done
		before := r.requestsFor(l.Digest)
		mount(l.Digest)
		if after := r.requestsFor(l.Digest); after != before {
			t.Errorf("Mount of %s sent %d requests despite the prefetched TOC", l.Digest, after-before)
		}
	}
	if len(s.tocs) != 0 {
		t.Errorf("unclaimed prefetches left: %d", len(s.tocs))
	}
}

// TestSharedFramesFetchedOnce: two mounted layers holding the same file
// (same frames) read at the same moment fetch its frame once: the store
// gives every layer one node-wide flight group.
func TestSharedFramesFetchedOnce(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	// Whole chunks (the default chunk size is 1 MiB): small files are
	// packed into frames with their neighbours, which differ here.
	shared := strings.Repeat("shared between two layers\n", 2<<20/26+1)[:2<<20]
	var descs []ocispec.Descriptor
	for _, other := range []string{"a", "b"} {
		d, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"shared.txt": shared, other + ".txt": other}))
		descs = append(descs, d)
	}
	layerLabels := r.addManifest(t, "test/shared:1", descs...)
	cache, err := chunkcache.Open(t.TempDir(), 256<<20)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Hosts: registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true}), Cache: cache})
	if err != nil {
		t.Fatal(err)
	}
	var mps []string
	for _, labels := range layerLabels {
		mp := t.TempDir()
		if err := s.Mount(t.Context(), mp, labels); err != nil {
			t.Fatal(err)
		}
		unmountAtCleanup(t, s, mp)
		mps = append(mps, mp)
	}
	before := r.requestsFor(descs[0].Digest) + r.requestsFor(descs[1].Digest)
	r.mu.Lock()
	r.delay = 300 * time.Millisecond
	r.mu.Unlock()
	errs := make(chan error, 1)
	go func() {
		b, err := os.ReadFile(filepath.Join(mps[0], "shared.txt"))
		if err == nil && string(b) != shared {
			err = errors.New("wrong content")
		}
		errs <- err
	}()
	for r.requestsFor(descs[0].Digest)+r.requestsFor(descs[1].Digest) == before {
		time.Sleep(time.Millisecond)
	}
	b, err := os.ReadFile(filepath.Join(mps[1], "shared.txt"))
	if err != nil || string(b) != shared {
		t.Fatalf("read through the second layer: %v", err)
	}
	if err := <-errs; err != nil {
		t.Fatalf("read through the first layer: %v", err)
	}
	if n := r.requestsFor(descs[0].Digest) + r.requestsFor(descs[1].Digest) - before; n != 1 {
		t.Fatalf("%d blob requests for a frame both layers hold, want 1", n)
	}
}

// TestLazyMinSize: a new mount of a layer smaller than LazyMinSize is
// declined as not ours (containerd unpacks it) without a byte of the blob
// read, and no TOC of it is prefetched; a larger layer of the same image
// is served.
func TestLazyMinSize(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	small, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"patch.go": "package main\n"}))
	big, _ := r.addLazyLayer(t, tarOfB(t, "data.bin", testRandom(64<<10)))
	if small.Size >= 8<<10 || big.Size < 32<<10 {
		t.Fatalf("layer sizes %d and %d do not straddle the bound", small.Size, big.Size)
	}
	labels := r.addManifest(t, "test/app:1", big, small)
	s := newTestStore(t)
	s.cfg.LazyMinSize = 16 << 10
	ctx := t.Context()

	mp := t.TempDir()
	if err := s.Mount(ctx, mp, labels[0]); err != nil {
		t.Fatalf("Mount of the %d-byte layer: %v", big.Size, err)
	}
	unmountAtCleanup(t, s, mp)
	smallMP := t.TempDir()
	err := s.Mount(ctx, smallMP, labels[1])
	if err == nil {
		unmountAtCleanup(t, s, smallMP)
	}
	if !errdefs.IsNotImplemented(err) || !strings.Contains(err.Error(), "lazy_min_size") {
		t.Fatalf("Mount of the %d-byte layer: %v, want not implemented (below lazy_min_size)", small.Size, err)
	}
	s.mu.Lock()
	_, prefetched := s.tocs[small.Digest]
	s.mu.Unlock()
	if n := r.requestsFor(small.Digest); n != 0 || prefetched {
		t.Errorf("the declined layer's blob got %d requests, TOC prefetch started: %v; want none", n, prefetched)
	}
	if len(s.Status()) != 1 {
		t.Errorf("declined mount left state: %+v", s.Status())
	}
}

// testRandom returns n incompressible bytes, the same every run.
func testRandom(n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{7}).Read(b)
	return b
}
