//go:build linux

package egress

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// TableName is the inet table Apply owns in an environment's network
// namespace.
const TableName = "envsnap_egress"

var table = &nftables.Table{Name: TableName, Family: nftables.TableFamilyINet}

// Apply replaces the egress table in the network namespace open at netns
// with rules, in one netlink batch: the namespace never runs with half a
// policy. The output chain's own policy is drop, so a packet no rule
// decides (none should reach it) is still stopped.
//
// Apply must run before the environment's processes start: a process
// holding CAP_NET_ADMIN in the namespace could delete the table, which is
// why the shim refuses such containers.
func Apply(netns int, rules []Rule) error {
	c, err := nftables.New(nftables.WithNetNSFd(netns))
	if err != nil {
		return fmt.Errorf("egress: netlink: %w", err)
	}
	// Add-delete-add empties a table left by an earlier container of the
	// same pod (CRI containers share the sandbox's namespace) without
	// failing when there is none.
	c.AddTable(table)
	c.DelTable(table)
	c.AddTable(table)
	for _, k := range Kinds {
		c.AddObj(&nftables.NamedObj{Table: table, Name: string(k), Type: nftables.ObjTypeCounter, Obj: &expr.Counter{}})
	}
	drop := nftables.ChainPolicyDrop
	chain := c.AddChain(&nftables.Chain{
		Name: "output", Table: table, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter, Policy: &drop,
	})
	for _, exprs := range preamble() {
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: exprs})
	}
	for _, r := range rules {
		list, err := ruleExprs(r)
		if err != nil {
			return err
		}
		for _, exprs := range list {
			c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: exprs})
		}
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("egress: install table %s: %w", TableName, err)
	}
	return nil
}

// Counters reads the rejected-packet counters of one namespace's table
// over a netlink socket opened in that namespace once: opening one costs a
// thread switch into the namespace, which a reader polling every second
// for each of hundreds of environments should not repeat
// (BenchmarkCounters). The socket keeps the namespace alive until Close.
type Counters struct{ conn *nftables.Conn }

// OpenCounters opens a reader for the table in netns.
func OpenCounters(netns int) (*Counters, error) {
	c, err := nftables.New(nftables.WithNetNSFd(netns), nftables.AsLasting())
	if err != nil {
		return nil, fmt.Errorf("egress: netlink: %w", err)
	}
	return &Counters{conn: c}, nil
}

// Read returns the packets rejected so far, per kind.
func (c *Counters) Read() (map[Kind]uint64, error) {
	objs, err := c.conn.GetNamedObjects(table)
	if err != nil {
		return nil, fmt.Errorf("egress: read counters: %w", err)
	}
	out := make(map[Kind]uint64, len(Kinds))
	for _, o := range objs {
		no, ok := o.(*nftables.NamedObj)
		if !ok {
			continue
		}
		if ctr, ok := no.Obj.(*expr.Counter); ok {
			out[Kind(no.Name)] = ctr.Packets
		}
	}
	return out, nil
}

// Close releases the socket.
func (c *Counters) Close() error { return c.conn.CloseLasting() }

// preamble is what every policy accepts first: replies to connections
// made into the environment, its loopback, and IPv6 neighbour and router
// discovery (without which no IPv6 destination is reachable).
func preamble() [][]expr.Any {
	established := binary.NativeEndian.AppendUint32(nil, expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED)
	return [][]expr.Any{
		{
			&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: established, Xor: make([]byte, 4)},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
			&expr.Verdict{Kind: expr.VerdictAccept},
		},
		{
			&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname("lo")},
			&expr.Verdict{Kind: expr.VerdictAccept},
		},
		{
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_ICMPV6}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 1},
			// router solicitation 133 to neighbour advertisement 136
			&expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: []byte{133}, ToData: []byte{136}},
			&expr.Verdict{Kind: expr.VerdictAccept},
		},
	}
}

// ruleExprs translates one rule into one nftables rule, or two for a
// reject that may see TCP: a TCP connection is refused with a reset, which
// the kernel sends at once, while the ICMP errors that refuse everything
// else are rate-limited (icmp_ratelimit, icmp_msgs_per_sec), and a scan
// would otherwise stall on timeouts instead of learning nothing quickly.
func ruleExprs(r Rule) ([][]expr.Any, error) {
	var match []expr.Any
	if r.Dst.IsValid() {
		a := r.Dst.Addr()
		proto, off := byte(unix.NFPROTO_IPV4), uint32(16) // iphdr.daddr
		if a.Is6() {
			proto, off = unix.NFPROTO_IPV6, 24 // ipv6hdr.daddr
		}
		n := uint32(a.BitLen() / 8)
		match = append(match,
			&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
		)
		if r.Dst.Bits() < a.BitLen() {
			match = append(match, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: n, Mask: mask(r.Dst), Xor: make([]byte, n)})
		}
		match = append(match, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: r.Dst.Masked().Addr().AsSlice()})
	}
	if r.Proto != 0 {
		match = append(match, l4proto(byte(r.Proto))...)
		if r.Ports != (PortRange{}) && r.Ports != AllPorts {
			match = append(match, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}) // dport
			lo, hi := binary.BigEndian.AppendUint16(nil, r.Ports.Lo), binary.BigEndian.AppendUint16(nil, r.Ports.Hi)
			if r.Ports.Lo == r.Ports.Hi {
				match = append(match, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: lo})
			} else {
				match = append(match, &expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: lo, ToData: hi})
			}
		}
	} else if r.Ports != (PortRange{}) {
		return nil, fmt.Errorf("egress rule %+v: ports without a protocol", r)
	}
	switch r.Verdict {
	case Accept:
		return [][]expr.Any{append(match, &expr.Verdict{Kind: expr.VerdictAccept})}, nil
	case Reject:
		if r.Kind == "" {
			return nil, fmt.Errorf("egress rule %+v: reject without a counter", r)
		}
		count := &expr.Objref{Type: int(nftables.ObjTypeCounter), Name: string(r.Kind)}
		rst := &expr.Reject{Type: unix.NFT_REJECT_TCP_RST}
		// ICMP "administratively prohibited" fails a send or connect at
		// once (EHOSTUNREACH) instead of leaving the agent to time out.
		icmp := &expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}
		switch r.Proto {
		case TCP:
			return [][]expr.Any{append(match, count, rst)}, nil
		case 0:
			tcp := append(append(slices.Clone(match), l4proto(byte(TCP))...), count, rst)
			return [][]expr.Any{tcp, append(match, count, icmp)}, nil
		}
		return [][]expr.Any{append(match, count, icmp)}, nil
	}
	return nil, fmt.Errorf("egress rule %+v: unknown verdict", r)
}

func l4proto(p byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

// mask is the network mask of p as bytes.
func mask(p netip.Prefix) []byte {
	n := p.Addr().BitLen() / 8
	m := make([]byte, n)
	for i := 0; i < p.Bits(); i++ {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return m
}

// ifname pads an interface name as the kernel stores it.
func ifname(n string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, n)
	return b
}
