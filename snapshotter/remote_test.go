//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// fakeFS stands in for the FUSE data plane. As root it mounts a tmpfs per
// layer (a separate mount, like the FUSE one) holding a file named after the
// layer, so the tests can check that overlay mounts really read through the
// symlinked upper directories; otherwise it writes into the plain directory.
type fakeFS struct {
	mu       sync.Mutex
	mounted  map[string]string // mountpoint -> layer digest
	mounts   int               // Mount calls that succeeded
	notLazy  map[string]bool   // layer digests to refuse as "not our format"
	checkErr error
	real     bool
	// unmountDelay widens the window in which an unmount is in progress.
	unmountDelay time.Duration
	mountErr     error // when set, Mount fails with it
}

func newFakeFS() *fakeFS {
	return &fakeFS{mounted: map[string]string{}, notLazy: map[string]bool{}, real: os.Getuid() == 0}
}

// layerFile is the file the fake puts in the root of a layer mount.
func layerFile(d digest.Digest) string { return "layer-" + d.Encoded()[:12] }

func (f *fakeFS) Mount(ctx context.Context, mountpoint string, labels map[string]string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := labels[LabelLayerDigest]
	if f.mountErr != nil {
		return f.mountErr
	}
	if f.notLazy[d] {
		return fmt.Errorf("layer %s: %w", d, errdefs.ErrNotImplemented)
	}
	if labels[LabelImageRef] == "" || (labels[LabelManifestDigest] == "") == (labels[LabelTOCDigest] == "") {
		return errors.New("want an image ref and either a manifest or a TOC digest label")
	}
	if _, ok := f.mounted[mountpoint]; ok {
		return fmt.Errorf("%s already mounted", mountpoint)
	}
	if f.real {
		if err := unix.Mount("tmpfs", mountpoint, "tmpfs", 0, "size=1m"); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(mountpoint, layerFile(digest.Digest(d))), []byte(d), 0o644); err != nil {
		return err
	}
	f.mounted[mountpoint] = d
	f.mounts++
	return nil
}

func (f *fakeFS) Check(ctx context.Context, mountpoint string, labels map[string]string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.mounted[mountpoint]; !ok {
		return fmt.Errorf("%s not mounted", mountpoint)
	}
	return f.checkErr
}

func (f *fakeFS) Unmount(ctx context.Context, mountpoint string) error {
	time.Sleep(f.unmountDelay)
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.mounted[mountpoint]
	if !ok {
		return fmt.Errorf("%s not mounted", mountpoint)
	}
	if f.real {
		if err := unix.Unmount(mountpoint, 0); err != nil {
			return err
		}
	} else if err := os.Remove(filepath.Join(mountpoint, layerFile(digest.Digest(d)))); err != nil {
		return err
	}
	delete(f.mounted, mountpoint)
	return nil
}

func (f *fakeFS) state() (mounted map[string]string, mounts int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := make(map[string]string, len(f.mounted))
	for k, v := range f.mounted {
		m[k] = v
	}
	return m, f.mounts
}

func testContext(t *testing.T) context.Context {
	return namespaces.WithNamespace(t.Context(), "test")
}

