package lazyfs

import (
	"errors"
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
