//go:build linux

package idleprio

import (
	"context"
	"os/exec"
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
	// first sample, every kind runs with the same.
	Lower()
	const samples = 8
	const (
		normal = iota
		lowered
		process
	)
	gcBeside := func(kind int) time.Duration {
		stop, done := make(chan struct{}), make(chan struct{})
		ctx, kill := context.WithCancel(context.Background())
		spinner := exec.CommandContext(ctx, "/bin/sh", "-c", "while :; do :; done")
		go func() {
			defer close(done)
			switch kind {
			case normal:
				spinUntil(stop)
			case lowered:
				Run(func() { spinUntil(stop) })
			case process:
				RunProcess(spinner) // ends killed
			}
		}()
		time.Sleep(100 * time.Millisecond)
		start := time.Now()
		runtime.GC()
		d := time.Since(start)
		close(stop)
		kill()
		<-done
		return d
	}
	for range b.N {
		var got [3][]time.Duration
		for range samples {
			for kind := range got {
				got[kind] = append(got[kind], gcBeside(kind))
			}
		}
		for kind := range got {
			slices.Sort(got[kind])
		}
		p50 := func(kind int) float64 { return float64(got[kind][samples/2].Microseconds()) / 1e3 }
		b.ReportMetric(p50(normal), "gc-ms-p50-beside-normal")
		b.ReportMetric(p50(lowered), "gc-ms-p50-beside-lowered")
		b.ReportMetric(float64(got[lowered][samples-1].Microseconds())/1e3, "gc-ms-max-beside-lowered")
		b.ReportMetric(p50(process), "gc-ms-p50-beside-lowered-process")
		b.ReportMetric(float64(got[process][samples-1].Microseconds())/1e3, "gc-ms-max-beside-lowered-process")
		b.ReportMetric(p50(lowered)/p50(normal), "lowered/normal")
		b.ReportMetric(p50(process)/p50(normal), "lowered-process/normal")
	}
}
