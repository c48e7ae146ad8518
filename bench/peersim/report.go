package peersim

import (
	"flag"
	"fmt"
	"io"
)

// Flags binds every input of c to a flag of fs, with c's values as
// defaults.
func Flags(fs *flag.FlagSet, c *Config) {
	fs.Int64Var(&c.Seed, "seed", c.Seed, "random seed (placement, read sets, failing nodes)")
	fs.IntVar(&c.Nodes, "nodes", c.Nodes, "nodes")
	fs.IntVar(&c.EnvsPerNode, "envs", c.EnvsPerNode, "environments per node")
	fs.IntVar(&c.Rollouts, "rollouts", c.Rollouts, "environments per task group")
	fs.DurationVar(&c.Stagger, "stagger", c.Stagger, "spread the nodes' starts uniformly over this span")
	fs.BoolVar(&c.Pack, "pack", c.Pack, "place a task's rollouts on as few nodes as possible (default: spread at random)")
	for i := range c.Groups {
		g := &c.Groups[i]
		fs.Int64Var(&g.Size, g.Name+"-size", g.Size, g.Name+" group: compressed bytes")
		fs.Int64Var(&g.Read, g.Name+"-read", g.Read, g.Name+" group: compressed bytes one episode fetches")
		if g.Kind == Shared {
			fs.Int64Var(&g.ReadyRead, g.Name+"-ready", g.ReadyRead, g.Name+" group: of them, bytes fetched before ready")
		}
	}
	fs.DurationVar(&c.RegistryRTT, "registry-rtt", c.RegistryRTT, "registry round trip per request")
	bps(fs, &c.RegistryBandwidth, "registry-bps", "registry egress, bits/s, shared by all transfers")
	bps(fs, &c.NodeBandwidth, "node-bps", "node NIC each way, bits/s")
	fs.DurationVar(&c.PeerRTT, "peer-rtt", c.PeerRTT, "round trip between nodes")
	fs.Int64Var(&c.PieceSize, "piece", c.PieceSize, "compressed bytes per fetch")
	fs.Int64Var(&c.StripeSize, "stripe", c.StripeSize, "bytes of blob per owner (peer.StripeSize)")
	fs.IntVar(&c.PrefetchInflight, "prefetch-inflight", c.PrefetchInflight, "prefetch requests in flight per node")
	fs.DurationVar(&c.LocalReady, "local-ready", c.LocalReady, "ready time with every byte cached")
	fs.DurationVar(&c.HedgeAfter, "hedge-after", c.HedgeAfter, "ask the registry when the owner has not accepted by then")
	fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "give up on an owner after this long without progress")
	fs.BoolVar(&c.WholeAnswerTimeout, "whole-answer-timeout", c.WholeAnswerTimeout, "the timeout bounds the whole answer (internal/peer before its deadlines followed progress)")
	fs.DurationVar(&c.BadFor, "bad-for", c.BadFor, "skip a failed owner for")
	fs.IntVar(&c.MaxServing, "max-serving", c.MaxServing, "requests an owner answers at once; past it it refuses at once (0: no bound)")
	fs.BoolVar(&c.AnyLayer, "any-layer", c.AnyLayer, "design alternative: owners serve layers they do not have open")
	fs.IntVar(&c.Replicas, "replicas", c.Replicas, "design alternative: owners per stripe (0 or 1: one, as internal/peer)")
	fs.DurationVar(&c.FailAt, "fail-at", c.FailAt, "when nodes fail in the failure rows")
}

type bitsFlag struct{ bytes *float64 }

func (b bitsFlag) String() string {
	if b.bytes == nil {
		return ""
	}
	return fmt.Sprintf("%g", *b.bytes*8)
}

func (b bitsFlag) Set(s string) error {
	var v float64
	if _, err := fmt.Sscanf(s, "%g", &v); err != nil || v <= 0 {
		return fmt.Errorf("bits/s %q: want a positive number", s)
	}
	*b.bytes = v / 8
	return nil
}

func bps(fs *flag.FlagSet, bytes *float64, name, usage string) {
	fs.Var(bitsFlag{bytes}, name, usage)
}

// Row is one scenario of the table.
type Row struct {
	Name string
	Result
}

