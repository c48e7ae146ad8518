//go:build linux

package layerstore

import (
	"context"
	"github.com/envsnap/envsnap/internal/prereq"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/native"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/snapshotter"
)

// TestNativeCopyAfterFill: a mounted layer gets its native copy once the
// background fill has every chunk, with the layer's bytes.
func TestNativeCopyAfterFill(t *testing.T) {
	prereq.RequireFUSE(t)
	r := newFakeRegistry(t)
	lazy, _, _ := testImage(t, r)
	cache, err := chunkcache.Open(t.TempDir(), 256<<20)
	if err != nil {
		t.Fatal(err)
	}
	copies, err := native.Open(context.Background(), t.TempDir(), cache)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(copies.Close)
	cache.SetTenant(copies)
	s, err := New(Config{
		Hosts:  registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true}),
		Cache:  cache,
		Fill:   true,
		Native: copies,
	})
	if err != nil {
		t.Fatal(err)
	}
	mp := t.TempDir()
	if err := s.Mount(t.Context(), mp, lazy); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Unmount(context.Background(), mp) })
	d := digest.Digest(lazy[snapshotter.LabelLayerDigest])
	deadline := time.Now().Add(30 * time.Second)
	var dir string
	for {
		var ok bool
		if dir, ok = s.NativeDir(d); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no native copy 30 s after the mount: %+v, %+v", copies.Stats(), s.Status()[mp])
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, err := os.ReadFile(filepath.Join(dir, "hello.txt"))
	if err != nil || string(b) != "hello, lazy world\n" {
		t.Fatalf("native copy: %q, %v", b, err)
	}
	if st := copies.Stats(); st.Builds != 1 || cache.Stats().Charged != st.Size {
		t.Errorf("stats %+v, cache charged %d", st, cache.Stats().Charged)
	}
}
