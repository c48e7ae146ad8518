package headline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/devenv"
)

// Page-cache sharing systems: which lower the environments' overlay
// stacks on. All run under runc with no quota, so only the lower differs.
const (
	PCOverlayfs     = "overlayfs"
	PCEnvsnapLazy   = "envsnap-lazy"   // FUSE lowers, chunks fetched on demand (--fill=false)
	PCEnvsnapNative = "envsnap-native" // every layer fetched and its native copy built first
)

// PageCacheSystems in the order they run by default.
var PageCacheSystems = []string{PCOverlayfs, PCEnvsnapLazy, PCEnvsnapNative}

// PageCacheConfig is the page-cache sharing scenario: N environments of
// one image (one harness layer) each hold the agent CLI resident, and
// the node's page cache and the cgroups' file pages are compared with
// one environment alone.
type PageCacheConfig struct {
	Tasks   string
	N       int
	Systems []string
	RTT     time.Duration
	Rate    int64
	Timeout time.Duration
	Log     io.Writer
}

func (c *PageCacheConfig) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, format+"\n", args...)
	}
}

// PageCacheReport is what the scenario measured, side by side.
type PageCacheReport struct {
	Started  time.Time                `json:"started"`
	Duration time.Duration            `json:"duration_ns"`
	Command  string                   `json:"command"`
	Machine  string                   `json:"machine"`
	Task     string                   `json:"task"`
	N        int                      `json:"n"`
	Order    []string                 `json:"order"`
	Systems  map[string]*PageCacheRun `json:"systems"`
}

// PageCacheRun is one system: one environment, then N.
type PageCacheRun struct {
	One, All PageCacheLevel
	// Lowers describes the file systems of the first environment's
	// overlay lowers (FUSE or the node's disk), as mounted.
	Lowers string `json:"lowers"`
}

// PageCacheLevel is the node with Envs environments resident.
type PageCacheLevel struct {
	Envs int `json:"envs"`
	// NodeFile is the node's page cache (Cached) above the node before
	// the first environment; EnvFile the file pages charged to the
	// environments' cgroups, summed (a page is charged to the cgroup that
	// first read it, once).
	NodeFile int64 `json:"node_file"`
	EnvFile  int64 `json:"env_file"`
	// NodeMemory is MemTotal - MemAvailable above the same base.
	NodeMemory int64 `json:"node_memory"`
}

// holder answers no model request: the agent has loaded its code and
// waits, resident, until the scenario releases it.
type holder struct {
	mu    sync.Mutex
	ready map[string]chan struct{}
	stop  chan struct{}
}

func (h *holder) expect(key string) <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	ch := make(chan struct{})
	h.ready[key] = ch
	return ch
}

func (h *holder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := apiKeyOf(r.Header)
	h.mu.Lock()
	if ch, ok := h.ready[key]; ok && ch != nil {
		close(ch)
		h.ready[key] = nil
	}
	stop := h.stop
	h.mu.Unlock()
	select {
	case <-stop:
	case <-r.Context().Done():
	}
	http.Error(w, "released", http.StatusServiceUnavailable)
}

