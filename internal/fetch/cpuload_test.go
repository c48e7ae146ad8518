package fetch

import (
	"context"
	"errors"
	"os/exec"
	"runtime"
	"testing"
	"time"
)

// TestCPULoadSample: the cores other processes used are the node's busy
// time less this process's, per interval, read again only once the
// interval is over; no reading is no signal.
func TestCPULoadSample(t *testing.T) {
	readings := []cpuCounters{
		{cores: 2, busy: 100, total: 400, self: 10},
		// 1 s on 2 cores: 1.5 core-seconds busy, 0.5 of them ours.
		{cores: 2, busy: 101.5, total: 402, self: 10.5},
		// Then only this process was busy.
		{cores: 2, busy: 102.5, total: 404, self: 11.5},
	}
	var fail error
	c := cpuLoad{read: func() (cpuCounters, error) {
		if fail != nil {
			return cpuCounters{}, fail
		}
		r := readings[0]
		readings = readings[1:]
		return r, nil
	}}
	t0 := time.Unix(1000, 0)
	if cores, _ := c.sample(t0); cores != 0 {
		t.Fatalf("one reading: %v cores, want 0 (no signal yet)", cores)
	}
	if cores, others := c.sample(t0.Add(cpuSampleEvery)); cores != 2 || others != 1 {
		t.Fatalf("second reading: %v cores, %v busy with others, want 2 and 1", cores, others)
	}
	// Within the interval the reading is not taken again.
	if cores, others := c.sample(t0.Add(cpuSampleEvery + cpuSampleEvery/2)); cores != 2 || others != 1 {
		t.Fatalf("within the interval: %v, %v, want 2, 1", cores, others)
	}
	if _, others := c.sample(t0.Add(2 * cpuSampleEvery)); others != 0 {
		t.Fatalf("only this process busy: others %v, want 0", others)
	}
	fail = errors.New("no /proc")
	if cores, _ := c.sample(t0.Add(3 * cpuSampleEvery)); cores != 0 {
		t.Fatalf("unreadable: %v cores, want 0 (no signal)", cores)
	}
}

// TestCPULoadSeesOtherProcesses reads this node's real counters while
// other processes keep every core busy.
func TestCPULoadSeesOtherProcesses(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := runtime.NumCPU()
	for range n {
		cmd := exec.CommandContext(ctx, "sh", "-c", "while :; do :; done")
		if err := cmd.Start(); err != nil {
			t.Fatalf("start a busy process: %v", err)
		}
		t.Cleanup(func() { cancel(); cmd.Wait() })
	}
	c := cpuLoad{read: readCPUCounters}
	c.sample(time.Now())
	time.Sleep(2 * cpuSampleEvery)
	cores, others := c.sample(time.Now())
	if cores != float64(n) {
		t.Fatalf("cores %v, want %d", cores, n)
	}
	// Busy processes on every core: the node is saturated, and this
	// process, which only waits, used next to none of it.
	if others < float64(n)-0.5 {
		t.Fatalf("%d busy processes: others used %.2f cores, want more than %.1f", n, others, float64(n)-0.5)
	}
	if d := DefaultFillPolicy().Decide(time.Now(), Foreground{Cores: cores, OthersCPU: others}, 1, time.Now()); d.Hold != HoldCPU {
		t.Fatalf("every core busy: the fill's decision is %v, want %v", d.Hold, HoldCPU)
	}
}
