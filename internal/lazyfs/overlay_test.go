package lazyfs

import (
	"archive/tar"
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// TestOverlayLowerLayer stacks the FUSE mount over a plain lower directory
// in overlayfs, as the snapshotter does, and checks the OCI whiteouts and
// opaque directories take effect and writes land in the upper directory.
func TestOverlayLowerLayer(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt, _, srv := f.mount(t)

	// What an older layer below ours contains.
	base := t.TempDir()
	for p, data := range map[string]string{
		"gone":        "lower",
		"usr/removed": "lower",
		"usr/base":    "lower",
		"opq/old":     "lower",
		"redo/old":    "lower",
		"shadow":      "old",
		"etc/group":   "lower",
	} {
		if err := os.MkdirAll(filepath.Join(base, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(base, p), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	upper, work, merged := t.TempDir(), t.TempDir(), t.TempDir()
	opts := "lowerdir=" + mnt + ":" + base + ",upperdir=" + upper + ",workdir=" + work
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay %s: %v", opts, err)
	}
	// Registered after the FUSE mount's cleanup, so it runs first.
	t.Cleanup(func() { _ = unix.Unmount(merged, unix.MNT_DETACH) })

	for _, p := range []string{"gone", "usr/removed", "opq/old", "redo/old"} {
		if _, err := os.Lstat(filepath.Join(merged, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: %v, want hidden by the layer's whiteout/opaque dir", p, err)
		}
	}
	for p, want := range map[string]string{
		"usr/base":   "lower", // plain dirs merge
		"usr/kept":   "kept",
		"opq/keep":   "keep",
		"redo/fresh": "fresh",
		"shadow":     "new",
		"etc/group":  "lower",
		"etc/passwd": "root:x:0:0::/root:/bin/sh\n",
		"bin/ls":     "#!busybox\n",
	} {
		if got, err := os.ReadFile(filepath.Join(merged, p)); err != nil || string(got) != want {
			t.Errorf("%s = %q, %v; want %q", p, got, err, want)
		}
	}
	for _, d := range []string{".", "opq", "usr"} {
		ents, err := os.ReadDir(filepath.Join(merged, d))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".wh.") || e.Name() == "gone" || e.Name() == "removed" || e.Name() == "old" {
				t.Errorf("readdir %s shows %s", d, e.Name())
			}
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(merged, "bin/su"), &st); err != nil || st.Mode&unix.S_ISUID == 0 {
		t.Errorf("bin/su through overlay: mode %o, %v; want setuid", st.Mode, err)
	}
	if got := xattrs(t, filepath.Join(merged, "bin/su"))["security.capability"]; got != capability {
		t.Errorf("security.capability through overlay = %q", got)
	}

	// Writes go to the upper dir; the layer is untouched.
	if err := os.WriteFile(filepath.Join(merged, "newfile"), []byte("n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(merged, "etc/passwd"), []byte("changed"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(merged, "bin/busybox")); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(upper, "etc/passwd")); string(got) != "changed" {
		t.Errorf("upper etc/passwd = %q", got)
	}
	if _, err := os.Stat(filepath.Join(upper, "newfile")); err != nil {
		t.Errorf("upper newfile: %v", err)
	}
	if err := unix.Lstat(filepath.Join(upper, "bin/busybox"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("upper bin/busybox is not a whiteout: mode %o rdev %d, %v", st.Mode, st.Rdev, err)
	}
	// The copied-up file kept the capability.
	if got := xattrs(t, filepath.Join(merged, "bin/su"))["security.capability"]; got != capability {
		t.Errorf("security.capability = %q", got)
	}
	if got, _ := os.ReadFile(filepath.Join(mnt, "etc/passwd")); string(got) != "root:x:0:0::/root:/bin/sh\n" {
		t.Errorf("layer etc/passwd changed: %q", got)
	}
	if _, err := os.Stat(filepath.Join(mnt, "bin/busybox")); err != nil {
		t.Errorf("layer bin/busybox: %v", err)
	}
	// Direct writes to the layer itself are refused.
	if err := os.WriteFile(filepath.Join(mnt, "etc/passwd"), []byte("x"), 0o644); errnoOf(err) != unix.EROFS {
		t.Errorf("write to the layer: %v, want EROFS", err)
	}

	// Unmount while the overlay uses the layer succeeds: overlayfs holds
	// private clones of its lower mounts. The overlay keeps working,
	// served by the same server, until it goes away; only then does Wait
	// return. (So a ChunkSource must outlive Wait, not Unmount.)
	if err := srv.Unmount(); err != nil {
		t.Fatalf("Unmount while overlay uses the layer: %v", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(mnt, &sfs); err != nil || sfs.Type == unix.FUSE_SUPER_MAGIC {
		t.Errorf("layer mountpoint still a FUSE mount after Unmount (%v)", err)
	}
	got, err := os.ReadFile(filepath.Join(merged, "data/big"))
	if err != nil || !bytes.Equal(got, bigData()) {
		t.Errorf("overlay read after the layer's Unmount: %v", err)
	}
	waited := make(chan struct{})
	go func() { srv.Wait(); close(waited) }()
	select {
	case <-waited:
		t.Error("Wait returned while the overlay still uses the connection")
	case <-time.After(200 * time.Millisecond):
	}
	if err := unix.Unmount(merged, 0); err != nil {
		t.Fatalf("unmount overlay: %v", err)
	}
	select {
	case <-waited:
	case <-time.After(10 * time.Second):
		// Possibly a copy in another mount namespace; see cleanupMount.
		t.Log("Wait did not return 10s after the overlay went away")
	}
}

// TestOverlaySetuidExec: the FUSE mount is nosuid, which must not matter
// to containers: overlayfs applies its own mount's flags when executing.
func TestOverlaySetuidExec(t *testing.T) {
	requireFUSE(t)
	id, err := exec.LookPath("id")
	if err != nil {
		prereq.Missing(t, "id(1): %v", err)
	}
	bin, err := os.ReadFile(id)
	if err != nil {
		t.Fatal(err)
	}
	blob, toc := convert(t, bytes.NewReader(buildTar(t, []tarFile{
		{hdr: hdr(tar.TypeReg, "suid-id", 0o4755), data: bin},
	})))
	mnt, _ := mountLayer(t, toc, newBlobSource(bytes.NewReader(blob)))
	merged := mountOverlay(t, mnt)

	run := func(p string) string {
		// Through a shell: this process serves the FUSE mount, and Go
		// starts children with vfork, which suspends the forking thread
		// (holding its P) until the child's execve returns; an execve
		// that needs this very process to answer FUSE requests can then
		// deadlock against a GC stop-the-world. The shell itself lives
		// on ext4.
		cmd := exec.Command("/bin/sh", "-c", `exec "$0" -u`, p)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("run %s as nobody: %v", p, err)
		}
		return strings.TrimSpace(string(out))
	}
	if got := run(filepath.Join(merged, "suid-id")); got != "0" {
		t.Errorf("setuid-root binary through overlay runs with euid %s, want 0", got)
	}
	// The same file straight from the FUSE mount does not get root: the
	// check above is about overlayfs, not a lax lower mount.
	if got := run(filepath.Join(mnt, "suid-id")); got != "65534" {
		t.Errorf("setuid binary on the nosuid FUSE mount runs with euid %s, want 65534", got)
	}
}

// mountOverlay mounts overlayfs with lower as its only lower layer and
// returns the merged directory, reachable by unprivileged users.
func mountOverlay(t *testing.T, lower string) string {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{dir, filepath.Dir(dir), filepath.Dir(lower), filepath.Dir(filepath.Dir(lower))} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	upper, work, merged := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "merged")
	for _, d := range []string{upper, work, merged} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	opts := "lowerdir=" + lower + ",upperdir=" + upper + ",workdir=" + work
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay %s: %v", opts, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(merged, 0); err != nil {
			t.Errorf("unmount overlay: %v", err)
			_ = unix.Unmount(merged, unix.MNT_DETACH)
		}
	})
	return merged
}

// TestOverlayLowerWithoutXattrs: a layer whose view shows no extended
// attribute answers the first xattr query of each kind with ENOSYS and
// the kernel answers the rest itself, while overlayfs over it looks up,
// reads and copies up its files as usual; a layer that shows one keeps
// answering.
func TestOverlayLowerWithoutXattrs(t *testing.T) {
	requireFUSE(t)
	files := []tarFile{{hdr: hdr(tar.TypeDir, "d", 0o755)}}
	for i := range 20 {
		files = append(files, tarFile{hdr: hdr(tar.TypeReg, "d/f"+strconv.Itoa(i), 0o644), data: []byte("content " + strconv.Itoa(i))})
	}
	blob, toc := convert(t, bytes.NewReader(buildTar(t, files)))
	mnt, srv := mountLayer(t, toc, newBlobSource(bytes.NewReader(blob)))
	merged := mountOverlay(t, mnt)
	for i := range 20 {
		p := filepath.Join(merged, "d", "f"+strconv.Itoa(i))
		if got, err := os.ReadFile(p); err != nil || string(got) != "content "+strconv.Itoa(i) {
			t.Fatalf("read %s: %q, %v", p, got, err)
		}
		// A metadata change copies the file up: overlayfs lists and
		// reads the lower's xattrs to copy them.
		if err := os.Chmod(p, 0o600); err != nil {
			t.Fatalf("chmod %s (copy-up): %v", p, err)
		}
		if _, err := unix.Lgetxattr(p, "security.capability", make([]byte, 64)); err != unix.ENODATA {
			t.Fatalf("getxattr %s: %v, want ENODATA", p, err)
		}
		if _, err := unix.Lgetxattr(filepath.Join(mnt, "d", "f"+strconv.Itoa(i)), "user.x", make([]byte, 64)); err != unix.EOPNOTSUPP {
			t.Fatalf("getxattr on the FUSE mount: %v, want EOPNOTSUPP", err)
		}
	}
	if got, err := os.ReadFile(filepath.Join(merged, "d", "f3")); err != nil || string(got) != "content 3" {
		t.Fatalf("read after copy-up: %q, %v", got, err)
	}
	st := srv.Stats()
	if n := st.Ops["getxattr"].Count + st.Ops["listxattr"].Count; n > 2 {
		t.Errorf("%d xattr requests reached the daemon, want at most one of each kind", n)
	}
	if e := st.Ops["getxattr"].Errors + st.Ops["listxattr"].Errors; e != 0 {
		t.Errorf("%d xattr requests counted as errors", e)
	}

	// With one xattr in the layer every query is answered.
	files = append(files, tarFile{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "x", Mode: 0o644, PAXRecords: map[string]string{"SCHILY.xattr.user.k": "v"}}, data: []byte("x")})
	blob, toc = convert(t, bytes.NewReader(buildTar(t, files)))
	mnt, srv = mountLayer(t, toc, newBlobSource(bytes.NewReader(blob)))
	for range 3 {
		if _, err := unix.Lgetxattr(filepath.Join(mnt, "d", "f1"), "user.k", make([]byte, 64)); err != unix.ENODATA {
			t.Fatalf("getxattr of a missing attribute: %v, want ENODATA", err)
		}
	}
	if n := srv.Stats().Ops["getxattr"].Count; n < 3 {
		t.Errorf("%d getxattr requests reached the daemon for 3 queries of a layer with xattrs", n)
	}
}

// TestFlushAndLseekOncePerMount: closes and SEEK_DATA/SEEK_HOLE queries,
// on the FUSE mount and by overlayfs' copy-ups, cost the daemon one
// request of each kind per mount; the kernel answers the rest, with the
// same offsets go-fuse gave.
func TestFlushAndLseekOncePerMount(t *testing.T) {
	requireFUSE(t)
	files := numberedFiles(20, 3000)
	blob, toc := convert(t, bytes.NewReader(buildTar(t, files)))
	mnt, srv := mountLayer(t, toc, newBlobSource(bytes.NewReader(blob)))
	for i := range 20 {
		f, err := os.Open(filepath.Join(mnt, "d", "f"+strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		size := int64(3000 + i)
		for _, q := range []struct {
			off    int64
			whence int
			want   int64
		}{{0, unix.SEEK_DATA, 0}, {100, unix.SEEK_DATA, 100}, {0, unix.SEEK_HOLE, size}, {size - 1, unix.SEEK_HOLE, size}} {
			if got, err := unix.Seek(int(f.Fd()), q.off, q.whence); err != nil || got != q.want {
				t.Fatalf("seek f%d to %d whence %d: %d, %v; want %d", i, q.off, q.whence, got, err, q.want)
			}
		}
		if _, err := unix.Seek(int(f.Fd()), size, unix.SEEK_DATA); err != unix.ENXIO {
			t.Fatalf("SEEK_DATA at the end of f%d: %v, want ENXIO", i, err)
		}
		if err := f.Close(); err != nil {
			t.Fatalf("close f%d: %v", i, err)
		}
	}
	copyUpAll(t, mountOverlay(t, mnt), files)
	st := srv.Stats()
	// At least one: the node answers them (go-fuse's own answers are
	// OK, which would bring every later one to the daemon).
	for _, op := range []string{"flush", "lseek"} {
		if n := st.Ops[op].Count; n != 1 {
			t.Errorf("%d %s requests reached the daemon, want 1", n, op)
		}
		if e := st.Ops[op].Errors; e != 0 {
			t.Errorf("%d %s requests counted as errors", e, op)
		}
	}
}

// TestOpenOncePerMountWithoutBacking: a mount that can hand no file a
// passthrough copy answers the first open with ENOSYS and the kernel opens
// the rest itself, keeping the page cache across opens as
// FOPEN_KEEP_CACHE did; reads, mmap and copy-ups through overlayfs work as
// before. (Mounts with backing answer every open: the passthrough tests.)
func TestOpenOncePerMountWithoutBacking(t *testing.T) {
	requireFUSE(t)
	files := numberedFiles(20, 5000)
	blob, toc := convert(t, bytes.NewReader(buildTar(t, files)))
	mnt, srv := mountLayer(t, toc, newBlobSource(bytes.NewReader(blob)))
	for round := range 2 {
		for i := range 20 {
			p := filepath.Join(mnt, "d", "f"+strconv.Itoa(i))
			if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, files[i+1].data) {
				t.Fatalf("round %d: read %s: %d bytes, %v", round, p, len(got), err)
			}
		}
	}
	f, err := os.Open(filepath.Join(mnt, "d", "f7"))
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, 5007, unix.PROT_READ, unix.MAP_SHARED)
	f.Close()
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	if !bytes.Equal(m, files[8].data) {
		t.Errorf("mmap of f7 differs from the layer's bytes")
	}
	unix.Munmap(m)
	copyUpAll(t, mountOverlay(t, mnt), files)
	st := srv.Stats()
	if n := st.Ops["open"].Count; n != 1 {
		t.Errorf("%d opens reached the daemon, want 1", n)
	}
	if e := st.Ops["open"].Errors; e != 0 {
		t.Errorf("%d opens counted as errors", e)
	}
	// One read per file: the second round, the mapping and the copy-ups
	// found the pages the first round left.
	if n := st.Ops["read"].Count; n > 20 {
		t.Errorf("%d reads reached the daemon for 20 files read 2 times, mapped and copied up; want at most 20", n)
	}
}

// numberedFiles is a layer of directory d holding n files d/f0... of
// size+i bytes of one letter each.
func numberedFiles(n, size int) []tarFile {
	files := []tarFile{{hdr: hdr(tar.TypeDir, "d", 0o755)}}
	for i := range n {
		files = append(files, tarFile{hdr: hdr(tar.TypeReg, "d/f"+strconv.Itoa(i), 0o644), data: bytes.Repeat([]byte{byte('a' + i)}, size+i)})
	}
	return files
}

// copyUpAll changes the mode of every file of numberedFiles through the
// overlay at merged, which copies it up, and reads it back.
func copyUpAll(t *testing.T, merged string, files []tarFile) {
	t.Helper()
	for i := range len(files) - 1 {
		p := filepath.Join(merged, "d", "f"+strconv.Itoa(i))
		if err := os.Chmod(p, 0o600); err != nil {
			t.Fatalf("chmod %s (copy-up): %v", p, err)
		}
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, files[i+1].data) {
			t.Fatalf("read %s after copy-up: %d bytes, %v", p, len(got), err)
		}
	}
}
