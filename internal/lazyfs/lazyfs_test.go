package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/layerfmt"
)

var fixtureTime = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

// testChunkSize is small so a 1 MiB file has many chunks.
const testChunkSize = 64 << 10

// capability is a v2 security.capability value (cap_net_bind_service).
var capability = string([]byte{0x01, 0x00, 0x00, 0x02, 0x00, 0x04, 0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})

func bigData() []byte {
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, 1<<20+12345)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func hdr(typ byte, name string, mode int64) tar.Header {
	return tar.Header{Typeflag: typ, Name: name, Mode: mode, ModTime: fixtureTime}
}

// fixture covers every entry type, whiteouts, hard links, xattrs and a
// multi-chunk file.
func fixture() []tarFile {
	withX := func(h tar.Header, x map[string]string) tar.Header {
		h.PAXRecords = map[string]string{}
		for k, v := range x {
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		return h
	}
	owned := func(h tar.Header, uid, gid int) tar.Header { h.Uid, h.Gid = uid, gid; return h }
	dev := func(h tar.Header, major, minor int64) tar.Header { h.Devmajor, h.Devminor = major, minor; return h }
	link := func(h tar.Header, target string) tar.Header { h.Linkname = target; return h }
	return []tarFile{
		{hdr: hdr(tar.TypeDir, "etc/", 0o755)},
		{hdr: hdr(tar.TypeReg, "etc/passwd", 0o644), data: []byte("root:x:0:0::/root:/bin/sh\n")},
		{hdr: hdr(tar.TypeReg, "etc/zero", 0)},
		{hdr: withX(hdr(tar.TypeReg, "etc/attrs", 0o600), map[string]string{"user.foo": "bar", "user.other": "x"}), data: []byte("a")},
		{hdr: hdr(tar.TypeDir, "bin/", 0o755)},
		{hdr: hdr(tar.TypeReg, "bin/busybox", 0o755), data: []byte("#!busybox\n")},
		{hdr: link(hdr(tar.TypeLink, "bin/ls", 0o755), "bin/busybox")},
		{hdr: link(hdr(tar.TypeLink, "bin/cat", 0o755), "bin/busybox")},
		{hdr: link(hdr(tar.TypeSymlink, "bin/sh", 0o777), "busybox")},
		{hdr: withX(hdr(tar.TypeReg, "bin/su", 0o4755), map[string]string{"security.capability": capability}), data: []byte("su")},
		{hdr: owned(hdr(tar.TypeReg, "bin/sg", 0o2711), 1000, 1001), data: []byte("sg")},
		{hdr: hdr(tar.TypeDir, "tmp/", 0o1777)},
		{hdr: hdr(tar.TypeDir, "dev/", 0o755)},
		{hdr: dev(hdr(tar.TypeChar, "dev/null", 0o666), 1, 3)},
		{hdr: dev(hdr(tar.TypeBlock, "dev/sda", 0o660), 8, 0)},
		{hdr: dev(hdr(tar.TypeChar, "dev/wide", 0o600), 300, 70000)},
		{hdr: hdr(tar.TypeDir, "run/", 0o755)},
		{hdr: hdr(tar.TypeFifo, "run/fifo", 0o600)},
		{hdr: withX(hdr(tar.TypeDir, "hostile/", 0o755), map[string]string{"trusted.overlay.redirect": "/etc", "user.overlay.opaque": "y", "user.ok": "1"})},
		{hdr: hdr(tar.TypeReg, ".wh.gone", 0o644)},
		{hdr: hdr(tar.TypeDir, "usr/", 0o755)},
		{hdr: hdr(tar.TypeReg, "usr/.wh.removed", 0o644)},
		{hdr: hdr(tar.TypeReg, "usr/kept", 0o644), data: []byte("kept")},
		{hdr: hdr(tar.TypeDir, "opq/", 0o755)},
		{hdr: hdr(tar.TypeReg, "opq/.wh..wh..opq", 0o644)},
		{hdr: hdr(tar.TypeReg, "opq/keep", 0o644), data: []byte("keep")},
		{hdr: hdr(tar.TypeReg, ".wh.shadow", 0o644)},
		{hdr: hdr(tar.TypeReg, "shadow", 0o644), data: []byte("new")},
		{hdr: hdr(tar.TypeReg, ".wh.redo", 0o644)},
		{hdr: hdr(tar.TypeDir, "redo/", 0o750)},
		{hdr: hdr(tar.TypeReg, "redo/fresh", 0o644), data: []byte("fresh")},
		{hdr: hdr(tar.TypeDir, "data/", 0o755)},
		{hdr: owned(hdr(tar.TypeReg, "data/big", 0o640), 7, 8), data: bigData()},
		{hdr: hdr(tar.TypeReg, "data/empty", 0o644)},
	}
}

type fixtureLayer struct {
	blob []byte
	toc  *layerfmt.TOC
}

func newFixture(t testing.TB) fixtureLayer {
	t.Helper()
	blob, toc := convert(t, bytes.NewReader(buildTar(t, fixture())), layerfmt.WithChunkSize(testChunkSize))
	return fixtureLayer{blob: blob, toc: toc}
}

func (f fixtureLayer) mount(t testing.TB, opts ...Option) (string, *blobSource, *Server) {
	t.Helper()
	src := newBlobSource(bytes.NewReader(f.blob))
	mnt, srv := mountLayer(t, f.toc, src, opts...)
	return mnt, src, srv
}

func TestMetadataFromTOCOnly(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, src, srv := f.mount(t)

	const reg, dir, lnk, chr, blk, fifo = unix.S_IFREG, unix.S_IFDIR, unix.S_IFLNK, unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO
	tests := []struct {
		path       string
		mode       uint32
		uid, gid   uint32
		size       int64
		nlink      uint64
		rdev       uint64
		fixtureMod bool // mtime comes from the fixture (not a synthetic whiteout/implicit dir)
	}{
		{path: ".", mode: dir | 0o755, nlink: 2 + 10}, // bin data dev etc hostile opq redo run tmp usr
		{path: "etc", mode: dir | 0o755, nlink: 2, fixtureMod: true},
		{path: "etc/passwd", mode: reg | 0o644, size: 26, nlink: 1, fixtureMod: true},
		{path: "etc/zero", mode: reg, nlink: 1, fixtureMod: true},
		{path: "bin/busybox", mode: reg | 0o755, size: 10, nlink: 3, fixtureMod: true},
		{path: "bin/ls", mode: reg | 0o755, size: 10, nlink: 3, fixtureMod: true},
		{path: "bin/sh", mode: lnk | 0o777, size: 7, nlink: 1, fixtureMod: true},
		{path: "bin/su", mode: reg | 0o4755, size: 2, nlink: 1, fixtureMod: true},
		{path: "bin/sg", mode: reg | 0o2711, uid: 1000, gid: 1001, size: 2, nlink: 1, fixtureMod: true},
		{path: "tmp", mode: dir | 0o1777, nlink: 2, fixtureMod: true},
		{path: "dev/null", mode: chr | 0o666, nlink: 1, rdev: unix.Mkdev(1, 3), fixtureMod: true},
		{path: "dev/sda", mode: blk | 0o660, nlink: 1, rdev: unix.Mkdev(8, 0), fixtureMod: true},
		{path: "dev/wide", mode: chr | 0o600, nlink: 1, rdev: unix.Mkdev(300, 70000), fixtureMod: true},
		{path: "run/fifo", mode: fifo | 0o600, nlink: 1, fixtureMod: true},
		{path: "gone", mode: chr, nlink: 1, rdev: 0, fixtureMod: true}, // overlay whiteout
		{path: "usr/removed", mode: chr, nlink: 1, rdev: 0, fixtureMod: true},
		{path: "shadow", mode: reg | 0o644, size: 3, nlink: 1, fixtureMod: true},
		{path: "redo", mode: dir | 0o750, nlink: 2, fixtureMod: true},
		{path: "data/big", mode: reg | 0o640, uid: 7, gid: 8, size: int64(len(bigData())), nlink: 1, fixtureMod: true},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(mnt, tc.path), &st); err != nil {
				t.Fatal(err)
			}
			if st.Mode != tc.mode {
				t.Errorf("mode = %o, want %o", st.Mode, tc.mode)
			}
			if st.Uid != tc.uid || st.Gid != tc.gid {
				t.Errorf("owner = %d:%d, want %d:%d", st.Uid, st.Gid, tc.uid, tc.gid)
			}
			if st.Size != tc.size {
				t.Errorf("size = %d, want %d", st.Size, tc.size)
			}
			if st.Nlink != tc.nlink {
				t.Errorf("nlink = %d, want %d", st.Nlink, tc.nlink)
			}
			if st.Rdev != tc.rdev {
				t.Errorf("rdev = %d:%d, want %d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev), unix.Major(tc.rdev), unix.Minor(tc.rdev))
			}
			if tc.fixtureMod && (st.Mtim.Sec != fixtureTime.Unix() || st.Mtim.Nsec != int64(fixtureTime.Nanosecond())) {
				t.Errorf("mtime = %d.%09d, want %d.%09d", st.Mtim.Sec, st.Mtim.Nsec, fixtureTime.Unix(), fixtureTime.Nanosecond())
			}
		})
	}

	// Hard links are one inode; inode numbers come from the TOC.
	var a, b, c unix.Stat_t
	for p, st := range map[string]*unix.Stat_t{"bin/busybox": &a, "bin/ls": &b, "bin/cat": &c} {
		if err := unix.Lstat(filepath.Join(mnt, p), st); err != nil {
			t.Fatal(err)
		}
	}
	if a.Ino != b.Ino || a.Ino != c.Ino {
		t.Errorf("hard links have inodes %d %d %d, want one", a.Ino, b.Ino, c.Ino)
	}
	bb, _ := f.toc.Lookup("bin/busybox")
	if a.Ino != ino(bb) {
		t.Errorf("bin/busybox ino = %d, want TOC index+1 = %d", a.Ino, ino(bb))
	}

	// Whiteout markers are hidden, whiteouts renamed, shadowed ones dropped.
	wantRoot := []string{"bin", "data", "dev", "etc", "gone", "hostile", "opq", "redo", "run", "shadow", "tmp", "usr"}
	if got := readdirnames(t, mnt); !slices.Equal(got, wantRoot) {
		t.Errorf("readdir / = %v, want %v", got, wantRoot)
	}
	for d, want := range map[string][]string{
		"usr": {"kept", "removed"}, "opq": {"keep"}, "bin": {"busybox", "cat", "ls", "sg", "sh", "su"},
	} {
		if got := readdirnames(t, filepath.Join(mnt, d)); !slices.Equal(got, want) {
			t.Errorf("readdir %s = %v, want %v", d, got, want)
		}
	}
	for _, hidden := range []string{".wh.gone", "opq/.wh..wh..opq", "usr/.wh.removed", ".wh.shadow", "nonexistent"} {
		if _, err := os.Lstat(filepath.Join(mnt, hidden)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("lstat %s: %v, want ENOENT", hidden, err)
		}
	}
	if got, err := os.Readlink(filepath.Join(mnt, "bin/sh")); err != nil || got != "busybox" {
		t.Errorf("readlink bin/sh = %q, %v", got, err)
	}

	// xattrs: preserved, overlay ones from the tar dropped, opaque derived.
	xattrTests := []struct {
		path string
		want map[string]string
	}{
		{"bin/su", map[string]string{"security.capability": capability}},
		{"etc/attrs", map[string]string{"user.foo": "bar", "user.other": "x"}},
		{"hostile", map[string]string{"user.ok": "1"}},
		{"opq", map[string]string{"trusted.overlay.opaque": "y"}},
		{"redo", map[string]string{"trusted.overlay.opaque": "y"}},
		{"usr", map[string]string{}},
		{"gone", map[string]string{}},
	}
	for _, tc := range xattrTests {
		if got := xattrs(t, filepath.Join(mnt, tc.path)); !mapsEqual(got, tc.want) {
			t.Errorf("xattrs of %s = %q, want %q", tc.path, got, tc.want)
		}
	}
	if _, err := unix.Lgetxattr(filepath.Join(mnt, "etc/attrs"), "user.missing", make([]byte, 16)); err != unix.ENODATA {
		t.Errorf("getxattr missing: %v, want ENODATA", err)
	}

	if n := src.calls.Load(); n != 0 {
		t.Errorf("metadata operations issued %d ReadChunk calls, want 0", n)
	}
	st := srv.Stats()
	if st.Ops["lookup"].Count == 0 || st.Ops["readdir"].Count == 0 || st.Ops["getxattr"].Count == 0 {
		t.Errorf("stats did not count operations: %+v", st.Ops)
	}
}