// MeasurePageCache runs the page-cache sharing scenario.
func MeasurePageCache(ctx context.Context, cfg PageCacheConfig) (_ *PageCacheReport, retErr error) {
	if cfg.N < 2 || cfg.N > netshape.MaxBridgeNodes-1 {
		return nil, fmt.Errorf("page-cache scenario: %d environments, want 2 to %d", cfg.N, netshape.MaxBridgeNodes-1)
	}
	if len(cfg.Systems) == 0 {
		cfg.Systems = PageCacheSystems
	}
	w, err := episode.LoadWorkload(cfg.Tasks)
	if err != nil {
		return nil, err
	}
	task := w.Tasks[0]
	rep := &PageCacheReport{Started: time.Now(), Machine: machine(), Task: task.ID, N: cfg.N, Order: cfg.Systems, Systems: map[string]*PageCacheRun{}}
	denv, _, metricsAddr, closeNode, err := startNode(ctx, cfg.Rate, cfg.RTT)
	if err != nil {
		return nil, err
	}
	defer closeNode()
	// Each system's files are its own inodes (overlayfs's unpacked
	// layers, the FUSE layers, the native copies), and its images are
	// deleted before the next: the cgroups' charges need no machine-wide
	// cache drop, which would disturb whatever else runs.
	b := &bench{cfg: Config{Log: cfg.Log}, env: denv, metrics: "http://" + metricsAddr + "/metrics", keepPageCache: true}
	br, err := netshape.NewBridge(ctx, fmt.Sprintf("%spc-%d", netshape.NamePrefix, os.Getpid()), cfg.N+1)
	if err != nil {
		return nil, fmt.Errorf("page-cache namespaces: %w", err)
	}
	defer func() {
		if err := br.Close(context.Background()); err != nil && retErr == nil {
			retErr = err
		}
	}()
	ln, err := br.Nodes[0].Listen(ctx, gatewayPort)
	if err != nil {
		return nil, err
	}
	h := &holder{ready: map[string]chan struct{}{}}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: time.Minute}
	go srv.Serve(ln)
	defer srv.Close()
	gw := net.JoinHostPort(br.Nodes[0].Addr.String(), strconv.Itoa(gatewayPort))
	allow := fmt.Sprintf("%s:%d/tcp", br.Nodes[0].Addr, gatewayPort)
	pub, err := episode.PublishGroups(ctx, denv.Hosts(), denv.Registry.Host, &episode.Workload{Tasks: []episode.Task{task}})
	if err != nil {
		return nil, err
	}
	envs, err := composeEnvs(ctx, denv.Hosts(), denv.Registry.Host, pub, []episode.Task{task}, 1)
	if err != nil {
		return nil, err
	}
	for _, sys := range cfg.Systems {
		snap, daemon := "envsnap", Envsnap
		switch sys {
		case PCOverlayfs:
			snap = "overlayfs"
		case PCEnvsnapLazy:
			daemon = EnvsnapNoFill
		case PCEnvsnapNative:
		default:
			return nil, fmt.Errorf("page-cache scenario: unknown system %q (want some of %s)", sys, strings.Join(PageCacheSystems, ", "))
		}
		if err := b.useSystem(daemon); err != nil {
			return nil, err
		}
		if err := b.reset(); err != nil {
			return nil, err
		}
		for _, n := range br.Nodes[1:] {
			if err := clearEgress(n.Path()); err != nil {
				return nil, err
			}
			if err := applyEgress(ctx, n.Path(), allow); err != nil {
				return nil, err
			}
		}
		img, err := denv.Pull(ctx, envs[0].ref, snap)
		if err != nil {
			return nil, err
		}
		if sys == PCEnvsnapNative {
			cfg.logf("%-15s waiting for every layer and its native copy", sys)
			if _, err := b.settle(ctx, cfg.Timeout); err != nil {
				return nil, err
			}
		}
		// Unpacking and native copies write the lowers' files through the
		// page cache, charged to containerd and the daemon: evicted, the
		// first environment's reads are charged to it and the later ones
		// show whether they are charged again.
		if err := evictPageCache(denv.Dir); err != nil {
			return nil, err
		}
		h.mu.Lock()
		h.stop = make(chan struct{})
		h.mu.Unlock()
		run := &PageCacheRun{}
		baseUsed, err := nodeMemoryUsed()
		if err != nil {
			return nil, err
		}
		baseFile, err := meminfo("Cached")
		if err != nil {
			return nil, err
		}
		level := func(n int) PageCacheLevel {
			// Let the agents settle after their first request.
			time.Sleep(3 * time.Second)
			l := PageCacheLevel{Envs: n}
			if used, err := nodeMemoryUsed(); err == nil {
				l.NodeMemory = used - baseUsed
			}
			if c, err := meminfo("Cached"); err == nil {
				l.NodeFile = c - baseFile
			}
			for _, m := range containerStats(denv) {
				l.EnvFile += m.file
			}
			return l
		}
		rctx, stopAll := context.WithCancel(ctx)
		var wg sync.WaitGroup
		errs := make(chan error, cfg.N)
		start := func(i int) error {
			key := fmt.Sprintf("pc-%s-%02d", sys, i)
			ready := h.expect(key)
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := denv.Run(rctx, img, devenv.RunOptions{
					Snapshotter: snap,
					Args:        []string{"/bin/sh", "-c", fmt.Sprintf("cd %s && exec agent -p 'Wait.' --output-format json --dangerously-skip-permissions </dev/null", task.Repo)},
					Env:         agentEnv(gw, key),
					Timeout:     24 * time.Hour,
					SpecOpts:    []oci.SpecOpts{oci.WithLinuxNamespace(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: br.Nodes[1+i].Path()})},
				})
				if rctx.Err() == nil {
					errs <- fmt.Errorf("environment %d ended before the measurement: %v", i+1, err)
				}
			}()
			select {
			case <-ready:
				return nil
			case err := <-errs:
				return err
			case <-time.After(cfg.Timeout):
				return fmt.Errorf("environment %d: no model request within %s", i+1, cfg.Timeout)
			}
		}
		err = start(0)
		if err == nil {
			run.One = level(1)
			run.Lowers = describeLowers(denv.Dir)
			for i := 1; i < cfg.N && err == nil; i++ {
				err = start(i)
			}
			if err == nil {
				run.All = level(cfg.N)
			}
		}
		h.mu.Lock()
		close(h.stop)
		h.mu.Unlock()
		stopAll()
		wg.Wait()
		if err != nil {
			return nil, fmt.Errorf("page cache on %s: %w", sys, err)
		}
		rep.Systems[sys] = run
		cfg.logf("%-15s lowers %s; 1 env: node page cache +%s, cgroups' file %s; %d envs: node page cache +%s, cgroups' file %s, node memory +%s (1 env: +%s)",
			sys, run.Lowers, mib(run.One.NodeFile), mib(run.One.EnvFile), cfg.N, mib(run.All.NodeFile), mib(run.All.EnvFile), mib(run.All.NodeMemory), mib(run.One.NodeMemory))
	}
	rep.Duration = time.Since(rep.Started)
	return rep, nil
}

