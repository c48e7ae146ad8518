//go:build linux

package layerstore

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/snapshotter"
)

// TestMetadataKeptInCache: a store opened on the node cache of an earlier
// one (a restarted daemon) mounts a layer that was mounted before without
// the registry, and serves the chunks in the cache; metadata that fails
// verification is not used.
func TestMetadataKeptInCache(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	desc, blob := r.addLazyLayer(t, tarOf(t, map[string]string{"a.txt": "kept across restarts\n"}))
	labels := r.addManifest(t, "test/kept:1", desc)[0]
	cacheDir := t.TempDir()
	var cache *chunkcache.Cache
	open := func() *Store {
		var err error
		cache, err = chunkcache.Open(cacheDir, 64<<20)
		if err != nil {
			t.Fatal(err)
		}
		s, err := New(Config{Hosts: registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true}), Cache: cache})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	ctx := t.Context()
	mountAndRead := func(ctx context.Context, s *Store) error {
		mp := t.TempDir()
		if err := s.Mount(ctx, mp, labels); err != nil {
			return err
		}
		b, err := os.ReadFile(filepath.Join(mp, "a.txt"))
		if uerr := s.Unmount(context.Background(), mp); uerr != nil {
			t.Errorf("unmount layer at %s: %v", mp, uerr)
		}
		if err != nil || string(b) != "kept across restarts\n" {
			t.Fatalf("read: %q, %v", b, err)
		}
		return nil
	}

	if err := mountAndRead(ctx, open()); err != nil {
		t.Fatal(err)
	}
	// A fetched chunk is cached after its readers have their bytes, and
	// the layer closes after Unmount returns: a restart is a restart once
	// the chunk is on disk.
	toc, err := layerfmt.ReadTOC(ctx, bytes.NewReader(blob), int64(len(blob)), digest.Digest(desc.Annotations[layerfmt.AnnotationTOCDigest]))
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); !cache.Contains(toc.Chunk(1, 0).Digest); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the chunk of a.txt is not in the cache 10 s after it was read")
		}
	}
	r.srv.Close() // the registry is gone from here on
	if err := mountAndRead(ctx, open()); err != nil {
		t.Fatalf("mount with the registry gone and the metadata in the cache: %v", err)
	}

	// A damaged TOC copy is a miss, and without the registry the mount
	// fails instead of serving another tree.
	tocDigest := digest.Digest(desc.Annotations[layerfmt.AnnotationTOCDigest])
	p := filepath.Join(cacheDir, tocDigest.Algorithm().String(), tocDigest.Encoded()[:2], tocDigest.Encoded())
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("TOC not kept in the cache: %v", err)
	}
	b[len(b)/2] ^= 0xff
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	s := open()
	// Bounded: the registry's absence is retried until the deadline.
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := mountAndRead(short, s); err == nil {
		t.Fatal("mounted with a corrupt TOC in the cache and no registry")
	}
	if st := s.cfg.Cache.Stats(); st.Corrupt != 1 {
		t.Fatalf("corrupt cache entries %d, want 1 (the TOC)", st.Corrupt)
	}
}

// TestMountNeedsRoomForMetadata: a layer whose manifest and TOC cannot be
// kept in the node cache is not mounted (a restart would need the registry
// for them); the error says why. With room, both are in the cache and
// pinned for as long as the layer is mounted.
func TestMountNeedsRoomForMetadata(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	desc, _ := r.addLazyLayer(t, tarOf(t, map[string]string{"a.txt": "needs its metadata\n"}))
	labels := r.addManifest(t, "test/room:1", desc)[0]
	hosts := registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true})

	// A bound smaller than the TOC: nothing of the layer fits.
	tiny, err := chunkcache.Open(t.TempDir(), 64)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Hosts: hosts, Cache: tiny})
	if err != nil {
		t.Fatal(err)
	}
	mp := t.TempDir()
	err = s.Mount(t.Context(), mp, labels)
	if err == nil {
		unmountAtCleanup(t, s, mp)
		t.Fatal("mounted a layer whose metadata the node cache cannot keep")
	}
	if !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "in the node cache") {
		t.Errorf("Mount without room for the metadata: %v, want resource exhausted naming the node cache", err)
	}
	if st := s.Status(); len(st) != 0 {
		t.Errorf("failed mount left state: %+v", st)
	}

	cache, err := chunkcache.Open(t.TempDir(), 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	if s, err = New(Config{Hosts: hosts, Cache: cache}); err != nil {
		t.Fatal(err)
	}
	if err := s.Mount(t.Context(), mp, labels); err != nil {
		t.Fatal(err)
	}
	unmountAtCleanup(t, s, mp)
	toc := digest.Digest(desc.Annotations[layerfmt.AnnotationTOCDigest])
	manifest := digest.Digest(labels[snapshotter.LabelManifestDigest])
	for _, d := range []digest.Digest{toc, manifest} {
		if !cache.Contains(d) {
			t.Errorf("%s not kept in the node cache while the layer is mounted", d)
		}
	}
}
