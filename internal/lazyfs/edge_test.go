package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/layerfmt"
)

// TestDevFD serves a FUSE connection that another party mounted and passed
// to us as an open /dev/fuse descriptor (the "/dev/fd/N" hand-over).
func TestDevFD(t *testing.T) {
	requireFUSE(t)
	f := newFixture(t)
	mnt := t.TempDir()

	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions,max_read=%d", fd, maxRequest)
	if err := unix.Mount("envsnap-devfd", mnt, "fuse.envsnap", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		unix.Close(fd)
		t.Fatalf("mount with fd: %v", err)
	}
	src := newBlobSource(bytes.NewReader(f.blob))
	srv, err := Mount(context.Background(), mnt, f.toc, src, WithDevFD(fd))
	if err != nil {
		_ = forceUnmount(mnt)
		unix.Close(fd)
		t.Fatalf("serve fd %d: %v", fd, err)
	}
	t.Cleanup(func() { cleanupMount(t, mnt, srv) })
	var dev unix.Stat_t
	if err := unix.Stat("/dev/fuse", &dev); err != nil || dev.Mode&unix.S_IFMT != unix.S_IFCHR {
		t.Fatalf("/dev/fuse is no longer the device (something was mounted over it?): %v", err)
	}

	got, err := os.ReadFile(filepath.Join(mnt, "data/big"))
	if err != nil || !bytes.Equal(got, bigData()) {
		t.Fatalf("read through hand-over fd: %v", err)
	}
	if err := srv.Unmount(); err != nil {
		t.Fatalf("unmount: %v", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(mnt, &sfs); err != nil || sfs.Type == unix.FUSE_SUPER_MAGIC {
		t.Errorf("still a FUSE mount after Unmount (%v)", err)
	}
}

// TestHostileEntries converts odd but accepted tar entries and checks the
// daemon serves the rest of the tree without crashing or misbehaving.
func TestHostileEntries(t *testing.T) {
	requireFUSE(t)
	long := strings.Repeat("n", 300)
	candidates := []tarFile{
		{hdr: hdr(tar.TypeReg, ".wh.", 0o644)},
		{hdr: hdr(tar.TypeReg, ".wh...", 0o644)},
		{hdr: hdr(tar.TypeDir, ".wh.whdir/", 0o755)},
		{hdr: hdr(tar.TypeReg, ".wh.whdir/child", 0o644), data: []byte("x")},
		{hdr: hdr(tar.TypeDir, "marker/", 0o755)},
		{hdr: hdr(tar.TypeDir, "marker/.wh..wh..opq/", 0o755)},
		{hdr: hdr(tar.TypeReg, "marker/.wh..wh..opq/inner", 0o644)},
		{hdr: hdr(tar.TypeReg, long, 0o644), data: []byte("long")},
		{hdr: hdr(tar.TypeReg, ".wh."+long, 0o644)},
		{hdr: hdr(tar.TypeReg, "new\nline", 0o644), data: []byte("nl")},
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "abs", Linkname: "/etc/shadow", Mode: 0o777}},
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "loop", Linkname: "loop", Mode: 0o777}},
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "up", Linkname: "../../../../x", Mode: 0o777}},
		{hdr: tar.Header{Typeflag: tar.TypeLink, Name: "hl-to-symlink", Linkname: "abs"}},
		{hdr: tar.Header{Typeflag: tar.TypeFifo, Name: "fifo", Mode: 0o600}},
		{hdr: tar.Header{Typeflag: tar.TypeLink, Name: "hl-to-fifo", Linkname: "fifo"}},
		{hdr: tar.Header{Typeflag: tar.TypeLink, Name: ".wh.hl", Linkname: "fifo"}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "negative-uid", Uid: -5, Mode: 0o644}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "ancient", Mode: 0o644, ModTime: fixtureTime.AddDate(-3000, 0, 0)}},
		{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "huge-dev", Mode: 0o600, Devmajor: 1 << 31, Devminor: 1<<32 - 1, Format: tar.FormatGNU}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "xattr-overlay", Mode: 0o644, PAXRecords: map[string]string{"SCHILY.xattr.trusted.overlay.metacopy": "", "SCHILY.xattr.trusted.overlay.origin": "x"}}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "ok", Mode: 0o644}, data: []byte("still served")},
	}
	// Keep what the converter accepts on its own (it rejects some of
	// these, which is its job, not ours).
	var accepted []tarFile
	for i, c := range candidates {
		trial := append(append([]tarFile{}, accepted...), c)
		if c.hdr.Typeflag == tar.TypeLink {
			// needs its target in the same stream
			trial = append(append([]tarFile{}, accepted...), c)
		}
		var blob bytes.Buffer
		if _, err := layerfmt.Convert(context.Background(), &blob, bytes.NewReader(buildTar(t, trial))); err != nil {
			t.Logf("converter rejects candidate %d (%s): %v", i, c.hdr.Name, err)
			continue
		}
		accepted = append(accepted, c)
	}
	blob, toc := convert(t, bytes.NewReader(buildTar(t, accepted)))
	src := newBlobSource(bytes.NewReader(blob))
	mnt, _ := mountLayer(t, toc, src)

	// Walk everything; every metadata call must answer.
	var seen []string
	err := filepath.WalkDir(mnt, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(mnt, p)
		seen = append(seen, rel)
		if strings.HasPrefix(filepath.Base(p), ".wh.") {
			t.Errorf("whiteout marker %s visible", rel)
		}
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("lstat %s: %v", rel, err)
		}
		_, _ = unix.Llistxattr(p, make([]byte, 4096))
		if d.Type()&fs.ModeSymlink != 0 {
			if _, err := os.Readlink(p); err != nil {
				t.Errorf("readlink %s: %v", rel, err)
			}
		}
		if d.Type().IsRegular() {
			if _, err := os.ReadFile(p); err != nil {
				t.Errorf("read %s: %v", rel, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("served: %q", seen)
	if got, err := os.ReadFile(filepath.Join(mnt, "ok")); err != nil || string(got) != "still served" {
		t.Errorf("ok = %q, %v", got, err)
	}
	if x := xattrs(t, filepath.Join(mnt, "xattr-overlay")); len(x) != 0 {
		t.Errorf("overlay xattrs from the tar exposed: %q", x)
	}
	// Names over NAME_MAX are hidden consistently (readdir and lookup).
	if _, err := os.Lstat(filepath.Join(mnt, long)); !os.IsNotExist(err) {
		t.Errorf("lstat of a 300-byte name: %v, want ENOENT", err)
	}
}
