package peer

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

const (
	outcomeHit     = "hit"     // the owner served every frame asked for
	outcomeUnknown = "unknown" // the owner does not have the layer open
	outcomeTimeout = "timeout" // no progress (sign of life, answer bytes) for the peer timeout
	outcomeCorrupt = "corrupt" // a frame did not match its digest
	outcomeBusy    = "busy"    // the owner was answering as many requests as it may (503)
	// outcomeUpstream: the owner's own registry fetch failed (502); the
	// owner is alive and not at fault.
	outcomeUpstream = "upstream"
	outcomeError    = "error" // refused, reset, cut short, other 5xx
)

// Metrics count the peer tier's traffic for Prometheus (it is a
// prometheus.Collector) and for Stats. A nil *Metrics records nothing.
type Metrics struct {
	servedBytes  atomic.Int64
	served       atomic.Int64
	refusedReqs  atomic.Int64
	busyReqs     atomic.Int64
	fetchedBytes atomic.Int64
	requests     atomic.Int64
	hedges       atomic.Int64
	badMarks     atomic.Int64
	byOutcome    [len(outcomesArr)]atomic.Int64

	// bad reports the peers skipped now (set by the daemon from its
	// Client; nil reports none).
	bad func() int
}

var outcomesArr = [7]string{outcomeHit, outcomeUnknown, outcomeTimeout, outcomeCorrupt, outcomeBusy, outcomeUpstream, outcomeError}

// NewMetrics returns empty counters.
func NewMetrics() *Metrics { return &Metrics{} }

// CountBad makes the metrics report the peers c skips now.
func (m *Metrics) CountBad(c *Client) {
	if m != nil {
		m.bad = func() int { return len(c.BadPeers()) }
	}
}

func (m *Metrics) servedFrames(n int64) {
	if m != nil {
		m.served.Add(1)
		m.servedBytes.Add(n)
	}
}

func (m *Metrics) refused() {
	if m != nil {
		m.refusedReqs.Add(1)
	}
}

func (m *Metrics) busy() {
	if m != nil {
		m.busyReqs.Add(1)
	}
}

func (m *Metrics) fetched(n int64) {
	if m != nil {
		m.fetchedBytes.Add(n)
	}
}

func (m *Metrics) request() {
	if m != nil {
		m.requests.Add(1)
	}
}

func (m *Metrics) hedge() {
	if m != nil {
		m.hedges.Add(1)
	}
}

func (m *Metrics) badMark() {
	if m != nil {
		m.badMarks.Add(1)
	}
}

func (m *Metrics) outcome(o string) {
	if m == nil {
		return
	}
	for i, name := range outcomesArr {
		if name == o {
			m.byOutcome[i].Add(1)
		}
	}
}

// Stats is a snapshot of the counters, as `containerd-envsnap status`
// prints them.
type Stats struct {
	Members      int              `json:"members"`
	BadPeers     int              `json:"bad_peers"`
	FetchedBytes int64            `json:"fetched_bytes"`
	ServedBytes  int64            `json:"served_bytes"`
	Served       int64            `json:"served_requests"`
	Refused      int64            `json:"refused_requests"`
	Busy         int64            `json:"busy_requests"`
	Requests     int64            `json:"requests"`
	Outcomes     map[string]int64 `json:"outcomes"`
	Hedges       int64            `json:"hedges"`
	BadMarks     int64            `json:"bad_marks"`
	// HitRatio is the share of requests to owners that they served
	// completely (0 before the first).
	HitRatio float64 `json:"hit_ratio"`
}

// Stats returns the counters now; members is the current member count.
func (m *Metrics) Stats(members int) Stats {
	s := Stats{
		Members:      members,
		FetchedBytes: m.fetchedBytes.Load(),
		ServedBytes:  m.servedBytes.Load(),
		Served:       m.served.Load(),
		Refused:      m.refusedReqs.Load(),
		Busy:         m.busyReqs.Load(),
		Requests:     m.requests.Load(),
		Hedges:       m.hedges.Load(),
		BadMarks:     m.badMarks.Load(),
		Outcomes:     map[string]int64{},
	}
	for i, name := range outcomesArr {
		s.Outcomes[name] = m.byOutcome[i].Load()
	}
	if s.Requests > 0 {
		s.HitRatio = float64(s.Outcomes[outcomeHit]) / float64(s.Requests)
	}
	if m.bad != nil {
		s.BadPeers = m.bad()
	}
	return s
}

var (
	descFetched  = prometheus.NewDesc("envsnap_peer_fetched_bytes_total", "Compressed frame bytes fetched from peers (verified).", nil, nil)
	descServed   = prometheus.NewDesc("envsnap_peer_served_bytes_total", "Compressed frame bytes served to peers.", nil, nil)
	descServedN  = prometheus.NewDesc("envsnap_peer_served_requests_total", "Frame requests of peers served.", nil, nil)
	descRefused  = prometheus.NewDesc("envsnap_peer_refused_requests_total", "Requests refused for missing or wrong credentials.", nil, nil)
	descBusy     = prometheus.NewDesc("envsnap_peer_busy_requests_total", "Requests of peers refused because this node was answering as many as it may.", nil, nil)
	descRequests = prometheus.NewDesc("envsnap_peer_requests_total", "Frame requests sent to owner peers.", nil, nil)
	descOutcome  = prometheus.NewDesc("envsnap_peer_request_outcomes_total", "Frame requests to peers by outcome (hit, unknown, timeout, corrupt, busy, upstream, error); requests given up because the registry answered first have none.", []string{"outcome"}, nil)
	descHitRatio = prometheus.NewDesc("envsnap_peer_hit_ratio", "Share of frame requests to peers that the owner served completely.", nil, nil)
	descHedges   = prometheus.NewDesc("envsnap_peer_hedges_total", "Reads that asked the registry because the owner had not answered within the hedge delay.", nil, nil)
	descBadMarks = prometheus.NewDesc("envsnap_peer_bad_marks_total", "Times a peer was marked bad (failed, made no progress for the peer timeout, or sent wrong bytes).", nil, nil)
	descBad      = prometheus.NewDesc("envsnap_peer_bad_peers", "Peers skipped now.", nil, nil)
)

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descFetched, descServed, descServedN, descRefused, descBusy, descRequests, descOutcome, descHitRatio, descHedges, descBadMarks, descBad} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	s := m.Stats(0)
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(descFetched, s.FetchedBytes)
	counter(descServed, s.ServedBytes)
	counter(descServedN, s.Served)
	counter(descRefused, s.Refused)
	counter(descBusy, s.Busy)
	counter(descRequests, s.Requests)
	for _, o := range outcomesArr {
		counter(descOutcome, s.Outcomes[o], o)
	}
	ch <- prometheus.MustNewConstMetric(descHitRatio, prometheus.GaugeValue, s.HitRatio)
	counter(descHedges, s.Hedges)
	counter(descBadMarks, s.BadMarks)
	ch <- prometheus.MustNewConstMetric(descBad, prometheus.GaugeValue, float64(s.BadPeers))
}
