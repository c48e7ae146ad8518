// Command workload is the program the shim end-to-end tests run inside
// containers (built static, CGO_ENABLED=0, and added to a busybox image).
// Each mode is one demand shape; it prints timestamps of its phase changes
// as "<phase> <unix nanoseconds>" so the test can line them up with the
// cgroup limits it samples from the host.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"
)

func main() {
	mode := flag.String("mode", "cpu", "cpu | mem | ramp | cache | respawn | burst | bench | idle")
	threads := flag.Int("threads", 1, "busy threads (cpu: before the jump; burst, bench)")
	threads2 := flag.Int("threads2", 8, "busy threads after the jump (cpu)")
	jump := flag.Duration("jump", 2*time.Second, "when the jump happens (cpu)")
	dur := flag.Duration("duration", 5*time.Second, "total run time (cpu), busy time (burst)")
	from := flag.Int("from", 100, "MiB allocated first (mem)")
	to := flag.Int("to", 1024, "MiB allocated in the end (mem), held (burst, bench)")
	step := flag.Int("step", 64, "MiB per allocation step (mem)")
	hold := flag.Duration("hold", time.Second, "how long to hold the memory (mem), idle time (burst)")
	work := flag.Int("work", 400, "units of CPU work per burst (bench)")
	bursts := flag.Int("bursts", 1, "bursts (bench)")
	gap := flag.Duration("gap", time.Second, "idle time between bursts (bench)")
	pace := flag.Duration("pace", 200*time.Millisecond, "pause between allocation steps (ramp)")
	flag.Parse()
	// Go sizes GOMAXPROCS from the cgroup quota, which the controller
	// changes under us: pin it so the demand is what the test asked for.
	runtime.GOMAXPROCS(max(*threads, *threads2, 2))

	switch *mode {
	case "cpu":
		var stop atomic.Bool
		spin(*threads, &stop)
		time.Sleep(*jump)
		stamp("jump")
		spin(*threads2-*threads, &stop)
		time.Sleep(*dur - *jump)
		stop.Store(true)
	case "mem":
		regions := allocate(*from, *to, *step)
		stamp("allocated")
		time.Sleep(*hold)
		free(regions)
	case "ramp":
		// A working set growing at a steady pace, like a build: slow
		// enough that a test can act in the middle of it.
		stamp("ramp")
		regions := allocate(*from, *from, *from)
		for total := *from; total < *to; total += *step {
			time.Sleep(*pace)
			regions = append(regions, allocate(*step, *step, *step)...)
		}
		stamp("allocated")
		time.Sleep(*hold)
		free(regions)
	case "cache":
		// An agent that built something and now waits on the model: some
		// anonymous memory plus a file it wrote (page cache) it will not
		// read again soon.
		regions := allocate(*from, *from, *from)
		f, err := os.Create("/cache.bin")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		buf := make([]byte, 1<<20)
		for i := range buf {
			buf[i] = byte(i)
		}
		for range *to {
			if _, err := f.Write(buf); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
		}
		f.Close()
		stamp("cached")
		time.Sleep(*hold)
		free(regions)
	case "respawn":
		// Restart the memory hog as a child each time the kernel kills
		// it, like an agent retrying a build that runs out of memory.
		for i := 0; ; i++ {
			cmd := exec.Command(os.Args[0], "-mode", "mem", "-from", fmt.Sprint(*from), "-to", fmt.Sprint(*to), "-step", fmt.Sprint(*step), "-hold", hold.String())
			cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
			err := cmd.Run()
			stamp(fmt.Sprintf("child-%d-exit(%v)", i, err))
			if err == nil {
				return
			}
		}
	case "burst":
		var stop atomic.Bool
		regions := allocate(*to, *to, *to)
		spin(*threads, &stop)
		stamp("busy")
		time.Sleep(*dur)
		stop.Store(true)
		free(regions)
		stamp("idle")
		time.Sleep(*hold)
	case "bench":
		// Bursts of CPU and memory demand separated by idle gaps, the
		// shape of an agent episode (think, build, think, test).
		start := time.Now()
		for b := range *bursts {
			if b > 0 {
				time.Sleep(*gap)
			}
			regions := allocate(*to, *to, 64)
			done := make(chan struct{})
			per := *work / *threads
			for range *threads {
				go func() {
					burn(per, regions)
					done <- struct{}{}
				}()
			}
			for range *threads {
				<-done
			}
			free(regions)
		}
		fmt.Printf("elapsed %d\n", time.Since(start).Nanoseconds())
	case "idle":
		time.Sleep(*hold)
	default:
		fmt.Fprintf(os.Stderr, "unknown mode %q\n", *mode)
		os.Exit(2)
	}
	stamp("done")
}

func stamp(phase string) { fmt.Printf("%s %d\n", phase, time.Now().UnixNano()) }

// spin starts n threads that burn CPU until stop is set.
func spin(n int, stop *atomic.Bool) {
	for range n {
		go func() {
			runtime.LockOSThread()
			x := uint64(1)
			for !stop.Load() {
				for i := 0; i < 1e5; i++ {
					x = x*6364136223846793005 + 1442695040888963407
				}
			}
			_ = x
		}()
	}
}

// allocate maps and touches memory in steps up to toMiB: anonymous pages
// the kernel must keep (there is no swap on the test machines).
func allocate(fromMiB, toMiB, stepMiB int) [][]byte {
	var regions [][]byte
	total := 0
	for total < toMiB {
		n := stepMiB
		if total == 0 {
			n = fromMiB
		}
		n = min(n, toMiB-total)
		b, err := syscall.Mmap(-1, 0, n<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			fmt.Fprintf(os.Stderr, "mmap %d MiB: %v\n", n, err)
			os.Exit(1)
		}
		for i := 0; i < len(b); i += 4096 {
			b[i] = 1
		}
		regions = append(regions, b)
		total += n
	}
	return regions
}

func free(regions [][]byte) {
	for _, b := range regions {
		_ = syscall.Munmap(b)
	}
}

// burn does units of work, each a pass of arithmetic plus a strided walk
// over the memory (so a memory limit below the set costs page faults, not
// only a CPU limit costs time).
func burn(units int, regions [][]byte) {
	x := uint64(1)
	for u := range units {
		for i := 0; i < 2e6; i++ {
			x = x*6364136223846793005 + 1442695040888963407
		}
		if len(regions) > 0 {
			r := regions[u%len(regions)]
			for i := 0; i < len(r); i += 4096 {
				r[i] += byte(x)
			}
		}
	}
	if x == 42 {
		fmt.Println(x)
	}
}
