//go:build linux

package layerstore

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/internal/unpacked"
	"github.com/envsnap/envsnap/layerfmt"
)

// TestPassthroughCopyAfterFill: once the fill has every chunk of a big
// file, its second open builds an unpacked copy from the verified chunks
// and the opens after that are handed the copy; small files never get one.
// A chunk corrupted on disk fails the build, never the reads, and never
// ends up in a copy.
func TestPassthroughCopyAfterFill(t *testing.T) {
	prereq.RequireFUSE(t)
	for _, corrupt := range []bool{false, true} {
		name := map[bool]string{false: "intact", true: "corrupt chunk"}[corrupt]
		t.Run(name, func(t *testing.T) {
			r := newFakeRegistry(t)
			big := randomBytes(3<<20+123, 1)
			desc, blob := r.addLazyLayer(t, tarOf(t, map[string]string{"big.bin": string(big), "small.txt": "small"}))
			labels := r.addManifest(t, "test/big:1", desc)[0]
			cacheDir := t.TempDir()
			cache, err := chunkcache.Open(cacheDir, 256<<20)
			if err != nil {
				t.Fatal(err)
			}
			files, err := unpacked.Open(t.TempDir(), 64<<20)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(files.Close)
			s, err := New(Config{
				Hosts:              registry.ConfigureHosts(context.Background(), registry.Options{PlainHTTP: true}),
				Cache:              cache,
				Fill:               true,
				Passthrough:        true,
				PassthroughMinSize: 64 << 10,
				Unpacked:           files,
			})
			if err != nil {
				t.Fatal(err)
			}
			mp := t.TempDir()
			if err := s.Mount(t.Context(), mp, labels); err != nil {
				t.Fatal(err)
			}
			unmountAtCleanup(t, s, mp)
			deadline := time.Now().Add(30 * time.Second)
			for st := s.Status()[mp]; st.CachedBytes < st.TotalBytes; st = s.Status()[mp] {
				if time.Now().After(deadline) {
					t.Fatalf("fill incomplete after 30s: %+v", st)
				}
				time.Sleep(20 * time.Millisecond)
			}
			corruptCache := func() {
				// Flip a byte of every cached chunk file.
				filepath.WalkDir(cacheDir, func(p string, de os.DirEntry, err error) error {
					if err == nil && de.Type().IsRegular() {
						b, _ := os.ReadFile(p)
						b[len(b)/2] ^= 0xff
						os.WriteFile(p, b, 0o600)
					}
					return nil
				})
			}
			// Open until the outcome shows (a copy handed out, or a
			// failed build): RELEASE reaches the daemon after close
			// returns, and an open while the last is not released stays
			// on the chunk path (lazyfs passthroughFS), so how many opens
			// that takes depends on timing.
			done := func(st unpacked.Stats) bool {
				if corrupt {
					return st.Failed > 0
				}
				return st.Hits > 0
			}
			for i := 0; i < 3 || !done(files.Stats()); i++ {
				if i == 100 {
					t.Fatalf("no outcome after 100 opens: %+v", files.Stats())
				}
				if corrupt && i == 1 {
					// After the first open: the second builds the copy.
					corruptCache()
				}
				for name, want := range map[string][]byte{"big.bin": big, "small.txt": []byte("small")} {
					got, err := os.ReadFile(filepath.Join(mp, name))
					if err != nil || !bytes.Equal(got, want) {
						t.Fatalf("read %s: %v (equal %v)", name, err, bytes.Equal(got, want))
					}
				}
				time.Sleep(50 * time.Millisecond)
				files.Wait()
			}
			st := files.Stats()
			if corrupt {
				if st.Failed == 0 || st.Builds != 0 || st.Entries != 0 {
					t.Fatalf("copy built from corrupt chunks: %+v", st)
				}
				return
			}
			// The first open builds nothing, a later one builds, the
			// ones after get the copy.
			if st.Builds != 1 || st.Entries != 1 || st.Size != int64(len(big)) || st.Hits == 0 {
				t.Fatalf("unpacked stats %+v, want one copy of big.bin handed out", st)
			}
			toc, err := layerfmt.ReadTOC(t.Context(), bytes.NewReader(blob), int64(len(blob)), digest.Digest(desc.Annotations[layerfmt.AnnotationTOCDigest]))
			if err != nil {
				t.Fatal(err)
			}
			idx, _ := toc.Lookup("big.bin")
			f, ok := files.Get(unpacked.Key(toc, idx))
			if !ok {
				t.Fatal("no copy of big.bin")
			}
			defer f.Close()
			if got, err := io.ReadAll(f); err != nil || !bytes.Equal(got, big) {
				t.Fatalf("copy of big.bin differs from the file: %v", err)
			}
		})
	}
}
