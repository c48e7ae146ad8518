//go:build linux

package envsnapshot

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/pkg/archive"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/lazyfs"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// squashChain is an image and a chain of snapshot diffs on it in which
// names come and go inside the chain: created in one diff, deleted in a
// later one, under directories the image has and under directories only
// the chain has. Only three markers of the chain hide something of the
// image: the whiteout of "old" and the opaque markers of "b" and "c"
// (which hides the image's "c/x", so the whiteout of the chain's own
// "c/x" below it hides nothing).
func squashChain(t *testing.T) (base []byte, chain [][]byte) {
	base = layerTar(t,
		dir("a"), file("a/x", "x0"),
		dir("b"), file("b/1", "b1"),
		dir("c"), file("c/x", "cx"),
		file("old", "old"),
	)
	d1 := layerTar(t,
		dir("fresh"), file("fresh/tmp", "t1"), file("fresh/keep", "k1"),
		file("scratch", "s1"),
		dir("gone"), file("gone/x", "g1"),
		dir("redo"), file("redo/1", "r1"),
		dir("a"), file("a/made", "m1"),
		dir("c"), opaque("c"), file("c/x", "new cx"), file("c/n", "cn"),
		dir("fresh2"), file("fresh2/x", "f2"),
	)
	d2 := layerTar(t,
		dir("fresh"), whiteout("fresh", "tmp"),
		whiteout(".", "scratch"),
		whiteout(".", "gone"),
		dir("redo"), opaque("redo"), file("redo/2", "r2"),
		dir("a"), whiteout("a", "made"),
		dir("c"), whiteout("c", "x"),
		whiteout(".", "old"),
	)
	d3 := layerTar(t,
		dir("b"), opaque("b"), file("b/2", "b2"),
		dir("fresh2"), opaque("fresh2"), file("fresh2/y", "f2y"),
	)
	return base, [][]byte{d1, d2, d3}
}

// TestSquashKeepsOnlyMarkersThatHide: the squash of squashChain writes the
// three markers that hide something of the image and no other.
func TestSquashKeepsOnlyMarkersThatHide(t *testing.T) {
	base, chain := squashChain(t)
	var readers []*layerfmt.Reader
	for _, d := range chain {
		readers = append(readers, reader(t, d))
	}
	var sq bytes.Buffer
	if err := Squash(context.Background(), &sq, NewBelow(reader(t, base).TOC()), readers); err != nil {
		t.Fatal(err)
	}
	var markers []string
	tr := tar.NewReader(&sq)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(path.Base(hdr.Name), whiteoutPrefix) {
			markers = append(markers, hdr.Name)
		}
	}
	want := []string{"b/" + whiteoutOpaque, "c/" + whiteoutOpaque, whiteoutPrefix + "old"}
	if fmt.Sprint(markers) != fmt.Sprint(want) {
		t.Errorf("squash markers = %q, want %q", markers, want)
	}
}

// TestSquashEqualsChainMounted mounts the image with the chain and with
// its squash, each as overlayfs lower directories the way containerd's
// overlay snapshotter applies layers and the way envsnap serves them
// (lazyfs mounts), and compares readdir and lstat of every path: a
// squashed whiteout that hides nothing is listed by overlayfs in a
// directory no lower layer shares, and stat of it fails.
func TestSquashEqualsChainMounted(t *testing.T) {
	prereq.RequireFUSE(t)
	base, chain := squashChain(t)
	var readers []*layerfmt.Reader
	for _, d := range chain {
		readers = append(readers, reader(t, d))
	}
	var sq bytes.Buffer
	if err := Squash(context.Background(), &sq, NewBelow(reader(t, base).TOC()), readers); err != nil {
		t.Fatal(err)
	}
	withChain := append([][]byte{base}, chain...)
	withSquash := [][]byte{base, sq.Bytes()}

	want := t.TempDir()
	apply(t, want, withChain...)
	oracle := mergedView(t, want)

	for _, tc := range []struct {
		name   string
		lowers func(*testing.T, [][]byte) []string
	}{
		{"overlayfs", appliedLowers},
		{"envsnap", lazyLowers},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gotChain := mergedView(t, mountLowers(t, tc.lowers(t, withChain)))
			gotSquash := mergedView(t, mountLowers(t, tc.lowers(t, withSquash)))
			if diffs := devenv.DiffTrees(oracle, gotChain); len(diffs) > 0 {
				t.Errorf("chain differs from the applied tree:\n%s", strings.Join(diffs, "\n"))
			}
			if diffs := devenv.DiffTrees(gotChain, gotSquash); len(diffs) > 0 {
				t.Errorf("squash differs from the chain:\n%s", strings.Join(diffs, "\n"))
			}
		})
	}
}

