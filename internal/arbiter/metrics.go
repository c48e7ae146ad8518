package arbiter

import (
	"encoding/json"
	"sort"
	"strings"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector exposes what the shims report as Prometheus metrics, labelled
// by environment. Besides the quota and usage the arbiter itself tracks,
// every numeric field of the controller's status (throttling, grow, shrink
// and failure counts, ...) becomes a gauge envlet_status_<field>, so the
// metrics follow the controller without this package knowing its fields.
func (s *Server) Collector() prometheus.Collector { return collector{s} }

type collector struct{ s *Server }

var (
	descQuotaCPU = prometheus.NewDesc("envlet_quota_cpu_cores", "CPU quota of the environment.", []string{"env"}, nil)
	descQuotaMem = prometheus.NewDesc("envlet_quota_memory_bytes", "Memory limit of the environment.", []string{"env"}, nil)
	descUsedCPU  = prometheus.NewDesc("envlet_usage_cpu_cores", "CPU used by the environment at its last report.", []string{"env"}, nil)
	descUsedMem  = prometheus.NewDesc("envlet_usage_memory_bytes", "Memory working set of the environment at its last report.", []string{"env"}, nil)
	descBaseCPU  = prometheus.NewDesc("envlet_base_cpu_cores", "Admitted (initial) CPU quota of the environment.", []string{"env"}, nil)
	descBaseMem  = prometheus.NewDesc("envlet_base_memory_bytes", "Admitted (initial) memory limit of the environment.", []string{"env"}, nil)
	descEnvs     = prometheus.NewDesc("envlet_arbiter_envs", "Environments admitted on this node.", nil, nil)
	descDenials  = prometheus.NewDesc("envlet_arbiter_denials_total", "Admissions rejected and grows granted less than asked.", []string{"kind"}, nil)
	descGaps     = prometheus.NewDesc("envlet_arbiter_client_gaps_total", "Times the arbiter stopped answering the environment's shim (as its shim last reported).", []string{"env"}, nil)
	descFailed   = prometheus.NewDesc("envlet_arbiter_client_failed_calls_total", "Arbiter calls of the environment's shim that got no answer (as its shim last reported).", []string{"env"}, nil)
)

// Describe sends nothing: the status gauges are discovered at collection
// time, which makes this an unchecked collector.
func (collector) Describe(chan<- *prometheus.Desc) {}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	s.mu.Lock()
	defer s.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(descEnvs, prometheus.GaugeValue, float64(len(s.envs)))
	for kind, n := range s.rejects {
		ch <- prometheus.MustNewConstMetric(descDenials, prometheus.CounterValue, n, kind)
	}
	for _, rec := range s.envs {
		i := rec.info
		ch <- prometheus.MustNewConstMetric(descQuotaCPU, prometheus.GaugeValue, i.Current.CPU, i.Env)
		ch <- prometheus.MustNewConstMetric(descQuotaMem, prometheus.GaugeValue, float64(i.Current.Memory), i.Env)
		ch <- prometheus.MustNewConstMetric(descUsedCPU, prometheus.GaugeValue, i.Used.CPU, i.Env)
		ch <- prometheus.MustNewConstMetric(descUsedMem, prometheus.GaugeValue, float64(i.Used.Memory), i.Env)
		ch <- prometheus.MustNewConstMetric(descBaseCPU, prometheus.GaugeValue, i.Base.CPU, i.Env)
		ch <- prometheus.MustNewConstMetric(descBaseMem, prometheus.GaugeValue, float64(i.Base.Memory), i.Env)
		if g := i.Gaps; g != nil {
			ch <- prometheus.MustNewConstMetric(descGaps, prometheus.CounterValue, float64(g.Gaps), i.Env)
			ch <- prometheus.MustNewConstMetric(descFailed, prometheus.CounterValue, float64(g.FailedCalls), i.Env)
		}
		for _, f := range NumericFields(i.Status) {
			d := prometheus.NewDesc("envlet_status_"+f.Name, "Controller status field "+f.Name+".", []string{"env"}, nil)
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, f.Value, i.Env)
		}
	}
}

// Field is one numeric leaf of a JSON document, named in snake case with
// nested objects joined by '_'.
type Field struct {
	Name  string
	Value float64
}

// NumericFields flattens the numeric and boolean leaves of a JSON object,
// sorted by name. Anything else (strings, arrays, invalid JSON) is skipped.
func NumericFields(doc json.RawMessage) []Field {
	var v any
	if len(doc) == 0 || json.Unmarshal(doc, &v) != nil {
		return nil
	}
	var out []Field
	var walk func(prefix string, v any)
	walk = func(prefix string, v any) {
		switch x := v.(type) {
		case map[string]any:
			for k, e := range x {
				name := snake(k)
				if prefix != "" {
					name = prefix + "_" + name
				}
				walk(name, e)
			}
		case float64:
			out = append(out, Field{prefix, x})
		case bool:
			b := 0.0
			if x {
				b = 1
			}
			out = append(out, Field{prefix, b})
		}
	}
	walk("", v)
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// snake turns Go and JSON field names (WorkingSet, OOMs, cpu-quota) into
// Prometheus-safe snake case (working_set, ooms, cpu_quota).
func snake(s string) string {
	var b strings.Builder
	rs := []rune(s)
	for i, r := range rs {
		switch {
		case unicode.IsUpper(r):
			// Start a word at a lower->upper edge, or at the last capital
			// of an acronym followed by lower case (HTTPServer -> http_server).
			if i > 0 && b.Len() > 0 && (unicode.IsLower(rs[i-1]) || unicode.IsDigit(rs[i-1]) ||
				(i+1 < len(rs) && unicode.IsLower(rs[i+1]) && unicode.IsUpper(rs[i-1]) && rs[i+1] != 's')) {
				b.WriteByte('_')
			}
			b.WriteRune(unicode.ToLower(r))
		case unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		default:
			if b.Len() > 0 && !strings.HasSuffix(b.String(), "_") {
				b.WriteByte('_')
			}
		}
	}
	return strings.Trim(b.String(), "_")
}