// evictPageCache writes back and evicts the page cache of every regular
// file below dir on dir's own file system (mounts below it, FUSE layers
// among them, are not entered: a lookup there would fetch), leaving the
// rest of the machine's page cache alone.
func evictPageCache(dir string) error {
	var root unix.Stat_t
	if err := unix.Stat(dir, &root); err != nil {
		return fmt.Errorf("evict page cache of %s: %w", dir, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("evict page cache of %s: %w", dir, err)
	}
	// DONTNEED drops clean pages only.
	err = unix.Syncfs(int(d.Fd()))
	d.Close()
	if err != nil {
		return fmt.Errorf("evict page cache of %s: syncfs: %w", dir, err)
	}
	return filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			// Containers and snapshots come and go under the node's
			// directory while it is walked.
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		var st unix.Stat_t
		if unix.Lstat(path, &st) != nil {
			return nil
		}
		if st.Dev != root.Dev {
			if e.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if !e.Type().IsRegular() {
			return nil
		}
		f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOATIME, 0)
		if err != nil {
			return nil
		}
		defer f.Close()
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			return fmt.Errorf("evict page cache of %s: %w", path, err)
		}
		return nil
	})
}

// describeLowers counts the file systems under the overlay lowers of the
// containers mounted now below the node's directory under (FUSE for a lazy layer, anything else for a
// native copy or overlayfs's unpacked directories).
func describeLowers(under string) string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "unknown: " + err.Error()
	}
	counts := map[string]int{}
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		// Only this node's containers: other nodes on the machine mount
		// theirs too.
		if f := strings.Fields(pre); !ok || len(f) < 5 || !strings.HasPrefix(f[4], under) || !strings.HasPrefix(post, "overlay ") {
			continue
		}
		for _, opt := range strings.Split(strings.Fields(post)[2], ",") {
			dirs, ok := strings.CutPrefix(opt, "lowerdir=")
			if !ok {
				continue
			}
			for _, d := range strings.Split(dirs, ":") {
				var st unix.Statfs_t
				kind := "unknown"
				if unix.Statfs(d, &st) == nil {
					kind = "disk"
					if st.Type == unix.FUSE_SUPER_MAGIC {
						kind = "FUSE"
					}
				}
				counts[kind]++
			}
		}
	}
	var parts []string
	for _, k := range []string{"FUSE", "disk", "unknown"} {
		if counts[k] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", counts[k], k))
		}
	}
	if len(parts) == 0 {
		return "none found"
	}
	return strings.Join(parts, ", ")
}

// WriteJSON writes the raw report.
func (rep *PageCacheReport) WriteJSON(path string) error { return writeJSON(path, rep) }