func readdirnames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func xattrs(t *testing.T, p string) map[string]string {
	t.Helper()
	sz, err := unix.Llistxattr(p, nil)
	if err != nil {
		t.Fatalf("listxattr %s: %v", p, err)
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(p, buf)
	if err != nil {
		t.Fatalf("listxattr %s: %v", p, err)
	}
	out := map[string]string{}
	for _, name := range strings.Split(string(buf[:sz]), "\x00") {
		if name == "" {
			continue
		}
		vsz, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			t.Fatalf("getxattr %s %s: %v", p, name, err)
		}
		v := make([]byte, vsz)
		if _, err := unix.Lgetxattr(p, name, v); err != nil {
			t.Fatalf("getxattr %s %s: %v", p, name, err)
		}
		out[name] = string(v)
	}
	return out
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func TestReadBytes(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, src, srv := f.mount(t)
	want := bigData()

	fd, err := os.Open(filepath.Join(mnt, "data/big"))
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	r := rand.New(rand.NewPCG(3, 4))
	for range 300 {
		off := r.Int64N(int64(len(want)) + 100)
		n := 1 + r.IntN(300<<10)
		got := make([]byte, n)
		cnt, err := fd.ReadAt(got, off)
		wantEnd := min(off+int64(n), int64(len(want)))
		if off >= int64(len(want)) {
			if cnt != 0 {
				t.Fatalf("read at %d past EOF returned %d bytes", off, cnt)
			}
			continue
		}
		if int64(cnt) != wantEnd-off {
			t.Fatalf("read %d at %d: got %d bytes (%v), want %d", n, off, cnt, err, wantEnd-off)
		}
		if !bytes.Equal(got[:cnt], want[off:wantEnd]) {
			t.Fatalf("read %d at %d: bytes differ from the source", n, off)
		}
	}
	for p, w := range map[string]string{"etc/passwd": "root:x:0:0::/root:/bin/sh\n", "bin/ls": "#!busybox\n", "shadow": "new", "data/empty": "", "redo/fresh": "fresh"} {
		if got, err := os.ReadFile(filepath.Join(mnt, p)); err != nil || string(got) != w {
			t.Errorf("read %s = %q, %v; want %q", p, got, err, w)
		}
	}
	if src.calls.Load() == 0 || srv.Stats().BytesRead == 0 {
		t.Errorf("reads were not served by the chunk source: calls=%d stats=%+v", src.calls.Load(), srv.Stats())
	}
}

// TestReadTouchesOnlyCoveringChunks checks a read fetches the chunks that
// hold the requested range and nothing else.
func TestReadTouchesOnlyCoveringChunks(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	idx, ok := f.toc.Lookup("data/big")
	if !ok {
		t.Fatal("data/big not in TOC")
	}
	chunks := f.toc.Chunks(idx)
	if len(chunks) < 8 {
		t.Fatalf("fixture has %d chunks, want a multi-chunk file", len(chunks))
	}
	tests := []struct {
		name   string
		off    int64
		n      int
		chunks []int
	}{
		{"inside one chunk", chunks[3].FileOffset + 100, 1000, []int{3}},
		{"across a boundary", chunks[6].FileOffset - 10, 20, []int{5, 6}},
		{"last partial chunk", chunks[len(chunks)-1].FileOffset + 1, 10, []int{len(chunks) - 1}},
		{"three chunks", chunks[1].FileOffset + 1, 2*testChunkSize - 2 + 4096, []int{1, 2, 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// A fresh mount: nothing in the page cache.
			mnt, src, _ := f.mount(t)
			fd, err := os.Open(filepath.Join(mnt, "data/big"))
			if err != nil {
				t.Fatal(err)
			}
			defer fd.Close()
			// No readahead: the test is about what lazyfs fetches for
			// what the kernel asks, not about the kernel's heuristics.
			if err := unix.Fadvise(int(fd.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
				t.Fatal(err)
			}
			src.reset()
			buf := make([]byte, tc.n)
			if _, err := fd.ReadAt(buf, tc.off); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf, bigData()[tc.off:tc.off+int64(tc.n)]) {
				t.Fatal("bytes differ")
			}
			want := map[chunkKey]int{}
			for _, k := range tc.chunks {
				want[keyOf(chunks[k])] = 1
			}
			got := src.readChunks()
			if len(got) != len(want) {
				t.Fatalf("read chunks %v, want %v", got, want)
			}
			for k := range want {
				if got[k] == 0 {
					t.Fatalf("read chunks %v, want %v", got, want)
				}
			}
		})
	}
}

func TestReadFailuresReturnEIO(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })

	corrupt := bytes.Clone(f.blob)
	idx, _ := f.toc.Lookup("data/big")
	bad := f.toc.Chunks(idx)[2]
	corrupt[bad.Offset+bad.CompressedSize/2] ^= 0xff

	tests := []struct {
		name        string
		blob        []byte
		hook        func(ctx context.Context, c layerfmt.Chunk) ([]byte, error)
		off         int64
		wantTimeout bool
	}{
		{name: "source error", blob: f.blob, off: 0, hook: func(context.Context, layerfmt.Chunk) ([]byte, error) {
			return nil, errors.New("registry unreachable")
		}},
		{name: "digest mismatch", blob: corrupt, off: bad.FileOffset + 5},
		{name: "short chunk", blob: f.blob, off: 0, hook: func(_ context.Context, c layerfmt.Chunk) ([]byte, error) {
			return make([]byte, c.Size-1), nil
		}},
		{name: "panicking source", blob: f.blob, off: 0, hook: func(context.Context, layerfmt.Chunk) ([]byte, error) {
			panic("fetcher bug")
		}},
		{name: "source ignores the timeout", blob: f.blob, off: 0, wantTimeout: true, hook: func(context.Context, layerfmt.Chunk) ([]byte, error) {
			<-stuck
			return nil, errors.New("released")
		}},
		{name: "source honours the timeout", blob: f.blob, off: 0, wantTimeout: true, hook: func(ctx context.Context, _ layerfmt.Chunk) ([]byte, error) {
			<-ctx.Done()
			return nil, ctx.Err()
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			src := newBlobSource(bytes.NewReader(tc.blob))
			src.hook = tc.hook
			mnt, srv := mountLayer(t, f.toc, src, WithReadTimeout(300*time.Millisecond))
			err := withinDeadline(t, 30*time.Second, "read", func() error {
				b, err := os.ReadFile(filepath.Join(mnt, "data/big"))
				if err == nil {
					return errors.New("whole-file read succeeded")
				}
				if len(b) > int(tc.off) {
					return errors.New("returned bytes past the failing chunk")
				}
				fd, err := os.Open(filepath.Join(mnt, "data/big"))
				if err != nil {
					return err
				}
				defer fd.Close()
				_, err = fd.ReadAt(make([]byte, 10), tc.off)
				return err
			})
			if errnoOf(err) != unix.EIO {
				t.Fatalf("read error = %v, want EIO", err)
			}
			st := srv.Stats()
			if st.ReadErrors == 0 {
				t.Errorf("ReadErrors not counted: %+v", st)
			}
			if tc.wantTimeout != (st.ReadTimeouts > 0) {
				t.Errorf("ReadTimeouts = %d, want timeout=%v", st.ReadTimeouts, tc.wantTimeout)
			}
			// Data outside the broken chunk is still served.
			if tc.hook == nil {
				fd, err := os.Open(filepath.Join(mnt, "data/big"))
				if err != nil {
					t.Fatal(err)
				}
				defer fd.Close()
				buf := make([]byte, 100)
				if _, err := fd.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, bigData()[:100]) {
					t.Errorf("read of a healthy chunk: %v", err)
				}
			}
		})
	}
}

