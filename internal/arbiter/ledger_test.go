package arbiter

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/envlet"
)

// A restarted arbiter with a ledger knows every grant before it answers
// anyone: a newcomer asking before the holder's shim re-registers cannot
// be handed the holder's memory a second time.
func TestLedgerRestart(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	ledger := DefaultLedgerPath(sock)
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	stop := startArbiter(t, sock, node, WithLedger(ledger))
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	if err := c.Admit(ctx, "a", envlet.Resources{CPU: 1, Memory: gib}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Grow(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib}); err != nil {
		t.Fatal(err)
	}
	// Usage alone is written at most every ledgerUseEvery.
	time.Sleep(ledgerUseEvery)
	if _, err := c.Report(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib}, envlet.Resources{CPU: 2, Memory: 2900 << 20}); err != nil {
		t.Fatal(err)
	}
	stop()
	startArbiter(t, sock, node, WithLedger(ledger))

	other := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { other.Close() })
	if err := other.Admit(ctx, "b", envlet.Resources{CPU: 0.5, Memory: gib / 2}); err != nil {
		t.Fatal(err)
	}
	if got, err := other.Grow(ctx, "b", envlet.Resources{Memory: 4 * gib}); err != nil || got.Memory != gib {
		t.Fatalf("b grew to %v (%v) before a re-registered, want 1 GiB: a's 3 GiB is in the ledger", got, err)
	}
	if err := other.Release(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	envs, err := other.List(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(envs) != 1 || envs[0].Env != "a" || envs[0].Current.Memory != 3*gib {
		t.Fatalf("after restart: %+v, want a restored with 3 GiB", envs)
	}
	// a's shim is still there: its next report goes through and keeps the grant.
	var lim envlet.Resources
	deadline := time.Now().Add(5 * time.Second)
	for {
		lim, err = c.Report(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib}, envlet.Resources{CPU: 2, Memory: 2900 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if c.Connected() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("client never reconnected")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if lim.Memory != 3*gib {
		t.Fatalf("a's limit after the restart %v, want its 3 GiB kept", lim)
	}
}

// A restored environment no shim speaks for within the grace period ended
// while the arbiter was down: its grant goes back to the node.
func TestLedgerExpiry(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "ledger.json")
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	s := NewServer(byRequest(node))
	if err := s.UseLedger(ctx, path); err != nil {
		t.Fatal(err)
	}
	if _, err := s.admit(ctx, &AdmitRequest{Env: "gone", Base: Resources{CPU: 1, Memory: 3 * gib}}); err != nil {
		t.Fatal(err)
	}
	s2 := NewServer(byRequest(node))
	s2.grace = 0
	if err := s2.UseLedger(ctx, path); err != nil {
		t.Fatal(err)
	}
	if got := s2.arb.Granted(); got.Memory != 3*gib {
		t.Fatalf("restored grants %v, want 3 GiB", got)
	}
	resp, err := s2.list(ctx, &ListRequest{Ended: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Envs) != 1 || resp.Envs[0].Ended.IsZero() || !strings.Contains(resp.Envs[0].Reason, "restart") {
		t.Fatalf("listing %+v, want gone ended", resp.Envs)
	}
	if got := s2.arb.Granted(); got.Memory != 0 {
		t.Fatalf("grants %v after expiry, want none", got)
	}
	b, err := os.ReadFile(path)
	if err != nil || strings.Contains(string(b), "gone") {
		t.Fatalf("ledger after expiry %q (%v), want without gone", b, err)
	}
}

// A corrupt ledger is set aside and the arbiter starts empty.
func TestLedgerCorrupt(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.json")
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := NewServer(envlet.NewNodeArbiter(envlet.Resources{CPU: 1, Memory: gib}, 0))
	if err := s.UseLedger(context.Background(), path); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path + ".bad"); err != nil {
		t.Fatalf("corrupt ledger not set aside: %v", err)
	}
	if len(s.arb.Leases()) != 0 {
		t.Fatal("leases from a corrupt ledger")
	}
}

// A live environment whose shim goes silent (its Release lost) gives its
// grant back after the stale period; a report afterwards is NotFound, which
// makes a live shim re-register.
func TestStaleLeaseExpires(t *testing.T) {
	ctx := context.Background()
	s := NewServer(byRequest(envlet.Resources{CPU: 2, Memory: 2 * gib}))
	if _, err := s.admit(ctx, &AdmitRequest{Env: "lost", Base: Resources{CPU: 2, Memory: gib}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.admit(ctx, &AdmitRequest{Env: "next", Base: Resources{CPU: 1, Memory: gib}}); err == nil {
		t.Fatal("admitted beyond the node while lost holds it")
	}
	s.stale = 0
	if _, err := s.admit(ctx, &AdmitRequest{Env: "next", Base: Resources{CPU: 1, Memory: gib}}); err != nil {
		t.Fatalf("lost's stale grant still held: %v", err)
	}
	if _, err := s.report(ctx, &ReportRequest{Env: "lost"}); !errdefs.IsNotFound(err) {
		t.Fatalf("report of an expired env: %v, want NotFound", err)
	}
}

// A ledger write that takes long (a busy disk) holds back the answer to
// the call whose change it persists, not the calls of everyone else. The
// temporary file is a fifo here: the write blocks until the test reads it.
func TestLedgerWriteOutsideTheLock(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "ledger.json")
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	s := NewServer(byRequest(node))
	if err := s.UseLedger(ctx, path); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(path+".tmp", 0o600); err != nil {
		t.Fatal(err)
	}
	admitted := make(chan error, 1)
	go func() {
		_, err := s.admit(ctx, &AdmitRequest{Env: "a", Base: Resources{CPU: 1, Memory: gib}})
		admitted <- err
	}()
	select {
	case err := <-admitted:
		t.Fatalf("admit answered (%v) before its ledger was written", err)
	case <-time.After(300 * time.Millisecond):
	}
	calls := []func() error{
		func() error { _, err := s.list(ctx, &ListRequest{}); return err },
		// A report of usage alone is not held back by its own write
		// either (past ledgerUseEvery, which the test skips).
		func() error {
			s.mu.Lock()
			s.ledgerAt = time.Time{}
			s.mu.Unlock()
			_, err := s.report(ctx, &ReportRequest{Env: "a", Current: Resources{CPU: 1, Memory: gib}, Used: Resources{CPU: 0.5, Memory: gib / 2}})
			return err
		},
	}
	for i, call := range calls {
		answered := make(chan error, 1)
		go func() { answered <- call() }()
		select {
		case err := <-answered:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("call %d (a listing, a report of usage) waited for a ledger write", i)
		}
	}
	f, err := os.Open(path + ".tmp")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(f)
	f.Close()
	if err != nil || !strings.Contains(string(b), `"env":"a"`) {
		t.Fatalf("ledger written %q (%v), want a's lease", b, err)
	}
	if err := <-admitted; err != nil {
		t.Fatal(err)
	}
	// The report's usage reaches the file after the admit's write (the
	// ledger is the fifo, renamed, until then).
	deadline := time.Now().Add(5 * time.Second)
	for {
		var b []byte
		fi, err := os.Lstat(path)
		if err == nil && fi.Mode().IsRegular() {
			b, err = os.ReadFile(path)
		}
		if err == nil && strings.Contains(string(b), `"used":{"cpu":0.5`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ledger %q (%v), want the reported usage written", b, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
