//go:build linux

package beneath

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// tree is a directory to read beneath, and a host directory next to it
// that nothing read beneath the first may ever reach.
type tree struct {
	root, host string
}

// hostMarker is what the host directory's file holds.
const hostMarker = "HOST SECRET\n"

func newTree(t testing.TB) *tree {
	t.Helper()
	base := t.TempDir()
	tr := &tree{root: filepath.Join(base, "root"), host: filepath.Join(base, "host")}
	for _, d := range []string{tr.root, tr.host, tr.root + "/a/b", tr.root + "/d"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		tr.host + "/secret.txt":   hostMarker,
		tr.root + "/a/f":          "inside f\n",
		tr.root + "/a/b/g":        "inside g\n",
		tr.root + "/d/secret.txt": "inside secret\n",
	}
	for p, data := range files {
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	links := map[string]string{
		"a/up":   "..",
		"a/abs":  "/etc",
		"a/host": tr.host,
		"l":      tr.host,
		"a/b/in": "../f",
		"loop":   "loop",
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(tr.root, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mkfifo(filepath.Join(tr.root, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	return tr
}

func (tr *tree) open(t testing.TB) *Dir {
	t.Helper()
	d, err := OpenRoot(tr.root)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// walked is one entry as a walk saw it.
type walked struct {
	mode     fs.FileMode
	ino      uint64
	link     string
	contents string
}

// walkAll reads every entry beneath root as a snapshot would.
func walkAll(t *testing.T, root *Dir) map[string]walked {
	t.Helper()
	got := map[string]walked{}
	err := Walk(context.Background(), root, func(d *Dir, name string) (*Dir, error) {
		st, err := d.Lstat(name)
		if err != nil {
			return nil, err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			sub, err := d.OpenDir(name)
			if err != nil {
				return nil, err
			}
			got[sub.Rel()] = walked{mode: sub.Info().Mode(), ino: sub.Stat().Ino}
			return sub, nil
		}
		x, err := d.Open(name)
		if err != nil {
			return nil, err
		}
		defer x.Close()
		w := walked{mode: x.Info().Mode(), ino: x.Stat().Ino}
		switch {
		case w.mode&fs.ModeSymlink != 0:
			if w.link, err = x.Readlink(); err != nil {
				return nil, err
			}
		case w.mode.IsRegular():
			f, err := x.OpenFile()
			if err != nil {
				return nil, err
			}
			b, err := io.ReadAll(io.NewSectionReader(f, 0, x.Stat().Size))
			f.Close()
			if err != nil {
				return nil, err
			}
			w.contents = string(b)
		default:
			if _, err := x.OpenFile(); !errors.Is(err, ErrNotRegular) {
				t.Errorf("%s (%s): OpenFile err %v, want ErrNotRegular", x.Rel(), w.mode, err)
			}
		}
		got[x.Rel()] = w
		return nil, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestWalkIsLstat: a walk beneath the root sees exactly what lstat sees
// by path, symlinks as symlinks (never followed, wherever they point),
// and reads only regular files.
func TestWalkIsLstat(t *testing.T) {
	tr := newTree(t)
	sock, err := net.Listen("unix", filepath.Join(tr.root, "a/sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer sock.Close()
	got := walkAll(t, tr.open(t))
	want := map[string]walked{}
	err = filepath.WalkDir(tr.root, func(p string, de fs.DirEntry, err error) error {
		if err != nil || p == tr.root {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(tr.root, p)
		w := walked{mode: fi.Mode(), ino: fi.Sys().(*syscall.Stat_t).Ino}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			w.link, err = os.Readlink(p)
		case fi.Mode().IsRegular():
			var b []byte
			b, err = os.ReadFile(p)
			w.contents = string(b)
		}
		want[rel] = w
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for n := range want {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if got[n] != want[n] {
			t.Errorf("%s: walk saw %+v, lstat %+v", n, got[n], want[n])
		}
	}
	if len(got) != len(want) {
		t.Errorf("walk saw %d entries, lstat %d", len(got), len(want))
	}
	for n, w := range got {
		if strings.Contains(w.contents, hostMarker) {
			t.Errorf("%s: read the host's file", n)
		}
	}
}

// TestNoWayOut: names and paths that lead out of the tree, through a
// symlink, "..", an absolute path or a mount, are refused.
func TestNoWayOut(t *testing.T) {
	tr := newTree(t)
	root := tr.open(t)
	for _, rel := range []string{"l/secret.txt", "a/host/secret.txt", "a/up/l/secret.txt", "a/abs/passwd", "../host/secret.txt", "a/../../host/secret.txt", "/etc/passwd", "loop/x", "a/b/in/x"} {
		if x, err := root.Lookup(rel); err == nil {
			x.Close()
			t.Errorf("Lookup(%q) succeeded", rel)
		}
	}
	for _, name := range []string{"", ".", "..", "a/f", "l/secret.txt", "x\x00y"} {
		if x, err := root.Open(name); err == nil {
			x.Close()
			t.Errorf("Open(%q) succeeded", name)
		}
		if _, err := root.Lstat(name); err == nil {
			t.Errorf("Lstat(%q) succeeded", name)
		}
	}
	x, err := root.Open("l")
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	if x.Info().Mode()&fs.ModeSymlink == 0 {
		t.Errorf("l opened as %s, want the symlink", x.Info().Mode())
	}
	if _, err := root.OpenDir("l"); !errors.Is(err, unix.ENOTDIR) && !errors.Is(err, unix.ELOOP) {
		t.Errorf("OpenDir of a symlink: %v, want ENOTDIR or ELOOP", err)
	}
	if _, err := root.OpenDir("fifo"); !errors.Is(err, unix.ENOTDIR) {
		t.Errorf("OpenDir of a FIFO: %v, want ENOTDIR", err)
	}
	if _, err := x.OpenFile(); !errors.Is(err, ErrNotRegular) {
		t.Errorf("OpenFile of a symlink: %v, want ErrNotRegular", err)
	}
	// What is inside stays reachable.
	for _, rel := range []string{"a/b/g", "a/../a/f", "a/b/../../d/secret.txt"} {
		x, err := root.Lookup(rel)
		if err != nil {
			t.Errorf("Lookup(%q): %v", rel, err)
			continue
		}
		x.Close()
	}

	// A mount inside the tree (even a bind mount of the tree's own file
	// system) is not crossed.
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root: bind mount")
	}
	mnt := filepath.Join(tr.root, "a/b")
	if err := unix.Mount(tr.host, mnt, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
	})
	ad, err := root.OpenDir("a")
	if err != nil {
		t.Fatal(err)
	}
	defer ad.Close()
	if x, err := ad.Open("b"); !errors.Is(err, unix.EXDEV) {
		if err == nil {
			x.Close()
		}
		t.Errorf("Open of a bind mount point: %v, want EXDEV", err)
	}
	if sub, err := ad.OpenDir("b"); !errors.Is(err, unix.EXDEV) {
		if err == nil {
			sub.Close()
		}
		t.Errorf("OpenDir of a bind mount point: %v, want EXDEV", err)
	}
	if _, err := ad.Lstat("b"); !errors.Is(err, unix.EXDEV) {
		t.Errorf("Lstat of a bind mount point: %v, want EXDEV", err)
	}
	if x, err := root.Lookup("a/b/secret.txt"); err == nil {
		x.Close()
		t.Error("Lookup through a bind mount point succeeded")
	}
}

// TestOnlyRegularFilesOpened: a FIFO (which a blocking open would wait on
// forever) and a device node are described from their descriptor, never
// opened for reading.
func TestOnlyRegularFilesOpened(t *testing.T) {
	tr := newTree(t)
	names := []string{"fifo"}
	if os.Geteuid() == 0 {
		// /dev/null's numbers: opening it would do no harm, but nothing
		// may open it.
		if err := unix.Mknod(filepath.Join(tr.root, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
			t.Fatal(err)
		}
		if err := unix.Lsetxattr(filepath.Join(tr.root, "l"), "trusted.k", []byte("on the symlink"), 0); err != nil {
			t.Fatal(err)
		}
		names = append(names, "null")
	}
	root := tr.open(t)
	for _, name := range names {
		x, err := root.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.OpenFile(); !errors.Is(err, ErrNotRegular) {
			t.Errorf("OpenFile(%s): %v, want ErrNotRegular", name, err)
		}
		if _, err := x.ListXattrs(); err != nil {
			t.Errorf("xattrs of %s: %v", name, err)
		}
		x.Close()
	}
	if os.Geteuid() == 0 {
		// The symlink's own xattr, not its target's.
		x, err := root.Open("l")
		if err != nil {
			t.Fatal(err)
		}
		defer x.Close()
		if v, err := x.GetXattr("trusted.k"); err != nil || string(v) != "on the symlink" {
			t.Errorf("xattr of the symlink: %q, %v", v, err)
		}
	}
}

// TestSameDirs: two walks agree on a file's directories only if every
// directory on the way is the same inode under the same name.
func TestSameDirs(t *testing.T) {
	tr := newTree(t)
	dirs := func() map[string]*Dir {
		out := map[string]*Dir{}
		if err := Walk(context.Background(), tr.open(t), func(d *Dir, name string) (*Dir, error) {
			out[d.Rel()] = d
			if st, err := d.Lstat(name); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
				return nil, err
			}
			return d.OpenDir(name)
		}); err != nil {
			t.Fatal(err)
		}
		return out
	}
	first := dirs()
	if again := dirs(); !SameDirs(first["a/b"], again["a/b"]) || !SameDirs(first[""], again[""]) {
		t.Error("the same directories in two walks are not the same")
	}
	// a replaced by another directory of the same name: a/b is no longer
	// reached through the same a.
	if err := os.Rename(filepath.Join(tr.root, "a"), filepath.Join(tr.root, "old-a")); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(tr.root, "a/b"), 0o755); err != nil {
		t.Fatal(err)
	}
	again := dirs()
	if SameDirs(first["a/b"], again["a/b"]) {
		t.Error("a/b under a new a is the same as under the old one")
	}
	if !SameDirs(first["d"], again["d"]) {
		t.Error("d did not change, yet differs")
	}
	// b moved to where it was, under the new a: same inode for b, not
	// for a.
	os.Remove(filepath.Join(tr.root, "a/b"))
	if err := os.Rename(filepath.Join(tr.root, "old-a/b"), filepath.Join(tr.root, "a/b")); err != nil {
		t.Fatal(err)
	}
	if again := dirs(); SameDirs(first["a/b"], again["a/b"]) {
		t.Error("the same b under another a counts as the same path")
	}
}

// lexical resolves rel beneath root as openat2 with RESOLVE_BENEATH |
// RESOLVE_NO_SYMLINKS must, with lstat by path on a tree nothing
// changes: the inode reached, or false where it must fail.
func lexical(root, rel string) (uint64, bool) {
	if rel == "" || strings.HasPrefix(rel, "/") || strings.Contains(rel, "\x00") {
		return 0, false
	}
	var stack []string
	parts := strings.Split(rel, "/")
	// A trailing slash asks for a directory (and follows a final
	// symlink, which is then refused).
	mustDir := strings.HasSuffix(rel, "/")
	last := len(parts) - 1
	for last >= 0 && (parts[last] == "" || parts[last] == ".") {
		if parts[last] == "." {
			mustDir = true
		}
		last--
	}
	for i, p := range parts {
		switch p {
		case "", ".":
			continue
		case "..":
			if len(stack) == 0 {
				return 0, false
			}
			stack = stack[:len(stack)-1]
			continue
		}
		if len(p) > 255 {
			return 0, false
		}
		fi, err := os.Lstat(filepath.Join(append([]string{root}, append(stack, p)...)...))
		if err != nil {
			return 0, false
		}
		final := i >= last
		if fi.Mode()&fs.ModeSymlink != 0 && (!final || mustDir) {
			return 0, false
		}
		if !fi.IsDir() && !final {
			return 0, false
		}
		stack = append(stack, p)
	}
	fi, err := os.Lstat(filepath.Join(append([]string{root}, stack...)...))
	if err != nil || mustDir && !fi.IsDir() {
		return 0, false
	}
	return fi.Sys().(*syscall.Stat_t).Ino, true
}

// FuzzLookup: whatever path is asked for, Lookup reaches exactly the entry
// a resolution that follows no symlink and never climbs above the root
// reaches, or fails where that fails; never anything outside the tree.
func FuzzLookup(f *testing.F) {
	for _, s := range []string{"a/f", "a/b/g", "l", "l/secret.txt", "a/up/l", "a/up/a/f", "..", "a/../..", "a/b/../../d/secret.txt",
		"/etc/passwd", "a/abs/passwd", "a/host/secret.txt", "d/secret.txt/", "a/b/in", "a/b/in/", "loop", "fifo", "a//b/./g", "d/.", "./a", ""} {
		f.Add(s)
	}
	tr := newTree(f)
	inside := map[uint64]bool{}
	if err := filepath.WalkDir(tr.root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := os.Lstat(p)
		if err == nil {
			inside[fi.Sys().(*syscall.Stat_t).Ino] = true
		}
		return err
	}); err != nil {
		f.Fatal(err)
	}
	root := tr.open(f)
	f.Fuzz(func(t *testing.T, rel string) {
		want, ok := lexical(tr.root, rel)
		x, err := root.Lookup(rel)
		if err != nil {
			if ok && !errors.Is(err, unix.ENAMETOOLONG) {
				t.Fatalf("Lookup(%q): %v; want inode %d", rel, err, want)
			}
			return
		}
		defer x.Close()
		got := x.Stat().Ino
		if !inside[got] {
			t.Fatalf("Lookup(%q) reached inode %d, outside the tree", rel, got)
		}
		if !ok || got != want {
			t.Fatalf("Lookup(%q) reached inode %d; want %d (ok %v)", rel, got, want, ok)
		}
		if x.Info().Mode().IsRegular() {
			f, err := x.OpenFile()
			if err != nil {
				t.Fatal(err)
			}
			f.Close()
		}
	})
}
