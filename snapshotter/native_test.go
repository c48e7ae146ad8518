//go:build linux

package snapshotter

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/opencontainers/go-digest"
)

// nativeFS is the fake data plane with native copies: a copy holds the
// same marker file as the layer mount, plus one saying it is the copy.
type nativeFS struct {
	*fakeFS
	mu   sync.Mutex
	dirs map[digest.Digest]string
}

func (f *nativeFS) NativeDir(d digest.Digest) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.dirs[d]
	return p, ok
}

func (f *nativeFS) addCopy(t *testing.T, d digest.Digest) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), d.Encoded())
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, layerFile(d)), []byte(d), 0o644); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.dirs[d] = dir
	f.mu.Unlock()
	return dir
}

func lowerdirs(t *testing.T, opts []string) []string {
	t.Helper()
	for _, o := range opts {
		if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
			return strings.Split(v, ":")
		}
	}
	t.Fatalf("no lowerdir in %v", opts)
	return nil
}

// TestNativeLowers: mounts handed out after a layer's copy is ready name
// the copy instead of the FUSE symlink, for rootfs overlays, views and
// Mounts alike; NativeInUse reports the layers of every active snapshot
// and view until they are removed.
func TestNativeLowers(t *testing.T) {
	fsys := &nativeFS{fakeFS: newFakeFS(), dirs: map[digest.Digest]string{}}
	s, _ := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	l1, l2 := layerDigest(1), layerDigest(2)
	prepareLazy(t, s, "c1", "", l1)
	prepareLazy(t, s, "c2", "c1", l2)

	before, err := s.Prepare(ctx, "rootfs-fuse", "c2")
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range lowerdirs(t, before[0].Options) {
		if _, err := os.Readlink(dir); err != nil {
			t.Errorf("lower %s before any copy: not the FUSE symlink: %v", dir, err)
		}
	}

	copy1 := fsys.addCopy(t, l1)
	ms, err := s.Prepare(ctx, "rootfs", "c2")
	if err != nil {
		t.Fatal(err)
	}
	lowers := lowerdirs(t, ms[0].Options)
	if len(lowers) != 2 || lowers[1] != copy1 {
		t.Fatalf("lowers %v: want the copy %s at the bottom", lowers, copy1)
	}
	if _, err := os.Readlink(lowers[0]); err != nil {
		t.Errorf("layer 2 has no copy but its lower %s is not the FUSE symlink", lowers[0])
	}
	checkMountedFiles(t, ms, []digest.Digest{l1, l2})
	if again, err := s.Mounts(ctx, "rootfs"); err != nil || lowerdirs(t, again[0].Options)[1] != copy1 {
		t.Errorf("Mounts: %v, %v", again, err)
	}
	// The first container keeps its FUSE lowers: they were resolved
	// when it mounted; Mounts now names the copy for any new mount.

	view, err := s.View(ctx, "view", "c1")
	if err != nil {
		t.Fatal(err)
	}
	if view[0].Type != "bind" || view[0].Source != copy1 {
		t.Errorf("view of layer 1: %+v, want a bind of %s", view[0], copy1)
	}

	used, err := s.NativeInUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !used[l1] || !used[l2] {
		t.Errorf("in use: %v, want both layers", used)
	}
	for _, k := range []string{"rootfs-fuse", "rootfs"} {
		if err := s.Remove(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	used, err = s.NativeInUse(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !used[l1] || used[l2] {
		t.Errorf("in use with only the view of layer 1 left: %v", used)
	}
	if err := s.Remove(ctx, "view"); err != nil {
		t.Fatal(err)
	}
	if used, err = s.NativeInUse(ctx); err != nil || len(used) != 0 {
		t.Errorf("in use with no active snapshot: %v, %v", used, err)
	}
}

func TestFitsOnePage(t *testing.T) {
	short := []string{"/r/snapshots/1/fs", "/r/snapshots/2/fs"}
	if !fitsOnePage([]string{"lowerdir=" + strings.Join(short, ":")}, short) {
		t.Error("two short lowers do not fit")
	}
	var long []string
	for i := range 60 {
		long = append(long, "/var/lib/envsnap/native/sha256/"+strings.Repeat(string(rune('a'+i%26)), 64))
	}
	opts := []string{"index=off", "lowerdir=" + strings.Join(long, ":")}
	if fitsOnePage(opts, long) {
		t.Error("60 native lowers of 64 hex digits fit in a page")
	}
	if !fitsOnePage([]string{"lowerdir=" + strings.Join(long[:40], ":")}, long[:40]) {
		t.Error("40 native lowers do not fit although relative to their common parent they take 40*72 bytes")
	}
}

// observerFS is the fake data plane that records NoteEnvironment calls.
type observerFS struct {
	*fakeFS
	mu    sync.Mutex
	notes map[string]int // mountpoint -> calls
}

func (f *observerFS) NoteEnvironment(mountpoint string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.notes[mountpoint]++
}

func (f *observerFS) count(mountpoint string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.notes[mountpoint]
}

// TestNoteEnvironment: each container's Prepare and each View tells the
// data plane once about every lazy layer below it; pulling the layers
// (an unpack's Prepare) and asking for a snapshot's mounts again do not.
func TestNoteEnvironment(t *testing.T) {
	fsys := &observerFS{fakeFS: newFakeFS(), notes: map[string]int{}}
	s, _ := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	l1, l2 := layerDigest(1), layerDigest(2)
	prepareLazy(t, s, "c1", "", l1)
	prepareLazy(t, s, "c2", "c1", l2)
	mp1, mp2 := s.layerMountpoint(l1), s.layerMountpoint(l2)
	if n1, n2 := fsys.count(mp1), fsys.count(mp2); n1 != 0 || n2 != 0 {
		t.Fatalf("after the pull: %d and %d environments noted, want none", n1, n2)
	}
	if _, err := s.Prepare(ctx, "rootfs-1", "c2"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Mounts(ctx, "rootfs-1"); err != nil {
		t.Fatal(err)
	}
	if n1, n2 := fsys.count(mp1), fsys.count(mp2); n1 != 1 || n2 != 1 {
		t.Fatalf("one container: %d and %d environments noted, want 1 and 1", n1, n2)
	}
	if _, err := s.Prepare(ctx, "rootfs-2", "c1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.View(ctx, "view", "c2"); err != nil {
		t.Fatal(err)
	}
	if n1, n2 := fsys.count(mp1), fsys.count(mp2); n1 != 3 || n2 != 2 {
		t.Fatalf("two containers and a view: %d and %d environments noted, want 3 and 2", n1, n2)
	}
}

// TestNoteEnvironmentAfterRestart: a restarted snapshotter tells the data
// plane about the containers and views that outlived its predecessor, and
// not about an unpack left unfinished.
func TestNoteEnvironmentAfterRestart(t *testing.T) {
	fake := newFakeFS()
	fsys := &observerFS{fakeFS: fake, notes: map[string]int{}}
	s, root := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	l1, l2 := layerDigest(1), layerDigest(2)
	prepareLazy(t, s, "c1", "", l1)
	prepareLazy(t, s, "c2", "c1", l2)
	if _, err := s.Prepare(ctx, "rootfs-1", "c2"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.View(ctx, "view", "c1"); err != nil {
		t.Fatal(err)
	}
	// An unpack of a layer that is not lazy, cut short by the restart.
	if _, err := s.Prepare(ctx, "extract-3", "c2", snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "c3"})); err != nil {
		t.Fatal(err)
	}
	s.Close()

	restarted := &observerFS{fakeFS: fake, notes: map[string]int{}}
	s2, err := New(ctx, root, restarted)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s2.Close() })
	mp1, mp2 := s2.layerMountpoint(l1), s2.layerMountpoint(l2)
	if n1, n2 := restarted.count(mp1), restarted.count(mp2); n1 != 2 || n2 != 1 {
		t.Fatalf("after a restart with a container and a view: %d and %d environments noted, want 2 and 1", n1, n2)
	}
}
