package egress

import (
	"context"
	"fmt"
	"net"
	"net/netip"
)

// Policy is an environment's resolved egress policy.
type Policy struct {
	// Allow lists the allowed destinations, names resolved.
	Allow []Entry
	// Resolvers are the only destinations of DNS (port 53, UDP and TCP).
	// They are the one exception to Deny: a node-local DNS cache on a
	// node address stays reachable on port 53 alone.
	Resolvers []netip.Addr
	// Deny is always rejected, whatever Allow says: the node's addresses,
	// the metadata service, the operator's additions.
	Deny []netip.Prefix
}

// MaxRules bounds the compiled policy: every packet an environment sends
// walks the list, and an annotation must not be able to make it long.
const MaxRules = 512

// Metadata are the cloud metadata service addresses (AWS, GCP, Azure and
// others use 169.254.169.254; AWS's IPv6 endpoint is fd00:ec2::254).
var Metadata = []netip.Prefix{
	netip.MustParsePrefix("169.254.169.254/32"),
	netip.MustParsePrefix("fd00:ec2::254/128"),
}

// NodeAddresses returns every address of the interfaces of the calling
// process's network namespace (the node's, for the shim), as host
// prefixes. Loopback addresses are left out: inside the environment they
// name its own loopback, which is not the node's.
func NodeAddresses() ([]netip.Prefix, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("list node addresses: %w", err)
	}
	var out []netip.Prefix
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(ipn.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if ip.IsLoopback() {
			continue
		}
		out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
	}
	return out, nil
}

// Lookup resolves a host name (net.DefaultResolver.LookupNetIP's shape).
type Lookup func(ctx context.Context, host string) ([]netip.Addr, error)

// Resolve replaces every named entry by one entry per address the name
// resolves to now. A name that does not resolve fails: an environment
// started without its mirror would fail later and less clearly.
func Resolve(ctx context.Context, entries []Entry, lookup Lookup) ([]Entry, error) {
	out := make([]Entry, 0, len(entries))
	for _, e := range entries {
		if e.Host == "" {
			out = append(out, e)
			continue
		}
		addrs, err := lookup(ctx, e.Host)
		if err == nil && len(addrs) == 0 {
			err = fmt.Errorf("no addresses")
		}
		if err != nil {
			return nil, fmt.Errorf("resolve egress host %s: %w", e.Host, err)
		}
		for _, a := range addrs {
			a = a.Unmap()
			r := e
			r.Host = ""
			r.Prefix = netip.PrefixFrom(a, a.BitLen())
			out = append(out, r)
		}
	}
	return out, nil
}

// LookupIP resolves with the calling process's resolver, both families.
func LookupIP(ctx context.Context, host string) ([]netip.Addr, error) {
	return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
}

// Verdict is what a rule does with a matching packet.
type Verdict uint8

const (
	Accept Verdict = iota
	Reject
)

// Kind names the counter a rejected packet is counted in.
type Kind string

const (
	KindNode  Kind = "node"  // the node's addresses and the metadata service
	KindDNS   Kind = "dns"   // DNS to a resolver that is not allowed
	KindOther Kind = "other" // anything else outside the allow-list
)

// Kinds lists every counter, in the order they are reported.
var Kinds = []Kind{KindNode, KindDNS, KindOther}

// Rule matches packets by destination, protocol and destination port; a
// zero field matches anything. The first matching rule decides.
type Rule struct {
	Dst     netip.Prefix
	Proto   Proto
	Ports   PortRange
	Verdict Verdict
	Kind    Kind // counter of a Reject
}

const dnsPort = 53

// Rules compiles p into the ordered rule list Apply installs after its
// fixed preamble (replies to established connections, loopback, IPv6
// neighbour discovery). The order is the policy:
//
//  1. DNS to the resolvers is accepted;
//  2. the denied networks (the node, the metadata service) are rejected,
//     whatever follows;
//  3. DNS to anywhere else is rejected, even inside an allowed network;
//  4. the allow-list is accepted;
//  5. everything else is rejected.
func (p Policy) Rules() ([]Rule, error) {
	dns := PortRange{dnsPort, dnsPort}
	var rs []Rule
	for _, r := range p.Resolvers {
		r = r.Unmap()
		host := netip.PrefixFrom(r, r.BitLen())
		rs = append(rs, Rule{Dst: host, Proto: UDP, Ports: dns}, Rule{Dst: host, Proto: TCP, Ports: dns})
	}
	for _, d := range p.Deny {
		rs = append(rs, Rule{Dst: d.Masked(), Verdict: Reject, Kind: KindNode})
	}
	rs = append(rs,
		Rule{Proto: UDP, Ports: dns, Verdict: Reject, Kind: KindDNS},
		Rule{Proto: TCP, Ports: dns, Verdict: Reject, Kind: KindDNS})
	for _, e := range p.Allow {
		if e.Host != "" {
			return nil, fmt.Errorf("egress entry %s: host name not resolved", e)
		}
		rs = append(rs, Rule{Dst: e.Prefix.Masked(), Proto: e.Proto, Ports: e.Ports})
	}
	rs = append(rs, Rule{Verdict: Reject, Kind: KindOther})
	if len(rs) > MaxRules {
		return nil, fmt.Errorf("egress policy compiles to %d rules, more than %d: use CIDRs", len(rs), MaxRules)
	}
	return rs, nil
}
