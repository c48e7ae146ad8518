// Package peersim is a discrete-event model of the peer tier
// (internal/peer) at a scale one machine cannot run: a thousand nodes
// starting an RL iteration at once, every node reading the same shared
// layer groups and its environments' task groups, with and without peers,
// and with nodes failing mid-iteration.
//
// The model follows the protocol as implemented: rendezvous ownership of
// 4 MiB stripes over the member list, one registry fetch per piece on the
// owner (node-wide single flight), owners that answer 404 for layers they
// do not have open, hedging to the registry when an owner has not
// accepted within HedgeAfter, a Timeout counted from the owner's last sign
// of life (an owner that accepted and is alive keeps sending) after which
// the owner is marked bad for BadFor by that requester alone and the
// stripe's next owner is asked (once), owners that refuse at once past MaxServing
// requests in progress, and liveness learnt from failed requests only. What it leaves out is listed in
// docs/scale.md.
//
// The invariant its tests hold it to is conservation of bytes: without
// peers the registry sends what every node reads, counted once per node;
// with peers and no failures it sends the union of what the cluster reads
// (when every owner has the layers open); a dead owner's pieces are sent
// again by the registry.
package peersim

import (
	"fmt"
	"time"
)

// Group is one layer group of an environment and what an episode reads of
// it.
type Group struct {
	Name string
	// Size is the group's compressed layer bytes.
	Size int64
	// Read is the compressed bytes one cold episode fetches from the
	// group without background fill; ReadyRead of them before the
	// environment is ready (fetched by the node's prefetch).
	Read      int64
	ReadyRead int64
	// Kind says who shares the group.
	Kind GroupKind
}

// GroupKind says which environments read a group.
type GroupKind int

const (
	// Shared groups (base, harness, evaluator) are read by every
	// environment.
	Shared GroupKind = iota
	// PerTask groups are one per task: every rollout of a task reads it.
	PerTask
	// PerEnv groups (the mutation) are distinct for every environment.
	PerEnv
)

// FailMode is how a failed node looks to its peers.
type FailMode int

const (
	// FailSilent: the node vanishes (power, kernel, network); requests
	// to it get no answer at all, connections hang.
	FailSilent FailMode = iota
	// FailRefuse: the daemon died and the kernel refuses or resets its
	// connections.
	FailRefuse
)

func (m FailMode) String() string {
	if m == FailRefuse {
		return "refuse"
	}
	return "silent"
}

// ParseFailMode parses "silent" or "refuse".
func ParseFailMode(s string) (FailMode, error) {
	switch s {
	case "silent":
		return FailSilent, nil
	case "refuse":
		return FailRefuse, nil
	}
	return 0, fmt.Errorf("fail mode %q: want silent or refuse", s)
}

// Config is one simulated iteration. DefaultConfig documents where each
// default comes from; docs/scale.md lists them with their sources.
type Config struct {
	Seed int64

	Nodes       int
	EnvsPerNode int
	// Rollouts is how many environments share one task group; the
	// iteration has Nodes*EnvsPerNode/Rollouts task groups.
	Rollouts int
	// Stagger spreads the nodes' starts uniformly over this span (a
	// scheduler admitting nodes gradually); 0 starts all at once.
	Stagger time.Duration
	// Pack places the rollouts of a task on as few nodes as possible;
	// otherwise environments are spread over nodes at random.
	Pack   bool
	Groups []Group

	// RegistryRTT is paid by every registry request before its first
	// byte; RegistryBandwidth is the registry's egress, shared fairly by
	// the transfers in progress.
	RegistryRTT       time.Duration
	RegistryBandwidth float64 // bytes/s
	// NodeBandwidth is each node's NIC, each way: downlink for what it
	// fetches, uplink for what it serves to peers.
	NodeBandwidth float64 // bytes/s
	PeerRTT       time.Duration

	// PieceSize is the compressed bytes of one fetch (a frame and its
	// read-ahead, or a prefetch request): the unit of reads.
	PieceSize  int64
	StripeSize int64
	// PrefetchInflight bounds a node's prefetch requests in flight.
	PrefetchInflight int
	// LocalReady is the part of an environment's ready time that is not
	// fetching: measured with every byte already cached.
	LocalReady time.Duration

	Peers      bool
	HedgeAfter time.Duration
	Timeout    time.Duration
	BadFor     time.Duration
	// MaxServing bounds the requests an owner answers at once
	// (peer.DefaultMaxServing); past it an owner refuses at once and the
	// requester reads from the registry. 0: no bound.
	MaxServing int

	// WholeAnswerTimeout makes Timeout bound the whole answer, as
	// internal/peer did before its deadlines followed progress: an answer
	// slow because its owner's uplink is shared times out, and a healthy
	// owner is marked bad.
	WholeAnswerTimeout bool

	// Design alternatives internal/peer does not implement, to measure
	// what changing it would buy. AnyLayer: an owner serves (fetching
	// from the registry) layers it does not have open, instead of 404.
	// Replicas > 1: each stripe has that many owners (its first
	// rendezvous members) and a requester asks the one its own id picks,
	// dividing an owner's fan-in by Replicas at the cost of Replicas
	// registry fetches per stripe.
	AnyLayer bool
	Replicas int

	// FailFraction of the nodes fail at FailAt.
	FailFraction float64
	FailAt       time.Duration
	FailMode     FailMode
}

