package peersim

import (
	"testing"
	"time"
)

// small is a cluster the tests run in milliseconds: every rule of the
// protocol still plays (several owners, task groups on some nodes only).
func small() Config {
	c := DefaultConfig()
	c.Nodes, c.EnvsPerNode, c.Rollouts = 12, 4, 3
	c.RegistryBandwidth = 10e9 / 8
	return c
}

func run(t *testing.T, c Config) Result {
	t.Helper()
	r, err := Run(c)
	if err != nil {
		t.Fatal(err)
	}
	if r.Stuck != 0 {
		t.Fatalf("%d of %d environments never finished their reads: a read failed", r.Stuck, r.Envs)
	}
	return r
}

// Without peers every node fetches each piece it reads once: the registry
// sends the sum over nodes of their distinct reads.
func TestNoPeersRegistrySendsWhatEachNodeReads(t *testing.T) {
	c := small()
	c.Peers = false
	r := run(t, c)
	if r.RegistryBytes != r.NodeBytes {
		t.Errorf("registry sent %d bytes, nodes read %d distinct bytes each in all", r.RegistryBytes, r.NodeBytes)
	}
	if r.PeerRequests != 0 || r.PeerBytes != 0 {
		t.Errorf("peers off, yet %d peer requests, %d bytes", r.PeerRequests, r.PeerBytes)
	}
}

// With peers, no failures, every owner having the layers open (one task
// group for all) and no timeouts, each piece leaves the registry once: the
// union of reads. Every byte a node read came from the registry or a
// peer exactly once.
func TestPeersRegistrySendsTheUnion(t *testing.T) {
	c := small()
	c.Rollouts = c.Nodes * c.EnvsPerNode
	c.Groups = c.Groups[:4] // no per-environment mutation layer
	c.Timeout, c.HedgeAfter = time.Hour, time.Hour
	r := run(t, c)
	if r.RegistryBytes != r.UnionBytes {
		t.Errorf("registry sent %d bytes, union of reads %d", r.RegistryBytes, r.UnionBytes)
	}
	if r.RegistryBytes+r.PeerBytes != r.NodeBytes {
		t.Errorf("registry %d + peers %d != bytes the nodes read %d", r.RegistryBytes, r.PeerBytes, r.NodeBytes)
	}
	if r.Unknown != 0 || r.Timeouts != 0 || r.BadMarks != 0 {
		t.Errorf("unexpected 404s %d, timeouts %d, bad marks %d", r.Unknown, r.Timeouts, r.BadMarks)
	}
	// Node-wide single flight: an owner gets at most one request per
	// other node for a piece, and every node but the owner asks for a
	// shared piece.
	if r.MaxFanIn != int32(c.Nodes-1) {
		t.Errorf("max fan-in %d, want %d (every other node once)", r.MaxFanIn, c.Nodes-1)
	}
	// Staggered starts: an owner that has not started yet has nothing
	// open and answers 404, so the registry sends more than the union;
	// every byte still comes from one of the two, once per node.
	c.Stagger = 10 * time.Second
	st := run(t, c)
	if st.Unknown == 0 || st.RegistryBytes <= st.UnionBytes || st.RegistryBytes+st.PeerBytes != st.NodeBytes {
		t.Errorf("staggered over %v: %d 404s, registry %d, peers %d, union %d, node reads %d", c.Stagger, st.Unknown, st.RegistryBytes, st.PeerBytes, st.UnionBytes, st.NodeBytes)
	}
}

// An owner answers 404 for a layer it does not have open; those reads go
// to the registry from every node that needs them, so task groups spread
// thin over the cluster gain little.
func TestUnopenedLayersGoToTheRegistry(t *testing.T) {
	c := small()
	c.Timeout, c.HedgeAfter = time.Hour, time.Hour
	r := run(t, c)
	if r.Unknown == 0 {
		t.Fatal("no 404s with task groups on some nodes only")
	}
	if r.RegistryBytes <= r.UnionBytes || r.RegistryBytes > r.NodeBytes {
		t.Errorf("registry %d, want in (union %d, node sum %d]", r.RegistryBytes, r.UnionBytes, r.NodeBytes)
	}
	if r.RegistryBytes+r.PeerBytes != r.NodeBytes {
		t.Errorf("registry %d + peers %d != bytes the nodes read %d", r.RegistryBytes, r.PeerBytes, r.NodeBytes)
	}
}

// A node that dies mid-iteration: every read on the others still
// completes, the dead owner's pieces come from the registry again when it
// is silent (hedged) and from the next owner when it refuses, and it is
// marked bad.
func TestDeadOwnerPiecesRefetched(t *testing.T) {
	for _, mode := range []FailMode{FailSilent, FailRefuse} {
		t.Run(mode.String(), func(t *testing.T) {
			c := small()
			c.Rollouts = c.Nodes * c.EnvsPerNode
			c.Groups = c.Groups[:4]
			c.Timeout = time.Hour // only the failure may cause a fallback
			base := run(t, c)
			c.FailFraction, c.FailMode = 0.25, mode
			c.FailAt = time.Duration(base.ReadyP50*float64(time.Second)) / 2
			r := run(t, c)
			if r.FailedNodes != 3 || r.Envs != base.Envs-3*c.EnvsPerNode {
				t.Fatalf("%d nodes failed, %d environments left of %d", r.FailedNodes, r.Envs, base.Envs)
			}
			if r.BadMarks == 0 {
				t.Error("no requester marked a dead owner bad")
			}
			if r.RegistryBytes < r.UnionBytes {
				t.Errorf("registry sent %d bytes, less than the union %d", r.RegistryBytes, r.UnionBytes)
			}
			switch mode {
			case FailSilent:
				if r.Hedges == 0 {
					t.Error("silent owners, no hedge")
				}
				// Hedged to the registry by every requester.
				if r.RegistryBytes <= r.UnionBytes {
					t.Errorf("registry sent %d bytes, no more than the union %d: the silent owners' pieces were not fetched again", r.RegistryBytes, r.UnionBytes)
				}
				if r.Refused != 0 {
					t.Errorf("silent owners refused %d requests", r.Refused)
				}
			case FailRefuse:
				// Refused before the hedge: the next owner is asked,
				// as peer.Client.Fetch does.
				if r.Refused == 0 || r.Failovers == 0 {
					t.Errorf("killed daemons: %d refused, %d requests to the next owner", r.Refused, r.Failovers)
				}
			}
		})
	}
}

