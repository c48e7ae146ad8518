//go:build linux

package native

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/lazyfs"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// workloadLayer converts one group tar of the benchmark workload with the
// format's defaults and caches every frame, as a completed fill leaves it.
func workloadLayer(t *testing.T, path string) ([]byte, *layerfmt.TOC, *chunkcache.Cache) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("%v (the benchmark workload: run bench/workload/build.sh --small, or make bench, once)", err)
	}
	defer f.Close()
	return cacheLayer(t, f)
}

// countingSource passes reads to a layer's read path and counts the
// bytes it served and the frames they came from.
type countingSource struct {
	lazyfs.ChunkSource
	mu     sync.Mutex
	served map[[2]int64]int64
	frames map[int]int64
}

func (s *countingSource) ReadChunk(ctx context.Context, c layerfmt.Chunk) ([]byte, func(), error) {
	b, release, err := s.ChunkSource.ReadChunk(ctx, c)
	if err == nil {
		s.mu.Lock()
		s.served[[2]int64{c.Offset, c.FrameOffset}] = c.Size
		s.frames[c.FrameIndex] = c.FrameSize
		s.mu.Unlock()
	}
	return b, release, err
}

func cpuTime(who int) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(who, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestBenchGoTestLowers runs the benchmark workload's first `go test` of
// a cold episode (the task's bug applied, the test failing) in a chroot
// on an overlay of the base and task groups, with a fresh upper, the
// page cache dropped before, once over the layers' FUSE mounts (lazyfs
// over fetch.Layer and a frame cache of the daemon's default size, every
// chunk already in the node cache) and
// once over their native copies, and once over the native copies with
// every file read into the page cache first (what an unpack leaves of a
// pulled image, which the status quo's cold test reads), the rounds
// interleaved: what serving
// the lower through FUSE costs a compile-and-test step when no byte has
// to cross the network. The FUSE server runs in this process, so its CPU
// is this process's; the test's is its children's. Gated by
// ENVSNAP_BENCH=1; needs the workload (ENVSNAP_BENCH_CACHE, default
// .cache/bench). ENVSNAP_BENCH_PROFILE=<dir> saves a CPU profile of this
// process over each FUSE round's test.
func TestBenchGoTestLowers(t *testing.T) {
	prereq.RequireBench(t)
	requireRoot(t)
	cache := os.Getenv("ENVSNAP_BENCH_CACHE")
	if cache == "" {
		cache = filepath.Join("..", "..", ".cache", "bench")
	}
	work := filepath.Join(cache, "workload", "small")
	const repo, bug = "/workspace/uuid", "/opt/tasks/uuid/uuid-hash-variant/bug.diff"
	ctx := context.Background()
	type group struct {
		blob   []byte
		toc    *layerfmt.TOC
		cache  *chunkcache.Cache
		native string
	}
	var groups []group // top first, as overlay lists lowers
	for _, name := range []string{"task-uuid.tar", "base.tar"} {
		blob, toc, c := workloadLayer(t, filepath.Join(work, name))
		dir := filepath.Join(t.TempDir(), "tree")
		if err := BuildTree(ctx, dir, toc, c); err != nil {
			t.Fatalf("native copy of %s: %v", name, err)
		}
		groups = append(groups, group{blob, toc, c, dir})
	}
	env := []string{"HOME=/root", "PATH=/usr/local/go/bin:/root/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"GOTOOLCHAIN=local", "GOPROXY=off", "GOSUMDB=off", "GOFLAGS=-mod=mod", "GOPATH=/root/go",
		"GOMODCACHE=/root/go/pkg/mod", "GOCACHE=/root/.cache/go-build", "LANG=C.UTF-8"}

	mount := func(t *testing.T, target, fstype, src, opts string, flags uintptr) {
		if err := unix.Mount(src, target, fstype, flags, opts); err != nil {
			t.Fatalf("mount %s on %s: %v", fstype, target, err)
		}
		t.Cleanup(func() {
			if err := unix.Unmount(target, 0); err != nil {
				t.Errorf("unmount %s: %v", target, err)
				unix.Unmount(target, unix.MNT_DETACH)
			}
		})
	}
	frames := fetch.NewFrameCache(128 << 20) // the daemon's frame_cache default
	// Never contacted: every chunk is in the node cache and the layers
	// have no fill.
	noRegistry := docker.ConfigureDefaultRegistries()
	type sample struct{ wall, testCPU, serverCPU float64 }
	results := map[string][]sample{}
	const rounds = 3
	for round := range rounds {
		for _, mode := range []string{"native", "native-cached", "fuse"} {
			t.Run(fmt.Sprintf("%s-%d", mode, round), func(t *testing.T) {
				var lowers []string
				var srcs []*countingSource
				for _, g := range groups {
					if mode != "fuse" {
						lowers = append(lowers, g.native)
						continue
					}
					// The daemon's read path: the layer reads the node
					// cache (every chunk is there, so the registry is
					// never asked) through the node-wide frame cache.
					desc := ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: digest.FromBytes(g.blob), Size: int64(len(g.blob))}
					blob, err := fetch.NewBlobReader(noRegistry, "registry.invalid/bench/gotest:1", desc)
					if err != nil {
						t.Fatal(err)
					}
					layer := fetch.NewLayer(blob, g.toc, g.cache, fetch.WithFill(false), fetch.WithSharedFrameCache(frames))
					t.Cleanup(func() { layer.Close() })
					src := &countingSource{ChunkSource: layer, served: map[[2]int64]int64{}, frames: map[int]int64{}}
					mnt := t.TempDir()
					srv, err := lazyfs.Mount(ctx, mnt, g.toc, src)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() {
						if err := srv.Unmount(); err != nil {
							t.Errorf("unmount %s: %v", mnt, err)
						}
					})
					lowers, srcs = append(lowers, mnt), append(srcs, src)
				}
				dir := t.TempDir()
				upper, wd, merged := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "merged")
				for _, d := range []string{upper, wd, merged} {
					if err := os.Mkdir(d, 0o755); err != nil {
						t.Fatal(err)
					}
				}
				mount(t, merged, "overlay", "overlay", "lowerdir="+strings.Join(lowers, ":")+",upperdir="+upper+",workdir="+wd, 0)
				mount(t, filepath.Join(merged, "proc"), "proc", "proc", "", 0)
				mount(t, filepath.Join(merged, "dev"), "", "/dev", "", unix.MS_BIND)
				sh := func(script string) (string, error) {
					cmd := exec.Command("chroot", merged, "/bin/sh", "-c", "cd "+repo+" && "+script)
					cmd.Env = env
					out, err := cmd.CombinedOutput()
					return string(out), err
				}
				out, err := sh("git apply " + bug)
				if err != nil {
					t.Fatalf("apply the bug: %v\n%s", err, out)
				}
				unix.Sync()
				if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
					t.Fatal(err)
				}
				if mode == "native-cached" {
					// As an unpack leaves a pulled image: every file
					// it wrote in the page cache.
					for _, g := range groups {
						if err := readTree(g.native); err != nil {
							t.Fatal(err)
						}
					}
				}
				var prof *os.File
				if d := os.Getenv("ENVSNAP_BENCH_PROFILE"); d != "" && mode == "fuse" {
					if prof, err = os.Create(filepath.Join(d, fmt.Sprintf("gotest-fuse-%d.pprof", round))); err != nil {
						t.Fatal(err)
					}
					if err := pprof.StartCPUProfile(prof); err != nil {
						t.Fatal(err)
					}
				}
				c0, s0, start := cpuTime(syscall.RUSAGE_CHILDREN), cpuTime(syscall.RUSAGE_SELF), time.Now()
				out, err = sh("go test ./...")
				wall := time.Since(start)
				c1, s1 := cpuTime(syscall.RUSAGE_CHILDREN), cpuTime(syscall.RUSAGE_SELF)
				if prof != nil {
					pprof.StopCPUProfile()
					prof.Close()
				}
				// The bug makes the test fail; a build error would not.
				if err == nil || !strings.Contains(out, "--- FAIL") {
					t.Fatalf("go test with the bug: %v, want failing tests\n%s", err, out)
				}
				s := sample{wall.Seconds(), (c1 - c0).Seconds(), (s1 - s0).Seconds()}
				results[mode] = append(results[mode], s)
				line := fmt.Sprintf("round %d %-6s: go test %.2fs, its CPU %.2fs, this process (FUSE server) %.2fs", round, mode, s.wall, s.testCPU, s.serverCPU)
				for i, src := range srcs {
					var served, frames int64
					for _, n := range src.served {
						served += n
					}
					for _, n := range src.frames {
						frames += n
					}
					line += fmt.Sprintf("; lower %d: served %.0f MiB from %.0f MiB of frames", i, float64(served)/(1<<20), float64(frames)/(1<<20))
				}
				t.Log(line)
			})
		}
	}
	med := func(mode string, f func(sample) float64) float64 {
		var v []float64
		for _, s := range results[mode] {
			v = append(v, f(s))
		}
		if len(v) == 0 {
			return 0
		}
		return median(v)
	}
	wall := func(s sample) float64 { return s.wall }
	test := func(s sample) float64 { return s.testCPU }
	server := func(s sample) float64 { return s.serverCPU }
	if n, c := med("native", wall), med("native-cached", wall); n > 0 && c > 0 {
		t.Logf("median of %d: go test %.2fs on FUSE lowers, %.2fs on native copies: %.2fx; its CPU %.2fs against %.2fs; FUSE server CPU %.2fs",
			rounds, med("fuse", wall), n, med("fuse", wall)/n, med("fuse", test), med("native", test), med("fuse", server))
		t.Logf("median of %d: native copies with every file in the page cache (as an unpack leaves an image) %.2fs: FUSE lowers %.2fx, native copies read from disk %.2fx",
			rounds, c, med("fuse", wall)/c, n/c)
	}
}

// readTree reads every regular file under dir, which leaves them in the
// page cache.
func readTree(dir string) error {
	return filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(io.Discard, f)
		return err
	})
}
