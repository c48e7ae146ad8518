// Package egress is the per-environment network allow-list: the
// io.envsnap.egress annotation's syntax, the ordered rules a policy
// compiles to, and their enforcement as an nftables table inside the
// environment's network namespace.
//
// # Invariant
//
// Whatever the allow-list says, an environment reaches neither the node it
// runs on (every address of the node's interfaces, so the snapshotter,
// the arbiter and kubelet on any port) nor the cloud metadata service;
// DNS goes only to the configured resolvers; anything else not allowed is
// rejected, counted per kind, and the shim logs the counts with the
// environment's id. Replies to connections made into the environment
// (probes, port-forward) and loopback traffic pass.
//
// # Life cycle
//
// The shim parses the node default and the annotation at Create (Parse),
// resolves host names once (Resolve), compiles the policy (Policy.Rules),
// and after runc has created the container, before its process runs user
// code, installs the table in the container's network namespace (Apply).
// Reading the counters (Counts) is how denials are observed.
package egress

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Annotation is the per-container allow-list. When present it replaces the
// node's default list; "none" (or an empty value) allows nothing beyond
// the resolvers.
const Annotation = "io.envsnap.egress"

// Proto is an IP protocol number an entry allows.
type Proto uint8

const (
	TCP Proto = 6
	UDP Proto = 17
)

func (p Proto) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return strconv.Itoa(int(p))
}

// Entry is one allowed destination: a network (or a host name to resolve
// at start), a port range and a protocol.
type Entry struct {
	// Host is a DNS name still to be resolved; empty once Prefix is set.
	Host   string
	Prefix netip.Prefix
	Ports  PortRange
	Proto  Proto
}

// PortRange is an inclusive range of destination ports.
type PortRange struct{ Lo, Hi uint16 }

// AllPorts is the range "*" stands for.
var AllPorts = PortRange{1, 65535}

func (r PortRange) String() string {
	switch {
	case r == AllPorts:
		return "*"
	case r.Lo == r.Hi:
		return strconv.Itoa(int(r.Lo))
	}
	return fmt.Sprintf("%d-%d", r.Lo, r.Hi)
}

// String renders e in the syntax Parse reads.
func (e Entry) String() string {
	host := e.Host
	if host == "" {
		host = e.Prefix.String()
		if e.Prefix.Addr().Is6() {
			host = "[" + host + "]"
		}
	}
	return fmt.Sprintf("%s:%s/%s", host, e.Ports, e.Proto)
}

// ErrSyntax marks an allow-list that does not parse.
var ErrSyntax = errors.New("egress entry syntax")

// Parse reads an allow-list: entries separated by commas or white space,
// each HOST:PORTS/PROTO where
//
//   - HOST is an IPv4 address or CIDR (10.0.0.0/8), an IPv6 address or
//     CIDR in brackets ([2001:db8::/32]), or a DNS name resolved when the
//     environment starts;
//   - PORTS is a port (443), a range (8000-8080) or * (any);
//   - PROTO is tcp or udp.
//
// "none" alone (or nothing) is the empty list. Any malformed entry fails
// the whole list: a typo must not silently open or close a path.
func Parse(s string) ([]Entry, error) {
	fields := strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\n' || r == '\r' })
	if len(fields) == 1 && fields[0] == "none" {
		return nil, nil
	}
	var out []Entry
	for _, f := range fields {
		e, err := parseEntry(f)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

func parseEntry(s string) (Entry, error) {
	var e Entry
	fail := func(why string) (Entry, error) {
		return Entry{}, fmt.Errorf("%w: %q: %s (want HOST:PORTS/tcp|udp)", ErrSyntax, s, why)
	}
	rest, proto, ok := cutLast(s, "/")
	if !ok {
		return fail("no protocol")
	}
	switch proto {
	case "tcp":
		e.Proto = TCP
	case "udp":
		e.Proto = UDP
	default:
		return fail("protocol must be tcp or udp")
	}
	host, ports, ok := cutLast(rest, ":")
	if !ok || host == "" {
		return fail("no port")
	}
	pr, err := parsePorts(ports)
	if err != nil {
		return fail(err.Error())
	}
	e.Ports = pr
	if inner, ok := strings.CutPrefix(host, "["); ok {
		inner, ok = strings.CutSuffix(inner, "]")
		if !ok {
			return fail("unclosed [")
		}
		p, err := parsePrefix(inner)
		if err != nil || !p.Addr().Is6() {
			return fail("bracketed host must be an IPv6 address or CIDR")
		}
		e.Prefix = p
		return e, nil
	}
	if strings.ContainsAny(host, "[]:") {
		return fail("IPv6 addresses go in brackets")
	}
	if p, err := parsePrefix(host); err == nil {
		if !p.Addr().Is4() {
			return fail("IPv6 addresses go in brackets")
		}
		e.Prefix = p
		return e, nil
	}
	if !validName(host) {
		return fail("host is neither an address, a CIDR nor a DNS name")
	}
	e.Host = strings.ToLower(strings.TrimSuffix(host, "."))
	return e, nil
}

// cutLast splits s around the last sep.
func cutLast(s, sep string) (before, after string, ok bool) {
	i := strings.LastIndex(s, sep)
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+len(sep):], true
}

// parsePrefix reads an address (a host prefix) or a CIDR whose host bits
// are zero: 10.1.2.3/8 is a typo for one of two things, so it is refused.
func parsePrefix(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		if a.Zone() != "" {
			return netip.Prefix{}, fmt.Errorf("zoned address")
		}
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return p, err
	}
	if p.Masked() != p {
		return p, fmt.Errorf("CIDR %s has host bits set", s)
	}
	if p.Addr().Is4In6() {
		return p, fmt.Errorf("IPv4-mapped CIDR %s", s)
	}
	return p, nil
}

func parsePorts(s string) (PortRange, error) {
	if s == "*" {
		return AllPorts, nil
	}
	lo, hi, isRange := strings.Cut(s, "-")
	l, err := parsePort(lo)
	if err != nil {
		return PortRange{}, err
	}
	h := l
	if isRange {
		if h, err = parsePort(hi); err != nil {
			return PortRange{}, err
		}
		if h < l {
			return PortRange{}, fmt.Errorf("port range %s is reversed", s)
		}
	}
	return PortRange{l, h}, nil
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 || s[0] == '+' {
		return 0, fmt.Errorf("port %q must be 1-65535", s)
	}
	return uint16(n), nil
}

// validName accepts RFC 1123 host names (letters, digits, hyphens, dots).
func validName(s string) bool {
	s = strings.TrimSuffix(s, ".")
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, r := range label {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
				return false
			}
		}
	}
	// A name made of digits and dots only is a malformed address.
	return strings.Trim(s, "0123456789.") != ""
}
