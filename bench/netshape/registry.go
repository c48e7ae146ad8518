package netshape

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"time"
)

// RegistryPort is the port a registry listens on inside a link's namespace.
const RegistryPort = 5000

// RegistryNet runs a registry in a Link's namespace behind a latency
// proxy: what a benchmark hands devenv.WithRegistryNetwork so that every
// pull crosses the shaped link.
type RegistryNet struct {
	ctx  context.Context
	link *Link
	rtt  time.Duration
	desc string
}

// NewRegistryNet serves the registry through link with rtt added.
func NewRegistryNet(ctx context.Context, link *Link, rtt time.Duration) *RegistryNet {
	return &RegistryNet{ctx: ctx, link: link, rtt: rtt}
}

// Command runs bin inside the link's namespace.
func (n *RegistryNet) Command(bin string, args ...string) *exec.Cmd {
	return n.link.Command(n.ctx, bin, args...)
}

// ListenAddr is where the registry listens, inside the namespace.
func (n *RegistryNet) ListenAddr() string { return fmt.Sprintf("%s:%d", n.link.NSAddr, RegistryPort) }

// Front starts the latency proxy clients connect to.
func (n *RegistryNet) Front(string) (string, io.Closer, error) {
	p, desc, err := n.link.Proxy(n.ctx, RegistryPort, n.rtt)
	if err != nil {
		return "", nil, err
	}
	n.desc = desc
	return p.Addr(), p, nil
}

// Describe says what the link and proxy are, once Front has run.
func (n *RegistryNet) Describe() string { return n.desc }
