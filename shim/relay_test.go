//go:build linux

package shim

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/fifo"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/envlet"
)

// TestRelayNoticeAtExactCap: output that fills the cap exactly, then
// goes on, still ends with the notice saying why it stops, and fails
// the environment. The chunk past the cap then starts right at the cap.
func TestRelayNoticeAtExactCap(t *testing.T) {
	const limit = 64 << 10
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	dst := filepath.Join(dir, "client-stdout")
	if err := unix.Mkfifo(dst, 0o600); err != nil {
		t.Fatal(err)
	}
	client, err := fifo.OpenFifo(ctx, dst, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	tripped := make(chan envlet.Failure, 1)
	g := &guard{env: "env", limits: guardLimits{output: limit}, trip: func(f envlet.Failure) { tripped <- f }}
	p, err := g.relay(ctx, dir, "stdout", dst)
	if err != nil {
		t.Fatal(err)
	}
	w, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(bytes.Repeat([]byte("a"), limit)); err != nil {
		t.Fatal(err)
	}
	// The relay has taken exactly the cap once the client has read it.
	head := make([]byte, limit)
	if _, err := io.ReadFull(client, head); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("past the cap\n")); err != nil {
		t.Fatal(err)
	}
	w.Close()
	rest, err := io.ReadAll(client)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rest), "output cap of 65536 bytes reached") || strings.Contains(string(rest), "past the cap") {
		t.Errorf("after the cap the client read %q, want only the notice", rest)
	}
	select {
	case f := <-tripped:
		if f.Reason != envlet.ReasonOutputCapExceeded || f.Cap != limit {
			t.Errorf("failure %+v, want %s at %d", f, envlet.ReasonOutputCapExceeded, limit)
		}
	case <-ctx.Done():
		t.Fatal("the environment was not failed")
	}
}
