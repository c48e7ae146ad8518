package arbiter

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/envsnap/envsnap/internal/envlet"
)

// A refusal crosses the socket as the node's state once, with its kind.
func TestAdmitRefusalMessage(t *testing.T) {
	sock := socketPath(t)
	startArbiter(t, sock, envlet.Resources{CPU: 1, Memory: gib})
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second, Node: envlet.Resources{CPU: 64, Memory: 256 * gib}})
	t.Cleanup(func() { c.Close() })
	if err := c.Admit(context.Background(), "ns/y", envlet.Resources{CPU: 0.5, Memory: gib / 2}); err != nil {
		t.Fatal(err)
	}
	// The arbiter's node, not the shim's configured one.
	if node, _ := c.Capacity(); node.Memory != gib {
		t.Fatalf("client's view of the node %v, want the arbiter's 1 GiB", node)
	}
	err := c.Admit(context.Background(), "ns/x", envlet.Resources{CPU: 2, Memory: 2 * gib})
	if !errdefs.IsResourceExhausted(err) {
		t.Fatalf("admit: %v, want ErrResourceExhausted", err)
	}
	if msg := err.Error(); strings.Contains(msg, "ns/x") || strings.Count(msg, "resource exhausted") != 1 || !strings.HasPrefix(msg, "node ") {
		t.Fatalf("refusal %q: want the node's state once, not the env", msg)
	}
}
