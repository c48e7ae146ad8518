//go:build linux

package egress

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
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
	// The kernel acknowledges every message of the batch at its end, one
	// per rule: a rule per node address makes the acknowledgements of a
	// node with many addresses (110 rules on a host with 98 network
	// namespaces and their bridges) overrun the socket's default receive
	// buffer, and the flush fails with ENOBUFS.
	c, err := nftables.New(nftables.WithNetNSFd(netns), nftables.WithSockOptions(receiveBuffer(ackBuffer)))
	if err != nil {
		return fmt.Errorf("egress: netlink: %w", err)
	}
	// Add-delete-add empties a table left by an earlier container of the
	// same pod (CRI containers share the sandbox's namespace) without
	// failing when there is none.
	c.AddTable(table)
	c.DelTable(table)
	c.AddTable(table)
	for _, set := range deniedSets {
		s := *set
		s.Table = table
		if err := c.AddSet(&s, nil); err != nil {
			return fmt.Errorf("egress: set %s: %w", s.Name, err)
		}
	}
	for _, k := range Kinds {
		c.AddObj(&nftables.NamedObj{Table: table, Name: string(k), Type: nftables.ObjTypeCounter, Obj: &expr.Counter{}})
		deny := c.AddChain(&nftables.Chain{Name: denyChain(k), Table: table})
		for _, exprs := range denyExprs(k) {
			c.AddRule(&nftables.Rule{Table: table, Chain: deny, Exprs: exprs})
		}
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
		exprs, err := ruleExprs(r)
		if err != nil {
			return err
		}
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: exprs})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("egress: install table %s (%d rules): %w", TableName, len(rules), err)
	}
	return nil
}

// ackBuffer is the receive buffer Apply asks for: an acknowledgement
// takes about 1 KiB of it (its socket buffer's true size), so this holds
// those of a few thousand rules.
const ackBuffer = 4 << 20

// receiveBuffer sets a netlink socket's receive buffer to size, beyond
// net.core.rmem_max when the process may (CAP_NET_ADMIN, as the shim
// has), else as far as rmem_max allows.
func receiveBuffer(size int) nftables.SockOption {
	return func(c *netlink.Conn) error {
		raw, err := c.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := raw.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, size)
		}); err != nil {
			return err
		}
		if serr != nil {
			return c.SetReadBuffer(size)
		}
		return nil
	}
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

// Attempt is one recorded denied destination.
type Attempt struct {
	Dst   netip.AddrPort
	Proto Proto
}

func (a Attempt) String() string { return a.Dst.String() + "/" + a.Proto.String() }

// Denied returns the destinations denied within DeniedMemory.
func (c *Counters) Denied() ([]Attempt, error) {
	var out []Attempt
	for _, set := range deniedSets {
		s := *set
		s.Table = table
		elems, err := c.conn.GetSetElements(&s)
		if err != nil {
			return nil, fmt.Errorf("egress: read set %s: %w", s.Name, err)
		}
		n := 4
		if s.Name == deniedSets[unix.NFPROTO_IPV6].Name {
			n = 16
		}
		for _, e := range elems {
			if len(e.Key) < n+8 {
				continue
			}
			addr, _ := netip.AddrFromSlice(e.Key[:n])
			out = append(out, Attempt{
				Dst:   netip.AddrPortFrom(addr, binary.BigEndian.Uint16(e.Key[n+4:n+6])),
				Proto: Proto(e.Key[n]),
			})
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

// ruleExprs translates one rule: its match, then accept, or a jump to
// the deny chain of its kind.
func ruleExprs(r Rule) ([]expr.Any, error) {
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
		return append(match, &expr.Verdict{Kind: expr.VerdictAccept}), nil
	case Reject:
		if !slices.Contains(Kinds, r.Kind) {
			return nil, fmt.Errorf("egress rule %+v: reject without a known counter", r)
		}
		return append(match, &expr.Verdict{Kind: expr.VerdictGoto, Chain: denyChain(r.Kind)}), nil
	}
	return nil, fmt.Errorf("egress rule %+v: unknown verdict", r)
}

func denyChain(k Kind) string { return "deny_" + string(k) }

// The denied destinations of the last minute, per family: address,
// protocol and destination port (meaningless for protocols without
// ports). The kernel adds to them, the shim reads and logs them; a full
// set records nothing more until entries expire, the packet is rejected
// all the same.
var deniedSets = map[uint8]*nftables.Set{
	unix.NFPROTO_IPV4: {Name: "denied4", KeyType: nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto, nftables.TypeInetService)},
	unix.NFPROTO_IPV6: {Name: "denied6", KeyType: nftables.MustConcatSetType(nftables.TypeIP6Addr, nftables.TypeInetProto, nftables.TypeInetService)},
}

func init() {
	for _, s := range deniedSets {
		s.Concatenation, s.Dynamic, s.HasTimeout = true, true, true
		s.Timeout, s.Size = DeniedMemory, DeniedSetSize
	}
}

// DeniedMemory is how long a denied destination stays recorded, and
// DeniedSetSize how many are recorded at most per family.
const (
	DeniedMemory  = time.Minute
	DeniedSetSize = 1024
)

// denyExprs is the chain every rejection of kind k goes to: record the
// destination, count, refuse. A TCP connection is refused with a reset,
// which the kernel sends at once; anything else gets ICMP
// "administratively prohibited" (EHOSTUNREACH), which the kernel
// rate-limits (icmp_ratelimit, icmp_msgs_per_sec), so a scan does not
// stall on timeouts.
func denyExprs(k Kind) [][]expr.Any {
	var rules [][]expr.Any
	for _, fam := range []uint8{unix.NFPROTO_IPV4, unix.NFPROTO_IPV6} {
		set := deniedSets[fam]
		// A concatenated key is loaded into consecutive 32-bit registers,
		// one field per register (or four for an IPv6 address).
		off, n := uint32(16), uint32(4)
		if fam == unix.NFPROTO_IPV6 {
			off, n = 24, 16
		}
		reg := uint32(unix.NFT_REG32_00)
		rules = append(rules, []expr.Any{
			&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{fam}},
			&expr.Payload{DestRegister: reg, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: n},
			&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: reg + n/4},
			&expr.Payload{DestRegister: reg + n/4 + 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
			&expr.Dynset{SrcRegKey: reg, SetName: set.Name, Operation: unix.NFT_DYNSET_OP_ADD, Timeout: DeniedMemory},
		})
	}
	count := &expr.Objref{Type: int(nftables.ObjTypeCounter), Name: string(k)}
	return append(rules,
		append(l4proto(byte(TCP)), count, &expr.Reject{Type: unix.NFT_REJECT_TCP_RST}),
		[]expr.Any{count, &expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}},
	)
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
