package devenv

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"github.com/containerd/continuity/sysx"
)

// DescribeTree describes every entry below root, one line per path: type,
// permission bits, owner, size, sha256 of the contents, symlink target,
// device numbers, extended attributes (without overlayfs' own) and, for
// files with several names in the tree, the first name of the inode. Two trees with
// equal descriptions hold the same files as far as a container can tell,
// mtimes aside. Paths in skip (relative, slash-separated) are left out
// with everything below them (e.g. "proc", "sys", "dev").
func DescribeTree(root string, skip ...string) (map[string]string, error) {
	out := map[string]string{}
	type inode struct{ dev, ino uint64 }
	firstName := map[inode]string{}
	var paths []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		for _, s := range skip {
			if rel == s {
				if d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
		}
		paths = append(paths, p)
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.Strings(paths)
	// Hard links are told by names of the tree sharing an inode, not by
	// st_nlink: overlayfs reports a lower file's link count even when
	// the upper layer deleted its other names.
	names := map[inode]int{}
	for _, p := range paths {
		if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() {
			st := fi.Sys().(*syscall.Stat_t)
			names[inode{uint64(st.Dev), st.Ino}]++
		}
	}
	for _, p := range paths {
		rel, _ := filepath.Rel(root, p)
		rel = filepath.ToSlash(rel)
		fi, err := os.Lstat(p)
		if err != nil {
			return nil, err
		}
		st := fi.Sys().(*syscall.Stat_t)
		var b strings.Builder
		fmt.Fprintf(&b, "%s %o %d:%d", fi.Mode().Type(), fi.Mode().Perm()|fi.Mode()&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky), st.Uid, st.Gid)
		switch {
		case fi.Mode().IsRegular():
			f, err := os.Open(p)
			if err != nil {
				return nil, err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(&b, " size=%d sha256=%s", fi.Size(), hex.EncodeToString(h.Sum(nil))[:16])
			if key := (inode{uint64(st.Dev), st.Ino}); names[key] > 1 {
				if _, ok := firstName[key]; !ok {
					firstName[key] = rel
				}
				fmt.Fprintf(&b, " inode-of=%s", firstName[key])
			}
		case fi.Mode()&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(&b, " -> %s", t)
		case fi.Mode()&fs.ModeDevice != 0:
			fmt.Fprintf(&b, " dev=%d", st.Rdev)
		}
		keys, err := sysx.LListxattr(p)
		if err == nil {
			sort.Strings(keys)
			for _, k := range keys {
				if strings.HasPrefix(k, "trusted.overlay.") || strings.HasPrefix(k, "user.overlay.") {
					continue
				}
				v, err := sysx.LGetxattr(p, k)
				if err != nil {
					continue
				}
				fmt.Fprintf(&b, " xattr:%s=%q", k, v)
			}
		}
		out[rel] = b.String()
	}
	return out, nil
}

// DiffTrees lists the differences between two DescribeTree results.
func DiffTrees(want, got map[string]string) []string {
	var diffs []string
	for p, w := range want {
		g, ok := got[p]
		switch {
		case !ok:
			diffs = append(diffs, fmt.Sprintf("missing %s (%s)", p, w))
		case g != w:
			diffs = append(diffs, fmt.Sprintf("%s: want %s, got %s", p, w, g))
		}
	}
	for p, g := range got {
		if _, ok := want[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("extra %s (%s)", p, g))
		}
	}
	sort.Strings(diffs)
	return diffs
}
