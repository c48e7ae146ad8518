package fetch

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/nodecpu"
)

// cpuSampleEvery is how old the CPU reading the fill decides on may get:
// the envlet quota controller's cadence, short enough to see a compile
// start, long enough for /proc/stat's 10 ms ticks to mean something.
const cpuSampleEvery = 200 * time.Millisecond

// cpuCounters is one reading of the node's CPU time and this process's,
// in seconds.
type cpuCounters struct {
	cores int     // CPUs the node has online
	busy  float64 // node: every state but idle and iowait
	total float64 // node: every state
	self  float64 // this process, user + system
}

// readCPUCounters reads /proc/stat and this process's rusage.
func readCPUCounters() (cpuCounters, error) {
	node, err := nodecpu.Read()
	if err != nil {
		return cpuCounters{}, err
	}
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return cpuCounters{}, err
	}
	return cpuCounters{
		cores: node.Cores,
		busy:  node.Busy,
		total: node.Total,
		self:  time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds(),
	}, nil
}

// cpuLoad tracks how many cores the node's other processes keep busy: the
// background fill's own CPU is what it would take from them, so the
// daemon's time (foreground reads included, which the fill already yields
// to) is left out of the reading.
type cpuLoad struct {
	read func() (cpuCounters, error)

	mu     sync.Mutex
	prev   cpuCounters
	at     time.Time
	cores  float64 // of the latest interval; 0 until two readings
	others float64 // cores busy with other processes in it
}

// sample returns the node's cores and the cores other processes used over
// the latest interval of at least cpuSampleEvery, reading the counters
// again when that interval is over. cores is 0 when nothing could be read
// yet (no signal: the fill is not held on it).
func (c *cpuLoad) sample(now time.Time) (cores, others float64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && now.Sub(c.at) < cpuSampleEvery {
		return c.cores, c.others
	}
	cur, err := c.read()
	if err != nil {
		c.cores, c.at = 0, now
		return 0, 0
	}
	if prev := c.prev; prev.total > 0 && cur.total > prev.total && cur.cores > 0 {
		wall := (cur.total - prev.total) / float64(cur.cores)
		used := (cur.busy - prev.busy) - (cur.self - prev.self)
		c.cores = float64(cur.cores)
		c.others = min(max(used/wall, 0), c.cores)
	}
	c.prev, c.at = cur, now
	return c.cores, c.others
}