func TestMetrics(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	reg := prometheus.NewRegistry()
	src := newBlobSource(bytes.NewReader(f.blob))
	mnt, srv := mountLayer(t, f.toc, src, WithMetrics(reg, "sha256:abc"), WithFSName("envsnap-test"))
	if _, err := os.ReadFile(filepath.Join(mnt, "etc/passwd")); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["layer"] != "sha256:abc" {
				t.Errorf("%s has layer label %q", mf.GetName(), labels["layer"])
			}
			key := mf.GetName()
			if op := labels["op"]; op != "" {
				key += "/" + op
			}
			found[key] = m.GetCounter().GetValue()
		}
	}
	if found["envsnap_lazyfs_ops_total/read"] < 1 || found["envsnap_lazyfs_read_bytes_total"] != 26 || found["envsnap_lazyfs_chunk_reads_total"] < 1 {
		t.Errorf("metrics = %v", found)
	}
	mounts, _ := os.ReadFile("/proc/self/mounts")
	if !strings.Contains(string(mounts), "envsnap-test "+mnt+" fuse.envsnap ro,") {
		t.Errorf("mount not listed as read-only fuse.envsnap with our fsname:\n%s", mounts)
	}
	if err := srv.Unmount(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Unmount(); err != nil {
		t.Errorf("second Unmount: %v", err)
	}
	if mfs, _ := reg.Gather(); len(mfs) != 0 {
		t.Errorf("metrics still registered after Unmount: %d families", len(mfs))
	}
}

