package fetch

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the fetcher's Prometheus metrics. Create one set per daemon
// with NewMetrics and pass it to every Layer (WithMetrics) and BlobReader
// (WithRequestMetrics); a nil *Metrics records nothing.
type Metrics struct {
	registryBytes *prometheus.CounterVec
	cacheBytes    *prometheus.CounterVec
	latency       *prometheus.HistogramVec
	readWait      prometheus.Histogram
	requests      *prometheus.CounterVec
	mismatches    prometheus.Counter
	fillCached    *prometheus.GaugeVec
	fillTotal     *prometheus.GaugeVec
}

// NewMetrics creates the metrics and registers them on reg (nothing is
// registered globally).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		registryBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "envsnap_fetch_registry_bytes_total",
			Help: "Compressed layer bytes fetched from registries.",
		}, []string{"layer"}),
		cacheBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "envsnap_fetch_cache_bytes_total",
			Help: "Compressed chunk bytes served from the node chunk cache.",
		}, []string{"layer"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "envsnap_fetch_latency_seconds",
			Help: "Time to fetch one coalesced range from the registry, retries included.",
			// 1 ms to ~65 s: loopback registries up to a read that ran into
			// its deadline.
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 17),
		}, []string{"kind"}),
		readWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "envsnap_fetch_read_wait_seconds",
			Help: "Time a file-system read waited for a chunk that was not in the node cache (fetched from a peer or a registry).",
			// 0.5 ms to ~65 s: a peer on the same switch up to a read
			// that ran into its deadline.
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "envsnap_fetch_requests_total",
			Help: "HTTP requests to registries by outcome (ok, transient, error).",
		}, []string{"outcome"}),
		mismatches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "envsnap_fetch_digest_mismatches_total",
			Help: "Chunks fetched whose bytes did not match their digest (never served).",
		}),
		fillCached: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "envsnap_fetch_layer_cached_bytes",
			Help: "Compressed bytes of a mounted layer present in the node cache (background fill progress).",
		}, []string{"layer"}),
		fillTotal: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "envsnap_fetch_layer_total_bytes",
			Help: "Compressed bytes of all chunks of a mounted layer.",
		}, []string{"layer"}),
	}
	var errs []error
	for _, c := range []prometheus.Collector{m.registryBytes, m.cacheBytes, m.latency, m.readWait, m.requests, m.mismatches, m.fillCached, m.fillTotal} {
		errs = append(errs, reg.Register(c))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return m, nil
}

func (m *Metrics) request(err error) {
	if m == nil {
		return
	}
	outcome := "ok"
	if err != nil {
		outcome = "error"
		if t, _ := classify(err); t {
			outcome = "transient"
		}
	}
	m.requests.WithLabelValues(outcome).Inc()
}
