package netshape

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// Defaults for a Link.
const (
	// DefaultRate is the bandwidth of the shaped registry link.
	DefaultRate = 1_000_000_000 // bits per second
	// NamePrefix starts the name of every namespace a Link creates, so
	// that a leftover one is recognisable as ours.
	NamePrefix = "envsnap-bench-"
)

// benchNet is the range the /30s of Links come from: 198.18.0.0/15 is
// reserved for benchmarking network devices (RFC 2544) and is not routed
// on the internet, so a route to a veth cannot shadow a real destination.
var benchNet = netip.MustParsePrefix("198.18.0.0/15")

// LinkOpt configures a Link.
type LinkOpt func(*linkConfig)

type linkConfig struct {
	rate  int64
	name  string
	index int
}

// WithLinkRate sets the htb rate in bits per second on both ends.
func WithLinkRate(bitsPerSecond int64) LinkOpt {
	return func(c *linkConfig) { c.rate = bitsPerSecond }
}

// WithName names the namespace (default envsnap-bench-<pid>).
func WithName(name string) LinkOpt {
	return func(c *linkConfig) { c.name = name }
}

// Link is a network namespace joined to the root namespace by a veth pair
// whose two ends are shaped with an htb qdisc. A server started in the
// namespace (Listen, Command) is reached from the root namespace at
// NSAddr; the path crosses the shaped veth in both directions.
type Link struct {
	Name     string     // network namespace, under /run/netns
	HostIf   string     // veth end in the root namespace
	NSIf     string     // veth end in the namespace
	HostAddr netip.Addr // address of HostIf
	NSAddr   netip.Addr // address of NSIf: where clients dial servers in the namespace
	// Shaped is true when htb caps both directions at Rate. When false
	// (no htb in this kernel), the caller must cap bandwidth elsewhere,
	// e.g. WithRateLimit on a LatencyProxy.
	Shaped bool
	Rate   int64 // bits per second
	// ShapeErr says why Shaped is false.
	ShapeErr error
}

// NewLink creates the namespace, the veth pair, their addresses, and the
// htb qdiscs. It needs root and the ip and tc commands. Close removes all
// of it; on error nothing is left behind.
func NewLink(ctx context.Context, opts ...LinkOpt) (_ *Link, retErr error) {
	cfg := linkConfig{rate: DefaultRate, name: fmt.Sprintf("%s%d", NamePrefix, os.Getpid())}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.rate <= 0 {
		return nil, fmt.Errorf("link: invalid rate %d", cfg.rate)
	}
	if len(cfg.name) > 64 || strings.ContainsAny(cfg.name, "/ ") {
		return nil, fmt.Errorf("link: invalid namespace name %q", cfg.name)
	}
	host, ns, err := freeSubnet(cfg.name)
	if err != nil {
		return nil, err
	}
	// Interface names are limited to 15 bytes; derive short unique ones
	// from the subnet, which freeSubnet made unique on this machine.
	a := host.As4()
	tag := fmt.Sprintf("%04x", (uint32(a[1]&1)<<16|uint32(a[2])<<8|uint32(a[3]))>>2)
	l := &Link{
		Name:     cfg.name,
		HostIf:   "esb" + tag + "h",
		NSIf:     "esb" + tag + "n",
		HostAddr: host,
		NSAddr:   ns,
		Rate:     cfg.rate,
	}
	if err := run(ctx, "ip", "netns", "add", l.Name); err != nil {
		return nil, fmt.Errorf("link: create namespace: %w", err)
	}
	defer func() {
		if retErr != nil {
			l.Close(ctx)
		}
	}()
	steps := [][]string{
		{"ip", "link", "add", l.HostIf, "type", "veth", "peer", "name", l.NSIf, "netns", l.Name},
		{"ip", "addr", "add", l.HostAddr.String() + "/30", "dev", l.HostIf},
		{"ip", "link", "set", l.HostIf, "up"},
		{"ip", "-n", l.Name, "addr", "add", l.NSAddr.String() + "/30", "dev", l.NSIf},
		{"ip", "-n", l.Name, "link", "set", l.NSIf, "up"},
		{"ip", "-n", l.Name, "link", "set", "lo", "up"},
	}
	for _, s := range steps {
		if err := run(ctx, s[0], s[1:]...); err != nil {
			return nil, fmt.Errorf("link %s: %w", l.Name, err)
		}
	}
	l.ShapeErr = l.shape(ctx)
	l.Shaped = l.ShapeErr == nil
	log.G(ctx).WithField("netns", l.Name).WithField("host", l.HostAddr).WithField("ns", l.NSAddr).
		WithField("shaped", l.Shaped).WithField("rate_bits", l.Rate).Debug("link up")
	return l, nil
}