// appliedLowers applies each layer into a directory of its own as
// containerd's overlay snapshotter does (core/diff/apply: whiteouts become
// 0:0 character devices, opaque markers trusted.overlay.opaque), lowest
// first.
func appliedLowers(t *testing.T, layers [][]byte) []string {
	var dirs []string
	for i, l := range layers {
		d := t.TempDir()
		opts := []archive.ApplyOpt{archive.WithConvertWhiteout(archive.OverlayConvertWhiteout)}
		if len(dirs) > 0 {
			opts = append(opts, archive.WithParents(reversed(dirs)))
		}
		if _, err := archive.Apply(context.Background(), d, bytes.NewReader(l), opts...); err != nil {
			t.Fatalf("apply layer %d: %v", i, err)
		}
		dirs = append(dirs, d)
	}
	return dirs
}

// lazyLowers converts each layer to the envsnap format and serves it as
// a lazyfs mount, lowest first.
func lazyLowers(t *testing.T, layers [][]byte) []string {
	var dirs []string
	for _, l := range layers {
		r := reader(t, l)
		mnt := t.TempDir()
		srv, err := lazyfs.Mount(context.Background(), mnt, r.TOC(), readerSource{r})
		if err != nil {
			t.Fatalf("mount layer: %v", err)
		}
		t.Cleanup(func() {
			if err := srv.Unmount(); err != nil {
				t.Errorf("unmount %s: %v", mnt, err)
				_ = unix.Unmount(mnt, unix.MNT_DETACH)
			}
			srv.Wait()
		})
		dirs = append(dirs, mnt)
	}
	return dirs
}

// readerSource serves a layer's chunks from its blob in memory.
type readerSource struct{ r *layerfmt.Reader }

func (s readerSource) ReadChunk(_ context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	b, err := s.r.ReadChunk(c, nil)
	return b, nil, err
}

// mountLowers mounts a read-only overlayfs of lowers (lowest first).
func mountLowers(t *testing.T, lowers []string) string {
	mnt := t.TempDir()
	opts := "lowerdir=" + strings.Join(reversed(lowers), ":")
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, opts); err != nil {
		t.Fatalf("mount overlay %s: %v", opts, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	return mnt
}

func reversed(s []string) []string {
	out := make([]string, len(s))
	for i, v := range s {
		out[len(s)-1-i] = v
	}
	return out
}

// mergedView describes every path under root as readdir lists it: a
// listed name whose lstat fails is described by its error, every other
// one as devenv.DescribeTree does.
func mergedView(t *testing.T, root string) map[string]string {
	t.Helper()
	phantoms := map[string]string{}
	var walk func(rel string)
	walk = func(rel string) {
		ents, err := os.ReadDir(filepath.Join(root, rel))
		if err != nil {
			t.Fatalf("readdir %s: %v", rel, err)
		}
		for _, e := range ents {
			p := path.Join(rel, e.Name())
			fi, err := os.Lstat(filepath.Join(root, p))
			switch {
			case err != nil:
				phantoms[p] = "listed by readdir, lstat: " + errors.Unwrap(err).Error()
			case fi.IsDir():
				walk(p)
			}
		}
	}
	walk(".")
	skip := make([]string, 0, len(phantoms))
	for p := range phantoms {
		skip = append(skip, p)
	}
	sort.Strings(skip)
	view, err := devenv.DescribeTree(root, skip...)
	if err != nil {
		t.Fatal(err)
	}
	for p, d := range phantoms {
		view[p] = d
	}
	return view
}
