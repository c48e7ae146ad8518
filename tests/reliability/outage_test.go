package reliability_test

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

// hangBound is how long the outage tests give a container's step before
// calling it hung. The reads of a step take a few read timeouts at most
// (3 s here) when nothing hangs; the bound only has to survive a loaded
// 2-core machine, not measure anything.
const hangBound = 90 * time.Second

// outageScript reads /data/cached.bin (so its chunks are in the node
// cache), keeps it open on fd 3, and after /signal/1 reads it again through
// the open descriptor and a fresh open, then /data/uncached.bin (never read
// before); after /signal/2 it reads uncached.bin again.
const outageScript = `sha256sum /data/cached.bin
exec 3</data/cached.bin
echo ready
while [ ! -e /signal/1 ]; do sleep 0.05; done
if sha256sum <&3; then echo open-ok; else echo open-failed; fi
if sha256sum /data/cached.bin; then echo fresh-ok; else echo fresh-failed; fi
echo cached-done
if cat /data/uncached.bin >/dev/null; then echo uncached-ok; else echo uncached-failed; fi
echo outage-done
while [ ! -e /signal/2 ]; do sleep 0.05; done
if sha256sum /data/uncached.bin; then echo recovered-ok; else echo recovered-failed; fi
echo finished`

// outageRig is a container running outageScript on lazy layers, whose
// daemon is SIGKILLed and restarted while the registry is unreachable.
type outageRig struct {
	env              *testenv.Env
	img              lazyImage
	cached, uncached testenv.File
	rc               *runningContainer
	signals          string
	dataMount        string       // the layer mount holding /data
	down             atomic.Bool  // the registry is unreachable
	stall            atomic.Bool  // the registry accepts requests and never answers
	stalled          atomic.Int64 // requests held while stalling
	manifestRequests atomic.Int64 // manifest GETs while down
}

func newOutageRig(t *testing.T) *outageRig {
	r := &outageRig{
		// No background fill: what is cached is what the container
		// read. A short read timeout keeps the failing reads short.
		env:      testenv.New(t, testenv.WithEnvsnap("--fill=false", "--read-timeout=3s")),
		cached:   testenv.RandomFile("/data/cached.bin", 3<<20, 41),
		uncached: testenv.RandomFile("/data/uncached.bin", 3<<20, 42),
		signals:  t.TempDir(),
	}
	r.img = pushLazy(t, r.env, "rel/outage:1", []testenv.File{r.cached, r.uncached})
	image := r.env.Pull(t, r.img.Ref, "envsnap")
	// Unreachable as a dead link or a stopped proxy is: every connection
	// is reset before an answer.
	r.env.Registry.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
		if r.stall.Load() {
			r.stalled.Add(1)
			for r.stall.Load() && req.Context().Err() == nil {
				time.Sleep(50 * time.Millisecond)
			}
		}
		if !r.down.Load() {
			return false
		}
		if strings.Contains(req.URL.Path, "/manifests/") {
			r.manifestRequests.Add(1)
		}
		resetConnection(w)
		return true
	})
	r.rc = startContainer(t, r.env, image, r.signals, "/bin/sh", "-c", outageScript)
	// Runs before the container's clean-up: a daemon that left the
	// container hung would hang its deletion too, until it dies.
	t.Cleanup(func() {
		if t.Failed() {
			r.env.Envsnap.Kill()
		}
	})
	r.rc.waitOutput(t, "ready", time.Minute)
	for _, mp := range testenv.MountsBelow(filepath.Join(r.env.EnvsnapRoot, "layers")) {
		if _, err := os.Stat(filepath.Join(mp, r.cached.Path)); err == nil {
			r.dataMount = mp
		}
	}
	if r.dataMount == "" {
		t.Fatal("no layer mount holds " + r.cached.Path)
	}
	// The kernel must ask the daemon again after the restart, not answer
	// from its page cache: drop the pages the first read left.
	for _, f := range []testenv.File{r.cached, r.uncached} {
		evictPageCache(t, filepath.Join(r.dataMount, f.Path))
	}
	return r
}

// killAndRestartDuringOutage SIGKILLs the daemon, makes the registry
// unreachable, runs between (with the daemon down) and starts a new daemon.
// A daemon that fails to come up is reported, not fatal: the containers'
// fate is what the tests judge.
func (r *outageRig) killAndRestartDuringOutage(t *testing.T, between func()) {
	r.env.Envsnap.Kill()
	r.down.Store(true)
	if between != nil {
		between()
	}
	if _, err := r.env.Env.StartEnvsnap(); err != nil {
		t.Errorf("restart during the outage: %v", err)
	}
}

