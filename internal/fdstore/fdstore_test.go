//go:build linux

package fdstore

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestMain runs the test binary as a keeper when FDSTORE_TEST_KEEPER
// names a socket (TestStartThroughLauncher).
func TestMain(m *testing.M) {
	if p := os.Getenv("FDSTORE_TEST_KEEPER"); p != "" {
		if err := Serve(context.Background(), p); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestStartThroughLauncher: a launcher that starts the keeper in the
// background and exits 0 at once, as systemd-run does with a unit, gets
// a connected client; a launcher that fails is reported.
func TestStartThroughLauncher(t *testing.T) {
	dir, err := os.MkdirTemp("", "fdstore")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "k.sock")
	// Removing the socket ends the keeper (Serve's mount check).
	t.Cleanup(func() { os.RemoveAll(dir) })
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("FDSTORE_TEST_KEEPER", path)
	c, err := Start(t.Context(), path, "/bin/sh", "-c", `"$0" -test.run=^$ & exit 0`, self)
	if err != nil {
		t.Fatalf("start through a launcher: %v", err)
	}
	defer c.Close()
	if es, err := c.List(); err != nil || len(es) != 0 {
		t.Fatalf("List on the launched keeper = %v, %v", es, err)
	}
	if _, err := Start(t.Context(), filepath.Join(dir, "other.sock"), "/bin/sh", "-c", "exit 3"); err == nil {
		t.Fatal("a failing launcher was not reported")
	}
}

func startKeeper(t *testing.T) (string, <-chan error) {
	t.Helper()
	dir, err := os.MkdirTemp("", "fdstore")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "k.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() { done <- Serve(ctx, path); close(finished) }()
	t.Cleanup(func() { cancel(); <-finished })
	for i := 0; ; i++ {
		if c, err := Dial(path); err == nil {
			c.Close()
			break
		}
		if i > 200 {
			t.Fatal("keeper did not come up")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return path, done
}

// TestKeepsDescriptorAcrossClients: a pipe's write end given to the keeper
// by one client and closed there stays open; a second client gets it back
// and writing through it reaches the read end.
func TestKeepsDescriptorAcrossClients(t *testing.T) {
	path, _ := startKeeper(t)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])

	c1, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := c1.Put(Entry{Key: "a", Meta: []byte(`{"x":1}`), FD: p[1]}); err != nil {
		t.Fatal(err)
	}
	unix.Close(p[1]) // the caller's copy; the keeper holds its own
	c1.Close()       // like a daemon killed

	c2, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	es, err := c2.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 1 || es[0].Key != "a" || string(es[0].Meta) != `{"x":1}` {
		t.Fatalf("List = %+v", es)
	}
	if _, err := unix.Write(es[0].FD, []byte("hi")); err != nil {
		t.Fatalf("write through returned descriptor: %v", err)
	}
	unix.Close(es[0].FD)
	buf := make([]byte, 8)
	n, err := unix.Read(p[0], buf)
	if err != nil || string(buf[:n]) != "hi" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}

	// After Delete the keeper's copy is closed: the pipe has no writer.
	if err := c2.Delete("a"); err != nil {
		t.Fatal(err)
	}
	if es, err := c2.List(); err != nil || len(es) != 0 {
		t.Fatalf("List after Delete = %+v, %v", es, err)
	}
	n, err = unix.Read(p[0], buf)
	if n != 0 || err != nil {
		t.Fatalf("read after Delete = %d, %v; want EOF", n, err)
	}
}

// TestDropsEntryOfGoneMount: an entry tied to a mount that is not in
// mountinfo is dropped by the watcher.
func TestDropsEntryOfGoneMount(t *testing.T) {
	path, _ := startKeeper(t)
	c, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	f, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := c.Put(Entry{Key: "gone", Mountpoint: "/nonexistent/mount", Dev: "0:1", FD: int(f.Fd())}); err != nil {
		t.Fatal(err)
	}
	root, err := MountDev("/")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Put(Entry{Key: "root", Mountpoint: "/", Dev: root, FD: int(f.Fd())}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * checkInterval)
	for {
		es, err := c.List()
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range es {
			unix.Close(e.FD)
		}
		if len(es) == 1 && es[0].Key == "root" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("entries %+v; want only root", es)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestExitsWhenIdle: once the last client leaves and nothing is held, the
// keeper exits (a clean daemon stop leaves no process behind).
func TestExitsWhenIdle(t *testing.T) {
	path, done := startKeeper(t)
	c, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(3 * checkInterval):
		t.Fatal("keeper still running with nothing to keep")
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{`/a\040b`: "/a b", `/plain`: "/plain", `/x\134`: `/x\`} {
		if got := unescape(in); got != want {
			t.Errorf("unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestWedgedKeeper: a keeper that accepts the connection but never
// answers (stopped, wedged) fails the client's call after its timeout
// instead of holding the daemon's start-up forever, and the connection is
// closed so a late reply is never taken for the next one's.
func TestWedgedKeeper(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "wedged.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.AcceptUnix()
		if err == nil {
			<-t.Context().Done() // holds the connection, answers nothing
			c.Close()
		}
	}()
	c, err := Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.timeout = 100 * time.Millisecond
	done := make(chan error, 1)
	go func() {
		_, err := c.List()
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("List from a keeper that never answers succeeded")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("List still waits on a keeper that never answers after 30 s")
	}
	if err := c.Delete("x"); err == nil {
		t.Error("the connection to the wedged keeper is still used after a timeout")
	}
}