func newTestSnapshotter(t *testing.T, fsys FileSystem) (*Snapshotter, string) {
	t.Helper()
	root := t.TempDir()
	s, err := New(testContext(t), root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, root
}

func layerDigest(n int) digest.Digest { return digest.FromString(fmt.Sprintf("layer %d", n)) }

const testManifest = "sha256:1111111111111111111111111111111111111111111111111111111111111111"

// remoteOpts are the labels containerd's unpacker sends for one layer of a
// pull with remote-snapshot annotations.
func remoteOpts(chainID string, layer digest.Digest) snapshots.Opt {
	return remoteOptsFor(testRef, chainID, layer)
}

const testRef = "registry.test/envsnap/app:v1"

// remoteOptsFor are the labels of a pull of image ref.
func remoteOptsFor(ref, chainID string, layer digest.Digest) snapshots.Opt {
	return snapshots.WithLabels(map[string]string{
		snapshots.LabelSnapshotRef:                   chainID,
		"containerd.io/snapshot/diff-id":             layer.String(),
		"containerd.io/snapshot/cri.image-ref":       ref,
		"containerd.io/snapshot/cri.manifest-digest": testManifest,
		"containerd.io/snapshot/cri.layer-digest":    layer.String(),
		"containerd.io/gc.root":                      "now",
	})
}

// prepareLazy drives one layer through the remote-snapshot protocol and
// checks that the snapshotter took it lazily.
func prepareLazy(t *testing.T, s *Snapshotter, chainID, parent string, layer digest.Digest) {
	t.Helper()
	prepareLazyFor(t, s, testRef, chainID, parent, layer)
}

// prepareLazyFor is prepareLazy for a pull of image ref.
func prepareLazyFor(t *testing.T, s *Snapshotter, ref, chainID, parent string, layer digest.Digest) {
	t.Helper()
	ctx := testContext(t)
	key := "extract-1-" + chainID
	_, err := s.Prepare(ctx, key, parent, remoteOptsFor(ref, chainID, layer))
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("Prepare %s: got %v, want ErrAlreadyExists", chainID, err)
	}
	if _, err := s.Stat(ctx, key); !errdefs.IsNotFound(err) {
		t.Fatalf("active snapshot %s left behind: %v", key, err)
	}
}

func TestRemoteSnapshot(t *testing.T) {
	fsys := newFakeFS()
	s, root := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	l1 := layerDigest(1)

	prepareLazy(t, s, "chain1", "", l1)

	info, err := s.Stat(ctx, "chain1")
	if err != nil {
		t.Fatal(err)
	}
	if info.Kind != snapshots.KindCommitted || info.Parent != "" {
		t.Fatalf("chain1: kind %v parent %q", info.Kind, info.Parent)
	}
	for k, want := range map[string]string{
		snapshots.LabelSnapshotRef:             "chain1",
		"containerd.io/snapshot/cri.image-ref": "registry.test/envsnap/app:v1",
		LabelLayerDigest:                       l1.String(),
		LabelImageRef:                          "registry.test/envsnap/app:v1",
		LabelManifestDigest:                    testManifest,
	} {
		if got := info.Labels[k]; got != want {
			t.Errorf("label %s = %q, want %q", k, got, want)
		}
	}

	// containerd's metadata store finds the target with exactly this filter.
	var found []string
	filter := fmt.Sprintf(`labels.%q==%s,parent==%q`, snapshots.LabelSnapshotRef, "chain1", "")
	if err := s.Walk(ctx, func(ctx context.Context, i snapshots.Info) error {
		found = append(found, i.Name)
		return nil
	}, filter); err != nil {
		t.Fatal(err)
	}
	if len(found) != 1 || found[0] != "chain1" {
		t.Fatalf("Walk(%s) = %v", filter, found)
	}

	mounted, _ := fsys.state()
	mp := filepath.Join(root, "layers", "sha256", l1.Encoded(), "mnt")
	if mounted[mp] != l1.String() {
		t.Fatalf("layer not mounted at %s: %v", mp, mounted)
	}

	// A second Prepare of the same chainID (another pull) is answered
	// without mounting again.
	prepareLazy(t, s, "chain1", "", l1)
	if _, n := fsys.state(); n != 1 {
		t.Fatalf("%d mounts, want 1", n)
	}

	// A view of the lazy snapshot reads the layer mount.
	mounts, err := s.View(ctx, "view1", "chain1")
	if err != nil {
		t.Fatal(err)
	}
	checkMountedFiles(t, mounts, []digest.Digest{l1})
}

