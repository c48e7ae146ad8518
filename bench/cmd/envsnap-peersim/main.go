// Command envsnap-peersim runs bench/peersim's model of an RL iteration
// starting on a cluster, without peers, with peers, and with peers while
// 1% of the nodes die, and prints the comparison as a Markdown table
// (docs/scale.md).
package main

import (
	"flag"
	"fmt"
	"time"

	"github.com/docker/go-units"

	"github.com/envsnap/envsnap/bench/peersim"
	"github.com/envsnap/envsnap/internal/peer"
)

func main() {
	p := peersim.Params{Seed: 1, StripeBytes: peer.StripeSize}
	flag.IntVar(&p.Nodes, "nodes", 1000, "nodes")
	flag.IntVar(&p.EnvsPerNode, "envs", 100, "environments per node")
	flag.Float64Var(&p.EnvRate, "env-rate", 31, "environments started per second per node (published: 5,000/s per 160-node cell)")
	flag.IntVar(&p.BaseStripes, "base-stripes", 24, "4 MiB stripes of the shared groups read before ready (96 MiB: the agent CLI needed ~94 MiB before answering --version on the headline image)")
	flag.IntVar(&p.TaskStripes, "task-stripes", 12, "4 MiB stripes of a task group read before ready")
	flag.IntVar(&p.TaskGroups, "task-groups", 131, "task groups (published: 131 repositories)")
	flag.Float64Var(&p.NodeRate, "node-rate", 125e6, "node link, bytes/s each way (the 1 Gbit/s link measured on)")
	flag.DurationVar(&p.LANRTT, "lan-rtt", 500*time.Microsecond, "round trip between nodes")
	flag.Float64Var(&p.RegistryRate, "registry-rate", 1.25e9, "registry egress, bytes/s for all clients")
	flag.DurationVar(&p.RegistryRTT, "registry-rtt", 20*time.Millisecond, "round trip to the registry (the link measured on)")
	flag.DurationVar(&p.FailAt, "fail-at", 2*time.Second, "when the failing nodes die")
	flag.Parse()

	type row struct {
		name string
		r    peersim.Result
	}
	var rows []row
	for _, c := range []struct {
		name  string
		peers bool
		fail  float64
	}{{"no peers", false, 0}, {"peers", true, 0}, {"peers, 1% of nodes die", true, 0.01}} {
		q := p
		q.Peers, q.FailFraction = c.peers, c.fail
		start := time.Now()
		r := peersim.Run(q)
		rows = append(rows, row{c.name, r})
		_ = start
	}
	fmt.Printf("%d nodes x %d environments (%d/s per node); reads before ready: %d + %d stripes of %s (shared + one of %d task groups); node link %s/s, LAN RTT %s; registry %s/s, RTT %s\n\n",
		p.Nodes, p.EnvsPerNode, int(p.EnvRate), p.BaseStripes, p.TaskStripes, units.BytesSize(float64(p.StripeBytes)), p.TaskGroups,
		units.BytesSize(p.NodeRate), p.LANRTT, units.BytesSize(p.RegistryRate), p.RegistryRTT)
	fmt.Println("| | registry egress | registry requests | registry peak req/s | busiest owner peak req/s | max fan-in on one stripe | ready p50 | ready p99 | environments ready | requests that met a dead owner |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range rows {
		fmt.Printf("| %s | %s | %d | %d | %d | %d | %s | %s | %d | %d |\n", r.name, units.BytesSize(float64(r.r.RegistryBytes)), r.r.RegistryRequests,
			r.r.RegistryPeakRPS, r.r.OwnerPeakRPS, r.r.MaxFanIn, r.r.ReadyP50.Round(time.Millisecond), r.r.ReadyP99.Round(time.Millisecond), r.r.Envs, r.r.FailedPeerRequests)
	}
}
