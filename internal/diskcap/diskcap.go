// Package diskcap gives a container's writable snapshot a hard size and
// inode limit: the snapshot's directory, which holds overlay's upper
// ("fs") and work directories, becomes the mount point of an ext4 file
// system of that size, made in a sparse file inside the directory and
// loop-mounted over it. Writing past the limit fails with ENOSPC in the
// container; the envlet shim reads the limit from a record at the file
// system's root (outside the upper directory) and reports the full file
// system as DISK_CAP_EXCEEDED. The layer's files use the inodes of its
// own file system, so an inode bomb exhausts the layer, not the node.
//
// The images are sparse: Share sizes a cap so that a layer filled to it
// leaves the node a reserve, and Uncap moves a layer's files back onto
// the node's file system when its snapshot is committed.
//
// The loop device is set up with autoclear: it goes away when the file
// system is unmounted, or when the process setting it up dies before it
// is mounted, so nothing outlives the mount.
package diskcap

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/continuity/fs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Snapshot labels that ask for a cap; a value of 0 asks for none (over a
// node default). Bytes in decimal.
const (
	LabelBytes  = "containerd.io/snapshot/envsnap.disk-limit"
	LabelInodes = "containerd.io/snapshot/envsnap.inode-limit"
)

// MinBytes is the smallest cap: ext4 needs room for its own metadata.
const MinBytes = 4 << 20

const (
	imageName  = "writable.ext4"
	recordName = "envsnap-disk-cap.json"
)

// Limits is a cap; Inodes 0 gives one inode per 16 KiB.
type Limits struct {
	Bytes  int64 `json:"bytes"`
	Inodes int64 `json:"inodes,omitempty"`
}

// FromLabels is def with the labels' values over it.
func FromLabels(labels map[string]string, def Limits) (Limits, error) {
	l := def
	for _, f := range []struct {
		key string
		dst *int64
	}{{LabelBytes, &l.Bytes}, {LabelInodes, &l.Inodes}} {
		v, ok := labels[f.key]
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return Limits{}, fmt.Errorf("label %s=%q: want a number of bytes or files, 0 for none", f.key, v)
		}
		*f.dst = n
	}
	if l.Bytes > 0 && l.Bytes < MinBytes {
		return Limits{}, fmt.Errorf("disk cap %d bytes: below the smallest, %d", l.Bytes, MinBytes)
	}
	return l, nil
}

// Setup puts the "fs" and "work" directories of dir, a new snapshot's
// directory whose two are still empty, on a new file system of l: an
// image of l taken from pool (nil for none) when it has one, otherwise
// one made now. On error nothing is left mounted.
func Setup(ctx context.Context, dir string, l Limits, pool *Pool) (retErr error) {
	var sts [2]unix.Stat_t
	names := [2]string{"fs", "work"}
	for i, n := range names {
		if err := unix.Lstat(filepath.Join(dir, n), &sts[i]); err != nil {
			return fmt.Errorf("disk cap: %w", err)
		}
	}
	img := filepath.Join(dir, imageName)
	if !pool.take(ctx, l, img) {
		if err := format(ctx, img, l, (*exec.Cmd).Run); err != nil {
			return err
		}
	}
	defer func() {
		if retErr != nil {
			os.Remove(img)
		}
	}()
	if err := Mount(dir); err != nil {
		return err
	}
	defer func() {
		if retErr != nil {
			if err := unix.Unmount(dir, 0); err != nil {
				retErr = errors.Join(retErr, fmt.Errorf("disk cap: unmount after failure: %w", err))
			}
		}
	}()
	for i, n := range names {
		p := filepath.Join(dir, n)
		if err := os.Mkdir(p, 0o700); err != nil {
			return fmt.Errorf("disk cap: %w", err)
		}
		// overlay's own modes, past the umask.
		if err := unix.Chmod(p, sts[i].Mode&0o7777); err != nil {
			return fmt.Errorf("disk cap: chmod %s: %w", p, err)
		}
		if err := os.Lchown(p, int(sts[i].Uid), int(sts[i].Gid)); err != nil {
			return fmt.Errorf("disk cap: %w", err)
		}
	}
	b, err := json.Marshal(l)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, recordName), b, 0o600); err != nil {
		return fmt.Errorf("disk cap: write record: %w", err)
	}
	return nil
}