// Scenarios runs c without peers, with peers, and with peers while
// failFraction of the nodes fail (silently, and refusing), all from the
// same seed.
func Scenarios(c Config, failFraction float64) ([]Row, error) {
	type sc struct {
		name string
		edit func(*Config)
	}
	list := []sc{
		{"no peers", func(c *Config) { c.Peers = false }},
		{"peers", func(c *Config) { c.Peers = true }},
	}
	if failFraction > 0 {
		pct := fmt.Sprintf("%g%%", failFraction*100)
		list = append(list,
			sc{"no peers, " + pct + " fail", func(c *Config) { c.Peers, c.FailFraction = false, failFraction }},
			sc{"peers, " + pct + " fail silently", func(c *Config) { c.Peers, c.FailFraction, c.FailMode = true, failFraction, FailSilent }},
			sc{"peers, " + pct + " daemons killed", func(c *Config) { c.Peers, c.FailFraction, c.FailMode = true, failFraction, FailRefuse }},
		)
	}
	var rows []Row
	for _, s := range list {
		cc := c
		cc.Groups = append([]Group(nil), c.Groups...)
		s.edit(&cc)
		r, err := Run(cc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
		rows = append(rows, Row{s.name, r})
	}
	return rows, nil
}

// WriteTable prints the inputs and the rows as markdown.
func WriteTable(w io.Writer, c Config, rows []Row) {
	envs := c.Nodes * c.EnvsPerNode
	if c.AnyLayer || c.Replicas > 1 {
		fmt.Fprintf(w, "Design alternatives (not internal/peer): owners serve unopened layers %v, owners per stripe %d.\n\n", c.AnyLayer, max(1, c.Replicas))
	}
	fmt.Fprintf(w, "%d nodes x %d environments, %d task groups (%d rollouts each, %s), nodes starting over %v; registry %.0f Mbit/s, %v; node NIC %.0f Mbit/s, peer RTT %v; piece %s, stripe %s; hedge %v, timeout %v %s, bad for %v, owner answers at most %d at once (0: no bound); failures at %v.\n\n",
		c.Nodes, c.EnvsPerNode, (envs+c.Rollouts-1)/c.Rollouts, c.Rollouts, map[bool]string{true: "packed", false: "spread at random"}[c.Pack], c.Stagger,
		c.RegistryBandwidth*8/1e6, c.RegistryRTT, c.NodeBandwidth*8/1e6, c.PeerRTT, mib(c.PieceSize), mib(c.StripeSize), c.HedgeAfter, c.Timeout, map[bool]string{false: "without progress", true: "for the whole answer"}[c.WholeAnswerTimeout], c.BadFor, c.MaxServing, c.FailAt)
	if len(rows) > 0 {
		r := rows[0]
		fmt.Fprintf(w, "Union of reads %s; sum over nodes of what each reads %s (%.1fx the union).\n\n", gb(r.UnionBytes), gb(r.NodeBytes), float64(r.NodeBytes)/float64(r.UnionBytes))
	}
	fmt.Fprintln(w, "| scenario | registry egress | / union | registry req/s peak (mean) | hottest owner req/s peak | max fan-in (requests for one piece at its owner) | most answers one owner sent at once | ready p50 | ready p99 | reads done p50 | reads done p99 | hedges | timeouts | refused | 404 | busy | next owner asked | bad marks | envs (stuck) |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Fprintf(w, "| %s | %s | %.2fx | %d (%.0f) | %d | %d | %d | %s | %s | %s | %s | %d | %d | %d | %d | %d | %d | %d | %d (%d) |\n",
			r.Name, gb(r.RegistryBytes), float64(r.RegistryBytes)/float64(r.UnionBytes),
			r.RegistryPeakRPS, r.RegistryMeanRPS, r.HottestOwnerPeakRPS, r.MaxFanIn, r.PeakOwnerTransfers,
			sec(r.ReadyP50), sec(r.ReadyP99), sec(r.ReadsDoneP50), sec(r.ReadsDoneP99),
			r.Hedges, r.Timeouts, r.Refused, r.Unknown, r.Busy, r.Failovers, r.BadMarks, r.Envs, r.Stuck)
	}
}

func mib(b int64) string   { return fmt.Sprintf("%g MiB", float64(b)/(1<<20)) }
func gb(b int64) string    { return fmt.Sprintf("%.1f GB", float64(b)/1e9) }
func sec(s float64) string { return fmt.Sprintf("%.2f s", s) }
