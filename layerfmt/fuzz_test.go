package layerfmt

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
)

// smallTar is a quick seed with a few entry types.
func smallTar(t testing.TB) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range []*tar.Header{
		{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755},
		{Typeflag: tar.TypeReg, Name: "d/f", Mode: 0o644, Size: 5, PAXRecords: map[string]string{"SCHILY.xattr.user.x": "y"}},
		{Typeflag: tar.TypeSymlink, Name: "s", Linkname: "d/f"},
		{Typeflag: tar.TypeLink, Name: "h", Linkname: "d/f"},
		{Typeflag: tar.TypeChar, Name: "c", Devmajor: 1, Devminor: 3},
	} {
		h.ModTime = time.Unix(1e9, 0)
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write([]byte("hello"))
		}
	}
	tw.Close()
	return buf.Bytes()
}

// walkTOC touches every accessor; a TOC that decoded must not make any of
// them panic or loop.
func walkTOC(t *testing.T, toc *TOC) {
	for i := 0; i < toc.Len(); i++ {
		e := toc.Entry(i)
		if j, ok := toc.Lookup(e.Name); !ok || j != i {
			t.Fatalf("Lookup(%q) = %d, %v; want %d", e.Name, j, ok, i)
		}
		toc.Children(i)
		toc.Parent(i)
		toc.Resolve(i)
		for k, c := range toc.Chunks(i) {
			if toc.ChunkAt(i, c.FileOffset) != k {
				t.Fatalf("ChunkAt(%d) != %d", c.FileOffset, k)
			}
		}
	}
}

// FuzzDecodeTOC feeds the footer and TOC decoders. The first byte picks
// the layer under test: 0 a whole blob tail through ReadTOC, 1 encoded TOC
// bytes through DecodeTOC, 2 decompressed TOC bytes through the record
// validator (where mutations are not stopped by checksums).
func FuzzDecodeTOC(f *testing.F) {
	for _, in := range [][]byte{smallTar(f), synthTar(f)} {
		var out bytes.Buffer
		res, err := Convert(context.Background(), &out, bytes.NewReader(in), WithChunkSize(MinChunkSize))
		if err != nil {
			f.Fatal(err)
		}
		blob := out.Bytes()
		tail := blob[max(0, len(blob)-int(res.TOCSize)-FooterSize-64):]
		f.Add(append([]byte{0}, tail...))
		enc := blob[len(blob)-FooterSize-int(res.TOCSize) : len(blob)-FooterSize]
		f.Add(append([]byte{1}, enc...))
		raw, err := zstd.DecodeTo(nil, enc)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(append([]byte{2}, raw...))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		var toc *TOC
		var err error
		switch data[0] % 3 {
		case 0:
			toc, err = ReadTOC(context.Background(), bytes.NewReader(data[1:]), int64(len(data)-1), "")
		case 1:
			toc, err = DecodeTOC(data[1:], "")
		case 2:
			toc, err = parseTOC(data[1:])
		}
		if err != nil {
			if !typedErr(err) {
				t.Fatalf("untyped error: %v", err)
			}
			return
		}
		walkTOC(t, toc)
	})
}

// FuzzConvert converts arbitrary input as a tar stream: it must not panic,
// and whatever it accepts must round-trip.
func FuzzConvert(f *testing.F) {
	f.Add(smallTar(f))
	f.Add([]byte{})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "a/b/c", Size: 3, ModTime: time.Unix(5, 6), Format: tar.FormatPAX})
	tw.Write([]byte("abc"))
	tw.Close()
	f.Add(buf.Bytes())
	f.Fuzz(func(t *testing.T, in []byte) {
		var out bytes.Buffer
		res, err := Convert(context.Background(), &out, bytes.NewReader(in), WithChunkSize(MinChunkSize))
		if err != nil {
			return
		}
		blob := out.Bytes()
		r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
		if err != nil {
			t.Fatalf("own output rejected: %v", err)
		}
		walkTOC(t, r.TOC())
		src := tarEntries(in)
		for _, e := range src {
			checkEntry(t, r, e)
		}
		plain, err := zstd.DecodeTo(nil, blob)
		if err != nil {
			t.Fatalf("plain zstd decode: %v", err)
		}
		if digestOf(plain) != res.DiffID {
			t.Fatal("diffID does not match the decompressed tar")
		}
		got := tarEntries(plain)
		if len(got) != len(src) {
			t.Fatalf("decompressed tar has %d entries, input %d", len(got), len(src))
		}
		for k := range src {
			if got[k].hdr.Name != src[k].hdr.Name || !bytes.Equal(got[k].data, src[k].data) {
				t.Fatalf("entry %d: %q differs from input %q", k, got[k].hdr.Name, src[k].hdr.Name)
			}
		}
	})
}

// tarEntries reads the entries archive/tar accepts, stopping at the first
// error (Convert accepted the same stream, so there is none).
func tarEntries(b []byte) []tarEntry {
	tr := tar.NewReader(bytes.NewReader(b))
	var out []tarEntry
	for {
		hdr, err := tr.Next()
		if err != nil {
			return out
		}
		data, err := io.ReadAll(tr)
		if err != nil && !errors.Is(err, io.EOF) {
			return out
		}
		out = append(out, tarEntry{hdr, data})
	}
}
