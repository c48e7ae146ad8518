//go:build linux

package native

import (
	"archive/tar"
	"context"
	"fmt"
	"github.com/envsnap/envsnap/internal/prereq"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/lazyfs"
	"github.com/envsnap/envsnap/layerfmt"
)

// frameSource serves chunks from the chunk cache through a decoded-frame
// memo, as the daemon does with its node-wide frame cache.
type frameSource struct {
	chunks Chunks
	mu     sync.Mutex
	frames map[int64][]byte
}

func (s *frameSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	b, err := s.readChunk(c)
	return b, nil, err
}

func (s *frameSource) readChunk(c layerfmt.Chunk) ([]byte, error) {
	s.mu.Lock()
	f, ok := s.frames[c.Offset]
	s.mu.Unlock()
	if !ok {
		b, ok := s.chunks.Get(c.Digest)
		if !ok {
			return nil, fmt.Errorf("chunk %s: %w", c.Digest, ErrChunkMissing)
		}
		var err error
		if f, err = layerfmt.DecodeVerifiedFrame(c, b, nil); err != nil {
			return nil, err
		}
		s.mu.Lock()
		s.frames[c.Offset] = f
		s.mu.Unlock()
	}
	return f[c.FrameOffset : c.FrameOffset+c.Size], nil
}

// benchTree is a layer shaped like what a warm episode reads (a toolchain,
// a module and build cache): many small files in many directories.
func benchTree(dirs, perDir int) []tarFile {
	mt := time.Date(2024, 3, 1, 0, 0, 0, 0, time.UTC)
	files := []tarFile{{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "tree/", Mode: 0o755, ModTime: mt}}}
	for d := range dirs {
		files = append(files,
			tarFile{hdr: tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("tree/d%03d/", d), Mode: 0o755, ModTime: mt}},
			tarFile{hdr: tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("tree/d%03d/sub/", d), Mode: 0o755, ModTime: mt}})
		for f := range perDir {
			n := d*perDir + f
			data := []byte(strings.Repeat(fmt.Sprintf("package p%d // line %d\n", n, n), 1+n*977%15000/32))
			files = append(files, tarFile{hdr: tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("tree/d%03d/sub/f%03d.go", d, f), Mode: 0o644, ModTime: mt}, data: data})
		}
	}
	return files
}

// walkRead stats every entry under dir and reads every regular file, as a
// compiler walking its inputs does: lookups, getattrs, opens and reads.
func walkRead(tb testing.TB, dir string) (time.Duration, int64) {
	buf := make([]byte, 64<<10)
	var n int64
	start := time.Now()
	err := filepath.WalkDir(dir, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if _, err := de.Info(); err != nil {
			return err
		}
		if !de.Type().IsRegular() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		m, err := io.CopyBuffer(io.Discard, struct{ io.Reader }{f}, buf)
		f.Close()
		n += m
		return err
	})
	if err != nil {
		tb.Fatalf("walk %s: %v", dir, err)
	}
	return time.Since(start), n
}

// overlayOf mounts a read-only overlay with lower dir (and an empty second
// lower: overlayfs wants two without an upper), as a container's rootfs
// stacks its layers.
func overlayOf(tb testing.TB, lower string) string {
	tb.Helper()
	mnt, empty := tb.TempDir(), tb.TempDir()
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, "lowerdir="+lower+":"+empty); err != nil {
		tb.Fatalf("mount overlay on %s: %v", lower, err)
	}
	tb.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	return mnt
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// TestBenchLowers measures, on one layer of 12,000 small files, a walk
// that stats and reads every file through an overlay whose lower is: the
// tree containerd's overlay applier unpacks (what overlayfs runs on), the
// native copy (option a), an EROFS image of it mounted from its file
// (option b; needs mkfs.erofs), and the layer's FUSE mount (lazyfs, the
// current lower, with its long entry and attribute timeouts: option c
// without passthrough, which the daemon only uses for files >= 64 KiB).
// Page cache warm (walked just before) and dropped. Rounds interleave;
// medians of 5. Gated by ENVSNAP_BENCH=1.
func TestBenchLowers(t *testing.T) {
	prereq.RequireBench(t)
	requireRoot(t)
	blob, toc, cache := cachedLayer(t, buildTar(t, benchTree(300, 40)))
	ctx := context.Background()

	applierDir := applied(t, blob)
	nativeDir := filepath.Join(t.TempDir(), "tree")
	start := time.Now()
	if err := BuildTree(ctx, nativeDir, toc, cache); err != nil {
		t.Fatal(err)
	}
	t.Logf("native copy built in %.2fs (%d KiB charged; blob %d KiB)", time.Since(start).Seconds(), TreeSize(toc)>>10, len(blob)>>10)

	fuseDir := t.TempDir()
	srv, err := lazyfs.Mount(ctx, fuseDir, toc, &frameSource{chunks: cache, frames: map[int64][]byte{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Unmount() })

	views := []struct{ name, dir string }{
		{"overlayfs (applier)", overlayOf(t, applierDir)},
		{"native copy", overlayOf(t, nativeDir)},
		{"FUSE (lazyfs)", overlayOf(t, fuseDir)},
	}
	if mkfs, err := exec.LookPath("mkfs.erofs"); err == nil {
		img := filepath.Join(t.TempDir(), "layer.erofs")
		start := time.Now()
		if b, err := exec.Command(mkfs, img, nativeDir).CombinedOutput(); err != nil {
			t.Fatalf("mkfs.erofs: %v\n%s", err, b)
		}
		st, _ := os.Stat(img)
		t.Logf("mkfs.erofs from the native copy: %.2fs, image %d KiB", time.Since(start).Seconds(), st.Size()>>10)
		mnt := t.TempDir()
		if b, err := exec.Command("mount", "-t", "erofs", "-o", "ro", img, mnt).CombinedOutput(); err != nil {
			t.Fatalf("mount erofs: %v\n%s", err, b)
		}
		t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
		views = append(views, struct{ name, dir string }{"EROFS (file-backed)", overlayOf(t, mnt)})
	} else {
		t.Log("no mkfs.erofs: EROFS row skipped")
	}

	_, want := walkRead(t, filepath.Join(views[0].dir, "tree"))
	for _, drop := range []string{"page cache warm", "caches dropped"} {
		times := map[string][]float64{}
		for range 5 {
			for _, v := range views {
				p := filepath.Join(v.dir, "tree")
				if drop == "page cache warm" {
					walkRead(t, p)
				} else {
					unix.Sync()
					if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
						t.Fatal(err)
					}
				}
				d, n := walkRead(t, p)
				if n != want {
					t.Fatalf("%s: read %d bytes, applier tree %d", v.name, n, want)
				}
				times[v.name] = append(times[v.name], d.Seconds())
			}
		}
		base := median(times[views[0].name])
		for _, v := range views {
			m := median(times[v.name])
			t.Logf("walk+read of %d files (%d MiB), %s: %-20s %.3fs  ratio to overlayfs %.2f", 12000, want>>20, drop, v.name, m, m/base)
		}
	}
}