// With a timeout for the whole answer, an owner that cannot send a hot
// piece to everyone within Timeout is given up on and marked bad by its
// requesters, who go to the registry (or the next owner). With the
// timeout counting time without progress (the code's rule), the same slow
// but live owners are waited for: no timeout, no bad mark, and the
// registry sends the union only.
func TestOverloadedOwnerTimesOut(t *testing.T) {
	c := small()
	c.Rollouts = c.Nodes * c.EnvsPerNode
	c.Groups = c.Groups[:4]
	c.NodeBandwidth = 2 * float64(c.PieceSize) // two pieces a second
	c.Timeout = 2 * time.Second
	c.MaxServing = 0
	p := run(t, c)
	if p.Timeouts != 0 || p.BadMarks != 0 || p.RegistryBytes != p.UnionBytes {
		t.Errorf("progress timeouts: %d timeouts, %d bad marks, registry %d for a union of %d", p.Timeouts, p.BadMarks, p.RegistryBytes, p.UnionBytes)
	}
	c.WholeAnswerTimeout = true
	r := run(t, c)
	if r.Timeouts == 0 || r.BadMarks == 0 {
		t.Fatalf("timeouts %d, bad marks %d from owners sending %d answers at once", r.Timeouts, r.BadMarks, r.PeakOwnerTransfers)
	}
	if r.RegistryBytes <= r.UnionBytes {
		t.Errorf("registry sent %d, union %d: given-up reads did not go to the registry", r.RegistryBytes, r.UnionBytes)
	}

	// Owners that answer at most two requests at once refuse the rest
	// at once: those read from the registry without waiting out the
	// timeout, and fewer healthy owners are marked bad.
	c.MaxServing = 2
	b := run(t, c)
	if b.Busy == 0 || b.PeakOwnerTransfers > 2 || b.BadMarks >= r.BadMarks {
		t.Errorf("bounded owners: %d refused busy, %d answers at once, %d bad marks (%d unbounded)", b.Busy, b.PeakOwnerTransfers, b.BadMarks, r.BadMarks)
	}
}

// The same seed gives the same run; another seed another placement.
func TestDeterministic(t *testing.T) {
	c := small()
	c.FailFraction = 0.1
	a, b := run(t, c), run(t, c)
	if a.Stats.RegistryBytes != b.Stats.RegistryBytes || a.ReadyP99 != b.ReadyP99 || a.End != b.End || a.Unknown != b.Unknown {
		t.Errorf("two runs of seed %d differ: %+v vs %+v", c.Seed, a.Stats, b.Stats)
	}
	c.Seed++
	if d := run(t, c); d.End == a.End && d.Unknown == a.Unknown {
		t.Errorf("seeds %d and %d ran alike", c.Seed-1, c.Seed)
	}
}

func TestBadConfig(t *testing.T) {
	for _, edit := range []func(*Config){
		func(c *Config) { c.Nodes = 0 },
		func(c *Config) { c.PieceSize = c.StripeSize + 1 },
		func(c *Config) { c.FailFraction = 1 },
		func(c *Config) { c.Groups[0].Read = c.Groups[0].Size + 1 },
	} {
		c := small()
		c.Groups = append([]Group(nil), c.Groups...)
		edit(&c)
		if _, err := Run(c); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
}

// Design alternatives: owners that serve unopened layers bring the
// registry back to the union with task groups spread thin; replicated
// stripes divide the fan-in and cost one registry fetch per replica.
func TestAlternatives(t *testing.T) {
	c := small()
	c.Timeout, c.HedgeAfter = time.Hour, time.Hour
	c.AnyLayer = true
	r := run(t, c)
	if r.Unknown != 0 || r.RegistryBytes != r.UnionBytes {
		t.Errorf("owners serving any layer: %d 404s, registry %d, union %d", r.Unknown, r.RegistryBytes, r.UnionBytes)
	}

	c = small()
	c.Rollouts = c.Nodes * c.EnvsPerNode
	c.Groups = c.Groups[:4]
	c.Timeout, c.HedgeAfter = time.Hour, time.Hour
	one := run(t, c)
	c.Replicas = 3
	three := run(t, c)
	if three.MaxFanIn >= one.MaxFanIn {
		t.Errorf("fan-in %d with 3 owners per stripe, %d with one", three.MaxFanIn, one.MaxFanIn)
	}
	if three.RegistryBytes <= one.RegistryBytes || three.RegistryBytes > 3*one.RegistryBytes {
		t.Errorf("registry %d with 3 owners per stripe, want in (%d, 3x]", three.RegistryBytes, one.RegistryBytes)
	}
	if three.RegistryBytes+three.PeerBytes != three.NodeBytes {
		t.Errorf("registry %d + peers %d != bytes the nodes read %d", three.RegistryBytes, three.PeerBytes, three.NodeBytes)
	}
}
