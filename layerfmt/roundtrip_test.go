package layerfmt

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/klauspost/compress/zstd"

	"github.com/envsnap/envsnap/internal/prereq"
)

// tarDir writes a tar of dir (names relative to dir's parent, like
// `tar -C parent -cf - base`) with archive/tar.
func tarDir(t testing.TB, dir string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	parent := filepath.Dir(dir)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if info.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(parent, p)
		hdr.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			hdr.Name += "/"
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if info.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := io.Copy(tw, f); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("tar %s: %v", dir, err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

var (
	goTarOnce sync.Once
	goTar     []byte
)

// goRootTar is a tar of $GOROOT (~16k files), built once per test binary.
func goRootTar(t testing.TB) []byte {
	goTarOnce.Do(func() { goTar = tarDir(t, filepath.Clean(os.Getenv("GOROOT_FOR_TEST"))) })
	return goTar
}

func init() {
	if os.Getenv("GOROOT_FOR_TEST") == "" {
		os.Setenv("GOROOT_FOR_TEST", "/usr/local/go")
	}
}

func convert(t testing.TB, in []byte, opts ...WriteOption) ([]byte, *WriteResult) {
	t.Helper()
	var out bytes.Buffer
	res, err := Convert(context.Background(), &out, bytes.NewReader(in), opts...)
	if err != nil {
		t.Fatalf("Convert: %v", err)
	}
	return out.Bytes(), res
}

type tarEntry struct {
	hdr  *tar.Header
	data []byte
}

func readTar(t testing.TB, r io.Reader) []tarEntry {
	t.Helper()
	tr := tar.NewReader(r)
	var out []tarEntry
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("read tar: %v", err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("read tar %s: %v", hdr.Name, err)
		}
		out = append(out, tarEntry{hdr, data})
	}
}

// checkEntry compares a source tar entry with the TOC's view of it and the
// bytes the Reader serves.
func checkEntry(t *testing.T, r *Reader, src tarEntry) {
	t.Helper()
	h := src.hdr
	if h.Typeflag == tar.TypeXGlobalHeader {
		return
	}
	name, err := cleanName(h.Name)
	if err != nil {
		t.Fatalf("%s: %v", h.Name, err)
	}
	i, ok := r.TOC().Lookup(name)
	if !ok {
		t.Fatalf("%s: not in TOC", name)
	}
	e := r.TOC().Entry(i)
	if e.Name != name {
		t.Errorf("%s: Entry.Name %q", name, e.Name)
	}
	wantType := map[byte]EntryType{tar.TypeReg: TypeReg, tar.TypeDir: TypeDir, tar.TypeSymlink: TypeSymlink,
		tar.TypeLink: TypeHardlink, tar.TypeChar: TypeChar, tar.TypeBlock: TypeBlock, tar.TypeFifo: TypeFIFO}[h.Typeflag]
	if e.Type != wantType {
		t.Errorf("%s: type %v, want %v", name, e.Type, wantType)
	}
	fm := h.FileInfo().Mode()
	if e.Type == TypeHardlink {
		fm &^= fs.ModeType
	}
	if e.Mode != fm {
		t.Errorf("%s: mode %v, want %v", name, e.Mode, fm)
	}
	if e.UID != h.Uid || e.GID != h.Gid || !e.ModTime.Equal(h.ModTime) {
		t.Errorf("%s: owner/mtime %d:%d %v, want %d:%d %v", name, e.UID, e.GID, e.ModTime, h.Uid, h.Gid, h.ModTime)
	}
	if e.Type == TypeChar || e.Type == TypeBlock {
		if int64(e.Devmajor) != h.Devmajor || int64(e.Devminor) != h.Devminor {
			t.Errorf("%s: device %d:%d", name, e.Devmajor, e.Devminor)
		}
	}
	switch e.Type {
	case TypeSymlink:
		if e.Linkname != h.Linkname {
			t.Errorf("%s: symlink %q, want %q", name, e.Linkname, h.Linkname)
		}
	case TypeHardlink:
		if want, _ := cleanName(h.Linkname); e.Linkname != want {
			t.Errorf("%s: hard link %q, want %q", name, e.Linkname, want)
		}
	}
	var wantX map[string]string
	for k, v := range h.PAXRecords {
		if key, ok := strings.CutPrefix(k, xattrPrefix); ok {
			if wantX == nil {
				wantX = map[string]string{}
			}
			wantX[key] = v
		}
	}
	if len(wantX) != len(e.Xattrs) {
		t.Errorf("%s: xattrs %v, want %v", name, e.Xattrs, wantX)
	}
	for k, v := range wantX {
		if e.Xattrs[k] != v {
			t.Errorf("%s: xattr %s=%q, want %q", name, k, e.Xattrs[k], v)
		}
	}
	if e.Type == TypeReg {
		if e.Size != h.Size {
			t.Errorf("%s: size %d, want %d", name, e.Size, h.Size)
		}
		got := make([]byte, e.Size)
		n, err := r.ReadFileAt(i, got, 0)
		if err != nil && !(errors.Is(err, io.EOF) && n == len(got)) {
			t.Fatalf("%s: ReadFileAt: %v", name, err)
		}
		if !bytes.Equal(got, src.data) {
			t.Errorf("%s: content differs", name)
		}
	}
}

// roundTrip converts in and checks the blob both ways: through the TOC and
// Reader, and through a plain zstd decoder + archive/tar.
func roundTrip(t *testing.T, in []byte, opts ...WriteOption) ([]byte, *WriteResult) {
	t.Helper()
	blob, res := convert(t, in, opts...)
	src := readTar(t, bytes.NewReader(in))
	r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	if err != nil {
		t.Fatalf("NewReader: %v", err)
	}
	for _, e := range src {
		checkEntry(t, r, e)
	}

	dec, err := zstd.NewReader(bytes.NewReader(blob))
	if err != nil {
		t.Fatal(err)
	}
	defer dec.Close()
	plain, err := io.ReadAll(dec)
	if err != nil {
		t.Fatalf("plain zstd decode: %v", err)
	}
	if d := digestOf(plain); d != res.DiffID {
		t.Errorf("diffID %s, sha256 of the decompressed blob %s", res.DiffID, d)
	}
	if d := digestOf(blob); d != res.Digest || int64(len(blob)) != res.Size {
		t.Errorf("blob digest/size %s/%d, result %s/%d", d, len(blob), res.Digest, res.Size)
	}
	out := readTar(t, bytes.NewReader(plain))
	if len(out) != len(src) {
		t.Fatalf("decompressed tar has %d entries, source %d", len(out), len(src))
	}
	for k := range src {
		a, b := src[k].hdr, out[k].hdr
		if a.Name != b.Name || a.Typeflag != b.Typeflag && !(a.Typeflag == tar.TypeRegA && b.Typeflag == tar.TypeReg) ||
			a.Linkname != b.Linkname || a.Mode&unixModeMask != b.Mode || a.Uid != b.Uid || a.Gid != b.Gid ||
			!a.ModTime.Equal(b.ModTime) || a.Uname != b.Uname || a.Gname != b.Gname ||
			(a.Typeflag == tar.TypeChar || a.Typeflag == tar.TypeBlock) && (a.Devmajor != b.Devmajor || a.Devminor != b.Devminor) ||
			!bytes.Equal(src[k].data, out[k].data) {
			t.Errorf("entry %d: decompressed tar has %+v, source %+v", k, b, a)
		}
		for key, v := range a.PAXRecords {
			if strings.HasPrefix(key, xattrPrefix) && b.PAXRecords[key] != v {
				t.Errorf("%s: PAX record %s lost", a.Name, key)
			}
		}
	}
	return blob, res
}

func TestRoundTripGoRoot(t *testing.T) {
	if testing.Short() {
		prereq.Skip(t, prereq.Short, "converts all of GOROOT")
	}
	in := goRootTar(t)
	blob, res := roundTrip(t, in)
	t.Logf("GOROOT: tar %d bytes -> blob %d bytes, %d entries, TOC %d bytes", len(in), len(blob), res.Entries, res.TOCSize)

	// The zstd command line tool reads the blob as a tar.zst too.
	if _, err := exec.LookPath("zstd"); err != nil {
		t.Log("zstd command not installed; skipping its check")
		return
	}
	path := filepath.Join(t.TempDir(), "layer.tar.zst")
	if err := os.WriteFile(path, blob, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", `zstd -q -d -c "$1" | tar -tf - | wc -l`, "sh", path)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("zstd -d | tar -t: %v: %s", err, out)
	}
	if got, want := strings.TrimSpace(string(out)), len(readTar(t, bytes.NewReader(in))); got != itoa(want) {
		t.Errorf("zstd -d | tar -t listed %s entries, want %d", got, want)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
