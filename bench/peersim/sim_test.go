package peersim

import (
	"testing"
	"time"
)

func small() Params {
	return Params{
		Nodes: 20, EnvsPerNode: 10, EnvRate: 31, StripeBytes: 4 << 20,
		BaseStripes: 6, TaskStripes: 3, TaskGroups: 8,
		NodeRate: 125e6, LANRTT: 500 * time.Microsecond,
		RegistryRate: 1.25e9, RegistryRTT: 20 * time.Millisecond,
		Seed: 1,
	}
}

// Without peers every node fetches each stripe it needs once; with them
// the cluster fetches each stripe once.
func TestRegistryBytes(t *testing.T) {
	p := small()
	none := Run(p)
	p.Peers = true
	peers := Run(p)
	// Every node needs all base stripes; task groups vary, so only
	// bounds are exact here.
	perNodeMin := int64(p.BaseStripes+p.TaskStripes) * p.StripeBytes
	if none.RegistryBytes < int64(p.Nodes)*perNodeMin {
		t.Errorf("without peers the registry sent %d bytes, less than every node's base and one task group", none.RegistryBytes)
	}
	all := int64(p.BaseStripes+p.TaskStripes*p.TaskGroups) * p.StripeBytes
	if peers.RegistryBytes > all || peers.RegistryBytes < int64(p.BaseStripes)*p.StripeBytes {
		t.Errorf("with peers the registry sent %d bytes; the distinct stripes are at most %d", peers.RegistryBytes, all)
	}
	if peers.Envs != p.Nodes*p.EnvsPerNode || none.Envs != peers.Envs {
		t.Errorf("environments ready: %d and %d", none.Envs, peers.Envs)
	}
	if peers.MaxFanIn == 0 || peers.OwnerPeakRPS == 0 {
		t.Errorf("no owner traffic: %+v", peers)
	}
}

// Nodes dying mid-iteration cost no environment of the others.
func TestFailures(t *testing.T) {
	p := small()
	p.Peers = true
	p.FailFraction = 0.1
	p.FailAt = 150 * time.Millisecond
	r := Run(p)
	if r.Envs != (p.Nodes-2)*p.EnvsPerNode {
		t.Errorf("%d environments ready on %d live nodes", r.Envs, p.Nodes-2)
	}
	if r.FailedPeerRequests == 0 {
		t.Errorf("no request met a dead owner: %+v", r)
	}
}
