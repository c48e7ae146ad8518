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
	mnt := t.TempDir()
	fd, err := mountFUSE(mnt, "lazyfs-abort-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(fd) // the last descriptor: ends the connection if Abort did not
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
	if err := Abort(mnt); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, unix.ENOTCONN) {
			t.Fatalf("waiting request after Abort: %v, want ENOTCONN", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting request still waits after Abort")
	}
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
	mnt := t.TempDir()
	fd, err := mountFUSE(mnt, "lazyfs-abort-helper-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(fd)
		_ = forceUnmount(mnt)
	})
	dev := mountDev(t, mnt)
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
	before := fusectlMounts(t)
	abortConnection(t, dev)
	select {
	case err := <-done:
		if !errors.Is(err, unix.ENOTCONN) {
			t.Fatalf("waiting request after the abort: %v, want ENOTCONN", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting request still waits after the abort")
	}
	if after := fusectlMounts(t); after != before {
		t.Errorf("%d fusectl mounts after the abort, %d before", after, before)
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
