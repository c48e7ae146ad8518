package egress

import (
	"context"
	"errors"
	"net/netip"
	"reflect"
	"testing"
)

func TestParse(t *testing.T) {
	pfx := netip.MustParsePrefix
	for _, tc := range []struct {
		in   string
		want []Entry
	}{
		{"", nil},
		{"none", nil},
		{"10.0.0.5:443/tcp", []Entry{{Prefix: pfx("10.0.0.5/32"), Ports: PortRange{443, 443}, Proto: TCP}}},
		{"10.0.0.0/8:8000-8080/udp, 192.0.2.1:*/tcp", []Entry{
			{Prefix: pfx("10.0.0.0/8"), Ports: PortRange{8000, 8080}, Proto: UDP},
			{Prefix: pfx("192.0.2.1/32"), Ports: AllPorts, Proto: TCP},
		}},
		{"[2001:db8::/32]:443/tcp [::1]:80/tcp", []Entry{
			{Prefix: pfx("2001:db8::/32"), Ports: PortRange{443, 443}, Proto: TCP},
			{Prefix: pfx("::1/128"), Ports: PortRange{80, 80}, Proto: TCP},
		}},
		{"Mirror.Example.com.:5000/tcp", []Entry{{Host: "mirror.example.com", Ports: PortRange{5000, 5000}, Proto: TCP}}},
		{"pypi:443/tcp\n\tproxy-1.internal:3128/tcp", []Entry{
			{Host: "pypi", Ports: PortRange{443, 443}, Proto: TCP},
			{Host: "proxy-1.internal", Ports: PortRange{3128, 3128}, Proto: TCP},
		}},
	} {
		got, err := Parse(tc.in)
		if err != nil {
			t.Errorf("Parse(%q): %v", tc.in, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("Parse(%q) = %+v, want %+v", tc.in, got, tc.want)
		}
	}
}

func TestParseRejects(t *testing.T) {
	for _, in := range []string{
		"10.0.0.5:443",          // no protocol
		"10.0.0.5/tcp",          // no port
		"10.0.0.5:443/icmp",     // protocol
		"10.0.0.5:0/tcp",        // port 0
		"10.0.0.5:65536/tcp",    // port too big
		"10.0.0.5:+80/tcp",      // sign
		"10.0.0.5:90-80/tcp",    // reversed range
		"10.0.0.5:80-/tcp",      // open range
		"10.1.2.3/8:443/tcp",    // host bits set
		"10.0.0.0/33:443/tcp",   // prefix length
		"2001:db8::1:443/tcp",   // IPv6 without brackets
		"[10.0.0.1]:443/tcp",    // IPv4 in brackets
		"[2001:db8::1:443/tcp",  // unclosed bracket
		"[fe80::1%eth0]:80/tcp", // zone
		"1.2.3:443/tcp",         // digits-only name
		"-bad.example:443/tcp",  // label starts with a hyphen
		"ex ample:443/tcp",      // second field has no port
		"a_b.example:443/tcp",   // underscore
		":443/tcp",              // no host
		"none, 10.0.0.1:1/tcp",  // none mixed with entries
		"10.0.0.5:443/tcp,x",    // one bad entry fails the list
	} {
		if got, err := Parse(in); !errors.Is(err, ErrSyntax) {
			t.Errorf("Parse(%q) = %+v, %v; want ErrSyntax", in, got, err)
		}
	}
}

func TestResolve(t *testing.T) {
	in, err := Parse("mirror.test:443/tcp, 10.0.0.0/8:53/udp")
	if err != nil {
		t.Fatal(err)
	}
	lookup := func(_ context.Context, host string) ([]netip.Addr, error) {
		if host != "mirror.test" {
			return nil, errors.New("no such host")
		}
		return []netip.Addr{netip.MustParseAddr("::ffff:192.0.2.7"), netip.MustParseAddr("2001:db8::7")}, nil
	}
	got, err := Resolve(context.Background(), in, lookup)
	if err != nil {
		t.Fatal(err)
	}
	want := []Entry{
		{Prefix: netip.MustParsePrefix("192.0.2.7/32"), Ports: PortRange{443, 443}, Proto: TCP},
		{Prefix: netip.MustParsePrefix("2001:db8::7/128"), Ports: PortRange{443, 443}, Proto: TCP},
		in[1],
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Resolve = %v, want %v", got, want)
	}
	bad, _ := Parse("gone.test:443/tcp")
	if _, err := Resolve(context.Background(), bad, lookup); err == nil {
		t.Error("an unresolvable name resolved")
	}
}

func TestRules(t *testing.T) {
	allow, err := Parse("10.0.0.0/8:443/tcp, 10.1.0.0/16:*/udp")
	if err != nil {
		t.Fatal(err)
	}
	node := netip.MustParsePrefix("10.0.0.1/32")
	resolver := netip.MustParseAddr("10.0.0.1") // a node-local cache
	p := Policy{Allow: allow, Resolvers: []netip.Addr{resolver}, Deny: append([]netip.Prefix{node}, Metadata...)}
	got, err := p.Rules()
	if err != nil {
		t.Fatal(err)
	}
	dns := PortRange{53, 53}
	want := []Rule{
		{Dst: node, Proto: UDP, Ports: dns},
		{Dst: node, Proto: TCP, Ports: dns},
		{Dst: node, Verdict: Reject, Kind: KindNode},
		{Dst: Metadata[0], Verdict: Reject, Kind: KindNode},
		{Dst: Metadata[1], Verdict: Reject, Kind: KindNode},
		{Proto: UDP, Ports: dns, Verdict: Reject, Kind: KindDNS},
		{Proto: TCP, Ports: dns, Verdict: Reject, Kind: KindDNS},
		{Dst: allow[0].Prefix, Proto: TCP, Ports: PortRange{443, 443}},
		{Dst: allow[1].Prefix, Proto: UDP, Ports: AllPorts},
		{Verdict: Reject, Kind: KindOther},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Rules:\n got %+v\nwant %+v", got, want)
	}
	// First match decides: the node inside an allowed network stays
	// denied, and so does DNS to an allowed network.
	for _, tc := range []struct {
		dst   string
		proto Proto
		port  uint16
		want  Verdict
		kind  Kind
	}{
		{"10.0.0.1", TCP, 443, Reject, KindNode},
		{"10.0.0.1", UDP, 53, Accept, ""},
		{"10.2.3.4", TCP, 443, Accept, ""},
		{"10.2.3.4", TCP, 53, Reject, KindDNS},
		{"10.1.2.3", UDP, 9999, Accept, ""},
		{"10.2.3.4", UDP, 9999, Reject, KindOther},
		{"169.254.169.254", TCP, 80, Reject, KindNode},
		{"192.0.2.1", TCP, 443, Reject, KindOther},
	} {
		v, k := decide(got, netip.MustParseAddr(tc.dst), tc.proto, tc.port)
		if v != tc.want || k != tc.kind {
			t.Errorf("%s %s/%d: %v %q, want %v %q", tc.dst, tc.proto, tc.port, v, k, tc.want, tc.kind)
		}
	}

	unresolved, _ := Parse("mirror.test:443/tcp")
	if _, err := (Policy{Allow: unresolved}).Rules(); err == nil {
		t.Error("an unresolved name compiled")
	}
	many := make([]Entry, MaxRules)
	for i := range many {
		many[i] = allow[0]
	}
	if _, err := (Policy{Allow: many}).Rules(); err == nil {
		t.Error("an oversized policy compiled")
	}
}

// decide is the first-match semantics the kernel applies to rules.
func decide(rules []Rule, dst netip.Addr, proto Proto, port uint16) (Verdict, Kind) {
	for _, r := range rules {
		if r.Dst.IsValid() && !r.Dst.Contains(dst) {
			continue
		}
		if r.Proto != 0 && r.Proto != proto {
			continue
		}
		if r.Ports != (PortRange{}) && (port < r.Ports.Lo || port > r.Ports.Hi) {
			continue
		}
		return r.Verdict, r.Kind
	}
	return Reject, ""
}

func TestNodePolicy(t *testing.T) {
	def, _ := Parse("192.0.2.10:443/tcp")
	n := Node{Allow: def, Resolvers: []netip.Addr{netip.MustParseAddr("192.0.2.53")}, Deny: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}}
	nodeAddrs := func() ([]netip.Prefix, error) {
		return []netip.Prefix{netip.MustParsePrefix("10.1.1.1/32")}, nil
	}
	lookup := func(context.Context, string) ([]netip.Addr, error) { return nil, errors.New("no lookups expected") }
	ctx := context.Background()

	if _, ok, err := n.Policy(ctx, nil, lookup, nodeAddrs); ok || err != nil {
		t.Errorf("not enforced, no annotation: policy %v, %v", ok, err)
	}
	p, ok, err := n.Policy(ctx, map[string]string{Annotation: "none"}, lookup, nodeAddrs)
	if !ok || err != nil || len(p.Allow) != 0 {
		t.Errorf("annotation none: %+v %v %v", p, ok, err)
	}
	wantDeny := []netip.Prefix{netip.MustParsePrefix("10.1.1.1/32"), Metadata[0], Metadata[1], n.Deny[0]}
	if !reflect.DeepEqual(p.Deny, wantDeny) || !reflect.DeepEqual(p.Resolvers, n.Resolvers) {
		t.Errorf("deny %v resolvers %v, want %v %v", p.Deny, p.Resolvers, wantDeny, n.Resolvers)
	}
	n.Enforce = true
	if p, ok, err := n.Policy(ctx, nil, lookup, nodeAddrs); !ok || err != nil || !reflect.DeepEqual(p.Allow, def) {
		t.Errorf("enforced default: %+v %v %v", p, ok, err)
	}
	if _, _, err := n.Policy(ctx, map[string]string{Annotation: "10.0.0.1:443"}, lookup, nodeAddrs); !errors.Is(err, ErrSyntax) {
		t.Errorf("bad annotation: %v", err)
	}
}
