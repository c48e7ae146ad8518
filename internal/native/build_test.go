//go:build linux

package native

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"github.com/envsnap/envsnap/internal/prereq"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive"
	"github.com/containerd/containerd/v2/pkg/archive/compression"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/layerfmt"
)

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root (mknod, chown, trusted xattrs)")
	}
}

type tarFile struct {
	hdr  tar.Header
	data []byte
}

// allKinds is a layer with every entry kind the format carries, the OCI
// whiteouts, and files spanning and sharing frames.
func allKinds() []tarFile {
	mt := time.Date(2024, 3, 1, 12, 0, 0, 0, time.UTC)
	rnd := rand.New(rand.NewPCG(1, 2))
	big := make([]byte, 300<<10) // spans several 64 KiB chunks
	for i := range big {
		big[i] = byte(rnd.IntN(7)) // compressible but not trivially
	}
	dir := func(name string, mode int64, uid int) tarFile {
		return tarFile{hdr: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode, Uid: uid, Gid: uid, ModTime: mt}}
	}
	reg := func(name string, mode int64, data []byte) tarFile {
		return tarFile{hdr: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Uid: 1000, Gid: 1001, ModTime: mt.Add(time.Hour)}, data: data}
	}
	files := []tarFile{
		dir("./", 0o755, 0),
		dir("bin/", 0o755, 0),
		reg("bin/tool", 0o4755, big),
		reg("bin/empty", 0o644, nil),
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/sh", Linkname: "tool", ModTime: mt, Uid: 5, Gid: 6}},
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/dangling", Linkname: "/nowhere/at/all", ModTime: mt}},
		dir("dev/", 0o755, 0),
		{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3, ModTime: mt}},
		{hdr: tar.Header{Typeflag: tar.TypeBlock, Name: "dev/loop0", Mode: 0o660, Devmajor: 7, Devminor: 0, Gid: 6, ModTime: mt}},
		{hdr: tar.Header{Typeflag: tar.TypeFifo, Name: "dev/fifo", Mode: 0o600, ModTime: mt}},
		dir("etc/", 0o2750, 0),
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "etc/attrs", Mode: 0o640, ModTime: mt, PAXRecords: map[string]string{
			"SCHILY.xattr.user.mime":   "text/plain",
			"SCHILY.xattr.trusted.tag": "x",
		}}, data: []byte("with xattrs\n")},
		dir("opaque/", 0o755, 0),
		reg("opaque/.wh..wh..opq", 0o644, nil),
		reg("opaque/kept", 0o644, []byte("kept")),
		dir("gone/", 0o755, 0),
		reg("gone/.wh.deleted", 0o644, nil),
		dir("tmp/", 0o1777, 0),
		dir("data/", 0o700, 42),
	}
	// Small files that share frames.
	for i := range 40 {
		files = append(files, reg(fmt.Sprintf("data/f%02d", i), 0o644, bytes.Repeat([]byte{byte('a' + i%26)}, 100+i*37)))
	}
	files = append(files,
		// Tar writers give a hard link its target's metadata, and the
		// applier sets it again on the shared inode.
		tarFile{hdr: tar.Header{Typeflag: tar.TypeLink, Name: "data/tool-link", Linkname: "bin/tool", Mode: 0o4755, Uid: 1000, Gid: 1001, ModTime: mt.Add(time.Hour)}},
		tarFile{hdr: tar.Header{Typeflag: tar.TypeLink, Name: "etc/attrs-link", Linkname: "etc/attrs", Mode: 0o640, ModTime: mt}},
	)
	return files
}

