package netshape

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
)

func requireNetAdmin(t *testing.T) {
	t.Helper()
	prereq.RequireRoot(t) // to create network namespaces
	for _, tool := range []string{"ip", "tc"} {
		if _, err := exec.LookPath(tool); err != nil {
			prereq.Missing(t, "needs %s: %v", tool, err)
		}
	}
}

// linkSeq names the links of one test binary; tests using it do not run
// in parallel.
var linkSeq int

func newTestLink(t *testing.T, opts ...LinkOpt) *Link {
	t.Helper()
	ctx := context.Background()
	linkSeq++
	l, err := NewLink(ctx, append([]LinkOpt{WithName(fmt.Sprintf("%s%d-t%d", NamePrefix, os.Getpid(), linkSeq))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := l.Close(ctx); err != nil {
			t.Errorf("close link: %v", err)
		}
	})
	return l
}

// TestLinkShapesBandwidth sends a blob from a server inside the namespace
// to the root namespace over the htb-shaped veth.
func TestLinkShapesBandwidth(t *testing.T) {
	requireNetAdmin(t)
	for _, tc := range []struct {
		name string
		bits int64
	}{
		{"1gbit", 1_000_000_000},
		{"300mbit", 300_000_000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newTestLink(t, WithLinkRate(tc.bits))
			if !l.Shaped {
				prereq.Missing(t, "htb unavailable (%v); benches fall back to WithRateLimit in the proxy", l.ShapeErr)
			}
			ln, err := l.Listen(context.Background(), 0)
			if err != nil {
				t.Fatal(err)
			}
			const size = 64 << 20
			blobServer(t, ln, size)
			n, rate := download(t, ln.Addr().String())
			if n != size {
				t.Fatalf("read %d bytes, want %d", n, size)
			}
			ratio := rate / float64(tc.bits)
			t.Logf("htb %s on veth %s<->%s (%s -> %s): %d MiB at %.0f Mbit/s = %.3f of the configured rate",
				tc.name, l.HostIf, l.NSIf, l.NSAddr, l.HostAddr, size>>20, rate/1e6, ratio)
			// htb is a hard cap: beyond its burst (a few ms of data)
			// nothing passes faster. How close to the cap a loaded
			// 2-core machine gets is printed, not asserted.
			if ratio > 1.1 {
				t.Errorf("throughput %.3f of the htb rate: not shaped", ratio)
			}
			// Side by side: the same veth without the qdiscs, to tell the
			// cap from what the CPU allows right now.
			for _, dev := range [][]string{{"qdisc", "del", "dev", l.HostIf, "root"}, {"-n", l.Name, "qdisc", "del", "dev", l.NSIf, "root"}} {
				if out, err := exec.Command("tc", dev...).CombinedOutput(); err != nil {
					t.Fatalf("tc %v: %v: %s", dev, err, out)
				}
			}
			_, raw := download(t, ln.Addr().String())
			t.Logf("same veth without htb: %.0f Mbit/s (shaped/unshaped %.3f)", raw/1e6, rate/raw)
		})
	}
}

// TestLinkWithProxy is the bench's registry path: a client in the root
// namespace, the latency proxy on loopback, the server in the namespace
// behind the shaped veth.
func TestLinkWithProxy(t *testing.T) {
	requireNetAdmin(t)
	l := newTestLink(t)
	ln, err := l.Listen(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	echoServer(t, ln)
	p, desc, err := l.Proxy(context.Background(), ln.Addr().(*net.TCPAddr).Port, 20*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	t.Logf("registry path: %s", desc)
	if l.Shaped != (p.RateLimit() == 0) {
		t.Errorf("shaped=%v but proxy rate limit %d: exactly one of htb and the proxy must cap bandwidth", l.Shaped, p.RateLimit())
	}
	direct := medianRTT(t, ln.Addr().String(), 30)
	proxied := medianRTT(t, p.Addr(), 30)
	t.Logf("veth RTT %v; through the 20ms proxy %v (added %v)", direct, proxied, proxied-direct)
	if proxied < 20*time.Millisecond {
		t.Errorf("RTT through proxy %v < 20ms", proxied)
	}
}

// TestLinkTeardown checks that Close leaves no namespace, veth or address
// behind, also when a server in the namespace still has a listener open.
func TestLinkTeardown(t *testing.T) {
	requireNetAdmin(t)
	ctx := context.Background()
	l, err := NewLink(ctx, WithName(fmt.Sprintf("%s%d-teardown", NamePrefix, os.Getpid())))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			l.Close(ctx)
		}
	})
	if _, err := net.InterfaceByName(l.HostIf); err != nil {
		t.Fatalf("host veth %s missing after NewLink: %v", l.HostIf, err)
	}
	if out, err := exec.Command("ip", "-n", l.Name, "-o", "addr", "show", "dev", l.NSIf).CombinedOutput(); err != nil {
		t.Fatalf("namespace veth: %v: %s", err, out)
	}
	ln, err := l.Listen(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// A process in the namespace must not keep it alive past Close.
	sleeper := l.Command(ctx, "sleep", "30")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sleeper.Process.Kill()
		sleeper.Wait()
	})

	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	closed = true
	if _, err := net.InterfaceByName(l.HostIf); err == nil {
		t.Errorf("host veth %s still exists after Close", l.HostIf)
	}
	if _, err := os.Stat("/run/netns/" + l.Name); err == nil {
		t.Errorf("namespace %s still exists after Close", l.Name)
	}
	left, err := LeftoverNamespaces()
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(left, l.Name) {
		t.Errorf("LeftoverNamespaces still lists %s", l.Name)
	}
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ip, _, _ := net.ParseCIDR(a.String()); ip != nil && ip.Equal(net.IP(l.HostAddr.AsSlice())) {
			t.Errorf("address %s still assigned after Close", l.HostAddr)
		}
	}
}

func TestFreeSubnetStaysInBenchRange(t *testing.T) {
	for _, name := range []string{"a", "envsnap-bench-1", "envsnap-bench-424242", ""} {
		host, ns, err := freeSubnet(name)
		if err != nil {
			t.Fatal(err)
		}
		if !benchNet.Contains(host) || !benchNet.Contains(ns) {
			t.Errorf("%q: %s/%s outside %s", name, host, ns, benchNet)
		}
		hp, _ := host.Prefix(30)
		np, _ := ns.Prefix(30)
		if hp != np || host == ns || hp.Addr() == host {
			t.Errorf("%q: %s and %s are not the two hosts of one /30", name, host, ns)
		}
	}
}
