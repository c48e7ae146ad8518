package lazyfs

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// dirent is one raw entry of getdents64.
type dirent struct {
	name string
	ino  uint64
	off  int64
	typ  uint8
}

// rawDirents lists dir with getdents64 itself: the standard library's
// readers drop "." and "..", which this test is about.
func rawDirents(t *testing.T, dir string) map[string]dirent {
	t.Helper()
	out := map[string]dirent{}
	for _, e := range rawListing(t, dir, 0) {
		out[e.name] = e
	}
	return out
}

// rawListing lists dir in order with getdents64, from cookie off on.
func rawListing(t *testing.T, dir string, off int64) []dirent {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open %s: %v", dir, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Seek(fd, off, 0); err != nil {
		t.Fatalf("seek %s to %d: %v", dir, off, err)
	}
	var out []dirent
	buf := make([]byte, 4096)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			t.Fatalf("getdents %s: %v", dir, err)
		}
		if n == 0 {
			return out
		}
		for b := buf[:n]; len(b) > 0; {
			// struct linux_dirent64: ino u64, off s64, reclen u16, type u8, name.
			reclen := binary.NativeEndian.Uint16(b[16:18])
			name := b[19:reclen]
			for i, c := range name {
				if c == 0 {
					name = name[:i]
					break
				}
			}
			out = append(out, dirent{name: string(name), ino: binary.NativeEndian.Uint64(b[0:8]),
				off: int64(binary.NativeEndian.Uint64(b[8:16])), typ: b[18]})
			b = b[reclen:]
		}
	}
}

// TestDotEntries: every directory of a layer lists "." and "..", as
// directories with the inode numbers stat gives them, on the mount
// itself and through overlayfs for a directory only the layer has (which
// overlayfs lists by passing the layer's own listing through).
func TestDotEntries(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, _, _ := f.mount(t)

	base := t.TempDir()
	if err := os.MkdirAll(filepath.Join(base, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	merged := t.TempDir()
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_RDONLY, "lowerdir="+mnt+":"+base); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(merged, unix.MNT_DETACH) })

	inoOf := func(p string) uint64 {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	for _, tc := range []struct{ root, dir string }{
		{mnt, "."}, {mnt, "bin"}, {mnt, "usr"}, {mnt, "opq"}, {mnt, "redo"}, {mnt, "data"},
		// Only in the lazy layer: overlayfs passes its listing through.
		{merged, "bin"}, {merged, "data"},
		// Merged with the plain lower: overlayfs's own listing.
		{merged, "etc"},
	} {
		dir := filepath.Join(tc.root, tc.dir)
		got := rawDirents(t, dir)
		for _, name := range []string{".", ".."} {
			e, ok := got[name]
			if !ok {
				t.Errorf("%s lists no %q (entries: %d)", dir, name, len(got))
				continue
			}
			if e.typ != unix.DT_DIR {
				t.Errorf("%s: %q has type %d, want DT_DIR", dir, name, e.typ)
			}
		}
		// Through overlayfs the inode numbers are overlayfs's to choose;
		// on the mount they are the layer's.
		if tc.root == mnt {
			if e := got["."]; e.ino != inoOf(dir) {
				t.Errorf("%s: \".\" has inode %d, stat says %d", dir, e.ino, inoOf(dir))
			}
			if tc.dir != "." {
				if e := got[".."]; e.ino != inoOf(filepath.Dir(dir)) {
					t.Errorf("%s: \"..\" has inode %d, stat of the parent says %d", dir, e.ino, inoOf(filepath.Dir(dir)))
				}
			}
		}
	}
}

// TestDirOffsets: a listing resumed from the cookie of any entry (on a
// fresh open, as after a takeover) goes on with exactly the entries after
// it, and the children keep the cookies they had before "." and ".." were
// listed (their 1-based position among the children), so a server of
// this version resumes the listings an older one handed over.
func TestDirOffsets(t *testing.T) {
	for n := range 5 {
		seen := map[uint64]bool{0: true}
		for i := range n + 2 {
			off := dirOffset(i, n)
			if seen[off] {
				t.Errorf("n=%d: cookie %d of entry %d is not unique", n, off, i)
			}
			seen[off] = true
			if got := dirPosition(off, n); got != i+1 {
				t.Errorf("n=%d: cookie %d of entry %d resumes at %d, want %d", n, off, i, got, i+1)
			}
		}
		for k := 1; k <= n; k++ {
			if got := dirPosition(uint64(k), n); got != k+2 {
				t.Errorf("n=%d: an older server's cookie %d resumes at entry %d, want %d (after child %d)", n, k, got, k+2, k)
			}
		}
	}

	requireFUSE(t)
	f := newFixture(t)
	mnt, _, _ := f.mount(t)
	dir := filepath.Join(mnt, "bin")
	all := rawListing(t, dir, 0)
	if len(all) != 8 || all[0].name != "." || all[1].name != ".." {
		t.Fatalf("bin lists %v, want . .. and six names", all)
	}
	for i, e := range all {
		rest := rawListing(t, dir, e.off)
		if len(rest) != len(all)-i-1 {
			t.Errorf("resumed after %q (cookie %d): %d entries, want %d", e.name, e.off, len(rest), len(all)-i-1)
			continue
		}
		for j := range rest {
			if rest[j].name != all[i+1+j].name {
				t.Errorf("resumed after %q: entry %d is %q, want %q", e.name, j, rest[j].name, all[i+1+j].name)
			}
		}
	}
}
