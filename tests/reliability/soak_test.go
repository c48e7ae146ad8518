package reliability_test

import (
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestBenchSoak (ENVSNAP_BENCH=1; ENVSNAP_SOAK sets the duration, 30m by
// default): rounds of concurrent environments reading random files, with
// daemon SIGKILLs under a running container, transient registry faults,
// and image removal and re-pull (unmount, eviction, mount again) mixed in.
// Every byte must be right, every container must survive the restarts,
// and the daemon's goroutines and memory must not grow over time.
func TestBenchSoak(t *testing.T) {
	prereq.RequireBench(t)
	dur := 30 * time.Minute
	if v := os.Getenv("ENVSNAP_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("ENVSNAP_SOAK: %v", err)
		}
		dur = d
	}
	env := testenv.New(t, testenv.WithEnvsnap("--read-timeout", "15s", "--cache-size", "64MiB"))
	rng := rand.New(rand.NewSource(7))
	files := make([]testenv.File, 300)
	for i := range files {
		files[i] = testenv.RandomFile(fmt.Sprintf("/data/s%03d.bin", i), int64(64<<10+rng.Intn(448<<10)), int64(7000+i))
	}
	img := pushLazy(t, env, "rel/soak:1", files)
	data := img.Layers[len(img.Layers)-1]
	blob, err := contentBytes(env, data)
	if err != nil {
		t.Fatal(err)
	}
	proxy := &faultProxy{blob: blob, path: "/blobs/" + data.Digest.String()}
	env.Registry.Intercept(proxy.handle)
	t.Cleanup(func() { env.Registry.Intercept(nil) })
	image := env.Pull(t, img.Ref, "envsnap")

	readSample := func(r *rand.Rand, n int) error {
		args := []string{"sha256sum"}
		var sample []testenv.File
		for _, k := range r.Perm(len(files))[:n] {
			sample = append(sample, files[k])
			args = append(args, files[k].Path)
		}
		res, err := env.Env.Run(env.Context(), image, testenv.RunOptions{Snapshotter: "envsnap", Args: args})
		if err != nil {
			return err
		}
		if res.ExitCode != 0 {
			return fmt.Errorf("exit %d stderr %q", res.ExitCode, res.Stderr)
		}
		for _, f := range sample {
			if !strings.Contains(res.Stdout, f.Digest().Encoded()+"  "+f.Path) {
				return fmt.Errorf("%s wrong or missing", f.Path)
			}
		}
		return nil
	}

	var baseGoroutines float64
	var peakRSS int64
	rounds, restarts, repulls := 0, 0, 0
	deadline := time.Now().Add(dur)
	for round := 0; time.Now().Before(deadline); round++ {
		rounds++
		if round%3 == 1 {
			// Not "corrupt": a chunk failing verification fails the read
			// at once (docs/reliability.md); TestRegistryFaults has it.
			faults := []string{"reset", "truncate", "503", "429", "latency"}
			proxy.set(faults[round/3%len(faults)], 2)
		}
		var wg sync.WaitGroup
		errs := make(chan error, 4)
		for w := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := readSample(rand.New(rand.NewSource(int64(round*10+w))), 12); err != nil {
					errs <- fmt.Errorf("round %d env %d: %w", round, w, err)
				}
			}()
		}
		// Every fifth round a container reads across a daemon SIGKILL.
		if round%5 == 4 {
			signals := t.TempDir()
			f := files[rng.Intn(len(files))]
			rc := startContainer(t, env, image, signals, "/bin/sh", "-c", "echo ready; while [ ! -e /signal/go ]; do sleep 0.05; done; sha256sum "+f.Path)
			rc.waitOutput(t, "ready", time.Minute)
			peakRSS = max(peakRSS, vmHWM(t, env.Envsnap.PID()))
			env.Envsnap.Kill()
			env.StartEnvsnap(t)
			restarts++
			os.WriteFile(filepath.Join(signals, "go"), nil, 0o644)
			st, ok := rc.exited(2 * time.Minute)
			switch {
			case !ok:
				t.Errorf("round %d: container hung across the restart", round)
			case st.ExitCode() != 0 || !strings.HasPrefix(rc.out.String(), "ready\n"+f.Digest().Encoded()):
				t.Errorf("round %d: container across the restart: exit %d stdout %q stderr %q; want %s", round, st.ExitCode(), rc.out, rc.errOut, f.Digest().Encoded())
			}
			rc.task.Delete(env.Context())
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		proxy.set("", 0)
		// Every seventh round the image goes away (layers unmounted,
		// chunks unpinned) and comes back.
		if round%7 == 6 {
			if err := env.Client.ImageService().Delete(env.Context(), img.Ref, images.SynchronousDelete()); err != nil {
				t.Fatalf("delete image: %v", err)
			}
			image = env.Pull(t, img.Ref, "envsnap")
			repulls++
		}
		if exited, err := env.Envsnap.Exited(); exited {
			t.Fatalf("round %d: daemon exited: %v\n%s", round, err, env.Envsnap.LogTail(40))
		}
		if t.Failed() {
			break
		}
		if round == 2 {
			baseGoroutines, _ = metric(t, env, "go_goroutines")
		}
	}
	peakRSS = max(peakRSS, vmHWM(t, env.Envsnap.PID()))
	g, _ := metric(t, env, "go_goroutines")
	st := envsnapStatus(t, env).Cache
	t.Logf("soak %s: %d rounds, %d daemon restarts under a running container, %d re-pulls, %d faulted registry requests", dur, rounds, restarts, repulls, proxy.faulted.Load())
	t.Logf("daemon peak RSS %d MiB; goroutines %v (after round 3: %v); cache %d/%d bytes, %d evictions", peakRSS>>20, g, baseGoroutines, st.Size, st.MaxBytes, st.Evictions)
	if baseGoroutines > 0 && g > baseGoroutines+50 {
		t.Errorf("goroutines grew from %v to %v", baseGoroutines, g)
	}
	if peakRSS > 200<<20 {
		t.Errorf("daemon peak RSS %d MiB", peakRSS>>20)
	}
}