// step signals the container and waits, bounded, for it to print want.
func (r *outageRig) step(t *testing.T, signal, want string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(r.signals, signal), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(hangBound)
	for !strings.Contains(r.rc.out.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("container hung: no %q within %s after the restart during the outage: stdout %q stderr %q\n%s",
				want, hangBound, r.rc.out, r.rc.errOut, r.env.Envsnap.LogTail(40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// checkFUSEDescriptors: the daemon holds two /dev/fuse descriptors per
// layer it serves (its own, which a successor gets through the keeper,
// and go-fuse's), none of connections it does not serve.
func (r *outageRig) checkFUSEDescriptors(t *testing.T) {
	t.Helper()
	served := 0
	for _, l := range envsnapStatus(t, r.env).Layers {
		if l.Mounted {
			served++
		}
	}
	if n := fuseDescriptors(t, r.env.Envsnap.PID()); n != 2*served {
		t.Errorf("daemon holds %d /dev/fuse descriptors for %d served layers, want %d", n, served, 2*served)
	}
}

// TestRestartDuringRegistryOutage: a daemon SIGKILLed under a running
// container and restarted while the registry is unreachable takes the
// mounts over from the manifests and TOCs it kept in the node cache, with
// no registry round trip: the container's reads of cached data succeed
// with the right bytes, a read of data that is not cached fails with EIO
// after the read timeout (as in an outage without a restart) and succeeds
// once the registry is back. Nothing hangs, and the new daemon holds no
// /dev/fuse descriptor beyond those of the mounts it serves. (It used to
// fail the takeover on the manifest fetch, keep the handed-over
// descriptor open, and leave the container waiting in the kernel.)
func TestRestartDuringRegistryOutage(t *testing.T) {
	r := newOutageRig(t)
	r.killAndRestartDuringOutage(t, nil)
	r.step(t, "1", "outage-done")

	out := r.rc.out.String()
	sum := r.cached.Digest().Encoded()
	for _, want := range []string{"open-ok", "fresh-ok", "uncached-failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("container output lacks %q: stdout %q stderr %q", want, out, r.rc.errOut)
		}
	}
	if n := strings.Count(out, sum); n != 3 {
		t.Errorf("sha256 of the cached file printed %d times, want 3 (before, open fd, fresh open): %q", n, out)
	}
	if e := r.rc.errOut.String(); !strings.Contains(e, "Input/output error") {
		t.Errorf("uncached read during the outage: stderr %q, want an I/O error", e)
	}
	if !r.env.Envsnap.LogContains("took over layer mounts of the previous daemon") || r.env.Envsnap.LogContains("cannot take over") {
		t.Errorf("the new daemon did not take every mount over:\n%s", r.env.Envsnap.LogTail(40))
	}
	if n := r.manifestRequests.Load(); n != 0 {
		t.Errorf("the takeover asked the unreachable registry for %d manifests; they are in the node cache", n)
	}
	for _, l := range envsnapStatus(t, r.env).Layers {
		if !l.Mounted {
			t.Errorf("layer %s not mounted after the restart: %s", l.Digest, l.Error)
		}
	}
	r.checkFUSEDescriptors(t)

	r.down.Store(false)
	r.step(t, "2", "finished")
	if out := r.rc.out.String(); !strings.Contains(out, "recovered-ok") || !strings.Contains(out, r.uncached.Digest().Encoded()) {
		t.Errorf("read after the registry came back: stdout %q stderr %q", out, r.rc.errOut)
	}
}

// TestRestartDuringOutageWithoutMetadata: when the takeover cannot happen
// (here the kept TOC of the data layer is corrupt and the registry is
// unreachable), the new daemon aborts the connection: the container's
// reads of that layer fail with ENOTCONN within a bounded time instead of
// hanging, the other layer is still served, and the daemon holds no
// descriptor of the aborted connection.
func TestRestartDuringOutageWithoutMetadata(t *testing.T) {
	r := newOutageRig(t)
	r.killAndRestartDuringOutage(t, func() {
		corruptKeptTOC(t, r.env, r.img, r.dataMount)
	})
	r.step(t, "1", "outage-done")

	out := r.rc.out.String()
	for _, want := range []string{"open-failed", "fresh-failed", "uncached-failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("container output lacks %q: stdout %q stderr %q", want, out, r.rc.errOut)
		}
	}
	if e := r.rc.errOut.String(); !strings.Contains(e, "not connected") {
		t.Errorf("reads of the aborted layer: stderr %q, want ENOTCONN", e)
	}
	if !r.env.Envsnap.LogContains("cannot take over layer mount of the previous daemon") {
		t.Errorf("no failed takeover logged:\n%s", r.env.Envsnap.LogTail(40))
	}
	r.checkFUSEDescriptors(t)
}

// corruptKeptTOC flips a byte of the TOC the daemon kept in its node cache
// for the layer mounted at mountpoint.
func corruptKeptTOC(t *testing.T, env *testenv.Env, img lazyImage, mountpoint string) {
	t.Helper()
	hex := filepath.Base(filepath.Dir(mountpoint)) // layers/sha256/<hex>/mnt
	for _, res := range img.Results {
		if res.Digest.Encoded() != hex {
			continue
		}
		toc := digest.Digest(res.Annotations()[layerfmt.AnnotationTOCDigest])
		p := filepath.Join(env.EnvsnapRoot, "cache", toc.Algorithm().String(), toc.Encoded()[:2], toc.Encoded())
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("the TOC of layer %s is not kept in the node cache: %v", res.Digest, err)
		}
		b[len(b)/2] ^= 0xff
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Fatalf("no layer of the image is mounted at %s", mountpoint)
}

// evictPageCache drops the cached pages of the file at p.
func evictPageCache(t *testing.T, p string) {
	t.Helper()
	// unix.Open, not os.Open: no netpoller registration of a FUSE file.
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open %s: %v", p, err)
	}
	defer unix.Close(fd)
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatalf("evict page cache of %s: %v", p, err)
	}
}

// fuseDescriptors counts the /dev/fuse descriptors process pid holds.
func fuseDescriptors(t *testing.T, pid int) int {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && target == "/dev/fuse" {
			n++
		}
	}
	return n
}
