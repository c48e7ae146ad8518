// Package nodecpu reads how much CPU time the node has spent, and how much
// of it was busy, from /proc/stat: the benchmark explains its makespans
// with it (the iteration's CPU floor).
package nodecpu

import (
	"fmt"

	"github.com/prometheus/procfs"
)

// Times is one reading of the node's CPU counters, in seconds summed over
// every CPU.
type Times struct {
	Cores int     // CPUs online
	Busy  float64 // every state but idle and iowait: steal counts, as a core taken by the host is not ours to use
	Total float64 // every state
}

// Read reads /proc/stat.
func Read() (Times, error) {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return Times{}, fmt.Errorf("read node CPU time: %w", err)
	}
	st, err := fs.Stat()
	if err != nil {
		return Times{}, fmt.Errorf("read node CPU time: %w", err)
	}
	t := st.CPUTotal
	busy := t.User + t.Nice + t.System + t.IRQ + t.SoftIRQ + t.Steal
	return Times{Cores: len(st.CPU), Busy: busy, Total: busy + t.Idle + t.Iowait}, nil
}