func buildTar(t testing.TB, files []tarFile) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := f.hdr
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(f.data))
		}
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatalf("tar header %s: %v", h.Name, err)
		}
		if _, err := tw.Write(f.data); err != nil {
			t.Fatalf("tar data %s: %v", h.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// cachedLayer converts tarStream and puts every frame of the blob into a
// new chunk cache, as a completed background fill leaves it.
func cachedLayer(t testing.TB, tarStream []byte) (blob []byte, toc *layerfmt.TOC, cache *chunkcache.Cache) {
	t.Helper()
	return cacheLayer(t, bytes.NewReader(tarStream), layerfmt.WithChunkSize(64<<10))
}

// cacheLayer converts tarStream with opts and puts every frame of the blob
// into a new chunk cache.
func cacheLayer(t testing.TB, tarStream io.Reader, opts ...layerfmt.WriteOption) (blob []byte, toc *layerfmt.TOC, cache *chunkcache.Cache) {
	t.Helper()
	var b bytes.Buffer
	res, err := layerfmt.Convert(context.Background(), &b, tarStream, opts...)
	if err != nil {
		t.Fatalf("convert: %v", err)
	}
	toc, err = layerfmt.ReadTOC(context.Background(), bytes.NewReader(b.Bytes()), int64(b.Len()), res.TOCDigest)
	if err != nil {
		t.Fatalf("read TOC: %v", err)
	}
	cache, err = chunkcache.Open(t.TempDir(), 4<<30)
	if err != nil {
		t.Fatal(err)
	}
	for k := range toc.NumFrames() {
		f := toc.Frame(k)
		if err := cache.Put(f.Digest, b.Bytes()[f.Offset:f.Offset+f.CompressedSize]); err != nil {
			t.Fatal(err)
		}
	}
	return b.Bytes(), toc, cache
}

// applied is what containerd's overlay snapshotter makes of the blob: the
// decompressed stream applied by archive.Apply with overlay whiteouts.
func applied(t testing.TB, blob []byte) string {
	t.Helper()
	dir := t.TempDir()
	r, err := compression.DecompressStream(bytes.NewReader(blob))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := archive.Apply(context.Background(), dir, r, archive.WithConvertWhiteout(archive.OverlayConvertWhiteout)); err != nil {
		t.Fatalf("archive.Apply: %v", err)
	}
	return dir
}

func TestBuildTreeMatchesOverlayApplier(t *testing.T) {
	requireRoot(t)
	blob, toc, cache := cachedLayer(t, buildTar(t, allKinds()))
	want := applied(t, blob)
	got := filepath.Join(t.TempDir(), "tree")
	if err := BuildTree(context.Background(), got, toc, cache); err != nil {
		t.Fatalf("BuildTree: %v", err)
	}
	if size := TreeSize(toc); size < 300<<10 {
		t.Errorf("TreeSize %d: less than the big file alone", size)
	}
	w, g := describe(t, want), describe(t, got)
	if len(w) < 50 {
		t.Fatalf("reference tree has only %d entries", len(w))
	}
	for p, we := range w {
		ge, ok := g[p]
		if !ok {
			t.Errorf("%s: missing from the native tree", p)
			continue
		}
		if ge != we {
			t.Errorf("%s:\n got  %s\n want %s", p, ge, we)
		}
	}
	for p := range g {
		if _, ok := w[p]; !ok {
			t.Errorf("%s: in the native tree only", p)
		}
	}
	if lw, lg := linkGroups(t, want), linkGroups(t, got); strings.Join(lw, ";") != strings.Join(lg, ";") {
		t.Errorf("hard links: got %v, want %v", lg, lw)
	}
	// The whiteout and the opaque marker in their overlay form.
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(got, "gone/deleted"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("whiteout: %+v, %v", st, err)
	}
	if v, err := xattr(filepath.Join(got, "opaque"), layerfmt.OverlayOpaqueXattr); err != nil || v != "y" {
		t.Errorf("opaque xattr %q, %v", v, err)
	}
}

// TestBuildTreeHidesOverlayXattrs: layer content cannot steer overlayfs
// through the native copy; trusted.* attributes are dropped as
// containerd's applier drops them (the FUSE view hides the same).
func TestBuildTreeHidesOverlayXattrs(t *testing.T) {
	requireRoot(t)
	files := []tarFile{{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "f", Mode: 0o644, PAXRecords: map[string]string{
		"SCHILY.xattr.trusted.overlay.redirect": "/etc",
		"SCHILY.xattr.user.overlay.metacopy":    "",
		"SCHILY.xattr.trusted.other":            "1",
		"SCHILY.xattr.user.ok":                  "1",
	}}, data: []byte("x")}}
	_, toc, cache := cachedLayer(t, buildTar(t, files))
	got := filepath.Join(t.TempDir(), "tree")
	if err := BuildTree(context.Background(), got, toc, cache); err != nil {
		t.Fatal(err)
	}
	names := listxattr(t, filepath.Join(got, "f"))
	if strings.Join(names, ",") != "user.ok" {
		t.Errorf("xattrs %v, want only user.ok", names)
	}
}

// TestBuildTreeCorruptChunk: a cached frame whose bytes no longer match
// its digest fails the build; no tree with wrong bytes is produced.
func TestBuildTreeCorruptChunk(t *testing.T) {
	requireRoot(t)
	_, toc, cache := cachedLayer(t, buildTar(t, allKinds()))
	i, ok := toc.Lookup("bin/tool")
	if !ok {
		t.Fatal("bin/tool not in TOC")
	}
	damageChunk(t, cache, toc.Chunk(i, 1).Digest)
	err := BuildTree(context.Background(), filepath.Join(t.TempDir(), "tree"), toc, cache)
	if !errors.Is(err, ErrChunkMissing) {
		t.Fatalf("BuildTree with a corrupt chunk: %v, want ErrChunkMissing", err)
	}
	if cache.Stats().Corrupt != 1 {
		t.Errorf("cache reported %d corrupt entries, want 1", cache.Stats().Corrupt)
	}
}

// damageChunk flips a byte in the middle of chunk d's file in cache.
func damageChunk(t testing.TB, cache *chunkcache.Cache, d digest.Digest) {
	t.Helper()
	p := filepath.Join(cache.Dir(), d.Algorithm().String(), d.Encoded()[:2], d.Encoded())
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0xff
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// describe maps every path under root (but root) to its metadata and
// content, in a form that compares with ==.
func describe(t testing.TB, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		s := fmt.Sprintf("mode=%o uid=%d gid=%d", st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			s += fmt.Sprintf(" size=%d sha256=%x", st.Size, sha256.Sum256(b))
		case unix.S_IFLNK:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			s += " link=" + l
		case unix.S_IFCHR, unix.S_IFBLK:
			s += fmt.Sprintf(" rdev=%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		// containerd's applier leaves a whiteout's mtime at its
		// creation; everything else carries the layer's.
		if !(st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0) {
			s += fmt.Sprintf(" mtime=%d.%09d", st.Mtim.Sec, st.Mtim.Nsec)
		}
		for _, k := range listxattr(t, p) {
			v, err := xattr(p, k)
			if err != nil {
				return err
			}
			s += fmt.Sprintf(" %s=%q", k, v)
		}
		out[rel] = s
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// linkGroups lists the sets of paths that share an inode (hard links).
func linkGroups(t testing.TB, root string) []string {
	t.Helper()
	byIno := map[uint64][]string{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil || de.IsDir() {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		byIno[st.Ino] = append(byIno[st.Ino], rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, ps := range byIno {
		if len(ps) > 1 {
			sort.Strings(ps)
			out = append(out, strings.Join(ps, ","))
		}
	}
	sort.Strings(out)
	return out
}

func listxattr(t testing.TB, p string) []string {
	t.Helper()
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		t.Fatalf("listxattr %s: %v", p, err)
	}
	var names []string
	for _, k := range strings.Split(string(buf[:n]), "\x00") {
		if k != "" && !strings.HasPrefix(k, "security.selinux") {
			names = append(names, k)
		}
	}
	sort.Strings(names)
	return names
}

func xattr(p, k string) (string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Lgetxattr(p, k, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
