//go:build linux

package shim

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/shim"
)

// TestPickGroup fills groups of the namespace in order, counting the
// bundles that name each (also when containers start together), keeps a
// pod's containers with their sandbox, and honours runc's annotation.
func TestPickGroup(t *testing.T) {
	ns := t.TempDir()
	bundle := func(id string, ann map[string]string) string {
		t.Helper()
		dir := filepath.Join(ns, id)
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(map[string]any{"annotations": ann})
		if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	const size = 3
	// Seven containers starting at once: 3 + 3 + 1.
	got := map[string]int{}
	groupOf := map[string]string{} // bundle dir -> group
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range 7 {
		dir := bundle("c"+string(rune('0'+i)), nil)
		wg.Go(func() {
			g, err := pickGroup(dir, filepath.Base(dir), size)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			got[g]++
			groupOf[dir] = g
			mu.Unlock()
		})
	}
	wg.Wait()
	if got["envlet-0"] != 3 || got["envlet-1"] != 3 || got["envlet-2"] != 1 {
		t.Errorf("groups %v, want envlet-0 and -1 full (3), envlet-2 with 1", got)
	}
	// A deleted container's bundle is gone: its place is free again.
	// Which container landed in a full group depends on the goroutines'
	// order: delete one that did.
	var freed string
	for dir, g := range groupOf {
		if g == "envlet-0" {
			freed = dir
			break
		}
	}
	if err := os.RemoveAll(freed); err != nil {
		t.Fatal(err)
	}
	if g, err := pickGroup(bundle("late", nil), "late", size); err != nil || g != "envlet-0" {
		t.Errorf("after a delete in envlet-0: %q, %v; want the freed place there", g, err)
	}
	// A pod's container joins its sandbox's group, full or not.
	sb := bundle("sandbox", nil)
	sg, err := pickGroup(sb, "sandbox", size)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		id := "pod-c" + string(rune('0'+i))
		g, err := pickGroup(bundle(id, map[string]string{annSandboxID: "sandbox"}), id, size)
		if err != nil || g != sg {
			t.Errorf("pod container %s: group %q, %v; want its sandbox's %q", id, g, err, sg)
		}
	}
	if g, err := pickGroup(bundle("runc-group", map[string]string{AnnGroup: "mine"}), "runc-group", size); err != nil || g != "mine" {
		t.Errorf("annotated: %q, %v; want mine", g, err)
	}
	if g, err := pickGroup(bundle("alone", nil), "alone", 1); err != nil || g != "alone" {
		t.Errorf("group-size 1: %q, %v; want the container's own id", g, err)
	}
}

// TestGroupSocketStartsTogether: starts of one group arriving together
// at a socket a shim left behind (its process gone, the file still
// there) agree on one new socket: exactly one replaces it, the others
// find it alive, none fails. Without the group lock two of them took
// the socket for stale at once, and one failed to bind ("address
// already in use") or removed the other's new socket.
func TestGroupSocketStartsTogether(t *testing.T) {
	address := "unix://" + filepath.Join(t.TempDir(), "group")
	for round := range 20 {
		// A socket file nobody listens on, as a shim that exited leaves.
		os.Remove(strings.TrimPrefix(address, "unix://"))
		l, err := net.Listen("unix", strings.TrimPrefix(address, "unix://"))
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close()

		var (
			mu      sync.Mutex
			created []*net.UnixListener
			joined  int
			wg      sync.WaitGroup
		)
		for range 8 {
			wg.Go(func() {
				unlock, err := lockGroupSocket(address)
				if err != nil {
					t.Error(err)
					return
				}
				defer unlock()
				s, err := takeGroupSocket(address, "c")
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
					t.Errorf("round %d: %v", round, err)
				case s == nil:
					joined++
				default:
					created = append(created, s)
				}
			})
		}
		wg.Wait()
		if len(created) != 1 || joined != 7 {
			t.Fatalf("round %d: %d starts made a socket, %d joined one; want 1 and 7", round, len(created), joined)
		}
		// The one made is the one at the address.
		c, err := net.Dial("unix", strings.TrimPrefix(address, "unix://"))
		if err != nil {
			t.Fatalf("round %d: the new socket is not at the address: %v", round, err)
		}
		c.Close()
		created[0].SetUnlinkOnClose(false)
		created[0].Close()
	}
}

// TestGroupSocketLockFirstShim: on a node whose first shim this is, the
// socket directory does not exist yet; the lock makes it (a guest with
// no shim run before failed every start: "open shim socket lock: no such
// file or directory").
func TestGroupSocketLockFirstShim(t *testing.T) {
	address := "unix://" + filepath.Join(t.TempDir(), "s", "group")
	unlock, err := lockGroupSocket(address)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	s, err := groupSocket(address)
	if err != nil || s == nil {
		t.Fatalf("first socket of the node: %v, %v", s, err)
	}
	s.Close()
}

// TestUnlistWaitsForJoinedCreate: a lingering shim with no container
// keeps its group's socket while a start that returned it has not had
// its Create yet (containerd connects only after the start exits; the
// guest suite's CRI sandbox was created on a shim that had just removed
// its socket, and the pod's next container found no socket). Once the
// Create has come and gone, or the join is older than joinPatience, the
// shim leaves and its joins go with it.
func TestUnlistWaitsForJoinedCreate(t *testing.T) {
	address := "unix://" + filepath.Join(t.TempDir(), "group")
	unlock, err := lockGroupSocket(address)
	if err != nil {
		t.Fatal(err)
	}
	l, err := takeGroupSocket(address, "first")
	unlock()
	if err != nil || l == nil {
		t.Fatalf("first socket: %v, %v", l, err)
	}
	defer l.Close()
	// A second start finds the shim alive and joins it.
	unlock, err = lockGroupSocket(address)
	if err != nil {
		t.Fatal(err)
	}
	joiner, err := takeGroupSocket(address, "late")
	unlock()
	if err != nil || joiner != nil {
		t.Fatalf("join: %v, %v", joiner, err)
	}

	s := &Service{
		opts:    Options{Socket: address},
		bundles: map[string]string{},
		created: map[string]bool{"first": true},
	}
	ctx := context.Background()
	if s.unlist(ctx, 0) {
		t.Fatal("the shim left before the Create of a container joined to it")
	}
	if !shim.CanConnect(address) {
		t.Fatal("the socket is gone while a join is pending")
	}
	// The Create came and the container was deleted again.
	s.created["late"] = true
	if !s.unlist(ctx, 0) {
		t.Fatal("the shim did not leave with every join created")
	}
	if shim.CanConnect(address) {
		t.Fatal("the socket is still there after the shim left")
	}
	if _, err := os.Stat(joinsPath(address)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("joins left behind: %v", err)
	}

	// A join whose Create never comes holds the shim only joinPatience.
	s.unlisted = false
	l2, err := takeGroupSocket(address, "next")
	if err != nil || l2 == nil {
		t.Fatalf("second socket: %v, %v", l2, err)
	}
	defer l2.Close()
	if j, err := takeGroupSocket(address, "abandoned"); err != nil || j != nil {
		t.Fatalf("join: %v, %v", j, err)
	}
	old := time.Now().Add(-joinPatience - time.Second)
	if err := os.Chtimes(joinsPath(address), old, old); err != nil {
		t.Fatal(err)
	}
	if !s.unlist(ctx, 0) {
		t.Fatal("an abandoned join kept the shim past joinPatience")
	}
}
