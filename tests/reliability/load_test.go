package reliability_test

import (
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestBenchLoad50 (ENVSNAP_BENCH=1, `make bench`): 50 environments start at
// once from one image of 2000 files (16-256 KiB) and each reads its own
// random sample of 40 files, checking every sha256. Asserts: every byte
// right; the registry serves the layer at most once in total (each chunk
// fetched at most once, whatever the concurrency); the daemon's peak RSS
// under 200 MiB; no FUSE read slower than the read timeout (none failed).
func TestBenchLoad50(t *testing.T) {
	prereq.RequireBench(t)
	const (
		envs    = 50
		nFiles  = 2000
		perEnv  = 40
		timeout = 30 * time.Second
	)
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false", "--read-timeout", timeout.String()))
	rng := rand.New(rand.NewSource(1))
	files := make([]testenv.File, nFiles)
	for i := range files {
		files[i] = testenv.RandomFile(fmt.Sprintf("/data/d%02d/f%04d.bin", i%50, i), int64(16<<10+rng.Intn(240<<10)), int64(1000+i))
	}
	img := pushLazy(t, env, "rel/load:1", files)
	image := env.Pull(t, img.Ref, "envsnap")
	env.Registry.ResetCounters()

	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, envs)
	var mu sync.Mutex
	var slowest time.Duration
	for e := range envs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewSource(int64(e)))
			var sample []testenv.File
			args := []string{"sha256sum"}
			for _, k := range r.Perm(nFiles)[:perEnv] {
				sample = append(sample, files[k])
				args = append(args, files[k].Path)
			}
			t0 := time.Now()
			res, err := env.Env.Run(env.Context(), image, testenv.RunOptions{Snapshotter: "envsnap", Args: args, Timeout: 10 * time.Minute})
			took := time.Since(t0)
			mu.Lock()
			slowest = max(slowest, took)
			mu.Unlock()
			if err != nil {
				errs <- fmt.Errorf("env %d: %w", e, err)
				return
			}
			if res.ExitCode != 0 {
				errs <- fmt.Errorf("env %d: exit %d stderr %q", e, res.ExitCode, res.Stderr)
				return
			}
			for _, f := range sample {
				if !strings.Contains(res.Stdout, f.Digest().Encoded()+"  "+f.Path) {
					errs <- fmt.Errorf("env %d: %s wrong or missing", e, f.Path)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	wall := time.Since(start)

	var layerSize int64
	for _, l := range img.Layers {
		layerSize += l.Size
	}
	data := img.Layers[len(img.Layers)-1]
	served := env.Registry.BlobBytesServedFor(data.Digest.String())
	hwm := vmHWM(t, env.Envsnap.PID())
	st := envsnapStatus(t, env)
	t.Logf("%d environments x %d files: wall %s, slowest environment %s", envs, perEnv, wall.Round(time.Millisecond), slowest.Round(time.Millisecond))
	t.Logf("registry served %d bytes of the %d-byte data layer (%.2fx), %d blob requests", served, data.Size, float64(served)/float64(data.Size), env.Registry.BlobRequests())
	t.Logf("daemon peak RSS (VmHWM) %d MiB; cache %d bytes in %d entries", hwm>>20, st.Cache.Size, st.Cache.Entries)
	if served > data.Size {
		t.Errorf("registry served %d bytes of a %d-byte layer: some chunk was fetched more than once", served, data.Size)
	}
	if hwm > 200<<20 {
		t.Errorf("daemon peak RSS %d MiB, target under 200 MiB", hwm>>20)
	}
	reads := metricSum(t, env, "envsnap_lazyfs_ops_total", `op="read"`)
	readSecs := metricSum(t, env, "envsnap_lazyfs_op_seconds_total", `op="read"`)
	readErrs := metricSum(t, env, "envsnap_lazyfs_op_errors_total", `op="read"`)
	timeouts := metricSum(t, env, "envsnap_lazyfs_read_timeouts_total")
	if reads > 0 {
		t.Logf("FUSE reads %.0f, mean %.1f ms, failed %.0f, timed out %.0f", reads, 1000*readSecs/reads, readErrs, timeouts)
	}
	if reads == 0 {
		t.Error("no FUSE read in the metrics")
	}
	if timeouts > 0 || readErrs > 0 || env.Envsnap.LogContains("returning EIO") {
		t.Errorf("%.0f FUSE reads failed, %.0f of them at the %s read timeout", readErrs, timeouts, timeout)
	}
}
