// Package envsnapshot_test snapshots running containers on the envsnap
// snapshotter with `containerd-envsnap env snapshot`, forks the snapshots
// with `env fork`, and compares the forks' files with the parent's, on a
// real containerd, registry and envsnap daemon.
package envsnapshot_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/envsnapshot"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

// skip leaves out what the runtime mounts over the image.
var skip = []string{"proc", "sys", "dev", "etc/resolv.conf", "etc/hosts", "etc/hostname"}

type rig struct {
	env *testenv.Env
	bin string
}

func newRig(t *testing.T, daemonArgs ...string) *rig {
	t.Helper()
	e := testenv.New(t, testenv.WithEnvsnap(daemonArgs...))
	return &rig{env: e, bin: testenv.Binary(t, "containerd-envsnap")}
}

// cli runs containerd-envsnap against the rig's containerd and registry.
func (r *rig) cli(args ...string) (string, error) {
	full := append([]string{args[0], args[1],
		"--address", r.env.Address, "--namespace", r.env.Namespace, "--hosts-dir", r.env.HostsDir}, args[2:]...)
	out, err := exec.Command(r.bin, full...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("containerd-envsnap %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (r *rig) mustCLI(t *testing.T, args ...string) string {
	t.Helper()
	out, err := r.cli(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// upper is the writable directory of container id's snapshot.
func (r *rig) upper(t *testing.T, id string) string {
	t.Helper()
	ctx := r.env.Context()
	c, err := r.env.Client.LoadContainer(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mounts, err := r.env.Client.SnapshotService(info.Snapshotter).Mounts(ctx, info.SnapshotKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mounts {
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "upperdir="); ok {
				return v
			}
		}
	}
	t.Fatalf("no upperdir in the mounts of %s: %+v", id, mounts)
	return ""
}

// rootfs is where the shim mounted a running container's root filesystem.
func (r *rig) rootfs(id string) string {
	return filepath.Join(r.env.Dir, "state", "io.containerd.runtime.v2.task", r.env.Namespace, id, "rootfs")
}

// start runs script in a new container on envsnap from img and waits for
// the script to create /ready; the container then stays up.
func (r *rig) start(t *testing.T, img client.Image, id, script string) client.Task {
	t.Helper()
	return r.startOn(t, img, id, "envsnap", script)
}

// startOn is start with another snapshotter.
func (r *rig) startOn(t *testing.T, img client.Image, id, snapshotter, script string) client.Task {
	t.Helper()
	ctx := r.env.Context()
	c, err := r.env.Client.NewContainer(ctx, id,
		client.WithImage(img),
		client.WithSnapshotter(snapshotter),
		client.WithNewSnapshot(id, img),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs("/bin/sh", "-c", script+"\ntouch /ready\nexec sleep 100000")),
	)
	if err != nil {
		t.Fatalf("create %s: %v", id, err)
	}
	task, err := c.NewTask(ctx, cio.NullIO)
	if err != nil {
		t.Fatalf("task %s: %v", id, err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatalf("start %s: %v", id, err)
	}
	r.waitReady(t, id)
	return task
}

// waitReady waits for the container's script to create /ready, then
// removes the marker so that snapshots do not carry it to forks (where it
// would announce a script that has not run yet).
func (r *rig) waitReady(t *testing.T, id string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Minute)
	for {
		marker := filepath.Join(r.rootfs(id), "ready")
		if _, err := os.Stat(marker); err == nil {
			if err := os.Remove(marker); err != nil {
				t.Fatal(err)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("container %s never created /ready", id)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *rig) describe(t *testing.T, id string) map[string]string {
	t.Helper()
	d, err := devenv.DescribeTree(r.rootfs(id), skip...)
	if err != nil {
		t.Fatalf("describe %s: %v", id, err)
	}
	return d
}

func (r *rig) sameTree(t *testing.T, what string, want, got map[string]string) {
	t.Helper()
	if diffs := devenv.DiffTrees(want, got); len(diffs) > 0 {
		t.Fatalf("%s: %d differences:\n%s", what, len(diffs), strings.Join(diffs, "\n"))
	}
}

// fork forks ref n times with the CLI and returns the container IDs; each
// fork runs script (then creates /ready and stays up).
func (r *rig) fork(t *testing.T, ref, prefix string, n int, script string) []string {
	t.Helper()
	out := r.mustCLI(t, "env", "fork", "-n", strconv.Itoa(n), "--id-prefix", prefix, ref, "--",
		"/bin/sh", "-c", script+"\ntouch /ready\nexec sleep 100000")
	var ids []string
	for i := range n {
		id := fmt.Sprintf("%s-%d", prefix, i)
		if !strings.Contains(out, id+"\tready\t") {
			t.Fatalf("fork output lacks %s:\n%s", id, out)
		}
		r.waitReady(t, id)
		ids = append(ids, id)
	}
	return ids
}

var snapLine = regexp.MustCompile(`uploaded (\d+) bytes, (\d+) layers linked; depth (\d+)`)

// snapshot snapshots id to ref with the CLI and returns uploaded bytes and
// depth.
func (r *rig) snapshot(t *testing.T, id, ref string, extra ...string) (uploaded int64, depth int, out string) {
	t.Helper()
	out = r.mustCLI(t, append([]string{"env", "snapshot", "--push", ref}, append(extra, id)...)...)
	m := snapLine.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("unexpected snapshot output:\n%s", out)
	}
	uploaded, _ = strconv.ParseInt(m[1], 10, 64)
	depth, _ = strconv.Atoi(m[3])
	return uploaded, depth, out
}

// manifest fetches ref's manifest from the registry.
func (r *rig) manifest(t *testing.T, ref string) ocispec.Manifest {
	t.Helper()
	ctx := context.Background()
	res := r.env.Resolver()
	name, desc, err := res.Resolve(ctx, ref)
	if err != nil {
		t.Fatalf("resolve %s: %v", ref, err)
	}
	f, err := res.Fetcher(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := f.Fetch(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var m ocispec.Manifest
	if err := json.NewDecoder(rc).Decode(&m); err != nil {
		t.Fatal(err)
	}
	return m
}

func (r *rig) exists(ref string) bool {
	_, _, err := r.env.Resolver().Resolve(context.Background(), ref)
	return err == nil
}

// baseFiles is the original environment: a lazy image with a repository.
func baseFiles() []testenv.File {
	return []testenv.File{
		{Path: "/srv/repo/main.go", Data: []byte("package main\n")},
		{Path: "/srv/repo/README", Data: []byte("readme\n")},
		{Path: "/srv/repo/pkg/a.go", Data: []byte("package pkg\n")},
		{Path: "/srv/repo/pkg/b.go", Data: []byte("package pkg // b\n")},
		{Path: "/srv/cache/old", Data: []byte("stale cache\n")},
		testenv.RandomFile("/opt/tool/bin.dat", 4<<20, 7),
		{Path: "/etc/app.conf", Data: []byte("mode=base\n")},
	}
}

// episode is what an agent does up to step k: edits, deletes, renames,
// permission changes, a deleted and re-created directory (opaque), hard
// links, symlinks, a FIFO and a larger output file.
const episode = `set -e
echo 'package main // edited at step k' > /srv/repo/main.go
rm /srv/repo/README
mv /srv/repo/pkg/b.go /srv/repo/pkg/c.go
chmod 0700 /srv/repo/pkg
chmod 4755 /srv/repo/main.go
rm -rf /srv/cache
mkdir -p /srv/cache/new
echo fresh > /srv/cache/new/entry
echo shared > /srv/out.txt
ln /srv/out.txt /srv/out-link.txt
ln -s ../srv/repo/main.go /opt/main-link
mkfifo /srv/pipe
head -c 3145728 /opt/tool/bin.dat > /srv/build.out
chown 1000:1000 /srv/build.out
`

func TestSnapshotForkChain(t *testing.T) {
	r := newRig(t)
	e := r.env
	base := e.PushImage(t, "envsnap-test/env:1", baseFiles(), testenv.WithLazyLayers())
	img := e.Pull(t, base.Ref, "envsnap")
	r.start(t, img, "parent", episode)
	// An xattr, set through the container's root filesystem.
	if err := unix.Lsetxattr(filepath.Join(r.rootfs("parent"), "srv/out.txt"), "user.rl.step", []byte("k"), 0); err != nil {
		t.Fatal(err)
	}
	parentAtK := r.describe(t, "parent")

	snapA := e.Registry.Host + "/envsnap-test/snap:a"
	e.Registry.ResetCounters()
	uploaded, depth, out := r.snapshot(t, "parent", snapA, "--max-depth", "2")
	t.Logf("snapshot: %s", out)
	if depth != 1 {
		t.Errorf("depth %d, want 1", depth)
	}
	m := r.manifest(t, snapA)
	if len(m.Layers) != len(base.Layers)+1 {
		t.Fatalf("snapshot has %d layers, want the image's %d plus one", len(m.Layers), len(base.Layers))
	}
	top := m.Layers[len(m.Layers)-1]
	// Only the diff, the config and the manifest were uploaded: the
	// image's layers were linked.
	for _, d := range e.Registry.UploadedDigests() {
		for _, l := range base.Layers {
			if d == l.Digest.String() {
				t.Errorf("base layer %s was uploaded again", d)
			}
		}
	}
	if uploaded < top.Size || uploaded > top.Size+64<<10 {
		t.Errorf("uploaded %d bytes for a %d-byte diff layer", uploaded, top.Size)
	}

	// The parent keeps running after the snapshot and changes further;
	// the forks must show step k, not what came after.
	if err := os.WriteFile(filepath.Join(r.rootfs("parent"), "srv/after-k"), []byte("later"), 0o644); err != nil {
		t.Fatal(err)
	}
	forks := r.fork(t, snapA, "a", 2, "true")
	for _, id := range forks {
		got := r.describe(t, id)
		r.sameTree(t, "fork "+id+" vs parent at step k", parentAtK, got)
	}

	// Forks diverge independently.
	if err := os.WriteFile(filepath.Join(r.rootfs(forks[0]), "srv/only-a0"), []byte("a0"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(r.rootfs(forks[1]), "srv/repo/main.go")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ id, path string }{{forks[1], "srv/only-a0"}, {"parent", "srv/only-a0"}} {
		if _, err := os.Stat(filepath.Join(r.rootfs(c.id), c.path)); err == nil {
			t.Errorf("%s sees %s written by %s", c.id, c.path, forks[0])
		}
	}
	for _, id := range []string{forks[0], "parent"} {
		if _, err := os.Stat(filepath.Join(r.rootfs(id), "srv/repo/main.go")); err != nil {
			t.Errorf("%s lost main.go deleted by %s: %v", id, forks[1], err)
		}
	}

	// A directory only the chain has, with a file that the next step
	// deletes: the squash must not keep a whiteout for it (overlayfs
	// lists one in a directory no lower shares, with stat failing).
	if err := os.MkdirAll(filepath.Join(r.rootfs(forks[0]), "srv/chain-only"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"gone", "kept"} {
		if err := os.WriteFile(filepath.Join(r.rootfs(forks[0]), "srv/chain-only", f), []byte(f), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// Chain: snapshot fork a-0 (step k+m), fork it, change it, snapshot
	// again: with --max-depth 2 the third snapshot squashes.
	snapB := e.Registry.Host + "/envsnap-test/snap:b"
	_, depth, _ = r.snapshot(t, forks[0], snapB, "--max-depth", "2")
	if depth != 2 {
		t.Errorf("snapshot of a fork: depth %d, want 2", depth)
	}
	bForks := r.fork(t, snapB, "b", 1, `set -e
rm /srv/only-a0
rm /srv/chain-only/gone
rm -rf /srv/repo/pkg
mkdir /srv/repo/pkg
echo again > /srv/repo/pkg/z.go
echo k+2m >> /etc/app.conf
rm /srv/out.txt`)
	atK2 := r.describe(t, bForks[0])
	snapC := e.Registry.Host + "/envsnap-test/snap:c"
	// One over the limit: pushed at depth 3 at once, then squashed in the
	// background and re-tagged at depth 1.
	_, depth, out = r.snapshot(t, bForks[0], snapC, "--max-depth", "2")
	if depth != 3 || !strings.Contains(out, "squashed 3 snapshot layers into one") {
		t.Errorf("third snapshot in a chain with max depth 2: depth %d, want 3 then a background squash; output:\n%s", depth, out)
	}
	mc := r.manifest(t, snapC)
	if len(mc.Layers) != len(base.Layers)+1 {
		t.Errorf("squashed snapshot has %d layers, want %d", len(mc.Layers), len(base.Layers)+1)
	}
	from := mc.Annotations[envsnapshot.AnnotationSquashedFrom]
	if mu := r.manifest(t, e.Registry.Host+"/envsnap-test/snap@"+from); len(mu.Layers) != len(base.Layers)+3 {
		t.Errorf("the snapshot pushed before the squash (%q) has %d layers, want %d", from, len(mu.Layers), len(base.Layers)+3)
	}
	// Plain ctr runs a snapshot too: the transfer service's pull with the
	// remote-snapshot labels, then ctr run on envsnap.
	ctr := func(args ...string) {
		t.Helper()
		full := append([]string{"--address", e.Address, "--namespace", e.Namespace}, args...)
		if out, err := exec.Command(testenv.Tool(t, "ctr"), full...).CombinedOutput(); err != nil {
			t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ctr("images", "pull", "--hosts-dir", e.HostsDir, "--snapshotter", "envsnap", snapC)
	ctr("run", "-d", "--snapshotter", "envsnap", snapC, "c-0", "/bin/sh", "-c", "touch /ready; exec sleep 100000")
	r.waitReady(t, "c-0")
	r.sameTree(t, "ctr run of the squashed snapshot vs its parent", atK2, r.describe(t, "c-0"))
}

// TestSnapshotConsistentUnderWrites: the container rewrites two files in
// lockstep (a first, then b; each an overwrite in place of a fixed-width
// number by a shell builtin, so neither is ever empty; thousands of rounds
// a second) as fast as it can; at every instant 0 <= a-b <= 1. A snapshot that read
// the files at different moments would break that; a frozen one cannot.
func TestSnapshotConsistentUnderWrites(t *testing.T) {
	r := newRig(t)
	e := r.env
	base := e.PushImage(t, "envsnap-test/writer:1", nil, testenv.WithLazyLayers())
	img := e.Pull(t, base.Ref, "envsnap")
	r.start(t, img, "writer", `mkdir -p /w/m
head -c 1048576 /dev/zero > /w/m/pad
printf '%09d\n' 0 > /w/a
printf '%09d\n' 0 > /w/b
( i=0; while :; do i=$((i+1)); printf '%09d\n' $i 1<>/w/a; printf '%09d\n' $i 1<>/w/b; done ) &`)
	for n := range 5 {
		ref := fmt.Sprintf("%s/envsnap-test/writer-snap:%d", e.Registry.Host, n)
		_, _, out := r.snapshot(t, "writer", ref)
		if !regexp.MustCompile(`frozen [1-9]`).MatchString(out) {
			t.Errorf("snapshot %d of a running container reports no freeze:\n%s", n, out)
		}
		m := r.manifest(t, ref)
		top := m.Layers[len(m.Layers)-1]
		a, b := r.layerInt(t, ref, top, "w/a"), r.layerInt(t, ref, top, "w/b")
		if d := a - b; d < 0 || d > 1 {
			t.Fatalf("snapshot %d: a=%d b=%d: the files were not captured at one instant", n, a, b)
		}
		t.Logf("snapshot %d: a=%d b=%d", n, a, b)
	}
	// The writer still runs: its counter moves on after the snapshots.
	before := r.fileInt(t, "writer", "w/a")
	time.Sleep(200 * time.Millisecond)
	if after := r.fileInt(t, "writer", "w/a"); after <= before {
		t.Errorf("the writer stopped after the snapshots (a stayed at %d): the container was left frozen", after)
	}
}

func (r *rig) fileInt(t *testing.T, id, name string) int {
	t.Helper()
	for range 50 {
		b, err := os.ReadFile(filepath.Join(r.rootfs(id), name))
		if n, err2 := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && err2 == nil {
			return n
		}
		time.Sleep(10 * time.Millisecond) // caught between truncate and write
	}
	t.Fatalf("no number in %s of %s", name, id)
	return 0
}

// layerInt reads a number from a file of a pushed layer.
func (r *rig) layerInt(t *testing.T, ref string, l ocispec.Descriptor, name string) int {
	t.Helper()
	br, err := fetch.NewBlobReader(r.env.Hosts(), ref, l)
	if err != nil {
		t.Fatal(err)
	}
	lr, err := layerfmt.NewReader(br.ReaderAt(context.Background()), l.Size, digest.Digest(l.Annotations[layerfmt.AnnotationTOCDigest]))
	if err != nil {
		t.Fatal(err)
	}
	f, err := lr.Open(name)
	if err != nil {
		t.Fatalf("%s in the snapshot layer: %v", name, err)
	}
	defer f.Close()
	b, _ := io.ReadAll(f)
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("%s in the snapshot holds %q: a torn write", name, b)
	}
	return n
}

func TestSnapshotBadInput(t *testing.T) {
	r := newRig(t)
	e := r.env
	ctx := e.Context()
	base := e.PushImage(t, "envsnap-test/bad:1", nil, testenv.WithLazyLayers())
	img := e.Pull(t, base.Ref, "envsnap")
	target := e.Registry.Host + "/envsnap-test/bad-snap:1"

	out, err := r.cli("env", "snapshot", "--push", target, "no-such-container")
	if err == nil || !strings.Contains(out, `container "no-such-container" in namespace "`+e.Namespace+`": not found`) {
		t.Errorf("unknown container: err %v, output:\n%s", err, out)
	}
	t.Logf("unknown container: %s", out)

	ovl := e.Pull(t, base.Ref, "overlayfs")
	if _, err := e.Client.NewContainer(ctx, "on-overlayfs", client.WithImage(ovl), client.WithSnapshotter("overlayfs"),
		client.WithNewSnapshot("on-overlayfs", ovl), client.WithNewSpec(oci.WithImageConfig(ovl))); err != nil {
		t.Fatal(err)
	}
	out, err = r.cli("env", "snapshot", "--push", target, "on-overlayfs")
	if err == nil || !strings.Contains(out, `uses the "overlayfs" snapshotter`) {
		t.Errorf("container on overlayfs: err %v, output:\n%s", err, out)
	}
	t.Logf("container on overlayfs: %s", out)

	task := r.start(t, img, "big", "head -c 2097152 /dev/urandom > /big")
	out, err = r.cli("env", "snapshot", "--max-diff-size", "1MiB", "--push", target, "big")
	if err == nil || !strings.Contains(out, "diff larger than the configured cap") {
		t.Errorf("diff over the cap: err %v, output:\n%s", err, out)
	}
	t.Logf("diff over the cap: %s", out)
	if r.exists(target) {
		t.Errorf("%s exists after a refused snapshot", target)
	}

	// A read that fails while the container is frozen: a directory of
	// the upper marked as moved by overlayfs' redirect_dir (directories
	// are read frozen) is refused; the container is thawed all the same.
	if err := os.Mkdir(filepath.Join(r.rootfs("big"), "moved"), 0o755); err != nil {
		t.Fatal(err)
	}
	moved := filepath.Join(r.upper(t, "big"), "moved")
	if err := unix.Lsetxattr(moved, "trusted.overlay.redirect", []byte("/old"), 0); err != nil {
		t.Fatal(err)
	}
	out, err = r.cli("env", "snapshot", "--push", target, "big")
	t.Logf("read failing while frozen: %s", out)
	if err == nil || !strings.Contains(out, "redirect_dir or metacopy") {
		t.Errorf("read failing while frozen: err %v, output:\n%s", err, out)
	}
	if st, err := task.Status(ctx); err != nil || st.Status != client.Running {
		t.Errorf("after a read that failed while frozen the task is %v (%v), want running", st.Status, err)
	}
	if r.exists(target) {
		t.Errorf("%s exists after a failed read", target)
	}
	if err := unix.Lremovexattr(moved, "trusted.overlay.redirect"); err != nil {
		t.Fatal(err)
	}

	// Every blob upload fails: the snapshot fails, no manifest appears,
	// and the container is running (thawed), not left frozen.
	e.Registry.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
		if strings.Contains(req.URL.Path, "/blobs/uploads/") && req.Method != http.MethodPost {
			http.Error(w, "injected upload failure", http.StatusInternalServerError)
			return true
		}
		return false
	})
	out, err = r.cli("env", "snapshot", "--push", target, "big")
	e.Registry.Intercept(nil)
	t.Logf("push failure: %s", out)
	if err == nil || !strings.Contains(out, "diff layer") || !strings.Contains(out, "the manifest was not pushed") {
		t.Errorf("push failure: err %v, output:\n%s", err, out)
	}
	if r.exists(target) {
		t.Errorf("%s exists after a failed push", target)
	}
	st, err := task.Status(ctx)
	if err != nil || st.Status != client.Running {
		t.Errorf("after the failed snapshot the task is %v (%v), want running", st.Status, err)
	}
	// The diff layer is streamed in chunks while it is encoded: a chunk
	// the registry refuses, or a connection cut in the middle of one,
	// fails the snapshot with what did not get there; no image, and the
	// container runs.
	chunkFaults := []struct {
		name   string
		answer func(w http.ResponseWriter, req *http.Request)
		want   string
	}{
		{"PATCH refused", func(w http.ResponseWriter, req *http.Request) {
			http.Error(w, "injected refusal", http.StatusServiceUnavailable)
		}, "503 Service Unavailable: injected refusal"},
		{"connection cut", func(w http.ResponseWriter, req *http.Request) {
			_, _ = io.CopyN(io.Discard, req.Body, 1000)
			if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
				conn.Close()
			}
		}, "Patch "},
	}
	for _, f := range chunkFaults {
		e.Registry.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
			if req.Method == http.MethodPatch && strings.HasPrefix(req.Header.Get("Content-Range"), "262144-") {
				f.answer(w, req)
				return true
			}
			return false
		})
		_, err := envsnapshot.Take(ctx, e.Client, "big", target, envsnapshot.Options{Hosts: e.Hosts(), UploadChunk: 256 << 10})
		e.Registry.Intercept(nil)
		t.Logf("%s: %v", f.name, err)
		if err == nil || !strings.Contains(err.Error(), "diff layer: upload bytes 262144-524287") || !strings.Contains(err.Error(), f.want) ||
			!strings.Contains(err.Error(), "the manifest was not pushed") {
			t.Errorf("%s: %v", f.name, err)
		}
		if r.exists(target) {
			t.Errorf("%s exists after a failed chunk (%s)", target, f.name)
		}
		if st, err := task.Status(ctx); err != nil || st.Status != client.Running {
			t.Errorf("after a failed chunk (%s) the task is %v (%v), want running", f.name, st.Status, err)
		}
	}
	// The blobs go up but the manifest is refused: still no image.
	e.Registry.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
		if strings.Contains(req.URL.Path, "/manifests/") && req.Method == http.MethodPut {
			http.Error(w, "injected manifest failure", http.StatusInternalServerError)
			return true
		}
		return false
	})
	out, err = r.cli("env", "snapshot", "--push", target, "big")
	e.Registry.Intercept(nil)
	t.Logf("manifest push failure: %s", out)
	if err == nil || !strings.Contains(out, "manifest") || !strings.Contains(out, "the manifest was not pushed") {
		t.Errorf("manifest push failure: err %v, output:\n%s", err, out)
	}
	if r.exists(target) {
		t.Errorf("%s exists after a refused manifest push", target)
	}
	// The same snapshot goes through once the registry is healthy.
	r.snapshot(t, "big", target)
	// Without streaming (a registry that refuses chunked uploads) the
	// layer goes up after the encode, with no PATCH.
	e.Registry.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
		if req.Method == http.MethodPatch {
			http.Error(w, "no chunked uploads here", http.StatusMethodNotAllowed)
			return true
		}
		return false
	})
	unstreamed := e.Registry.Host + "/envsnap-test/bad-snap:unstreamed"
	res, err := envsnapshot.Take(ctx, e.Client, "big", unstreamed, envsnapshot.Options{Hosts: e.Hosts(), UploadChunk: -1})
	e.Registry.Intercept(nil)
	if err != nil {
		t.Fatalf("snapshot without streaming: %v", err)
	}
	if m := r.manifest(t, unstreamed); m.Layers[len(m.Layers)-1].Digest != res.Layer.Digest {
		t.Errorf("snapshot without streaming: top layer %s, want %s", m.Layers[len(m.Layers)-1].Digest, res.Layer.Digest)
	}

	// A stopped container is read in place, without a freeze.
	exited, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Kill(ctx, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited
	_, _, out = r.snapshot(t, "big", e.Registry.Host+"/envsnap-test/bad-snap:stopped")
	if !strings.Contains(out, "frozen 0s") {
		t.Errorf("snapshot of a stopped container reports a freeze:\n%s", out)
	}
	if m := r.manifest(t, e.Registry.Host+"/envsnap-test/bad-snap:stopped"); len(m.Layers) != len(base.Layers)+1 {
		t.Errorf("snapshot of a stopped container has %d layers, want %d", len(m.Layers), len(base.Layers)+1)
	}
}

// TestForkOnEmptyNode forks a snapshot on a second node (its own
// containerd and envsnap daemon, empty caches) that reaches the first
// node's registry: the fork starts with a small part of the image read.
func TestForkOnEmptyNode(t *testing.T) {
	// The first node's background fill would still be reading the base
	// layer from the shared registry while the second node forks, and
	// its bytes would count as the fork's.
	r := newRig(t, "--fill=false")
	e := r.env
	base := e.PushImage(t, "envsnap-test/big-env:1", []testenv.File{testenv.RandomFile("/opt/big/blob", 48<<20, 3)}, testenv.WithLazyLayers())
	img := e.Pull(t, base.Ref, "envsnap")
	r.start(t, img, "parent", "echo step-k > /state")
	snap := e.Registry.Host + "/envsnap-test/big-snap:1"
	r.snapshot(t, "parent", snap)

	// No background fill: what the registry served is what the fork read.
	node2 := &rig{env: testenv.New(t, testenv.WithEnvsnap("--fill=false")), bin: r.bin}
	testenv.WriteHostsDir(t, node2.env.HostsDir, e.Registry.Host)
	e.Registry.ResetCounters()
	ids := node2.fork(t, snap, "n2", 1, `[ "$(cat /state)" = step-k ] || exit 1`)
	served := e.Registry.BlobBytesServed()
	var imageBytes int64
	for _, l := range r.manifest(t, snap).Layers {
		imageBytes += l.Size
	}
	t.Logf("second node: fork ready after %d registry blob bytes of a %d-byte image (%.1f%%)", served, imageBytes, 100*float64(served)/float64(imageBytes))
	if served*4 > imageBytes {
		t.Errorf("the fork on an empty node read %d of %d image bytes from the registry: not lazy", served, imageBytes)
	}
	if _, err := os.Stat(filepath.Join(node2.rootfs(ids[0]), "state")); err != nil {
		t.Errorf("fork on the second node lacks /state: %v", err)
	}
}
