//go:build linux

package idleprio

import (
	"runtime"
	"slices"
	"testing"
	"time"
)

// BenchmarkGCBesideLoweredJob measures what a lowered job costs the
// rest of its process on a saturated node: runtime.GC beside a goroutine
// spinning at the daemon's priority and beside one spinning in a job,
// alternating, every core kept busy by other processes. A stop-the-world
// phase of the collector waits until every running goroutine stops at a
// safe point, and a lowered thread stops only when the kernel runs it:
// on this node at its next floor turn. Meanwhile every goroutine of the
// daemon waits, the file-system requests it serves included.
func BenchmarkGCBesideLoweredJob(b *testing.B) {
	startSpinners(b, runtime.NumCPU()+1)
	// The first job raises GOMAXPROCS (package doc): raised before the
	// first sample, both kinds run with the same.
	Lower()
	const samples = 8
	gcBeside := func(lowered bool) time.Duration {
		stop, done := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			if lowered {
				Run(func() { spinUntil(stop) })
			} else {
				spinUntil(stop)
			}
		}()
		time.Sleep(100 * time.Millisecond)
		start := time.Now()
		runtime.GC()
		d := time.Since(start)
		close(stop)
		<-done
		return d
	}
	for range b.N {
		var normal, lowered []time.Duration
		for range samples {
			normal = append(normal, gcBeside(false))
			lowered = append(lowered, gcBeside(true))
		}
		slices.Sort(normal)
		slices.Sort(lowered)
		b.ReportMetric(float64(normal[samples/2].Microseconds())/1e3, "gc-ms-p50-beside-normal")
		b.ReportMetric(float64(lowered[samples/2].Microseconds())/1e3, "gc-ms-p50-beside-lowered")
		b.ReportMetric(float64(lowered[samples-1].Microseconds())/1e3, "gc-ms-max-beside-lowered")
		b.ReportMetric(float64(lowered[samples/2])/float64(normal[samples/2]), "lowered/normal")
	}
}
