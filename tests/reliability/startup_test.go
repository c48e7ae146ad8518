package reliability_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/tests/testenv"
)

// exitBound is how long a daemon that must exit at once gets before the
// test calls it hung. It only has to survive a loaded 2-core machine; the
// hangs it catches last forever (or for the 10-minute read timeout).
const exitBound = 60 * time.Second

// waitExit waits, bounded by exitBound, for p to exit and returns how long
// that took.
func waitExit(t *testing.T, p *testenv.Process, what string) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if exited, _ := p.Exited(); exited {
			return time.Since(start)
		}
		if time.Since(start) > exitBound {
			t.Fatalf("%s still running after %s:\n%s", what, exitBound, p.LogTail(30))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSecondDaemonOnRoot: a second daemon on the root of a running one,
// with an address of its own, exits at once naming the holder (its pid
// and address), before it starts a keeper or touches the metadata
// database; the first one goes on serving. (It used to wait forever on
// the database's lock, deaf to SIGTERM, with a keeper of its own.)
func TestSecondDaemonOnRoot(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	sock := filepath.Join(t.TempDir(), "second.sock")
	second := testenv.StartProcess(t, t.TempDir(), "envsnap-second", nil, testenv.Binary(t, "containerd-envsnap"),
		"serve", "--root", env.EnvsnapRoot, "--address", sock, "--hosts-dir", env.HostsDir)
	took := waitExit(t, second, "a second daemon on the same root")
	t.Logf("second daemon exited %s after it was started", took.Round(time.Millisecond))

	holder := fmt.Sprintf("pid %d, address %s", env.Envsnap.PID(), env.SnapshotterSocket)
	if !second.LogContains(holder) || !second.LogContains("root "+env.EnvsnapRoot+" is in use") {
		t.Errorf("second daemon's error does not name the root and its holder (%s):\n%s", holder, second.LogTail(10))
	}
	for _, p := range []string{daemon.KeeperSocket(sock), sock, daemon.StatusSocket(sock)} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("the second daemon left %s behind", p)
		}
	}
	hc := unixHTTPClient(daemon.StatusSocket(env.SnapshotterSocket))
	if code, body, err := healthz(hc); err != nil || code != 200 {
		t.Errorf("first daemon after the second one failed: %d %q %v", code, body, err)
	}
}

// TestSIGTERMDuringBlockedRestore: a daemon restarted under a running
// container whose layer it cannot take over from the node cache (the kept
// TOC is corrupt) waits for the registry, which here accepts and never
// answers, with a 10-minute read timeout. SIGTERM then stops it at once,
// and the layer's connection is left with the keeper, not aborted: the
// next daemon takes it over when the registry answers again, and the
// container reads the right bytes through it. (It used to abort the
// connection on its way out: the container got ENOTCONN.)
func TestSIGTERMDuringBlockedRestore(t *testing.T) {
	r := newOutageRig(t)
	r.env.Envsnap.Kill()
	corruptKeptTOC(t, r.env, r.img, r.dataMount)
	r.stall.Store(true)

	args := []string{"serve", "--root", r.env.EnvsnapRoot, "--address", r.env.SnapshotterSocket,
		"--hosts-dir", r.env.HostsDir, "--log-level", "debug", "--lazy-min-size", "0",
		"--fill=false", "--read-timeout=10m"}
	blocked := testenv.StartProcess(t, t.TempDir(), "envsnap-blocked", nil, testenv.Binary(t, "containerd-envsnap"), args...)
	hc := unixHTTPClient(daemon.StatusSocket(r.env.SnapshotterSocket))
	for start := time.Now(); ; time.Sleep(50 * time.Millisecond) {
		code, body, _ := healthz(hc)
		if code == 503 && strings.Contains(body, "restoring") && r.stalled.Load() > 0 {
			break
		}
		if exited, err := blocked.Exited(); exited {
			t.Fatalf("the daemon exited before it blocked in the restore: %v\n%s", err, blocked.LogTail(30))
		}
		if time.Since(start) > hangBound {
			t.Fatalf("the restore never blocked on the registry (healthz %d %q, %d stalled requests)", code, body, r.stalled.Load())
		}
	}
	if err := syscall.Kill(blocked.PID(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	took := waitExit(t, blocked, "a daemon told to stop while its restore waits for the registry")
	t.Logf("daemon exited %s after SIGTERM", took.Round(time.Millisecond))
	if blocked.LogContains("cannot take over layer mount") {
		t.Errorf("the stopping daemon gave up a kept mount:\n%s", blocked.LogTail(30))
	}

	r.stall.Store(false)
	r.env.SetEnvsnapArgs("--fill=false", "--read-timeout=10m")
	if _, err := r.env.Env.StartEnvsnap(); err != nil {
		t.Fatal(err)
	}
	r.step(t, "1", "outage-done")
	out := r.rc.out.String()
	for _, want := range []string{"open-ok", "fresh-ok", "uncached-ok"} {
		if !strings.Contains(out, want) {
			t.Errorf("container output lacks %q: stdout %q stderr %q", want, out, r.rc.errOut)
		}
	}
	if n := strings.Count(out, r.cached.Digest().Encoded()); n != 3 {
		t.Errorf("sha256 of the cached file printed %d times, want 3: %q", n, out)
	}
	r.step(t, "2", "finished")
}
