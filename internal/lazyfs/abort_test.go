package lazyfs

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestAbort: a request waiting on a connection no server reads fails with
// ENOTCONN once the connection is aborted, although this process still
// holds the connection's descriptor (as the keeper of a dead daemon
// would), and the mount is gone.
func TestAbort(t *testing.T) {
	requireFUSE(t)
	mnt, waiting := stuckRequest(t, "lazyfs-abort-test")
	if err := Abort(mnt); err != nil {
		t.Fatal(err)
	}
	requireENOTCONN(t, waiting, "Abort")
	var st, parent unix.Stat_t
	if err := unix.Stat(mnt, &st); err != nil {
		t.Fatalf("mountpoint after Abort: %v", err)
	}
	if err := unix.Stat(mnt+"/..", &parent); err != nil || st.Dev != parent.Dev {
		t.Fatalf("still mounted after Abort (dev %d, parent %d, %v)", st.Dev, parent.Dev, err)
	}
}

// TestAbortConnectionHelper: the tests' last resort against a connection
// no server answers (abortConnection, through fusectl) ends a waiting
// request with ENOTCONN and leaves no fusectl mount behind.
func TestAbortConnectionHelper(t *testing.T) {
	requireFUSE(t)
	mnt, waiting := stuckRequest(t, "lazyfs-abort-helper-test")
	dev := mountDev(t, mnt)
	before := fusectlMounts(t)
	abortConnection(t, dev)
	requireENOTCONN(t, waiting, "the abort")
	if after := fusectlMounts(t); after != before {
		t.Errorf("%d fusectl mounts after the abort, %d before", after, before)
	}
}

// stuckRequest mounts a FUSE file system no server reads and sends it a
// request from another goroutine: the returned channel gets that
// request's result. The connection's descriptor is closed, and the mount
// forced off, at cleanup.
func stuckRequest(t *testing.T, name string) (mnt string, waiting <-chan error) {
	t.Helper()
	mnt = t.TempDir()
	fd, err := mountFUSE(mnt, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(fd) // the last descriptor: ends the connection if nothing else did
		_ = forceUnmount(mnt)
	})
	done := make(chan error, 1)
	go func() {
		var st unix.Stat_t
		done <- unix.Stat(mnt+"/x", &st)
	}()
	select {
	case err := <-done:
		t.Fatalf("a request no server read was answered: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	return mnt, done
}

// requireENOTCONN fails the test unless the stuck request ends with
// ENOTCONN after what aborted its connection.
func requireENOTCONN(t *testing.T, waiting <-chan error, after string) {
	t.Helper()
	select {
	case err := <-waiting:
		if !errors.Is(err, unix.ENOTCONN) {
			t.Fatalf("waiting request after %s: %v, want ENOTCONN", after, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the waiting request still waits after %s", after)
	}
}

// mountDev is the device number of the file system mounted at mnt, read
// from mountinfo (a stat would ask the file system's server).
func mountDev(t *testing.T, mnt string) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) < 5 || f[4] != mnt {
			continue
		}
		var major, minor uint32
		if _, err := fmt.Sscanf(f[2], "%d:%d", &major, &minor); err != nil {
			t.Fatalf("mountinfo device %q: %v", f[2], err)
		}
		return unix.Mkdev(major, minor)
	}
	t.Fatalf("%s is not in mountinfo", mnt)
	return 0
}

func fusectlMounts(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), " - fusectl ")
}
