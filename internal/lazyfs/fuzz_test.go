package lazyfs

import (
	"archive/tar"
	"bytes"
	"context"
	"strings"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/envsnap/envsnap/layerfmt"
)

// FuzzTree builds layers from arbitrary entry names (newline separated;
// a trailing "/" makes a directory, "name>target" a hard link) and checks
// the tree lazyfs presents, without a kernel mount:
//   - no operation panics;
//   - readdir never shows a ".wh." name, and every name it shows resolves
//     by Lookup to the same inode and file type;
//   - names starting with ".wh." never resolve.
func FuzzTree(f *testing.F) {
	f.Add("a\n.wh.a\nb/\nb/.wh..wh..opq\nb/c\n.wh.gone")
	f.Add("d/\nd/f\nd/g>d/f\n.wh.d\nx>d/f")
	f.Add(".wh.\n.wh...\n.wh..wh..opq/\n.wh..wh..opq/x\n" + strings.Repeat("n", 300))
	f.Add("a/b/c/d/e\na/.wh.b\n.wh.a/\nz>a/b/c/d/e")
	f.Fuzz(func(t *testing.T, spec string) {
		var files []tarFile
		for _, line := range strings.Split(spec, "\n") {
			if line == "" || len(files) > 64 {
				continue
			}
			h := tar.Header{Typeflag: tar.TypeReg, Name: line, Mode: 0o644}
			if name, target, ok := strings.Cut(line, ">"); ok {
				h = tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target}
			} else if strings.HasSuffix(line, "/") {
				h.Typeflag, h.Mode = tar.TypeDir, 0o755
			}
			files = append(files, tarFile{hdr: h, data: []byte(line)})
		}
		var tarBuf bytes.Buffer
		tw := tar.NewWriter(&tarBuf)
		for _, tf := range files {
			h := tf.hdr
			if h.Typeflag == tar.TypeReg {
				h.Size = int64(len(tf.data))
			}
			if tw.WriteHeader(&h) != nil {
				return
			}
			if h.Typeflag == tar.TypeReg {
				tw.Write(tf.data)
			}
		}
		if tw.Close() != nil {
			return
		}
		var blob bytes.Buffer
		res, err := layerfmt.Convert(context.Background(), &blob, &tarBuf)
		if err != nil {
			return // refusing is the converter's job
		}
		toc, err := layerfmt.ReadTOC(context.Background(), bytes.NewReader(blob.Bytes()), int64(blob.Len()), res.TOCDigest)
		if err != nil {
			t.Fatalf("converter output does not decode: %v", err)
		}
		root, err := NewRoot(toc, newBlobSource(bytes.NewReader(blob.Bytes())))
		if err != nil {
			t.Fatal(err)
		}
		fs.NewNodeFS(root, fsOptions(defaultOptions()))
		walkTree(t, root.(*node), 0)
	})
}

func walkTree(t *testing.T, n *node, depth int) {
	ctx := context.Background()
	var attr fuse.AttrOut
	n.Getattr(ctx, nil, &attr)
	n.Listxattr(ctx, make([]byte, 1024))
	n.Getxattr(ctx, opaqueXattr, make([]byte, 16))
	if attr.Mode&syscall.S_IFMT == syscall.S_IFLNK {
		n.Readlink(ctx)
	}
	if attr.Mode&syscall.S_IFMT == syscall.S_IFREG {
		buf := make([]byte, 64)
		if _, errno := n.Read(ctx, nil, buf, 0); errno != 0 {
			t.Errorf("read inode %d: %v", attr.Ino, errno)
		}
	}
	if attr.Mode&syscall.S_IFMT != syscall.S_IFDIR || depth > 16 {
		return
	}
	ds, errno := n.Readdir(ctx)
	if errno != 0 {
		t.Fatalf("readdir inode %d: %v", attr.Ino, errno)
	}
	for ds.HasNext() {
		e, _ := ds.Next()
		if e.Name == "." || e.Name == ".." {
			// go-fuse answers their lookups itself.
			continue
		}
		if strings.HasPrefix(e.Name, whiteoutPrefix) {
			t.Errorf("readdir shows %q", e.Name)
		}
		var out fuse.EntryOut
		child, errno := n.Lookup(ctx, e.Name, &out)
		if errno != 0 {
			t.Errorf("readdir shows %q but lookup fails: %v", e.Name, errno)
			continue
		}
		if out.Attr.Ino != e.Ino || out.Attr.Mode&syscall.S_IFMT != e.Mode {
			t.Errorf("%q: readdir ino %d mode %o, lookup ino %d mode %o", e.Name, e.Ino, e.Mode, out.Attr.Ino, out.Attr.Mode)
		}
		walkTree(t, child.Operations().(*node), depth+1)
	}
	var out fuse.EntryOut
	for _, hidden := range []string{opaqueMarker, whiteoutPrefix, whiteoutPrefix + "a"} {
		if _, errno := n.Lookup(ctx, hidden, &out); errno != syscall.ENOENT {
			t.Errorf("lookup %q: %v, want ENOENT", hidden, errno)
		}
	}
}
