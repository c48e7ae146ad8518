package netshape

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/containerd/log"
)

// Bridge is a set of network namespaces, the "nodes" of a cluster on one
// machine, each joined by a veth pair to one bridge in the root
// namespace. Nodes reach each other over the bridge, and the root
// namespace at HostAddr (where a Link's proxy, and so the registry, can
// be served). Nothing is shaped: it stands for the network between the
// nodes of a rack.
type Bridge struct {
	Name     string // the bridge device in the root namespace
	HostAddr netip.Addr
	Prefix   netip.Prefix
	Nodes    []BridgeNode
}

// BridgeNode is one namespace on a Bridge.
type BridgeNode struct {
	NetNS  string     // network namespace, under /run/netns
	HostIf string     // the veth end on the bridge
	Addr   netip.Addr // the namespace's address (its end is named eth0)
}

// Path is the namespace's file, for nsenter --net or setns.
func (n BridgeNode) Path() string { return "/run/netns/" + n.NetNS }

// Listen opens a TCP listener on port (0 picks one) at the node's
// address, inside its namespace.
func (n BridgeNode) Listen(ctx context.Context, port int) (net.Listener, error) {
	var ln net.Listener
	err := inNetNS(n.Path(), func() error {
		var err error
		var lc net.ListenConfig
		ln, err = lc.Listen(ctx, "tcp", netip.AddrPortFrom(n.Addr, uint16(port)).String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("namespace %s: listen: %w", n.NetNS, err)
	}
	return ln, nil
}

// Dial connects to addr from inside the node's namespace.
func (n BridgeNode) Dial(ctx context.Context, addr string) (net.Conn, error) {
	var c net.Conn
	err := inNetNS(n.Path(), func() error {
		var err error
		var d net.Dialer
		c, err = d.DialContext(ctx, "tcp", addr)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("namespace %s: dial %s: %w", n.NetNS, addr, err)
	}
	return c, nil
}

// MaxBridgeNodes is the most namespaces one bridge holds: with the host's
// address they fill a /24 of the bench's network, and the veth names
// (esx, the subnet's 5-digit tag, v, the index) stay within 15 bytes.
const MaxBridgeNodes = 250

// NewBridge creates the bridge, n namespaces named name-0 .. name-(n-1)
// (name starts with NamePrefix, as a Link's does, so LeftoverNamespaces
// finds them), their veths and addresses, and brings loopback up in each.
// It needs root and the ip command. Close removes all of it; on error
// nothing is left behind.
func NewBridge(ctx context.Context, name string, n int) (_ *Bridge, retErr error) {
	if n < 1 || n > MaxBridgeNodes {
		return nil, fmt.Errorf("bridge: %d nodes, want 1 to %d", n, MaxBridgeNodes)
	}
	if !strings.HasPrefix(name, NamePrefix) || len(name) > 60 || strings.ContainsAny(name, "/ ") {
		return nil, fmt.Errorf("bridge: invalid name %q (want %s...)", name, NamePrefix)
	}
	// The host, the nodes, the network and broadcast addresses.
	size := 32 - bits.Len(uint(n+2))
	prefix, err := freePrefix(name, size)
	if err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	a := prefix.Addr().As4()
	// Device names are limited to 15 bytes: short ones from the subnet,
	// which freePrefix made unique on this machine.
	tag := fmt.Sprintf("%05x", (uint32(a[1]&1)<<16|uint32(a[2])<<8|uint32(a[3]))>>(32-size))
	b := &Bridge{Name: "esx" + tag + "b", Prefix: prefix, HostAddr: prefix.Addr().Next()}
	if err := run(ctx, "ip", "link", "add", b.Name, "type", "bridge"); err != nil {
		return nil, fmt.Errorf("bridge: %w", err)
	}
	defer func() {
		if retErr != nil {
			b.Close(ctx)
		}
	}()
	mask := fmt.Sprintf("/%d", size)
	for _, s := range [][]string{
		{"ip", "addr", "add", b.HostAddr.String() + mask, "dev", b.Name},
		{"ip", "link", "set", b.Name, "up"},
	} {
		if err := run(ctx, s[0], s[1:]...); err != nil {
			return nil, fmt.Errorf("bridge %s: %w", b.Name, err)
		}
	}
	addr := b.HostAddr
	for i := range n {
		addr = addr.Next()
		nd := BridgeNode{NetNS: fmt.Sprintf("%s-%d", name, i), HostIf: fmt.Sprintf("esx%sv%d", tag, i), Addr: addr}
		if err := run(ctx, "ip", "netns", "add", nd.NetNS); err != nil {
			return nil, fmt.Errorf("bridge %s: create namespace: %w", b.Name, err)
		}
		b.Nodes = append(b.Nodes, nd)
		if err := run(ctx, "ip", "link", "add", nd.HostIf, "type", "veth", "peer", "name", "eth0", "netns", nd.NetNS); err != nil {
			return nil, fmt.Errorf("bridge %s node %d: %w", b.Name, i, err)
		}
		// No IPv6 link-local address on the host's end: every address
		// of the root namespace is a node address the envlet shim's
		// egress policy denies one rule each, and a hundred veths made
		// that batch overflow its netlink socket (ENOBUFS).
		if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+nd.HostIf+"/disable_ipv6", []byte("1"), 0o644); err != nil && !os.IsNotExist(err) {
			return nil, fmt.Errorf("bridge %s node %d: disable IPv6 on %s: %w", b.Name, i, nd.HostIf, err)
		}
		for _, s := range [][]string{
			{"ip", "link", "set", nd.HostIf, "master", b.Name},
			{"ip", "link", "set", nd.HostIf, "up"},
			{"ip", "-n", nd.NetNS, "addr", "add", nd.Addr.String() + mask, "dev", "eth0"},
			{"ip", "-n", nd.NetNS, "link", "set", "eth0", "up"},
			{"ip", "-n", nd.NetNS, "link", "set", "lo", "up"},
		} {
			if err := run(ctx, s[0], s[1:]...); err != nil {
				return nil, fmt.Errorf("bridge %s node %d: %w", b.Name, i, err)
			}
		}
	}
	log.G(ctx).WithField("bridge", b.Name).WithField("prefix", b.Prefix).WithField("nodes", n).Debug("bridge up")
	return b, nil
}

// Close deletes the veths, the namespaces and the bridge. Processes
// started in the namespaces must have exited: a namespace a process still
// holds outlives its name.
func (b *Bridge) Close(ctx context.Context) error {
	var errs []error
	for _, nd := range b.Nodes {
		if linkExists(nd.HostIf) {
			if err := run(ctx, "ip", "link", "del", nd.HostIf); err != nil {
				errs = append(errs, err)
			}
		}
		if _, err := os.Stat(nd.Path()); err == nil {
			if err := run(ctx, "ip", "netns", "del", nd.NetNS); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if linkExists(b.Name) {
		if err := run(ctx, "ip", "link", "del", b.Name); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("bridge %s: teardown: %w", b.Name, err)
	}
	return nil
}
