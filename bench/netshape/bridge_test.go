package netshape

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"testing"
)

// Three namespaces on a bridge: a server in one is reached from another
// and from the root namespace; Close leaves no namespace, veth or bridge.
func TestBridgeJoinsNamespaces(t *testing.T) {
	requireNetAdmin(t)
	ctx := context.Background()
	b, err := NewBridge(ctx, fmt.Sprintf("%s%d-br", NamePrefix, os.Getpid()), 3)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			b.Close(ctx)
		}
	})
	if len(b.Nodes) != 3 || !b.Prefix.Contains(b.HostAddr) || !benchNet.Contains(b.HostAddr) {
		t.Fatalf("bridge %+v", b)
	}
	ln, err := b.Nodes[0].Listen(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, "node0")
			c.Close()
		}
	}()
	for _, dial := range []struct {
		from string
		fn   func() (net.Conn, error)
	}{
		{"node 2", func() (net.Conn, error) { return b.Nodes[2].Dial(ctx, ln.Addr().String()) }},
		{"the root namespace", func() (net.Conn, error) { return net.Dial("tcp", ln.Addr().String()) }},
	} {
		c, err := dial.fn()
		if err != nil {
			t.Fatalf("from %s: %v", dial.from, err)
		}
		got, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(got) != "node0" {
			t.Errorf("from %s: read %q, %v", dial.from, got, err)
		}
	}
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	closed = true
	left, err := LeftoverNamespaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range b.Nodes {
		if slices.Contains(left, n.NetNS) || linkExists(n.HostIf) {
			t.Errorf("node %s (veth %s) left after Close", n.NetNS, n.HostIf)
		}
	}
	if linkExists(b.Name) {
		t.Errorf("bridge %s left after Close", b.Name)
	}
}
