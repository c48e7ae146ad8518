package reliability_test

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/envsnap/envsnap/internal/lazyfs"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// memSource serves chunks of a blob held in memory, verified by layerfmt.
type memSource struct{ blob []byte }

func (s memSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	if c.Offset < 0 || c.CompressedSize <= 0 || c.Offset+c.CompressedSize > int64(len(s.blob)) {
		return nil, nil, fmt.Errorf("chunk %d+%d outside the %d-byte blob", c.Offset, c.CompressedSize, len(s.blob))
	}
	b, err := layerfmt.DecodeChunk(c, s.blob[c.Offset:c.Offset+c.CompressedSize], nil)
	return b, nil, err
}

// fuzzSeedLayer is a small layer with every entry type lazyfs serves.
func fuzzSeedLayer(t testing.TB) (blob, rawTOC []byte) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range []*tar.Header{
		{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755},
		{Typeflag: tar.TypeReg, Name: "d/a", Mode: 0o644, Size: 3000},
		{Typeflag: tar.TypeReg, Name: "d/b", Mode: 0o600, Size: 70000},
		{Typeflag: tar.TypeSymlink, Name: "s", Linkname: "d/a"},
		{Typeflag: tar.TypeLink, Name: "h", Linkname: "d/a"},
		{Typeflag: tar.TypeReg, Name: "d/.wh.gone", Mode: 0o644},
		{Typeflag: tar.TypeReg, Name: "e/.wh..wh..opq", Mode: 0o644},
		{Typeflag: tar.TypeChar, Name: "c", Devmajor: 1, Devminor: 3},
	} {
		h.ModTime = time.Unix(1e9, 0)
		if h.Typeflag == tar.TypeReg {
			h.PAXRecords = map[string]string{"SCHILY.xattr.user.k": "v"}
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write(bytes.Repeat([]byte{byte(len(h.Name))}, int(h.Size)))
	}
	tw.Close()
	var out bytes.Buffer
	if _, err := layerfmt.Convert(context.Background(), &out, &buf, layerfmt.WithChunkSize(16<<10)); err != nil {
		t.Fatal(err)
	}
	blob = out.Bytes()
	off, size, err := layerfmt.TOCRange(blob[len(blob)-layerfmt.FooterSize:], int64(len(blob)))
	if err != nil {
		t.Fatal(err)
	}
	zd, _ := zstd.NewReader(nil)
	defer zd.Close()
	if rawTOC, err = zd.DecodeAll(blob[off:off+size], nil); err != nil {
		t.Fatal(err)
	}
	return blob, rawTOC
}

// FuzzMountTOC runs mutated TOCs through the mount path: whatever
// layerfmt accepts is mounted with lazyfs over the (unchanged) blob, and
// walking, stat-ing, reading links and reading every file must finish in
// bounded time without crashing the server; reads return the verified
// bytes or an error, never hang.
func FuzzMountTOC(f *testing.F) {
	prereq.RequireFUSE(f)
	blob, raw := fuzzSeedLayer(f)
	f.Add(raw)
	ze, err := zstd.NewWriter(nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		toc, err := layerfmt.DecodeTOC(ze.EncodeAll(raw, nil), "")
		if err != nil {
			return // refused: what a hostile TOC should get
		}
		dir, err := os.MkdirTemp("", "envsnap-fuzz")
		if err != nil {
			t.Fatal(err)
		}
		defer os.Remove(dir)
		srv, err := lazyfs.Mount(context.Background(), dir, toc, memSource{blob: blob}, lazyfs.WithReadTimeout(time.Second))
		if err != nil {
			return // refused at mount time
		}
		// The walk runs in a child process: a process that serves a
		// FUSE mount and also uses it can deadlock in the Go runtime
		// (seen here under the fuzzer: an OPEN nobody answers).
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, "find", dir, "-xdev",
			"(", "-type", "f", "-exec", "cat", "{}", "+", ")", "-o",
			"(", "-type", "l", "-exec", "readlink", "{}", "+", ")")
		var stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = io.Discard, &stderr
		err = cmd.Run()
		if ctx.Err() != nil {
			t.Errorf("walking the mount did not finish in 5s")
		}
		if msg := stderr.String(); strings.Contains(msg, "not connected") || strings.Contains(msg, "connection abort") {
			t.Errorf("the mount died while walked: %v: %s", err, msg)
		}
		if err := srv.Unmount(); err != nil {
			t.Fatalf("unmount: %v", err)
		}
	})
}