func TestRemoteSnapshotStack(t *testing.T) {
	fsys := newFakeFS()
	s, _ := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	l1, l2, l3 := layerDigest(1), layerDigest(2), layerDigest(3)
	fsys.notLazy[l2.String()] = true

	prepareLazy(t, s, "c1", "", l1)

	// A layer that is not in our format takes overlay's normal path: the
	// caller gets mounts to unpack into and commits itself.
	mounts, err := s.Prepare(ctx, "extract-2-c2", "c1", remoteOpts("c2", l2))
	if err != nil {
		t.Fatalf("Prepare non-lazy layer: %v", err)
	}
	if !isRoot() {
		t.Log("not root: skipping the unpack into overlay")
	} else {
		dir := t.TempDir()
		if err := mount.All(mounts, dir); err != nil {
			t.Fatal(err)
		}
		werr := os.WriteFile(filepath.Join(dir, layerFile(l2)), []byte(l2.String()), 0o644)
		if err := mount.UnmountAll(dir, 0); err != nil {
			t.Fatal(err)
		}
		if werr != nil {
			t.Fatal(werr)
		}
	}
	if err := s.Commit(ctx, "c2", "extract-2-c2"); err != nil {
		t.Fatal(err)
	}

	prepareLazy(t, s, "c3", "c2", l3)

	// A container's rootfs: overlay with three lowerdirs, two of them
	// symlinks to separate mounts.
	mounts, err = s.Prepare(ctx, "rootfs", "c3")
	if err != nil {
		t.Fatal(err)
	}
	want := []digest.Digest{l1, l3}
	if isRoot() {
		want = append(want, l2)
	}
	checkMountedFiles(t, mounts, want)
	if _, n := fsys.state(); n != 2 {
		t.Fatalf("%d mounts, want 2 (the non-lazy layer must not be mounted)", n)
	}
}

