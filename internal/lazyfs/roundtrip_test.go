package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"testing/fstest"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

const goroot = "/usr/local/go"

// tarDir streams dir as a tar (regular files, dirs, symlinks).
func tarDir(dir string, w io.WriteCloser) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name = rel
		if d.IsDir() {
			h.Name += "/"
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	// The caller closes w with err: closing it here too would turn an
	// error in the middle of a file into a bare "unexpected EOF".
	return err
}

// convertDir converts dir into a blob file and returns it with its TOC.
func convertDir(t testing.TB, dir string) (*os.File, *layerfmt.TOC) {
	t.Helper()
	blob, err := os.Create(filepath.Join(t.TempDir(), "blob"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { blob.Close() })
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(tarDir(dir, pw)) }()
	start := time.Now()
	res, err := layerfmt.Convert(context.Background(), blob, pr)
	if err != nil {
		t.Fatalf("convert %s: %v", dir, err)
	}
	pr.Close()
	t.Logf("converted %s: %d entries, blob %d MiB, TOC %d KiB in %s", dir, res.Entries, res.Size>>20, res.TOCSize>>10, time.Since(start).Round(time.Millisecond))
	toc, err := layerfmt.ReadTOC(context.Background(), blob, res.Size, res.TOCDigest)
	if err != nil {
		t.Fatal(err)
	}
	return blob, toc
}

// TestGoRootRoundTrip mounts a converted Go toolchain (~15k files) and
// compares every entry with the source directory.
func TestGoRootRoundTrip(t *testing.T) {
	requireFUSE(t)
	if _, err := os.Stat(goroot); err != nil {
		prereq.Missing(t, "no %s: %v", goroot, err)
	}
	if testing.Short() {
		prereq.Skip(t, prereq.Short, "converts and reads ~270 MB")
	}
	blob, toc := convertDir(t, goroot)
	src := newBlobSource(blob)
	mnt, srv := mountLayer(t, toc, src)

	start := time.Now()
	var files, dirs int
	err := filepath.WalkDir(goroot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(goroot, p)
		want, err := os.Lstat(p)
		if err != nil {
			return err
		}
		got, err := os.Lstat(filepath.Join(mnt, rel))
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			return nil
		}
		if got.Mode() != want.Mode() {
			t.Errorf("%s: mode %v, want %v", rel, got.Mode(), want.Mode())
		}
		if !got.ModTime().Equal(want.ModTime()) && rel != "." {
			t.Errorf("%s: mtime %v, want %v", rel, got.ModTime(), want.ModTime())
		}
		switch {
		case want.Mode().IsRegular():
			files++
			if got.Size() != want.Size() {
				t.Errorf("%s: size %d, want %d", rel, got.Size(), want.Size())
				return nil
			}
			a, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			b, err := os.ReadFile(filepath.Join(mnt, rel))
			if err != nil || !bytes.Equal(a, b) {
				t.Errorf("%s: content differs (%v)", rel, err)
			}
		case want.IsDir():
			dirs++
			a, _ := os.ReadDir(p)
			b, err := os.ReadDir(filepath.Join(mnt, rel))
			if err != nil || len(a) != len(b) {
				t.Errorf("%s: %d entries, want %d (%v)", rel, len(b), len(a), err)
			}
		case want.Mode()&fs.ModeSymlink != 0:
			a, _ := os.Readlink(p)
			if b, err := os.Readlink(filepath.Join(mnt, rel)); err != nil || a != b {
				t.Errorf("%s: link %q, want %q (%v)", rel, b, a, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	st := srv.Stats()
	t.Logf("compared %d files, %d dirs in %s; %d chunk reads, %d MiB served", files, dirs, time.Since(start).Round(time.Millisecond), st.ChunkReads, st.BytesRead>>20)
	if files < 1000 {
		t.Errorf("only %d files compared", files)
	}

	// The standard library's file system conformance test, on a subtree
	// (it reads every file several times).
	if err := fstest.TestFS(os.DirFS(filepath.Join(mnt, "src/encoding/json")), "decode.go", "encode.go"); err != nil {
		t.Error(err)
	}
}

// TestFSConformance runs fstest.TestFS over the synthetic layer's
// directories that hold no FIFOs, devices or whiteouts (opening a FIFO
// would block; a whiteout is a mode-0 device).
func TestFSConformance(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, _, _ := f.mount(t)
	for dir, expect := range map[string][]string{
		"etc":  {"passwd", "attrs", "zero"},
		"bin":  {"busybox", "ls", "cat", "su", "sg"},
		"data": {"big", "empty"},
	} {
		if err := fstest.TestFS(os.DirFS(filepath.Join(mnt, dir)), expect...); err != nil {
			t.Errorf("%s: %v", dir, err)
		}
	}
}
