package lazyfs

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// op identifies a FUSE operation for accounting.
type op int

const (
	opLookup op = iota
	opGetattr
	opReaddir
	opReadlink
	opGetxattr
	opListxattr
	opOpen
	opRead
	opFlush
	opLseek
	numOps
)

var opNames = [numOps]string{
	opLookup:    "lookup",
	opGetattr:   "getattr",
	opReaddir:   "readdir",
	opReadlink:  "readlink",
	opGetxattr:  "getxattr",
	opListxattr: "listxattr",
	opOpen:      "open",
	opRead:      "read",
	opFlush:     "flush",
	opLseek:     "lseek",
}

// OpStats counts one kind of FUSE operation.
type OpStats struct {
	Count  uint64
	Errors uint64 // operations that returned an errno other than ENOENT/ENODATA/ERANGE (and the ENOSYS of flush, lseek, opens of a mount without backing and xattr queries to a layer with none)
	Total  time.Duration
}

// Stats is a snapshot of a mount's counters since it was mounted.
type Stats struct {
	Ops          map[string]OpStats // keyed by operation name ("lookup", "read", ...)
	BytesRead    uint64             // file bytes returned to the kernel
	ChunkReads   uint64             // ChunkSource.ReadChunk calls
	ChunkBytes   uint64             // decompressed bytes those calls returned
	ReadTimeouts uint64             // reads failed because the read timeout expired
	ReadErrors   uint64             // reads failed with EIO for any reason (incl. timeouts)
	BackedOpens  uint64             // opens handed a local copy for passthrough (WithBacking)
}

type opCounter struct {
	count, errors, nanos atomic.Uint64
}

type counters struct {
	// onOp, when set (ActivityObserver), is called on every operation.
	onOp         func()
	ops          [numOps]opCounter
	bytesRead    atomic.Uint64
	chunkReads   atomic.Uint64
	chunkBytes   atomic.Uint64
	readTimeouts atomic.Uint64
	readErrors   atomic.Uint64
	backedOpens  atomic.Uint64
}

// record accounts one finished operation started at start. Expected
// negative answers (a missing name, a missing xattr, a size probe) are not
// errors.
func (c *counters) record(o op, start time.Time, failed bool) {
	if c.onOp != nil {
		c.onOp()
	}
	oc := &c.ops[o]
	oc.count.Add(1)
	oc.nanos.Add(uint64(time.Since(start)))
	if failed {
		oc.errors.Add(1)
	}
}

func (c *counters) snapshot() Stats {
	s := Stats{
		Ops:          make(map[string]OpStats, numOps),
		BytesRead:    c.bytesRead.Load(),
		ChunkReads:   c.chunkReads.Load(),
		ChunkBytes:   c.chunkBytes.Load(),
		ReadTimeouts: c.readTimeouts.Load(),
		ReadErrors:   c.readErrors.Load(),
		BackedOpens:  c.backedOpens.Load(),
	}
	for i := range c.ops {
		s.Ops[opNames[i]] = OpStats{
			Count:  c.ops[i].count.Load(),
			Errors: c.ops[i].errors.Load(),
			Total:  time.Duration(c.ops[i].nanos.Load()),
		}
	}
	return s
}

// collector exports counters as Prometheus metrics. It reads the same
// atomics as Stats at scrape time, so the hot path pays for one set of
// counters only.
type collector struct {
	c     *counters
	layer string

	ops, opErrors, opSeconds                      *prometheus.Desc
	bytesRead, chunkReads, chunkBytes, rdTimeouts *prometheus.Desc
	backedOpens                                   *prometheus.Desc
}

func newCollector(c *counters, layer string) *collector {
	labels := prometheus.Labels{"layer": layer}
	d := func(name, help string, varLabels ...string) *prometheus.Desc {
		return prometheus.NewDesc("envsnap_lazyfs_"+name, help, varLabels, labels)
	}
	return &collector{
		c:           c,
		layer:       layer,
		ops:         d("ops_total", "FUSE operations served.", "op"),
		opErrors:    d("op_errors_total", "FUSE operations that failed.", "op"),
		opSeconds:   d("op_seconds_total", "Time spent serving FUSE operations.", "op"),
		bytesRead:   d("read_bytes_total", "File bytes returned to the kernel."),
		chunkReads:  d("chunk_reads_total", "Chunk reads issued to the chunk source."),
		chunkBytes:  d("chunk_bytes_total", "Decompressed bytes returned by the chunk source."),
		rdTimeouts:  d("read_timeouts_total", "Reads that failed because the read timeout expired."),
		backedOpens: d("backed_opens_total", "Opens handed a local copy of the file (FUSE passthrough): reads of them bypass the daemon."),
	}
}

func (m *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.ops, m.opErrors, m.opSeconds, m.bytesRead, m.chunkReads, m.chunkBytes, m.rdTimeouts, m.backedOpens} {
		ch <- d
	}
}

func (m *collector) Collect(ch chan<- prometheus.Metric) {
	for i := range m.c.ops {
		oc := &m.c.ops[i]
		ch <- prometheus.MustNewConstMetric(m.ops, prometheus.CounterValue, float64(oc.count.Load()), opNames[i])
		ch <- prometheus.MustNewConstMetric(m.opErrors, prometheus.CounterValue, float64(oc.errors.Load()), opNames[i])
		ch <- prometheus.MustNewConstMetric(m.opSeconds, prometheus.CounterValue, float64(oc.nanos.Load())/1e9, opNames[i])
	}
	ch <- prometheus.MustNewConstMetric(m.bytesRead, prometheus.CounterValue, float64(m.c.bytesRead.Load()))
	ch <- prometheus.MustNewConstMetric(m.chunkReads, prometheus.CounterValue, float64(m.c.chunkReads.Load()))
	ch <- prometheus.MustNewConstMetric(m.chunkBytes, prometheus.CounterValue, float64(m.c.chunkBytes.Load()))
	ch <- prometheus.MustNewConstMetric(m.rdTimeouts, prometheus.CounterValue, float64(m.c.readTimeouts.Load()))
	ch <- prometheus.MustNewConstMetric(m.backedOpens, prometheus.CounterValue, float64(m.c.backedOpens.Load()))
}
