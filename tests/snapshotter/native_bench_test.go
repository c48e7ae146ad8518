package snapshotter_test

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/tests/testenv"
)

// treeFiles is a tree shaped like what a warm episode reads (a toolchain,
// a module and build cache): many small files in many directories.
func treeFiles(dirs, perDir int) []testenv.File {
	var files []testenv.File
	for d := range dirs {
		for f := range perDir {
			files = append(files, testenv.RandomFile(fmt.Sprintf("/tree/d%03d/sub/f%03d.go", d, f), int64(512+(d*perDir+f)*977%15000), int64(d*perDir+f)))
		}
	}
	return files
}

// walkRead stats every entry under dir and reads every regular file, as
// a compiler walking its inputs does: lookups, getattrs, opens and reads.
// It returns the time taken and the bytes read.
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

// mountLowers mounts a read-only overlay of lowers (top first) at a new
// directory: the view a container gets of them.
func mountLowers(tb testing.TB, lowers []string) string {
	dir := tb.TempDir()
	if len(lowers) == 1 {
		lowers = append(lowers, tb.TempDir()) // overlay wants two lowers without an upper
	}
	m := mount.Mount{Type: "overlay", Source: "overlay", Options: []string{"ro", "lowerdir=" + strings.Join(lowers, ":")}}
	if err := m.Mount(dir); err != nil {
		tb.Fatalf("mount overlay of %v: %v", lowers, err)
	}
	tb.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// erofsLowers packs each native copy into an EROFS image and mounts it
// from its file, lowest layer last as in lowers; nil when mkfs.erofs is
// not installed.
func erofsLowers(tb testing.TB, native []string) []string {
	mkfs, err := exec.LookPath("mkfs.erofs")
	if err != nil {
		tb.Logf("no mkfs.erofs: EROFS row skipped")
		return nil
	}
	var out []string
	for _, dir := range native {
		img := filepath.Join(tb.TempDir(), "layer.erofs")
		start := time.Now()
		if b, err := exec.Command(mkfs, img, dir).CombinedOutput(); err != nil {
			tb.Fatalf("mkfs.erofs %s: %v\n%s", dir, err, b)
		}
		st, _ := os.Stat(img)
		tb.Logf("mkfs.erofs of %s: %d KiB in %.2fs", filepath.Base(dir)[:12], st.Size()>>10, time.Since(start).Seconds())
		mnt := tb.TempDir()
		if b, err := exec.Command("mount", "-t", "erofs", "-o", "ro", img, mnt).CombinedOutput(); err != nil {
			tb.Fatalf("mount erofs %s: %v\n%s", img, err, b)
		}
		tb.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
		out = append(out, mnt)
	}
	return out
}

// TestBenchNativeLower compares, on the same layers, the warm walk-and-read
// of a 12k-file tree through the overlay a container gets with: the FUSE
// lowers, the native copies, EROFS images of the native copies, and
// overlayfs's own unpacked snapshots. Rounds interleave; medians.
func TestBenchNativeLower(t *testing.T) {
	requireBench(t)
	env := testenv.New(t, testenv.WithEnvsnap())
	img := pushLazyImage(t, env, "bench/tree:1", treeFiles(300, 40), "/bin/true")
	ctx := env.Context()
	if err := env.Push(ctx, env.Registry.Host+"/bench/tree-plain:1", img.Manifest); err != nil {
		t.Fatal(err)
	}
	lazyImg := env.Pull(t, img.Ref, "envsnap")
	// Mounted before any native copy exists: FUSE lowers for as long as
	// it stays mounted.
	fuseView := filepath.Dir(viewFile(t, env, lazyImg, "envsnap", "/tree"))
	if st := envsnapStatus(t, env); st.Native != nil && st.Native.Copies > 0 {
		t.Fatalf("native copies built before the FUSE view was mounted: %+v", st.Native)
	}
	waitFilled(t, env, 3*time.Minute)
	start := time.Now()
	st := waitNativeCopies(t, env, len(img.Layers), 3*time.Minute)
	t.Logf("native copies: %d layers, %d KiB, ready %.1fs after the fill", st.Native.Copies, st.Native.Size>>10, time.Since(start).Seconds())
	nativeView := filepath.Dir(viewFile(t, env, lazyImg, "envsnap", "/tree"))
	plainImg := env.Pull(t, env.Registry.Host+"/bench/tree-plain:1", "overlayfs")
	plainView := filepath.Dir(viewFile(t, env, plainImg, "overlayfs", "/tree"))

	var native []string // top first, as overlay lists lowers
	for i := len(img.Layers) - 1; i >= 0; i-- {
		d := img.Layers[i].Digest
		native = append(native, filepath.Join(env.EnvsnapRoot, "native", d.Algorithm().String(), d.Encoded()))
	}
	views := []struct{ name, dir string }{
		{"overlayfs", plainView},
		{"envsnap-fuse", fuseView},
		{"envsnap-native", nativeView},
	}
	if er := erofsLowers(t, native); er != nil {
		views = append(views, struct{ name, dir string }{"erofs", mountLowers(t, er)})
	}
	_, want := walkRead(t, filepath.Join(plainView, "tree"))
	for _, drop := range []pageCache{warmCache, dropAll} {
		times := map[string][]float64{}
		for range 5 {
			for _, v := range views {
				p := filepath.Join(v.dir, "tree")
				if drop == warmCache {
					walkRead(t, p)
				} else {
					unix.Sync()
					if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
						t.Fatalf("drop caches: %v", err)
					}
				}
				d, n := walkRead(t, p)
				if n != want {
					t.Fatalf("%s: read %d bytes, overlayfs %d", v.name, n, want)
				}
				times[v.name] = append(times[v.name], d.Seconds())
			}
		}
		base := median(times["overlayfs"])
		for _, v := range views {
			m := median(times[v.name])
			t.Logf("walk+read of %d files (%d MiB), %s: %-15s %.3fs  ratio to overlayfs %.2f", 12000, want>>20, drop, v.name, m, m/base)
		}
	}
}