// Measured inputs (docs/benchmarks.md and docs/benchmarks.json, headline
// run of 2026-11-29, envsnap-nofill/cold medians unless noted).
const (
	baseSize      = 228_661_399 // group_bytes.base
	baseRead      = 61_297_907  // median of the 4 nofill cold runs' base registry bytes
	harnessSize   = 75_249_004  // group_bytes.harness
	harnessRead   = 30_383_897  // every nofill cold run
	evaluatorRead = 3_589       // every cold run
	taskRead      = 18_640_144  // uuid task group, read whole by every cold run
	mutationRead  = 2_509       // uuid-hash-variant
	// readyRead is ready_registry_bytes (median of the nofill cold runs):
	// fetched before `agent --version` answered, all from the shared
	// groups, which carry prefetch lists; split below in proportion to
	// what the episode reads of base and harness.
	readyRead = 41_816_898
)

// DefaultConfig is the iteration docs/scale.md reports.
func DefaultConfig() Config {
	shared := int64(baseRead + harnessRead)
	baseReady := readyRead * baseRead / shared
	return Config{
		Seed:        1,
		Nodes:       1000,
		EnvsPerNode: 100,
		Rollouts:    16,
		Groups: []Group{
			{Name: "base", Size: baseSize, Read: baseRead, ReadyRead: baseReady, Kind: Shared},
			{Name: "harness", Size: harnessSize, Read: harnessRead, ReadyRead: readyRead - baseReady, Kind: Shared},
			{Name: "evaluator", Size: evaluatorRead, Read: evaluatorRead, Kind: Shared},
			{Name: "task", Size: taskRead, Read: taskRead, Kind: PerTask},
			{Name: "mutation", Size: mutationRead, Read: mutationRead, Kind: PerEnv},
		},
		RegistryRTT:       20 * time.Millisecond, // the shaped link
		RegistryBandwidth: 946e6 / 8,             // one blob download over the 1 Gbit/s link
		NodeBandwidth:     946e6 / 8,
		PeerRTT:           500 * time.Microsecond,
		PieceSize:         2 << 20, // layerfmt.DefaultChunkSize; read-ahead 1 MiB, prefetch requests up to 4 MiB
		StripeSize:        4 << 20, // peer.StripeSize
		PrefetchInflight:  6,       // fetch.PrefetchPolicy.Inflight
		LocalReady:        631_506_712 * time.Nanosecond,
		Peers:             true,
		HedgeAfter:        time.Second,      // peer.DefaultHedgeAfter: the floor of the adaptive delay, which the model's instant accepts never raise
		Timeout:           5 * time.Second,  // peer.DefaultTimeout
		BadFor:            30 * time.Second, // peer.DefaultBadFor
		MaxServing:        64,               // peer.DefaultMaxServing
		FailFraction:      0,
		FailAt:            time.Second,
		FailMode:          FailSilent,
	}
}

func (c Config) validate() error {
	switch {
	case c.Nodes < 1 || c.EnvsPerNode < 1:
		return fmt.Errorf("need at least one node and one environment per node, have %d and %d", c.Nodes, c.EnvsPerNode)
	case c.Stagger < 0:
		return fmt.Errorf("stagger %v: want >= 0", c.Stagger)
	case c.Rollouts < 1:
		return fmt.Errorf("rollouts per task %d: want >= 1", c.Rollouts)
	case c.PieceSize <= 0 || c.StripeSize < c.PieceSize:
		return fmt.Errorf("piece size %d and stripe size %d: want 0 < piece <= stripe", c.PieceSize, c.StripeSize)
	case c.RegistryBandwidth <= 0 || c.NodeBandwidth <= 0:
		return fmt.Errorf("bandwidths must be positive")
	case c.Replicas < 0 || c.Replicas > rankDepth:
		return fmt.Errorf("replicas %d: want 0-%d", c.Replicas, rankDepth)
	case c.MaxServing < 0:
		return fmt.Errorf("max serving %d: want >= 0", c.MaxServing)
	case c.PrefetchInflight < 1:
		return fmt.Errorf("prefetch in flight %d: want >= 1", c.PrefetchInflight)
	case c.FailFraction < 0 || c.FailFraction >= 1:
		return fmt.Errorf("fail fraction %g: want [0, 1)", c.FailFraction)
	}
	for _, g := range c.Groups {
		if g.Read < 0 || g.Read > g.Size || g.ReadyRead < 0 || g.ReadyRead > g.Read {
			return fmt.Errorf("group %s: want 0 <= ready read %d <= read %d <= size %d", g.Name, g.ReadyRead, g.Read, g.Size)
		}
	}
	return nil
}
