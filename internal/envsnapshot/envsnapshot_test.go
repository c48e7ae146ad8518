//go:build linux

package envsnapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/envsnap/envsnap/internal/prereq"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/archive"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/beneath"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/layerfmt"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root: overlayfs mounts, whiteout devices, trusted xattrs")
	}
}

// entry builds a tar entry for layer helpers.
type entry struct {
	name, data, link string
	typ              byte
	mode             int64
	xattrs           map[string]string
}

func file(name, data string) entry    { return entry{name: name, data: data, typ: tar.TypeReg} }
func dir(name string) entry           { return entry{name: name + "/", typ: tar.TypeDir, mode: 0o755} }
func hardlink(name, to string) entry  { return entry{name: name, link: to, typ: tar.TypeLink} }
func symlink(name, to string) entry   { return entry{name: name, link: to, typ: tar.TypeSymlink} }
func whiteout(dir, name string) entry { return file(filepath.Join(dir, whiteoutPrefix+name), "") }
func opaque(dir string) entry         { return file(filepath.Join(dir, whiteoutOpaque), "") }

func layerTar(t *testing.T, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		hdr := &tar.Header{Typeflag: e.typ, Name: e.name, Linkname: e.link, Mode: mode, Size: int64(len(e.data)), ModTime: time.Unix(1700000000, 0), Format: tar.FormatPAX}
		if e.typ != tar.TypeReg {
			hdr.Size = 0
		}
		for k, v := range e.xattrs {
			if hdr.PAXRecords == nil {
				hdr.PAXRecords = map[string]string{}
			}
			hdr.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if hdr.Size > 0 {
			tw.Write([]byte(e.data))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// apply unpacks OCI layer tars into dir with containerd's own applier:
// the oracle for what a layer means.
func apply(t *testing.T, dir string, tars ...[]byte) {
	t.Helper()
	for i, tb := range tars {
		if _, err := archive.Apply(context.Background(), dir, bytes.NewReader(tb)); err != nil {
			t.Fatalf("apply layer %d: %v", i, err)
		}
	}
}

func describe(t *testing.T, dir string) map[string]string {
	t.Helper()
	d, err := devenv.DescribeTree(dir)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func reader(t *testing.T, tb []byte) *layerfmt.Reader {
	t.Helper()
	var blob bytes.Buffer
	res, err := layerfmt.Convert(context.Background(), &blob, bytes.NewReader(tb))
	if err != nil {
		t.Fatal(err)
	}
	r, err := layerfmt.NewReader(bytes.NewReader(blob.Bytes()), res.Size, res.TOCDigest)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestSquashEqualsLayers: applying the squash of a chain of diffs gives
// the tree that applying the diffs one by one gives, with containerd's
// applier as the judge: whiteouts of lower files, a deleted file coming
// back as a directory (opaque), opaque directories, a type change,
// hard links whose first name is deleted later, symlinks, xattrs.
func TestSquashEqualsLayers(t *testing.T) {
	requireRoot(t)
	base := layerTar(t,
		dir("a"), file("a/x", "x0"), file("a/y", "y0"),
		dir("b"), file("b/1", "b1"),
		file("c", "c0"),
		dir("d"), file("d/1", "d1"), dir("d/sub"), file("d/sub/2", "d2"),
		dir("keep"), file("keep/k", "k0"),
		file("h1", "hard"), hardlink("h2", "h1"),
	)
	d1 := layerTar(t,
		dir("a"), whiteout("a", "x"), file("a/z", "z1"),
		dir("b"), opaque("b"), file("b/2", "b2"),
		dir("c"), file("c/k", "ck"),
		dir("e"), entry{name: "e/f", data: "shared", typ: tar.TypeReg, mode: 0o600, xattrs: map[string]string{"user.link": "both names"}},
		// tar(1) gives a hard link its inode's metadata; appliers apply it.
		entry{name: "e/g", link: "e/f", typ: tar.TypeLink, mode: 0o600, xattrs: map[string]string{"user.link": "both names"}},
		// A pair whose link sorts before its data: the squash writes the
		// data under the first name.
		dir("l"), file("l/z-data", "pair"), entry{name: "l/a-link", link: "l/z-data", typ: tar.TypeLink, mode: 0o644},
		entry{name: "attr", data: "with xattr", typ: tar.TypeReg, xattrs: map[string]string{"user.step": "1"}},
	)
	d2 := layerTar(t,
		dir("a"), dir("a/x"), file("a/x/q", "q2"),
		dir("e"), whiteout("e", "f"),
		whiteout(".", "d"),
		symlink("sym", "a/z"),
		whiteout(".", "h1"),
	)
	d3 := layerTar(t,
		file("d", "d is a file now"),
		dir("a"), file("a/z", "z3"),
		dir("b"), whiteout("b", "2"), file("b/3", "b3"),
		dir("e"), file("e/f", "new f"),
	)
	want := t.TempDir()
	apply(t, want, base, d1, d2, d3)

	// Knowing the image below only drops markers that hide nothing.
	for _, below := range []*Below{nil, NewBelow(reader(t, base).TOC())} {
		var sq bytes.Buffer
		if err := Squash(context.Background(), &sq, below, []*layerfmt.Reader{reader(t, d1), reader(t, d2), reader(t, d3)}); err != nil {
			t.Fatal(err)
		}
		got := t.TempDir()
		apply(t, got, base, sq.Bytes())
		if diffs := devenv.DiffTrees(describe(t, want), describe(t, got)); len(diffs) > 0 {
			t.Fatalf("squashed layer (image below known: %v) differs from the chain:\n%s", below != nil, strings.Join(diffs, "\n"))
		}
		// The squash must also be a valid layer on its own (layerfmt
		// refuses duplicates and dangling hard links).
		reader(t, sq.Bytes())
	}
}

// TestUpperTarMatchesOverlay makes changes through a real overlayfs
// mount, then checks that the upper directory written as an OCI diff and
// applied to the lower gives exactly the merged view: deletions (overlay
// whiteout devices), a directory deleted and re-created (opaque), renames,
// permissions, owners, xattrs, hard links, symlinks, FIFOs and a sparse
// file.
func TestUpperTarMatchesOverlay(t *testing.T) {
	requireRoot(t)
	root := t.TempDir()
	lower, upper, work, merged := filepath.Join(root, "lower"), filepath.Join(root, "upper"), filepath.Join(root, "work"), filepath.Join(root, "merged")
	for _, d := range []string{lower, upper, work, merged} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	base := layerTar(t,
		dir("etc"), file("etc/config", "v1"), file("etc/gone", "bye"),
		dir("data"), file("data/1", "one"), file("data/2", "two"), dir("data/deep"), file("data/deep/3", "three"),
		dir("srv"), file("srv/old-name", "renamed content"),
		file("mode", "chmod me"),
	)
	apply(t, lower, base)
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		prereq.Missing(t, "overlayfs: %v", err)
	}
	mounted := true
	unmount := func() {
		if mounted {
			if err := unix.Unmount(merged, 0); err != nil {
				t.Fatal(err)
			}
			mounted = false
		}
	}
	t.Cleanup(unmount)
	m := func(p string) string { return filepath.Join(merged, p) }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(m("etc/config"), []byte("v2"), 0o600))
	must(os.Remove(m("etc/gone")))
	must(os.RemoveAll(m("data")))
	must(os.MkdirAll(m("data/fresh"), 0o750))
	must(os.WriteFile(m("data/fresh/new"), []byte("new"), 0o644))
	must(os.Rename(m("srv/old-name"), m("srv/new-name")))
	must(os.Chmod(m("mode"), 0o4711))
	must(os.Lchown(m("mode"), 1000, 1001))
	must(os.WriteFile(m("attr"), []byte("x"), 0o644))
	must(unix.Lsetxattr(m("attr"), "user.env", []byte("rl"), 0))
	must(os.WriteFile(m("link-a"), []byte("linked"), 0o644))
	must(os.Link(m("link-a"), m("link-b")))
	must(os.Symlink("../etc/config", m("srv/cfg")))
	must(unix.Mkfifo(m("fifo"), 0o600))
	f, err := os.Create(m("sparse"))
	must(err)
	_, err = f.WriteAt([]byte("middle"), 4<<20)
	must(err)
	_, err = f.WriteAt([]byte("end"), 8<<20)
	must(err)
	must(f.Close())
	want := describe(t, merged)
	unmount()

	var diff bytes.Buffer
	st, err := WriteUpperTar(context.Background(), &diff, upper, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st.Whiteouts != 2 || st.Opaque != 1 {
		t.Errorf("stats %+v: want 2 whiteouts (etc/gone, srv/old-name) and 1 opaque dir (data)", st)
	}
	got := t.TempDir()
	apply(t, got, base, diff.Bytes())
	if diffs := devenv.DiffTrees(want, describe(t, got)); len(diffs) > 0 {
		t.Fatalf("applied diff differs from the overlay's merged view:\n%s", strings.Join(diffs, "\n"))
	}
	// The envsnap encoding keeps it all, and the upper read into memory
	// gives the same bytes.
	reader(t, diff.Bytes())
	tree, err := capture(context.Background(), rootOf(t, upper), nil, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(diff.Bytes(), diffTar(t, tree.entries)) {
		t.Error("the upper directory read into memory gives another diff than the upper itself")
	}
	// Encoded straight from the entries, the layer is the one Convert
	// makes of the diff's tar.
	var layer bytes.Buffer
	conv, err := layerfmt.Convert(context.Background(), &layer, bytes.NewReader(diff.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	var direct bytes.Buffer
	enc, _, err := encodeDiff(context.Background(), "", &direct, tree.entries, 0)
	if err != nil {
		t.Fatal(err)
	}
	if enc.desc.Digest != conv.Digest || enc.diffID != conv.DiffID || !bytes.Equal(layer.Bytes(), direct.Bytes()) {
		t.Errorf("layer encoded from the entries: %s (diffID %s), want %s (diffID %s) as Convert of the diff", enc.desc.Digest, enc.diffID, conv.Digest, conv.DiffID)
	}
	for _, e := range tree.entries {
		if e.rel == "sparse" && (e.data == nil || e.data.bytes() > 1<<20) {
			t.Errorf("sparse file held in memory: %+v; want only its data extents", e.data)
		}
	}
	if _, err := capture(context.Background(), rootOf(t, upper), nil, nil, 1<<20); !errors.Is(err, ErrDiffTooLarge) {
		t.Errorf("reading 8 MiB of sparse file under a 1 MiB cap: err %v, want ErrDiffTooLarge", err)
	}

	if _, err := WriteUpperTar(context.Background(), &bytes.Buffer{}, upper, 1<<20); !errors.Is(err, ErrDiffTooLarge) {
		t.Errorf("8 MiB sparse file under a 1 MiB cap: err %v, want ErrDiffTooLarge", err)
	}
}

// TestPrecopy: a frozen pass over a pre-copy reuses exactly the files that
// cannot have changed since, and its result is the tree a full copy gives.
func TestPrecopy(t *testing.T) {
	requireRoot(t)
	upper := t.TempDir()
	write := func(name, data string) { t.Helper(); writeUpperFile(t, upper, name, data) }
	for _, n := range []string{"keep", "d/keep2", "inplace", "gone", "replaced", "chmodded", "d2/child", "f2", "s", "dd/sub/x"} {
		write(n, "before "+n)
	}
	if err := os.Link(filepath.Join(upper, "keep"), filepath.Join(upper, "keep-link")); err != nil {
		t.Fatal(err)
	}
	// want is the diff of the upper as it is now, read in place.
	want := func() []byte {
		t.Helper()
		var b bytes.Buffer
		if _, err := WriteUpperTar(context.Background(), &b, upper, 0); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	diffOf := func(tree *captured) []byte { return diffTar(t, tree.entries) }

	// Everything was written just now: nothing is older than the pre-copy
	// by precopySlack, so nothing is reused.
	pre, err := precopy(context.Background(), rootOf(t, upper), 0)
	if err != nil {
		t.Fatal(err)
	}
	st, err := capture(context.Background(), rootOf(t, upper), pre, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st.Reused != 0 {
		t.Errorf("files written %s before the pre-copy were reused: reused %d, read %d", precopySlack, st.Reused, st.Copied)
	}
	if _, err := precopy(context.Background(), rootOf(t, upper), 10); !errors.Is(err, ErrDiffTooLarge) {
		t.Errorf("pre-copy of more than 10 bytes of file data under a 10-byte cap: err %v, want ErrDiffTooLarge", err)
	}

	// As if the files had been written long before the pre-copy.
	pre, err = precopy(context.Background(), rootOf(t, upper), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := pre.files["keep"]; ok {
		t.Error("the pre-copy read the data of a file with two names")
	}
	pre.start = pre.start.Add(2 * precopySlack)
	// Changes while the container ran on: an overwrite in place of the
	// same size with the mtime put back (only ctime tells), a deletion,
	// a replacement, a chmod, a new file.
	p := filepath.Join(upper, "inplace")
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("AFTER! inplace"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(p, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(upper, "gone")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(upper, "replaced")); err != nil {
		t.Fatal(err)
	}
	write("replaced", "after replaced")
	if err := os.Chmod(filepath.Join(upper, "chmodded"), 0o600); err != nil {
		t.Fatal(err)
	}
	write("new", "new")
	// Type changes: a directory becomes a file, a file a directory and
	// another a symlink; a whole tree goes.
	for _, p := range []string{"d2", "f2", "s", "dd"} {
		if err := os.RemoveAll(filepath.Join(upper, p)); err != nil {
			t.Fatal(err)
		}
	}
	write("d2", "now a file")
	write("f2/x", "now a directory")
	if err := os.Symlink("keep", filepath.Join(upper, "s")); err != nil {
		t.Fatal(err)
	}
	st, err = capture(context.Background(), rootOf(t, upper), pre, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st.Reused != 1 || st.Copied != 7 {
		t.Errorf("reused %d and read %d files, want 1 (d/keep2) and 7", st.Reused, st.Copied)
	}
	got := diffOf(st)
	if !bytes.Equal(want(), got) {
		t.Error("the upper read from a pre-copy brought up to date differs from the upper read in place")
	}
	// The pre-copy's data of a file changed after it must not reach the
	// diff: the same size and mtime, only the ctime moved.
	tr := tar.NewReader(bytes.NewReader(got))
	found := false
	for {
		hdr, err := tr.Next()
		if err != nil {
			break
		}
		if hdr.Name == "inplace" {
			b, _ := io.ReadAll(tr)
			if string(b) != "AFTER! inplace" {
				t.Errorf("inplace in the diff holds %q, the pre-copy's stale data; want the file's data when captured", b)
			}
			found = true
		}
	}
	if !found {
		t.Error("inplace is missing from the diff")
	}

	// A file mapped shared and writable is never reused.
	f, err := os.OpenFile(filepath.Join(upper, "d/keep2"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	dirty, err := mappedShared([]int{os.Getpid()})
	if err != nil {
		t.Fatal(err)
	}
	var sys unix.Stat_t
	if err := unix.Stat(filepath.Join(upper, "d/keep2"), &sys); err != nil {
		t.Fatal(err)
	}
	if !dirty.inodes[inode{sys.Dev, sys.Ino}] {
		t.Fatalf("mappedShared misses a shared writable mapping of d/keep2 (%d inodes)", len(dirty.inodes))
	}
	pre, err = precopy(context.Background(), rootOf(t, upper), 0)
	if err != nil {
		t.Fatal(err)
	}
	pre.start = pre.start.Add(2 * precopySlack)
	if st, err = capture(context.Background(), rootOf(t, upper), pre, dirty, 0); err != nil {
		t.Fatal(err)
	}
	if st.Reused != 6 {
		t.Errorf("reused %d files, want 6 (all single-name files but the mapped d/keep2)", st.Reused)
	}
	// A write through the mapping after the pre-copy moves neither mtime
	// nor ctime once the page is dirty: the diff must still hold it.
	copy(m, "MAPPED")
	if st, err = capture(context.Background(), rootOf(t, upper), pre, dirty, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(want(), diffOf(st)) {
		t.Error("a file written through a shared mapping after the pre-copy was captured stale")
	}
}

// diffTar is the tar writeDiff makes of entries.
func diffTar(t *testing.T, entries []*upperEntry) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	if _, err := writeDiff(context.Background(), tw, entries, 0); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// TestMappedParse: shared writable file mappings are found by inode and,
// since overlayfs shows its own inode numbers there, by the path the
// container's process sees.
func TestMappedParse(t *testing.T) {
	maps := `00400000-00401000 r--p 00000000 fe:00 9988685                            /bin/busybox
7fdf1ea18000-7fdf1ea19000 rw-s 00000000 00:31 10609424                   /srv/db
7fdf1ea19000-7fdf1ea1a000 rw-s 00001000 00:31 10609425                   /srv/my file (deleted)
7fdf1ea1a000-7fdf1ea1b000 rw-p 00000000 00:31 10609426                   /srv/private
7fdf1ea1b000-7fdf1ea1c000 rw-s 00000000 00:01 2048                       /SYSV00000000 (deleted)
7ffd5c1e0000-7ffd5c201000 rw-p 00000000 00:00 0                          [stack]
`
	m := &mapped{inodes: map[inode]bool{}, paths: map[string]bool{}}
	if err := m.parse(strings.NewReader(maps)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		rel  string
		key  inode
		want bool
	}{
		{"srv/db", inode{}, true},
		{"other", inode{unix.Mkdev(0, 0x31), 10609424}, true},
		{"srv/my file", inode{}, true},
		{"srv/private", inode{unix.Mkdev(0, 0x31), 10609426}, false},
		{"bin/busybox", inode{unix.Mkdev(0xfe, 0), 9988685}, false},
	} {
		if got := m.has(c.rel, c.key); got != c.want {
			t.Errorf("has(%q, %v) = %v, want %v", c.rel, c.key, got, c.want)
		}
	}
	var none *mapped
	if none.has("srv/db", inode{}) {
		t.Error("a nil set has entries")
	}
}

func TestDecide(t *testing.T) {
	for _, tc := range []struct {
		parent, max int
		want        Layout
	}{
		{0, 8, Layout{Keep: 0}},
		{7, 8, Layout{Keep: 7}},
		{8, 8, Layout{Keep: 8, Squash: 8, Background: true}},
		{9, 8, Layout{Squash: 9}},
		{12, 8, Layout{Squash: 12}},
		{2, 2, Layout{Keep: 2, Squash: 2, Background: true}},
		{1, 2, Layout{Keep: 1}},
		{0, 1, Layout{Keep: 0}},
		{1, 1, Layout{Keep: 1, Squash: 1, Background: true}},
		{2, 1, Layout{Squash: 2}},
		{3, 0, Layout{Keep: 3}}, // default depth
	} {
		if got := Decide(tc.parent, tc.max); got != tc.want {
			t.Errorf("Decide(%d, %d) = %+v, want %+v", tc.parent, tc.max, got, tc.want)
		}
	}
}

// TestUpperTarRefusesLowerState: an upper made with overlayfs'
// redirect_dir or metacopy keeps directory contents or file data in the
// lower layers; a diff of the upper alone would silently lose them.
func TestUpperTarRefusesLowerState(t *testing.T) {
	requireRoot(t)
	for _, attr := range []string{"trusted.overlay.redirect", "trusted.overlay.metacopy"} {
		upper := t.TempDir()
		p := filepath.Join(upper, "moved")
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Lsetxattr(p, attr, []byte("/old"), 0); err != nil {
			prereq.Missing(t, "set %s: %v", attr, err)
		}
		_, err := WriteUpperTar(context.Background(), io.Discard, upper, 0)
		if err == nil || !strings.Contains(err.Error(), "redirect_dir or metacopy") {
			t.Errorf("%s: err %v, want a refusal", attr, err)
		}
		if _, err := capture(context.Background(), rootOf(t, upper), nil, nil, 0); err == nil || !strings.Contains(err.Error(), "redirect_dir or metacopy") {
			t.Errorf("%s, read into memory: err %v, want a refusal", attr, err)
		}
	}
}

// TestReadContentShrunk: a file truncated between its stat and its read
// is reported as such (the pre-copy then leaves it to the frozen pass),
// never padded or cut to fit.
func TestReadContentShrunk(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, bytes.Repeat([]byte("x"), 10000), 0o644); err != nil {
		t.Fatal(err)
	}
	x, err := rootOf(t, dir).Open("f")
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	f, err := x.OpenFile()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if c, err := readContent(context.Background(), f); err != nil || c.bytes() != 10000 {
		t.Fatalf("read %v, err %v; want 10000 bytes", c, err)
	}
	if err := os.Truncate(p, 100); err != nil {
		t.Fatal(err)
	}
	if _, err := readContent(context.Background(), f); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("file shrunk since its stat: err %v, want io.ErrUnexpectedEOF", err)
	}
}

// rootOf opens dir as the root of a confined walk, for the test's life.
func rootOf(t *testing.T, dir string) *beneath.Dir {
	t.Helper()
	root, err := beneath.OpenRoot(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	return root
}

// TestSpeculation: the layer encoded from a pre-copy while it is read is
// kept only when the frozen read gives the same diff: never after a file
// changed since its pre-copy (same size and mtime, only ctime moved), a
// file was added, or a directory's xattrs changed.
func TestSpeculation(t *testing.T) {
	requireRoot(t)
	upper := t.TempDir()
	write := func(name, data string) { t.Helper(); writeUpperFile(t, upper, name, data) }
	write("a/one", "one")
	write("a/two", strings.Repeat("two", 1000))
	write("b/three", "three")
	if err := os.Link(filepath.Join(upper, "a/one"), filepath.Join(upper, "b/one-link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../a/two", filepath.Join(upper, "b/sym")); err != nil {
		t.Fatal(err)
	}
	layer := func(entries []*upperEntry) *blob {
		t.Helper()
		b, _, err := encodeDiff(context.Background(), "", io.Discard, entries, 0)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	// round pre-copies (as if long after the files were written), lets
	// change run, reads frozen, and reports whether the speculation held;
	// the layer it would push must then be the frozen read's.
	round := func(change func()) bool {
		t.Helper()
		s, err := startPrecopy(context.Background(), rootOf(t, upper), 0)
		if err != nil {
			t.Fatal(err)
		}
		pre, err := s.wait()
		if err != nil {
			t.Fatal(err)
		}
		pre.start = pre.start.Add(2 * precopySlack)
		change()
		frozen, err := capture(context.Background(), rootOf(t, upper), pre, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		held := s.holds(frozen)
		spec, want := layer(s.entries), layer(frozen.entries)
		if held && spec.desc.Digest != want.desc.Digest {
			t.Fatalf("speculation held, but its layer %s is not the frozen read's %s", spec.desc.Digest, want.desc.Digest)
		}
		if !held && spec.desc.Digest == want.desc.Digest {
			t.Errorf("speculation refused though its layer is the frozen read's")
		}
		return held
	}
	if !round(func() {}) {
		t.Error("nothing changed, hard link and symlink included: the speculation did not hold")
	}
	p := filepath.Join(upper, "a/two")
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if round(func() {
		if err := os.WriteFile(p, []byte(strings.Repeat("TWO", 1000)), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, fi.ModTime(), fi.ModTime()); err != nil {
			t.Fatal(err)
		}
	}) {
		t.Error("a file overwritten after its pre-copy (same size and mtime): the speculation held, with the stale data")
	}
	if round(func() { write("b/new", "new") }) {
		t.Error("a file added after the pre-copy: the speculation held")
	}
	if round(func() {
		if err := unix.Lsetxattr(filepath.Join(upper, "a"), "user.k", []byte("v"), 0); err != nil {
			t.Fatal(err)
		}
	}) {
		t.Error("a directory's xattr set after the pre-copy: the speculation held")
	}
}

// writeUpperFile writes data to name under upper, making its parents.
func writeUpperFile(t *testing.T, upper, name, data string) {
	t.Helper()
	p := filepath.Join(upper, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// swapLoop exchanges the names a and b (renameat2 RENAME_EXCHANGE) as fast
// as it can until the test ends, as a hostile container does to its own
// writable layer while it is snapshotted.
func swapLoop(t *testing.T, pairs ...[2]string) {
	t.Helper()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			for _, p := range pairs {
				select {
				case <-stop:
					return
				default:
				}
				if err := unix.Renameat2(unix.AT_FDCWD, p[0], unix.AT_FDCWD, p[1], unix.RENAME_EXCHANGE); err != nil {
					t.Errorf("exchange %s and %s: %v", p[0], p[1], err)
					return
				}
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}

// TestCaptureSwapRace: while directories holding secret.txt are swapped
// with symlinks to a host directory holding its own secret.txt, neither
// the pre-copy nor the frozen pass over it ever reads a byte of the
// host's file; while regular files are swapped with FIFOs and sockets,
// both finish.
func TestCaptureSwapRace(t *testing.T) {
	base := t.TempDir()
	upper, host := filepath.Join(base, "upper"), filepath.Join(base, "host")
	const hostSecret = "HOST-SECRET-BYTES"
	if err := os.MkdirAll(host, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(host, "secret.txt"), []byte(hostSecret), 0o644); err != nil {
		t.Fatal(err)
	}
	var pairs [][2]string
	for i := range 8 {
		d, l := filepath.Join(upper, fmt.Sprintf("d%d", i)), filepath.Join(upper, fmt.Sprintf("l%d", i))
		writeUpperFile(t, upper, fmt.Sprintf("d%d/secret.txt", i), "inside")
		if err := os.Symlink(host, l); err != nil {
			t.Fatal(err)
		}
		pairs = append(pairs, [2]string{d, l})
		f, p := filepath.Join(upper, fmt.Sprintf("f%d", i)), filepath.Join(upper, fmt.Sprintf("p%d", i))
		writeUpperFile(t, upper, fmt.Sprintf("f%d", i), "regular")
		if i%2 == 0 {
			if err := unix.Mkfifo(p, 0o644); err != nil {
				t.Fatal(err)
			}
		} else {
			s, err := net.Listen("unix", p)
			if err != nil {
				t.Fatal(err)
			}
			// Closing unlinks it: only once the swaps have stopped.
			t.Cleanup(func() { s.Close() })
		}
		pairs = append(pairs, [2]string{f, p})
	}
	swapLoop(t, pairs...)
	check := func(what string, entries []*upperEntry) {
		t.Helper()
		for _, e := range entries {
			if e.data != nil && strings.Contains(string(e.data.flat()), hostSecret) {
				t.Fatalf("%s: %s holds the host's secret.txt", what, e.rel)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	done := make(chan struct{})
	changed := 0
	go func() {
		defer close(done)
		for range 200 {
			root := rootOf(t, upper)
			s, err := startPrecopy(ctx, root, 0)
			if err != nil {
				t.Errorf("pre-copy: %v", err)
				return
			}
			pre, err := s.wait()
			if err != nil {
				t.Errorf("pre-copy: %v", err)
				return
			}
			check("pre-copy", s.entries)
			pre.start = pre.start.Add(2 * precopySlack) // reuse whatever looks unchanged
			// Not frozen: the swaps go on during this pass too.
			tree, err := capture(ctx, root, pre, nil, 0)
			if errors.Is(err, beneath.ErrChanged) {
				// A name that kept changing type: what a frozen
				// container cannot do.
				changed++
				continue
			}
			if err != nil {
				t.Errorf("capture: %v", err)
				return
			}
			check("capture", tree.entries)
		}
	}()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("200 pre-copies and captures did not finish in 2 minutes: blocked")
	}
	if changed > 100 {
		t.Errorf("%d of 200 captures refused a name that changed type: the retries do not work", changed)
	}
}
