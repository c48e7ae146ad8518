package headline

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/envsnap/envsnap/internal/nodecpu"
)

// cpuSample is the CPU time the node and the bench's daemons had used at
// one moment. Two samples bracket a scenario: on 2 cores the iteration is
// CPU-bound, so where the CPU went (the workload, containerd, the
// snapshotter daemon) explains a makespan ratio better than times alone.
type cpuSample struct {
	busy    float64            // node: every CPU state but idle and iowait
	daemons map[string]float64 // user+system by process name
}

// sampleCPU reads /proc. The node's counters that cannot be read are
// left out rather than failing the run: the numbers explain results,
// they are not results.
func (b *bench) sampleCPU() cpuSample {
	s := cpuSample{daemons: b.env.CPUSeconds()}
	// The registry's link proxy and the episode clients run in the
	// bench's own process.
	if self, ok := s.daemons["self"]; ok {
		delete(s.daemons, "self")
		s.daemons["bench"] = self
	}
	if node, err := nodecpu.Read(); err == nil {
		s.busy = node.Busy
	}
	return s
}

// since is the CPU used between prev and s, in seconds: "node" for the
// whole node, then each daemon.
func (s cpuSample) since(prev cpuSample) map[string]float64 {
	out := map[string]float64{"node": s.busy - prev.busy}
	for name, t := range s.daemons {
		if p, ok := prev.daemons[name]; ok {
			out[name] = t - p
		}
	}
	return out
}

// cpuLine formats a since result: the node first, then the daemons by name.
func cpuLine(cpu map[string]float64) string {
	names := make([]string, 0, len(cpu))
	for n := range cpu {
		if n != "node" {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	parts := []string{fmt.Sprintf("node %.1f", cpu["node"])}
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s %.1f", n, cpu[n]))
	}
	return strings.Join(parts, ", ")
}

// shareLine formats where the node's CPU went over a window: the node's
// CPU seconds, then every other entry by size with its share of the
// node's.
func shareLine(cpu map[string]float64, window time.Duration) string {
	node := cpu["node"]
	names := make([]string, 0, len(cpu))
	for n := range cpu {
		if n != "node" {
			names = append(names, n)
		}
	}
	slices.SortFunc(names, func(a, b string) int { return cmp.Compare(cpu[b], cpu[a]) })
	parts := make([]string, 0, len(names))
	for _, n := range names {
		share := 0.0
		if node > 0 {
			share = 100 * cpu[n] / node
		}
		parts = append(parts, fmt.Sprintf("%s %.1f (%.0f%%)", n, cpu[n], share))
	}
	return fmt.Sprintf("%.1f s, node %.1f CPU-s: %s", window.Seconds(), node, strings.Join(parts, ", "))
}