// shape attaches htb to both veth ends: the host end shapes what the root
// namespace sends (requests), the namespace end what servers in it send
// (blobs).
func (l *Link) shape(ctx context.Context) error {
	rate := fmt.Sprintf("%dbit", l.Rate)
	// burst of a few ms at line rate keeps htb accurate with the large GSO
	// packets veth carries; the default (one MTU-ish) undershoots badly.
	burst := fmt.Sprintf("%d", max(l.Rate/8/250, 64<<10))
	for _, ns := range []struct {
		prefix []string
		dev    string
	}{
		{nil, l.HostIf},
		{[]string{"-n", l.Name}, l.NSIf},
	} {
		args := append(append([]string{}, ns.prefix...), "qdisc", "add", "dev", ns.dev, "root", "handle", "1:", "htb", "default", "10")
		if err := run(ctx, "tc", args...); err != nil {
			return fmt.Errorf("htb qdisc on %s: %w", ns.dev, err)
		}
		args = append(append([]string{}, ns.prefix...), "class", "add", "dev", ns.dev, "parent", "1:", "classid", "1:10",
			"htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)
		if err := run(ctx, "tc", args...); err != nil {
			return fmt.Errorf("htb class on %s: %w", ns.dev, err)
		}
	}
	return nil
}

// Close deletes the veth pair and the namespace. Deleting the namespace
// alone would also destroy its veth end and with it the pair, but only
// once every process in it has exited; deleting the link first frees the
// addresses at once.
func (l *Link) Close(ctx context.Context) error {
	var errs []error
	if linkExists(l.HostIf) {
		if err := run(ctx, "ip", "link", "del", l.HostIf); err != nil {
			errs = append(errs, err)
		}
	}
	if _, err := os.Stat("/run/netns/" + l.Name); err == nil {
		if err := run(ctx, "ip", "netns", "del", l.Name); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("link %s: teardown: %w", l.Name, err)
	}
	return nil
}

// Command returns a command that runs inside the namespace. The caller
// must stop it before Close.
func (l *Link) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", l.Name, name}, args...)...)
}

// Listen opens a TCP listener inside the namespace on port (0 picks one),
// bound to NSAddr. A socket stays in the namespace it was created in, so
// the listener works from any goroutine afterwards.
func (l *Link) Listen(ctx context.Context, port int) (net.Listener, error) {
	var ln net.Listener
	err := inNetNS("/run/netns/"+l.Name, func() error {
		var err error
		var lc net.ListenConfig
		ln, err = lc.Listen(ctx, "tcp", netip.AddrPortFrom(l.NSAddr, uint16(port)).String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("link %s: listen: %w", l.Name, err)
	}
	return ln, nil
}

// inNetNS runs fn on an OS thread switched into the network namespace at
// path. The thread is not returned to the scheduler's pool if switching
// back fails.
func inNetNS(path string, fn func() error) error {
	target, err := os.Open(path)
	if err != nil {
		return err
	}
	defer target.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer self.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("setns: %w", err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: the runtime destroys it when this
			// goroutine exits instead of reusing a thread in the wrong
			// namespace.
			errc <- errors.Join(ferr, fmt.Errorf("setns back: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// freeSubnet picks a /30 in benchNet not assigned to any interface of the
// root namespace, starting from a hash of name so concurrent benches with
// different names rarely probe the same one.
func freeSubnet(name string) (host, ns netip.Addr, _ error) {
	p, err := freePrefix(name, 30)
	if err != nil {
		return host, ns, err
	}
	return p.Addr().Next(), p.Addr().Next().Next(), nil
}

// freePrefix picks a prefix of bits in benchNet that overlaps no address
// of an interface of the root namespace (a Link's /30, a Bridge's
// subnet), starting from a hash of name.
func freePrefix(name string, bits int) (netip.Prefix, error) {
	if bits < benchNet.Bits() || bits > 30 {
		return netip.Prefix{}, fmt.Errorf("no /%d in %s", bits, benchNet)
	}
	var used []netip.Prefix
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("list addresses: %w", err)
	}
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Is4() {
			used = append(used, p.Masked())
		}
	}
	var h uint32 = 2166136261
	for i := 0; i < len(name); i++ {
		h = (h ^ uint32(name[i])) * 16777619
	}
	subnets := uint32(1) << (bits - benchNet.Bits())
	base := benchNet.Addr().As4()
	start := uint32(base[0])<<24 | uint32(base[1])<<16
	for i := uint32(0); i < subnets; i++ {
		idx := (h + i) % subnets
		if idx == 0 {
			continue // skip the network's first subnet
		}
		p := netip.PrefixFrom(u32addr(start+idx<<(32-bits)), bits)
		if !slices.ContainsFunc(used, p.Overlaps) {
			return p, nil
		}
	}
	return netip.Prefix{}, fmt.Errorf("no free /%d in %s", bits, benchNet)
}

func u32addr(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

func linkExists(name string) bool {
	_, err := net.InterfaceByName(name)
	return err == nil
}

// LeftoverNamespaces lists namespaces named like ours, so a test can check
// that teardown removed them.
func LeftoverNamespaces() ([]string, error) {
	entries, err := os.ReadDir("/run/netns")
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), NamePrefix) {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Proxy starts a LatencyProxy on loopback in front of port on NSAddr,
// adding rtt. When the link is not shaped it caps bandwidth in the proxy
// instead. The returned description says which, for the bench's output.
func (l *Link) Proxy(ctx context.Context, port int, rtt time.Duration) (*LatencyProxy, string, error) {
	target := netip.AddrPortFrom(l.NSAddr, uint16(port)).String()
	opts := []ProxyOpt{WithRTT(rtt)}
	desc := fmt.Sprintf("%s RTT (in-process proxy), %d Mbit/s (htb on veth %s/%s, netns %s)", rtt, l.Rate/1e6, l.HostIf, l.NSIf, l.Name)
	if !l.Shaped {
		opts = append(opts, WithRateLimit(l.Rate))
		desc = fmt.Sprintf("%s RTT (in-process proxy), %d Mbit/s per connection (token bucket in the proxy: htb unavailable: %v)", rtt, l.Rate/1e6, l.ShapeErr)
	}
	p, err := NewLatencyProxy(ctx, "127.0.0.1:0", target, opts...)
	if err != nil {
		return nil, "", err
	}
	return p, desc, nil
}