// format makes img, a new sparse file, an ext4 file system of l; run
// runs the mkfs.ext4 command (Cmd.Run, or a lowered run). On error img
// is gone.
func format(ctx context.Context, img string, l Limits, run func(*exec.Cmd) error) (retErr error) {
	f, err := os.OpenFile(img, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("disk cap: create image: %w", err)
	}
	err = f.Truncate(l.Bytes)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	defer func() {
		if retErr != nil {
			os.Remove(img)
		}
	}()
	if err != nil {
		return fmt.Errorf("disk cap: size image: %w", err)
	}
	// No journal: the layer dies with its container, and a journal
	// costs mkfs time and a kernel thread per environment. No blocks
	// reserved for root: the agent is root.
	args := []string{"-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "nodiscard,lazy_itable_init=1"}
	if l.Inodes > 0 {
		args = append(args, "-N", strconv.FormatInt(l.Inodes, 10))
	} else {
		// mke2fs.conf's ratio depends on the size (one inode per 4 KiB
		// below 512 MiB): one per 16 KiB whatever the share.
		args = append(args, "-i", "16384")
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "mkfs.ext4", append(args, img)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := run(cmd); err != nil {
		return fmt.Errorf("disk cap: mkfs.ext4: %v: %s", err, out.Bytes())
	}
	return nil
}

// Available says why this node cannot make capped file systems (no
// mkfs.ext4, no loop devices), or nil when it can.
func Available() error {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		return fmt.Errorf("disk cap: no mkfs.ext4 on the node: %w", err)
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return fmt.Errorf("disk cap: no loop devices on the node: %w", err)
	}
	return nil
}

// Share is the size of a new capped layer that asks for want bytes on a
// file system of size bytes with avail free: want, or less so that what
// stays free when the layer is full is at least reservePct percent of
// the file system. The images are sparse, so a layer that fills its cap
// takes at most what was free beyond the reserve when it started, and
// its neighbours keep the reserve. An error means the node has no room
// for a layer of MinBytes.
func Share(want, size, avail int64, reservePct int) (int64, error) {
	reserve := size / 100 * int64(reservePct)
	room := avail - reserve
	if room >= want {
		return want, nil
	}
	if room < MinBytes {
		return 0, fmt.Errorf("disk cap: the node's writable file system has %d bytes free, %d of them its reserve (%d%%): no room for a writable layer of %d bytes",
			avail, reserve, reservePct, MinBytes)
	}
	return room, nil
}

// Space is the size and the free space (for an unprivileged writer) of
// the file system holding dir.
func Space(dir string) (size, avail int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return int64(st.Blocks) * int64(st.Bsize), int64(st.Bavail) * int64(st.Bsize), nil
}

// Uncap turns the capped snapshot directory dir back into a plain one,
// so that it can be committed: it copies the upper directory "fs" from
// the capped file system to staging (a path that does not exist yet, on
// the file system below dir), unmounts dir, puts the copy in place of
// the empty "fs" the mount covered and removes the image. A busy file
// system (a container still runs on it) fails and stays capped, without
// staging; past the unmount, staging is all there is of the layer and is
// kept whatever happens.
func Uncap(dir, staging string) error {
	// Overlay's whiteouts are devices and its opaque markers xattrs;
	// CopyDir keeps both, and hard links.
	if err := fs.CopyDir(staging, filepath.Join(dir, "fs")); err != nil {
		os.RemoveAll(staging)
		return fmt.Errorf("disk cap: copy the writable layer out: %w", err)
	}
	if err := unix.Unmount(dir, 0); err != nil {
		os.RemoveAll(staging)
		return fmt.Errorf("disk cap: unmount %s: %w", dir, err)
	}
	upper := filepath.Join(dir, "fs")
	if err := os.Remove(upper); err != nil {
		return fmt.Errorf("disk cap: %w", err)
	}
	if err := os.Rename(staging, upper); err != nil {
		return fmt.Errorf("disk cap: put the writable layer back: %w", err)
	}
	if err := os.Remove(filepath.Join(dir, imageName)); err != nil {
		return fmt.Errorf("disk cap: remove image: %w", err)
	}
	return nil
}

// Capped reports whether dir holds a capped snapshot's image.
func Capped(dir string) bool {
	_, err := os.Lstat(filepath.Join(dir, imageName))
	return err == nil
}

// Mount mounts dir's image over dir. The loop device reads and writes
// the image with direct I/O: buffered, every byte written sat in the page
// cache twice (the layer's file system's and the image file's), and a
// 64 MiB dd with fsync took 1.76x as long as on a plain upper directory;
// with direct I/O 0.99x (BenchmarkDefaultDiskCap, one run).
func Mount(dir string) error {
	m := mount.Mount{Type: "ext4", Source: filepath.Join(dir, imageName), Options: []string{"loop", "direct-io"}}
	if err := m.Mount(dir); err != nil {
		return fmt.Errorf("disk cap: mount %s: %w", m.Source, err)
	}
	return nil
}

// Mounted reports whether the file system of a capped snapshot is
// mounted at dir.
func Mounted(dir string) (bool, error) {
	return mountinfo.Mounted(dir)
}

// Unmount unmounts the capped file system at dir, if mounted. A busy one
// (a container still runs on it) is an error, and stays.
func Unmount(dir string) error {
	mounted, err := Mounted(dir)
	if err != nil {
		return fmt.Errorf("disk cap: %w", err)
	}
	if !mounted {
		return nil
	}
	if err := unix.Unmount(dir, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("disk cap: unmount %s: %w", dir, err)
	}
	return nil
}

// Read returns the cap of the snapshot whose upper directory is upper;
// ok is false when it has none.
func Read(upper string) (l Limits, ok bool, err error) {
	p := filepath.Join(filepath.Dir(filepath.Clean(upper)), recordName)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return Limits{}, false, nil
	}
	if err != nil {
		return Limits{}, false, fmt.Errorf("read disk cap record: %w", err)
	}
	if err := json.Unmarshal(b, &l); err != nil {
		return Limits{}, false, fmt.Errorf("decode disk cap record %s: %w", p, err)
	}
	return l, true, nil
}

// Usage is what statfs says of the file system holding upper: bytes and
// files in use, and why it is full ("" when it is not): less than
// fullSlack free, or no inode left.
func Usage(upper string) (usedBytes, usedInodes int64, full string, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(upper, &st); err != nil {
		return 0, 0, "", fmt.Errorf("statfs %s: %w", upper, err)
	}
	bs := int64(st.Bsize)
	usedBytes = int64(st.Blocks-st.Bfree) * bs
	usedInodes = int64(st.Files - st.Ffree)
	switch {
	case st.Ffree == 0:
		full = "no inode left"
	case int64(st.Bavail)*bs < fullSlack:
		full = "less than 1 MiB free"
	}
	return usedBytes, usedInodes, full, nil
}

// fullSlack: below this much free space a file system counts as full.
// ext4 refuses writes with some space still available to statfs (it
// keeps a margin for the metadata of delayed allocations): measured
// after dd ended with ENOSPC, 598 KiB free on 32 MiB (1 KiB blocks) and
// 400 KiB on 1 GiB (4 KiB blocks).
const fullSlack = 1 << 20
