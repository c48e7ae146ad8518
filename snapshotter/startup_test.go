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
	"github.com/opencontainers/go-digest"
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

// setMountErr makes the fake's Mount fail with err (nil: succeed), safely
// while the heal loop calls Mount.
func (f *fakeFS) setMountErr(err error) {
	f.mu.Lock()
	f.mountErr = err
	f.mu.Unlock()
}

// TestBrokenLayerHeals: a layer whose restore failed is reported broken
// with the reason; a snapshot over it fails with that reason
// (ErrUnavailable) instead of overlay's "failed to stat parent"; once it
// can be mounted, the heal loop mounts it without any call, or at once
// when an image pull looks at its snapshot (Stat). (A broken layer used to
// stay broken until a Prepare of the layer itself, which a pull of an
// image that is present never makes.)
func TestBrokenLayerHeals(t *testing.T) {
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

	waitMounted := func(s *Snapshotter) {
		t.Helper()
		for start := time.Now(); ; time.Sleep(10 * time.Millisecond) {
			if ls := s.Layers(); len(ls) == 1 && ls[0].Mounted && !ls[0].Broken && ls[0].Error == "" {
				return
			}
			if time.Since(start) > 30*time.Second {
				t.Fatalf("broken layer not mounted again 30 s after it could be: %+v", s.Layers())
			}
		}
	}
	for _, tc := range []struct {
		name     string
		interval time.Duration
		poke     func(s *Snapshotter)
	}{
		{"heal loop", 20 * time.Millisecond, func(*Snapshotter) {}},
		{"pull of the image", time.Hour, func(s *Snapshotter) {
			if _, err := s.Stat(ctx, "c1"); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fsys.setMountErr(errors.New("registry unreachable"))
			s, err := New(ctx, root, fsys, WithHealInterval(tc.interval))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ls := s.Layers()
			if len(ls) != 1 || ls[0].Mounted || !ls[0].Broken || !strings.Contains(ls[0].Error, "registry unreachable") {
				t.Fatalf("layers after a failed restore: %+v, want broken with the reason", ls)
			}
			_, err = s.Prepare(ctx, "k-"+tc.name, "c1")
			if !errdefs.IsUnavailable(err) || !strings.Contains(err.Error(), l.String()) || !strings.Contains(err.Error(), "registry unreachable") {
				t.Fatalf("Prepare over the broken layer: %v, want unavailable naming the layer and the reason", err)
			}

			fsys.setMountErr(nil)
			tc.poke(s)
			waitMounted(s)
			mounts, err := s.Prepare(ctx, "k-"+tc.name, "c1")
			if err != nil {
				t.Fatal(err)
			}
			checkMountedFiles(t, mounts, []digest.Digest{l})
			if err := s.Remove(ctx, "k-"+tc.name); err != nil {
				t.Fatal(err)
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
