package shim_test

import (
	"github.com/envsnap/envsnap/internal/prereq"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

// BenchmarkIdleReclaim runs idle agent environments (16 MiB of anonymous
// memory and a 96 MiB file they wrote, then asleep) in two groups side by
// side, idle reclaim off and on (idle-reclaim-after 5 s), and reports the
// memory the node holds for each group (the sum of the containers'
// memory.usage_in_bytes) once both have been idle for 30 s.
//
//	ENVSNAP_BENCH=1 go test -run '^$' -bench IdleReclaim -benchtime 1x ./tests/shim/
func BenchmarkIdleReclaim(b *testing.B) {
	prereq.RequireBench(b)
	const perGroup = 10
	s := newSuite(b, node{})
	groups := map[string][]*ctr{}
	b.ResetTimer()
	for i := range 2 * perGroup {
		name, after := "off", "0s"
		if i%2 == 1 {
			name, after = "on", "5s"
		}
		c, err := s.run(b, map[string]string{"initial-cpu": "0.5", "initial-memory": "1Gi", "idle-reclaim-after": after},
			"-mode", "cache", "-from", "16", "-to", "96", "-hold", "10m")
		if err != nil {
			b.Fatal(err)
		}
		groups[name] = append(groups[name], c)
	}
	var last time.Time
	for _, cs := range groups {
		for _, c := range cs {
			if t := c.waitStamp(b, "cached", 5*time.Minute); t.After(last) {
				last = t
			}
		}
	}
	usage := func(name string) int64 {
		var sum int64
		for _, c := range groups[name] {
			p := filepath.Join("/sys/fs/cgroup/memory", c.ns, c.id, "memory.usage_in_bytes")
			raw, err := os.ReadFile(p)
			if err != nil {
				b.Fatalf("read %s: %v", p, err)
			}
			v, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			sum += v
		}
		return sum
	}
	beforeOff, beforeOn := usage("off"), usage("on")
	time.Sleep(time.Until(last.Add(30 * time.Second)))
	off, on := usage("off"), usage("on")
	b.StopTimer()
	b.ReportMetric(float64(off)/float64(perGroup)/float64(envlet.MiB), "off-MiB/env")
	b.ReportMetric(float64(on)/float64(perGroup)/float64(envlet.MiB), "on-MiB/env")
	b.ReportMetric(float64(off)/float64(on), "off/on")
	b.Logf("%d idle environments per group, node memory held after the writes: off %s, on %s; 30 s idle later: off %s, on %s (off/on %.2fx)",
		perGroup, envlet.FormatBytes(beforeOff), envlet.FormatBytes(beforeOn), envlet.FormatBytes(off), envlet.FormatBytes(on), float64(off)/float64(on))
}
