package nodecpu

import (
	"runtime"
	"testing"
	"time"
)

// TestReadCountsBusyTime: a core kept spinning shows as busy time. (Two
// readings' differences are not compared field by field: the kernel may
// move iowait backwards, seen once in a clean-clone run.)
func TestReadCountsBusyTime(t *testing.T) {
	before, err := Read()
	if err != nil {
		t.Fatal(err)
	}
	if before.Cores < 1 || before.Cores > runtime.NumCPU()*4 {
		t.Fatalf("cores = %d, this process sees %d", before.Cores, runtime.NumCPU())
	}
	if before.Busy <= 0 || before.Total < before.Busy {
		t.Fatalf("busy %.2f s of total %.2f s", before.Busy, before.Total)
	}
	// /proc/stat counts in 10 ms ticks: spin for long enough that they show.
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); {
	}
	after, err := Read()
	if err != nil {
		t.Fatal(err)
	}
	if spun := after.Busy - before.Busy; spun < 0.1 {
		t.Errorf("300 ms of spinning added %.3f s of busy time", spun)
	}
}