func TestRemoteSnapshotSharedLayer(t *testing.T) {
	fsys := newFakeFS()
	s, root := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	base1, base2, shared := layerDigest(1), layerDigest(2), layerDigest(3)
	mp := filepath.Join(root, "layers", "sha256", shared.Encoded(), "mnt")

	// The same layer on two different bases: two chainIDs, one mount.
	prepareLazy(t, s, "a1", "", base1)
	prepareLazy(t, s, "a2", "a1", shared)
	prepareLazy(t, s, "b1", "", base2)
	prepareLazy(t, s, "b2", "b1", shared)
	if _, n := fsys.state(); n != 3 {
		t.Fatalf("%d mounts, want 3", n)
	}

	// Removing the parent of a lazy snapshot is refused by the metadata
	// store and must not drop a reference.
	if err := s.Remove(ctx, "a1"); err == nil {
		t.Fatal("removed a parent snapshot")
	}

	for _, key := range []string{"a2", "a1"} {
		if err := s.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
	mounted, _ := fsys.state()
	if mounted[mp] == "" {
		t.Fatal("shared layer unmounted while b2 still uses it")
	}
	if len(mounted) != 2 {
		t.Fatalf("mounts after removing chain a: %v", mounted)
	}
	for _, key := range []string{"b2", "b1"} {
		if err := s.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
	if mounted, _ := fsys.state(); len(mounted) != 0 {
		t.Fatalf("left mounted after removing everything: %v", mounted)
	}
	if _, err := os.Stat(mp); !os.IsNotExist(err) {
		t.Fatalf("mountpoint not cleaned up: %v", err)
	}
	if ls := s.Layers(); len(ls) != 0 {
		t.Fatalf("layers after removing everything: %+v", ls)
	}
}

func TestRemoteSnapshotFallback(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []snapshots.Opt
	}{
		{"no labels", nil},
		{"ref only", []snapshots.Opt{snapshots.WithLabels(map[string]string{snapshots.LabelSnapshotRef: "c1"})}},
		{"no manifest", []snapshots.Opt{snapshots.WithLabels(map[string]string{
			snapshots.LabelSnapshotRef:                "c1",
			"containerd.io/snapshot/cri.image-ref":    "registry.test/x:1",
			"containerd.io/snapshot/cri.layer-digest": layerDigest(1).String(),
		})}},
		{"bad layer digest", []snapshots.Opt{snapshots.WithLabels(map[string]string{
			snapshots.LabelSnapshotRef:                   "c1",
			"containerd.io/snapshot/cri.image-ref":       "registry.test/x:1",
			"containerd.io/snapshot/cri.manifest-digest": testManifest,
			"containerd.io/snapshot/cri.layer-digest":    "nope",
		})}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fsys := newFakeFS()
			s, _ := newTestSnapshotter(t, fsys)
			ctx := testContext(t)
			mounts, err := s.Prepare(ctx, "extract-c1", "", tc.opts...)
			if err != nil {
				t.Fatalf("Prepare: %v", err)
			}
			if len(mounts) != 1 || mounts[0].Type != "bind" {
				t.Fatalf("mounts %+v", mounts)
			}
			if fi, err := os.Lstat(mounts[0].Source); err != nil || !fi.IsDir() {
				t.Fatalf("upper dir is not a plain directory: %v %v", fi, err)
			}
			if _, n := fsys.state(); n != 0 {
				t.Fatal("FileSystem mounted on the normal path")
			}
			if err := s.Commit(ctx, "c1", "extract-c1"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestRemoteSnapshotCheckRemounts(t *testing.T) {
	fsys := newFakeFS()
	s, _ := newTestSnapshotter(t, fsys)
	l := layerDigest(1)
	prepareLazy(t, s, "a1", "", l)
	fsys.checkErr = errors.New("transport endpoint is not connected")
	prepareLazy(t, s, "b1", "", layerDigest(2))
	prepareLazy(t, s, "b2", "b1", l) // shares l: Check fails, so it is remounted
	if _, n := fsys.state(); n != 3 {
		t.Fatalf("%d mounts, want 3 (l remounted after a failed check)", n)
	}
}

func TestRemoteSnapshotRestore(t *testing.T) {
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	l1, l2 := layerDigest(1), layerDigest(2)

	s, err := New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	prepareLazy(t, s, "c1", "", l1)
	prepareLazy(t, s, "c2", "c1", l2)
	prepareLazy(t, s, "d2", "c1", l2) // second reference to l2
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if mounted, _ := fsys.state(); len(mounted) != 0 {
		t.Fatalf("Close left mounts: %v", mounted)
	}

	s, err = New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if mounted, _ := fsys.state(); len(mounted) != 2 {
		t.Fatalf("restored mounts: %v", mounted)
	}
	refs := map[digest.Digest]int{}
	for _, ls := range s.Layers() {
		if !ls.Mounted {
			t.Errorf("layer %s not mounted: %s", ls.Digest, ls.Error)
		}
		refs[ls.Digest] = ls.Snapshots
	}
	if refs[l1] != 1 || refs[l2] != 2 {
		t.Fatalf("restored refs %v", refs)
	}
	mounts, err := s.Prepare(ctx, "rootfs", "c2")
	if err != nil {
		t.Fatal(err)
	}
	checkMountedFiles(t, mounts, []digest.Digest{l1, l2})
	if err := s.Remove(ctx, "rootfs"); err != nil {
		t.Fatal(err)
	}
	// Removing one of two users of l2 after a restart keeps it mounted.
	if err := s.Remove(ctx, "d2"); err != nil {
		t.Fatal(err)
	}
	if mounted, _ := fsys.state(); len(mounted) != 2 {
		t.Fatalf("mounts after removing d2: %v", mounted)
	}
}

func TestUpdateKeepsLazyLabels(t *testing.T) {
	s, _ := newTestSnapshotter(t, newFakeFS())
	ctx := testContext(t)
	l := layerDigest(1)
	prepareLazy(t, s, "c1", "", l)
	info, err := s.Update(ctx, snapshots.Info{Name: "c1", Labels: map[string]string{"x": "y"}}, "labels")
	if err != nil {
		t.Fatal(err)
	}
	if info.Labels["x"] != "y" || info.Labels[LabelLayerDigest] != l.String() {
		t.Fatalf("labels after Update: %v", info.Labels)
	}
}

func isRoot() bool { return os.Getuid() == 0 }

// checkMountedFiles mounts ms (as root) and checks that the root holds the
// marker file of every layer in want; without root it checks the symlinks.
func checkMountedFiles(t *testing.T, ms []mount.Mount, want []digest.Digest) {
	t.Helper()
	if !isRoot() {
		t.Log("not root: not mounting")
		return
	}
	dir := t.TempDir()
	if err := mount.All(ms, dir); err != nil {
		t.Fatalf("mount %+v: %v", ms, err)
	}
	defer func() {
		if err := mount.UnmountAll(dir, 0); err != nil {
			t.Errorf("unmount: %v", err)
		}
	}()
	for _, d := range want {
		b, err := os.ReadFile(filepath.Join(dir, layerFile(d)))
		if err != nil {
			t.Errorf("layer %s not visible through %s mount: %v", d, ms[0].Type, err)
			continue
		}
		if string(b) != d.String() {
			t.Errorf("layer file %s = %q", d, b)
		}
	}
}

// TestRemoteSnapshotConcurrent races Prepare and Remove of chains sharing
// one layer: the layer must never be mounted twice on its mountpoint (the
// fake refuses that, which would turn a lazy Prepare into a fallback) and
// nothing may stay mounted at the end.
func TestRemoteSnapshotConcurrent(t *testing.T) {
	fsys := newFakeFS()
	fsys.unmountDelay = time.Millisecond
	s, _ := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	shared := layerDigest(1)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				chain := fmt.Sprintf("g%d-%d", g, i)
				_, err := s.Prepare(ctx, "extract-"+chain, "", remoteOpts(chain, shared))
				if !errdefs.IsAlreadyExists(err) {
					errs <- fmt.Errorf("Prepare %s: %v, want ErrAlreadyExists", chain, err)
					return
				}
				if err := s.Remove(ctx, chain); err != nil {
					errs <- fmt.Errorf("Remove %s: %w", chain, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if mounted, _ := fsys.state(); len(mounted) != 0 {
		t.Fatalf("left mounted: %v", mounted)
	}
	if ls := s.Layers(); len(ls) != 0 {
		t.Fatalf("layers left: %+v", ls)
	}
}

// TestRestoreFailure: a layer that cannot be remounted on startup is
// reported, its snapshots fail to mount instead of showing an empty layer,
// and the next Prepare of the layer mounts it again.
func TestRestoreFailure(t *testing.T) {
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	l := layerDigest(1)
	s, err := New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	prepareLazy(t, s, "c1", "", l)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	fsys.mountErr = errors.New("registry unreachable")
	s, err = New(ctx, root, fsys)
	if err != nil {
		t.Fatalf("New must survive a failed restore: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	ls := s.Layers()
	if len(ls) != 1 || ls[0].Mounted || !strings.Contains(ls[0].Error, "registry unreachable") {
		t.Fatalf("layers after failed restore: %+v", ls)
	}
	// overlay stats the parent's upper directory (our dangling symlink).
	if _, err := s.View(ctx, "v1", "c1"); err == nil {
		t.Fatal("made a view of a snapshot whose layer is not mounted")
	}

	fsys.mountErr = nil
	prepareLazy(t, s, "d1", "", l) // another chain with the same layer
	mounts, err := s.View(ctx, "v1", "c1")
	if err != nil {
		t.Fatal(err)
	}
	checkMountedFiles(t, mounts, []digest.Digest{l})
}

// TestRestoreDetachesStaleMount: a mount left at a layer's mountpoint by a
// previous daemon (it could not unmount a layer a container still used) is
// detached before the layer is mounted again, not stacked on.
func TestRestoreDetachesStaleMount(t *testing.T) {
	if !isRoot() {
		prereq.Missing(t, "mounts: needs root")
	}
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	l := layerDigest(1)
	s, err := New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	prepareLazy(t, s, "c1", "", l)
	mp := s.layerMountpoint(l)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// What the previous daemon left behind.
	if err := os.MkdirAll(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for unix.Unmount(mp, unix.MNT_DETACH) == nil {
		}
	})

	s, err = New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if n := mountsAt(t, mp); n != 1 {
		t.Fatalf("%d mounts stacked at %s, want 1", n, mp)
	}
	if ls := s.Layers(); len(ls) != 1 || !ls[0].Mounted {
		t.Fatalf("layers %+v", ls)
	}
}

func mountsAt(t *testing.T, p string) int {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == p {
			n++
		}
	}
	return n
}

// hintOpts are the labels containerd's unpacker sends for one layer whose
// descriptor has hint annotations, when the client adds none of its own.
func hintOpts(chainID string, layer digest.Digest, extra map[string]string) snapshots.Opt {
	labels := map[string]string{
		snapshots.LabelSnapshotRef:       chainID,
		"containerd.io/snapshot/diff-id": layer.String(),
		layerfmt.AnnotationHintSource:    "registry.test/envsnap/base",
		layerfmt.AnnotationHintLayer:     layer.String(),
		layerfmt.AnnotationHintSize:      "4096",
		layerfmt.AnnotationHintTOC:       testManifest,
	}
	for k, v := range extra {
		if v == "" {
			delete(labels, k)
		} else {
			labels[k] = v
		}
	}
	return snapshots.WithLabels(labels)
}

func TestHintedSnapshot(t *testing.T) {
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	s, err := New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	l1 := layerDigest(1)
	if _, err := s.Prepare(ctx, "extract-c1", "", hintOpts("c1", l1, nil)); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("Prepare with hints: %v, want ErrAlreadyExists", err)
	}
	info, err := s.Stat(ctx, "c1")
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]string{
		LabelLayerDigest:    l1.String(),
		LabelImageRef:       "registry.test/envsnap/base",
		LabelTOCDigest:      testManifest,
		LabelLayerSize:      "4096",
		LabelManifestDigest: "",
	} {
		if got := info.Labels[k]; got != want {
			t.Errorf("label %s = %q, want %q", k, got, want)
		}
	}
	// The hint labels are enough to mount the layer again after a restart.
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err = New(ctx, root, fsys); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if ls := s.Layers(); len(ls) != 1 || !ls[0].Mounted {
		t.Fatalf("restored layers %+v", ls)
	}
}

// TestHintsNotLazy: hints that are incomplete or malformed, or that the
// FileSystem refuses, leave the layer to a normal unpack.
func TestHintsNotLazy(t *testing.T) {
	fsys := newFakeFS()
	s, _ := newTestSnapshotter(t, fsys)
	ctx := testContext(t)
	for i, extra := range []map[string]string{
		{layerfmt.AnnotationHintTOC: ""},
		{layerfmt.AnnotationHintSize: "-1"},
		{layerfmt.AnnotationHintLayer: "sha256:short"},
	} {
		chain := fmt.Sprintf("bad%d", i)
		ms, err := s.Prepare(ctx, "extract-"+chain, "", hintOpts(chain, layerDigest(10+i), extra))
		if err != nil || len(ms) != 1 {
			t.Fatalf("Prepare with hints %v: %v %v, want an active snapshot to unpack into", extra, ms, err)
		}
	}
	if _, n := fsys.state(); n != 0 {
		t.Fatalf("%d layers mounted from bad hints", n)
	}
	fsys.mountErr = fmt.Errorf("source not allowed: %w", errdefs.ErrPermissionDenied)
	ms, err := s.Prepare(ctx, "extract-refused", "", hintOpts("refused", layerDigest(20), nil))
	if err != nil || len(ms) != 1 {
		t.Fatalf("Prepare with a refused hint: %v %v, want an active snapshot to unpack into", ms, err)
	}
}

// TestInternalLabelsDropped: a manifest annotation named like one of the
// snapshotter's own labels reaches Prepare as a label; it must not make a
// normally unpacked snapshot look lazy.
func TestInternalLabelsDropped(t *testing.T) {
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	s, err := New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	forged := snapshots.WithLabels(map[string]string{
		snapshots.LabelSnapshotRef: "c1",
		LabelLayerDigest:           layerDigest(1).String(),
		LabelImageRef:              "registry.test/envsnap/forged",
		LabelManifestDigest:        testManifest,
	})
	if _, err := s.Prepare(ctx, "extract-c1", "", forged); err != nil {
		t.Fatal(err)
	}
	// The unpacker commits with the same labels.
	if err := s.Commit(ctx, "c1", "extract-c1", forged); err != nil {
		t.Fatal(err)
	}
	info, err := s.Stat(ctx, "c1")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range internalLabels {
		if v, ok := info.Labels[k]; ok {
			t.Errorf("committed snapshot kept forged label %s=%q", k, v)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err = New(ctx, root, fsys); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if ls := s.Layers(); len(ls) != 0 {
		t.Fatalf("a restart took the unpacked snapshot for a lazy one: %+v", ls)
	}
}

// TestLayerRefsFollowUsers: a layer's Refs name the images whose snapshots
// still use it, the most recent pull first, not the image that mounted it
// first (status showed that one long after it was gone).
func TestLayerRefsFollowUsers(t *testing.T) {
	fsys := newFakeFS()
	root := t.TempDir()
	ctx := testContext(t)
	s, err := New(ctx, root, fsys)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Close() }()
	base1, base2, shared, solo := layerDigest(1), layerDigest(2), layerDigest(3), layerDigest(4)
	const a, b, c, d = "registry.test/a:1", "registry.test/b:1", "registry.test/c:1", "registry.test/d:1"
	refsOf := func(l digest.Digest) []string {
		t.Helper()
		for _, ls := range s.Layers() {
			if ls.Digest == l {
				return ls.Refs
			}
		}
		t.Fatalf("layer %s not listed", l)
		return nil
	}
	check := func(l digest.Digest, want ...string) {
		t.Helper()
		if got := refsOf(l); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("layer %s: refs %q, want %q", l.Encoded()[:8], got, want)
		}
	}

	// The shared layer on two bases: image a mounts it, image b uses it too.
	prepareLazyFor(t, s, a, "a1", "", base1)
	prepareLazyFor(t, s, a, "a2", "a1", shared)
	prepareLazyFor(t, s, b, "b1", "", base2)
	prepareLazyFor(t, s, b, "b2", "b1", shared)
	check(shared, b, a)
	check(base1, a)

	// Image a is gone (containerd's GC removes its snapshots): the layer
	// stays mounted for b and names b alone.
	for _, key := range []string{"a2", "a1"} {
		if err := s.Remove(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
	check(shared, b)

	// One chain pulled by two images is one snapshot: it names the last.
	prepareLazyFor(t, s, c, "c1", "", solo)
	prepareLazyFor(t, s, d, "c1", "", solo)
	check(solo, d)

	// After a restart the snapshots' labels tell who created them.
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err = New(ctx, root, fsys); err != nil {
		t.Fatal(err)
	}
	check(shared, b)
	check(solo, c)
}

// countingSnapshotter counts overlay's Prepare calls, each slowed down
// to widen the window in which concurrent Prepares overlap.
type countingSnapshotter struct {
	snapshots.Snapshotter
	prepares atomic.Int32
}

func (c *countingSnapshotter) Prepare(ctx context.Context, key, parent string, opts ...snapshots.Opt) ([]mount.Mount, error) {
	c.prepares.Add(1)
	time.Sleep(20 * time.Millisecond)
	return c.Snapshotter.Prepare(ctx, key, parent, opts...)
}

// TestConcurrentPreparesOfOneTarget: environments pulled together prepare
// their shared layer at once; one Prepare makes it, the others wait and
// find it committed, without making and removing an active snapshot of
// their own (write transactions of overlay's metadata store).
func TestConcurrentPreparesOfOneTarget(t *testing.T) {
	fsys := newFakeFS()
	s, _ := newTestSnapshotter(t, fsys)
	counting := &countingSnapshotter{Snapshotter: s.Snapshotter}
	s.Snapshotter = counting
	ctx := testContext(t)
	shared := layerDigest(1)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() {
			_, errs[i] = s.Prepare(ctx, fmt.Sprintf("extract-%d-base", i), "", remoteOpts("base", shared))
		})
	}
	wg.Wait()
	for i, err := range errs {
		if !errdefs.IsAlreadyExists(err) {
			t.Errorf("Prepare %d: %v, want ErrAlreadyExists", i, err)
		}
	}
	if n := counting.prepares.Load(); n != 1 {
		t.Errorf("overlay Prepare called %d times for one target, want 1", n)
	}
	if info, err := s.Stat(ctx, "base"); err != nil || info.Kind != snapshots.KindCommitted {
		t.Fatalf("target: %+v, %v", info, err)
	}
	if _, mounts := fsys.state(); mounts != 1 {
		t.Errorf("%d mounts, want 1", mounts)
	}
}
