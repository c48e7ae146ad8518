package layerfmt

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/fstest"
	"time"
)

// synthTar builds a tar exercising every entry type and attribute OCI
// layers use.
func synthTar(t testing.TB) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	long := strings.Repeat("very-long-directory-name-", 8) + "/" + strings.Repeat("n", 200)
	rng := rand.New(rand.NewPCG(1, 2))
	big := make([]byte, 3<<20+123) // spans several 1 MiB chunks
	for i := range big {
		big[i] = byte(rng.IntN(16)) // compressible but not trivial
	}
	add := func(h *tar.Header, data []byte) {
		if h.ModTime.IsZero() {
			h.ModTime = mt
		}
		if data != nil {
			h.Size = int64(len(data))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatalf("%s: %v", h.Name, err)
		}
		if data != nil {
			if _, err := tw.Write(data); err != nil {
				t.Fatal(err)
			}
		}
	}
	add(&tar.Header{Typeflag: tar.TypeDir, Name: "./", Mode: 0o755}, nil)
	add(&tar.Header{Typeflag: tar.TypeDir, Name: "bin/", Mode: 0o755}, nil)
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/ping", Mode: 0o4755, Uid: 0, Gid: 0,
		PAXRecords: map[string]string{"SCHILY.xattr.security.capability": "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"}},
		[]byte("#!/bin/sh\necho ping\n"))
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/big", Mode: 0o755}, big)
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/empty", Mode: 0o644}, []byte{})
	add(&tar.Header{Typeflag: tar.TypeLink, Name: "bin/ping-link", Linkname: "bin/ping"}, nil)
	add(&tar.Header{Typeflag: tar.TypeLink, Name: "bin/big-link", Linkname: "./bin/big"}, nil)
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755}, []byte("busybox"))
	add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/sh", Linkname: "busybox", Mode: 0o777}, nil)
	add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "abs", Linkname: "/bin/ping", Mode: 0o777}, nil)
	add(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777}, nil)
	add(&tar.Header{Typeflag: tar.TypeDir, Name: "srv/", Mode: 0o2775, Uid: 1000, Gid: 1000,
		PAXRecords: map[string]string{"SCHILY.xattr.user.a": "1", "SCHILY.xattr.trusted.overlay.opaque": "y"}}, nil)
	add(&tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}, nil)
	add(&tar.Header{Typeflag: tar.TypeBlock, Name: "dev/sda", Mode: 0o660, Devmajor: 8, Devminor: 0, Gid: 6}, nil)
	add(&tar.Header{Typeflag: tar.TypeFifo, Name: "run/fifo", Mode: 0o600}, nil)
	add(&tar.Header{Typeflag: tar.TypeReg, Name: long, Mode: 0o600, Uid: 70000, Gid: 80000}, []byte("long name"))
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "etc/.wh.removed", Mode: 0o600}, []byte{})
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "var/lib/.wh..wh..opq", Mode: 0o600}, []byte{})
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "nano", Mode: 0o644, ModTime: time.Unix(1700000000, 123456789)}, []byte("sub-second mtime"))
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "old", Mode: 0o644, ModTime: time.Unix(-86400*365, 0)}, []byte("before 1970"))
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "ünïcødé file", Mode: 0o644, Uname: "user", Gname: "group"}, []byte("utf-8"))
	for i := range 300 { // many small files share frames
		add(&tar.Header{Typeflag: tar.TypeReg, Name: "small/" + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + itoa(i), Mode: 0o644},
			bytes.Repeat([]byte{byte(i)}, i*37))
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestRoundTripSynthetic(t *testing.T) {
	for _, cs := range []int{MinChunkSize, 64 << 10, DefaultChunkSize} {
		t.Run(itoa(cs), func(t *testing.T) {
			blob, res := roundTrip(t, synthTar(t), WithChunkSize(cs))
			// Deterministic: converting again gives the same bytes, whatever
			// order the parallel frame workers finished in.
			if blob2, res2 := convert(t, synthTar(t), WithChunkSize(cs)); !bytes.Equal(blob, blob2) || *res != *res2 {
				t.Errorf("second conversion differs: %s vs %s", res.Digest, res2.Digest)
			}
			r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
			if err != nil {
				t.Fatal(err)
			}
			toc := r.TOC()
			// Implicit parents, root from "./", hard links resolve to data.
			if i, ok := toc.Lookup("dev"); !ok || !toc.Entry(i).Implicit || toc.Type(i) != TypeDir {
				t.Errorf("dev: want an implicit directory")
			}
			if toc.Entry(0).Implicit || toc.Entry(0).Mode != fs.ModeDir|0o755 {
				t.Errorf("root: %+v", toc.Entry(0))
			}
			i, _ := toc.Lookup("bin/big-link")
			if e := toc.Entry(i); e.Type != TypeHardlink || e.Linkname != "bin/big" {
				t.Errorf("big-link: %+v", e)
			}
			got, err := fs.ReadFile(r, "bin/big-link")
			want, _ := fs.ReadFile(r, "bin/big")
			if err != nil || len(want) != 3<<20+123 || !bytes.Equal(got, want) {
				t.Errorf("reading a hard link: %v, %d bytes", err, len(got))
			}
			if cs == MinChunkSize && toc.NumChunks(mustLookup(t, toc, "bin/big")) < 3<<20/MinChunkSize {
				t.Errorf("big file not chunked")
			}
			// Children are sorted and contiguous; Parent inverts Children.
			for d := 0; d < toc.Len(); d++ {
				kids := toc.Children(d)
				for k, c := range kids {
					if toc.Parent(c) != d || k > 0 && toc.BaseName(kids[k-1]) >= toc.BaseName(c) {
						t.Fatalf("children of %s not sorted/linked", toc.Name(d))
					}
				}
			}
			// Random ranges of the big file touch only the chunks that hold them.
			bi := mustLookup(t, toc, "bin/big")
			rng := rand.New(rand.NewPCG(3, 4))
			for range 50 {
				off := rng.Int64N(int64(len(want)))
				n := rng.IntN(3 * cs)
				p := make([]byte, n)
				m, err := r.ReadFileAt(bi, p, off)
				wantN := min(int64(n), int64(len(want))-off)
				if int64(m) != wantN || (err != nil && !errors.Is(err, io.EOF)) || !bytes.Equal(p[:m], want[off:off+int64(m)]) {
					t.Fatalf("ReadFileAt(%d, %d) = %d, %v", off, n, m, err)
				}
			}
		})
	}
}

func mustLookup(t testing.TB, toc *TOC, name string) int {
	t.Helper()
	i, ok := toc.Lookup(name)
	if !ok {
		t.Fatalf("%s not found", name)
	}
	return i
}

func TestFSTest(t *testing.T) {
	blob, res := convert(t, synthTar(t))
	r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	if err != nil {
		t.Fatal(err)
	}
	if err := fstest.TestFS(r, "bin/ping", "bin/big", "bin/sh", "dev/null", "tmp", "small/a0", "etc/.wh.removed"); err != nil {
		t.Fatal(err)
	}
	if link, err := r.ReadLink("abs"); err != nil || link != "/bin/ping" {
		t.Errorf("ReadLink = %q, %v", link, err)
	}
	// Absolute symlinks resolve against the layer root.
	if b, err := fs.ReadFile(r, "abs"); err != nil || string(b) != "#!/bin/sh\necho ping\n" {
		t.Errorf("read through absolute symlink: %q %v", b, err)
	}
}

func TestConvertRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		hdrs []*tar.Header
	}{
		{"absolute", []*tar.Header{{Name: "/etc/passwd", Typeflag: tar.TypeReg}}},
		{"dotdot", []*tar.Header{{Name: "../escape", Typeflag: tar.TypeReg}}},
		{"inner dotdot", []*tar.Header{{Name: "a/../../escape", Typeflag: tar.TypeReg}}},
		{"duplicate", []*tar.Header{{Name: "a", Typeflag: tar.TypeReg}, {Name: "./a", Typeflag: tar.TypeReg}}},
		{"under file", []*tar.Header{{Name: "a", Typeflag: tar.TypeReg}, {Name: "a/b", Typeflag: tar.TypeReg}}},
		{"dangling hard link", []*tar.Header{{Name: "a", Typeflag: tar.TypeLink, Linkname: "nowhere"}}},
		{"hard link to dir", []*tar.Header{{Name: "d/", Typeflag: tar.TypeDir}, {Name: "a", Typeflag: tar.TypeLink, Linkname: "d"}}},
		{"huge uid", []*tar.Header{{Name: "a", Typeflag: tar.TypeReg, Uid: 1 << 40}}},
		{"root not dir", []*tar.Header{{Name: ".", Typeflag: tar.TypeReg}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			for _, h := range tc.hdrs {
				h.ModTime = time.Unix(0, 0)
				if err := tw.WriteHeader(h); err != nil {
					t.Fatal(err)
				}
			}
			tw.Close()
			if _, err := Convert(context.Background(), io.Discard, &buf); err == nil {
				t.Fatal("Convert accepted it")
			}
		})
	}
}