// TestUnmountAfterExternalUnmount: the daemon must cope with an operator
// (or a crashed previous cleanup) having unmounted the layer already.
func TestUnmountAfterExternalUnmount(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, _, srv := f.mount(t)
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	var done atomic.Bool
	go func() { srv.Wait(); done.Store(true) }()
	if err := srv.Unmount(); err != nil {
		t.Fatalf("Unmount after external unmount: %v", err)
	}
	// Something else mounted there later must not be touched.
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	if err := srv.Unmount(); err != nil {
		t.Fatal(err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(mnt, &sfs); err != nil || sfs.Type != unix.TMPFS_MAGIC {
		t.Errorf("Unmount removed an unrelated mount: %v type %x", err, sfs.Type)
	}
}

func TestWrongTOC(t *testing.T) {
	if _, err := NewRoot(nil, newBlobSource(bytes.NewReader(nil))); err == nil {
		t.Error("NewRoot(nil TOC) succeeded")
	}
	f := newFixture(t)
	if _, err := NewRoot(f.toc, nil); err == nil {
		t.Error("NewRoot(nil source) succeeded")
	}
}

func TestReadFailureLogsAreRateLimited(t *testing.T) {
	var r logLimiter
	now := time.Unix(1000, 0)
	if n, ok := r.allow(now); !ok || n != 0 {
		t.Fatalf("first failure not logged: %d %v", n, ok)
	}
	for i := range 50 {
		if _, ok := r.allow(now.Add(time.Duration(i) * time.Millisecond)); ok {
			t.Fatalf("failure %d within the interval logged", i)
		}
	}
	if n, ok := r.allow(now.Add(failLogInterval)); !ok || n != 50 {
		t.Errorf("after the interval: logged=%v suppressed=%d, want true 50", ok, n)
	}
}
