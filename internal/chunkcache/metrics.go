package chunkcache

import "github.com/prometheus/client_golang/prometheus"

// Collector exports the cache counters as Prometheus metrics. Register it on
// the daemon's registry; nothing is registered globally.
func (c *Cache) Collector() prometheus.Collector { return collector{c} }

var (
	descSize      = prometheus.NewDesc("envsnap_chunkcache_size_bytes", "Bytes of chunk data in the node chunk cache.", nil, nil)
	descMax       = prometheus.NewDesc("envsnap_chunkcache_max_bytes", "Configured bound of the node chunk cache.", nil, nil)
	descEntries   = prometheus.NewDesc("envsnap_chunkcache_entries", "Chunks in the node chunk cache.", nil, nil)
	descPinned    = prometheus.NewDesc("envsnap_chunkcache_pinned_entries", "Cached chunks pinned by mounted layers.", nil, nil)
	descHits      = prometheus.NewDesc("envsnap_chunkcache_hits_total", "Chunk cache lookups that returned verified data.", nil, nil)
	descMisses    = prometheus.NewDesc("envsnap_chunkcache_misses_total", "Chunk cache lookups that found nothing usable.", nil, nil)
	descEvictions = prometheus.NewDesc("envsnap_chunkcache_evictions_total", "Chunks evicted to respect the size bound.", nil, nil)
	descCorrupt   = prometheus.NewDesc("envsnap_chunkcache_corrupt_total", "Cached chunks dropped because their content did not match the digest.", nil, nil)
	descPutErrors = prometheus.NewDesc("envsnap_chunkcache_put_errors_total", "Chunks that could not be stored (cache full, ENOSPC, I/O error).", nil, nil)
)

type collector struct{ c *Cache }

func (collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSize, descMax, descEntries, descPinned, descHits, descMisses, descEvictions, descCorrupt, descPutErrors} {
		ch <- d
	}
}

func (k collector) Collect(ch chan<- prometheus.Metric) {
	s := k.c.Stats()
	ch <- prometheus.MustNewConstMetric(descSize, prometheus.GaugeValue, float64(s.Size))
	ch <- prometheus.MustNewConstMetric(descMax, prometheus.GaugeValue, float64(s.MaxBytes))
	ch <- prometheus.MustNewConstMetric(descEntries, prometheus.GaugeValue, float64(s.Entries))
	ch <- prometheus.MustNewConstMetric(descPinned, prometheus.GaugeValue, float64(s.Pinned))
	ch <- prometheus.MustNewConstMetric(descHits, prometheus.CounterValue, float64(s.Hits))
	ch <- prometheus.MustNewConstMetric(descMisses, prometheus.CounterValue, float64(s.Misses))
	ch <- prometheus.MustNewConstMetric(descEvictions, prometheus.CounterValue, float64(s.Evictions))
	ch <- prometheus.MustNewConstMetric(descCorrupt, prometheus.CounterValue, float64(s.Corrupt))
	ch <- prometheus.MustNewConstMetric(descPutErrors, prometheus.CounterValue, float64(s.PutErrors))
}
