package convert_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/opencontainers/image-spec/identity"
	"golang.org/x/sys/unix"
)

// tarEntry is one entry of a hand-written layer tar: the harness's File
// has no owners, xattrs, hard links or whiteouts.
type tarEntry struct {
	name     string
	typ      byte
	mode     int64
	uid, gid int
	data     []byte
	link     string
	xattrs   map[string]string
}

func layerTar(t *testing.T, entries []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Unix(1700000000, 0)
	for _, e := range entries {
		h := &tar.Header{Typeflag: e.typ, Name: e.name, Mode: e.mode, Uid: e.uid, Gid: e.gid,
			Linkname: e.link, ModTime: mtime, Format: tar.FormatPAX}
		if e.typ == tar.TypeReg {
			h.Size = int64(len(e.data))
		}
		for k, v := range e.xattrs {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(e.data); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// treeOf mounts a read-only view of img's root filesystem from snapshotter
// and describes every entry below it (see describeTree).
func treeOf(t *testing.T, ctx context.Context, c *client.Client, img client.Image, snapshotter string) map[string]string {
	t.Helper()
	diffIDs, err := img.RootFS(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A lease keeps containerd's garbage collector off the view.
	ctx, done, err := c.WithLease(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer done(ctx)
	sn := c.SnapshotService(snapshotter)
	key := fmt.Sprintf("tree-view-%s-%d", snapshotter, time.Now().UnixNano())
	mounts, err := sn.View(ctx, key, identity.ChainID(diffIDs).String())
	if err != nil {
		t.Fatalf("view %s on %s: %v", img.Name(), snapshotter, err)
	}
	defer func() {
		if err := sn.Remove(ctx, key); err != nil {
			t.Errorf("remove view %s: %v", key, err)
		}
	}()
	dir := t.TempDir()
	if err := mount.All(mounts, dir); err != nil {
		t.Fatalf("mount view of %s on %s: %v", img.Name(), snapshotter, err)
	}
	defer func() {
		if err := mount.UnmountAll(dir, 0); err != nil {
			t.Errorf("unmount view %s: %v", dir, err)
		}
	}()
	tree, err := describeTree(dir)
	if err != nil {
		t.Fatalf("walk %s on %s: %v", img.Name(), snapshotter, err)
	}
	return tree
}

// describeTree maps each path below root to a line holding what a
// container sees of it: type and mode bits, owner, size and sha256 of
// contents, modification time of non-directories, symlink target, extended
// attributes, and, for hard-linked files, the other paths of the link.
func describeTree(root string) (map[string]string, error) {
	out := map[string]string{}
	type inode struct{ dev, ino uint64 }
	links := map[inode][]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := "/" + strings.TrimPrefix(strings.TrimPrefix(p, root), "/")
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		line := fmt.Sprintf("mode=%o owner=%d:%d", st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return fmt.Errorf("read %s: %w", rel, err)
			}
			line += fmt.Sprintf(" size=%d sha256=%s mtime=%d nlink=%d", st.Size, hex.EncodeToString(h.Sum(nil)), st.Mtim.Sec, st.Nlink)
			if st.Nlink > 1 {
				k := inode{uint64(st.Dev), st.Ino}
				links[k] = append(links[k], rel)
			}
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += " -> " + target
		}
		xa, err := xattrs(p)
		if err != nil {
			return fmt.Errorf("xattrs of %s: %w", rel, err)
		}
		if xa != "" {
			line += " xattrs=" + xa
		}
		out[rel] = line
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, paths := range links {
		sort.Strings(paths)
		for _, p := range paths {
			out[p] += " links=" + strings.Join(paths, ",")
		}
	}
	return out, nil
}

func xattrs(p string) (string, error) {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		if err == unix.ENOTSUP {
			return "", nil
		}
		return "", err
	}
	var kv []string
	for _, k := range strings.Split(string(buf[:n]), "\x00") {
		if k == "" {
			continue
		}
		v := make([]byte, 64<<10)
		m, err := unix.Lgetxattr(p, k, v)
		if err != nil {
			return "", fmt.Errorf("get %s: %w", k, err)
		}
		kv = append(kv, fmt.Sprintf("%s=%q", k, v[:m]))
	}
	sort.Strings(kv)
	return strings.Join(kv, ","), nil
}
