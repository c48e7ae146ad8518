//go:build linux

package egress

import (
	"net/netip"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// scratchNetns returns a descriptor of a new, empty network namespace.
func scratchNetns(t testing.TB) int {
	t.Helper()
	prereq.RequireRoot(t)
	type result struct {
		fd  int
		err error
	}
	ch := make(chan result)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			ch <- result{-1, err}
			return
		}
		defer unix.Close(orig)
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ch <- result{-1, err}
			return
		}
		fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		// Back to the original namespace before the thread serves other
		// goroutines; a thread that cannot go back stays locked and dies
		// with this goroutine.
		if serr := unix.Setns(orig, unix.CLONE_NEWNET); serr == nil {
			runtime.UnlockOSThread()
		}
		ch <- result{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatalf("new network namespace: %v", r.err)
	}
	t.Cleanup(func() { unix.Close(r.fd) })
	return r.fd
}

func TestApplyInstallsAndReplaces(t *testing.T) {
	ns := scratchNetns(t)
	allow, err := Parse("10.0.0.0/8:443/tcp, [2001:db8::/32]:8000-8080/udp, 192.0.2.1:*/tcp")
	if err != nil {
		t.Fatal(err)
	}
	p := Policy{Allow: allow, Resolvers: []netip.Addr{netip.MustParseAddr("10.0.0.53")}, Deny: Metadata}
	rules, err := p.Rules()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // the second Apply replaces the first
		if err := Apply(ns, rules); err != nil {
			t.Fatalf("apply %d: %v", i, err)
		}
	}
	c, err := nftables.New(nftables.WithNetNSFd(ns))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := c.ListChain(table, "output")
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.GetRules(table, chain)
	if err != nil {
		t.Fatal(err)
	}
	if want := len(preamble()) + len(rules); len(got) != want {
		t.Errorf("%d rules in the namespace, want %d", len(got), want)
	}
	ctrs, err := OpenCounters(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer ctrs.Close()
	counts, err := ctrs.Read()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range Kinds {
		if n, ok := counts[k]; !ok || n != 0 {
			t.Errorf("counter %s = %d (present %v), want 0", k, n, ok)
		}
	}
	// The table is in the scratch namespace, not in the test's.
	self, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	host, err := OpenCounters(int(self.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	if tabs, err := host.Read(); err == nil && len(tabs) > 0 {
		t.Errorf("the host namespace has an %s table", TableName)
	}
}

func TestRuleExprsRejectsMalformed(t *testing.T) {
	for _, r := range []Rule{
		{Ports: PortRange{1, 2}, Verdict: Accept},
		{Verdict: Reject},
		{Verdict: Verdict(9)},
	} {
		if _, err := ruleExprs(r); err == nil {
			t.Errorf("ruleExprs(%+v) succeeded", r)
		}
	}
}

// BenchmarkCounters compares the shim's per-environment cost of reading
// the denial counters (once a second per environment) over a socket kept
// open in the namespace with opening one per read. The cost is the
// process's CPU time (user + system) per read: on a loaded machine wall
// time mostly measures the other processes.
func BenchmarkCounters(b *testing.B) {
	ns := scratchNetns(b)
	rules, err := Policy{Deny: Metadata}.Rules()
	if err != nil {
		b.Fatal(err)
	}
	if err := Apply(ns, rules); err != nil {
		b.Fatal(err)
	}
	cpu := func() time.Duration {
		var ru unix.Rusage
		if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	per := func(read func() error) float64 {
		start := cpu()
		for i := 0; i < b.N; i++ {
			if err := read(); err != nil {
				b.Fatal(err)
			}
		}
		return float64((cpu() - start).Nanoseconds()) / float64(b.N)
	}
	kept, err := OpenCounters(ns)
	if err != nil {
		b.Fatal(err)
	}
	defer kept.Close()
	b.ResetTimer()
	// What the shim does each second: the counters and the destinations.
	poll := func(c *Counters) error {
		if _, err := c.Read(); err != nil {
			return err
		}
		_, err := c.Denied()
		return err
	}
	keptNs := per(func() error { return poll(kept) })
	freshNs := per(func() error {
		c, err := OpenCounters(ns)
		if err != nil {
			return err
		}
		defer c.Close()
		return poll(c)
	})
	b.ReportMetric(keptNs, "kept-cpu-ns/poll")
	b.ReportMetric(freshNs, "fresh-cpu-ns/poll")
	b.ReportMetric(freshNs/keptNs, "fresh/kept")
}

// A node with many addresses (each a deny rule) gets a batch of hundreds
// of rules, whose acknowledgements overran the netlink socket's default
// receive buffer (ENOBUFS) on a host holding a hundred namespaces.
func TestApplyManyRules(t *testing.T) {
	ns := scratchNetns(t)
	var rules []Rule
	for i := range 100 {
		r, err := Parse(netip.AddrFrom4([4]byte{10, 1, byte(i / 200), byte(i%200 + 1)}).String() + ":8080/tcp")
		if err != nil {
			t.Fatal(err)
		}
		rules = append(rules, Policy{Allow: r}.mustRules(t)...)
	}
	if err := Apply(ns, rules); err != nil {
		t.Fatalf("apply %d rules: %v", len(rules), err)
	}
	c, err := nftables.New(nftables.WithNetNSFd(ns))
	if err != nil {
		t.Fatal(err)
	}
	chain, err := c.ListChain(table, "output")
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.GetRules(table, chain)
	if err != nil {
		t.Fatal(err)
	}
	if want := len(preamble()) + len(rules); len(got) != want {
		t.Errorf("%d rules in the namespace, want %d", len(got), want)
	}
}

func (p Policy) mustRules(t *testing.T) []Rule {
	t.Helper()
	rules, err := p.Rules()
	if err != nil {
		t.Fatal(err)
	}
	return rules
}
