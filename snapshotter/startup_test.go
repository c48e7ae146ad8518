//go:build linux

package snapshotter

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// TestNewMetadataLocked: while another process holds the metadata
// database (a second daemon on the same root, or any tool), New neither
// hangs on bolt's lock nor ignores its context: it gives up when the
// context is done, and otherwise after metadataLockWait with an error that
// says what is locked. (overlay's bolt open used to wait forever.)
func TestNewMetadataLocked(t *testing.T) {
	root := t.TempDir()
	s, err := New(testContext(t), root, newFakeFS())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// An exclusive flock on another open file description conflicts
	// with New's probe and bolt's own lock alike, as another process's would.
	db, err := os.OpenFile(filepath.Join(root, "metadata.db"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if err := unix.Flock(int(db.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}

	newBounded := func(ctx context.Context) error {
		t.Helper()
		done := make(chan error, 1)
		go func() {
			s, err := New(ctx, root, newFakeFS())
			if err == nil {
				s.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			return err
		case <-time.After(time.Minute):
			t.Fatal("New still waits on the locked metadata database after a minute")
			return nil
		}
	}

	ctx, cancel := context.WithCancel(testContext(t))
	time.AfterFunc(100*time.Millisecond, cancel)
	if err := newBounded(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("New with a cancelled context on a locked database: %v, want context.Canceled", err)
	}
	err = newBounded(testContext(t))
	if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), "locked by another process") {
		t.Errorf("New on a locked database: %v, want unavailable, locked by another process", err)
	}
}
