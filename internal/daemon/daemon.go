//go:build linux

package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"sort"
	"sync/atomic"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/fdstore"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/layerstore"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/internal/unpacked"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/snapshotter"
)

// shutdownGrace bounds how long in-flight snapshot calls may take to finish
// on shutdown before the server stops hard.
const shutdownGrace = 10 * time.Second

// Run serves the snapshotter until ctx is cancelled, then shuts down:
// stops accepting calls, unmounts every layer and closes the metadata.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return fmt.Errorf("create root: %w", err)
	}
	cache, err := chunkcache.Open(cfg.CacheDir, int64(cfg.CacheSize))
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), cache.Collector())

	fetchMetrics, err := fetch.NewMetrics(reg)
	if err != nil {
		return fmt.Errorf("register fetch metrics: %w", err)
	}
	var keeper *fdstore.Client
	if cfg.KeeperBinary != "" {
		// Without the keeper the daemon still serves; only restarts
		// then break running containers.
		if keeper, err = fdstore.Start(KeeperSocket(cfg.Address), cfg.KeeperBinary, "fdstore", "--socket", KeeperSocket(cfg.Address)); err != nil {
			log.G(ctx).WithError(err).Error("no descriptor keeper: layer mounts will not survive a restart of the daemon")
			keeper = nil
		} else {
			defer keeper.Close()
		}
	}
	hosts := registry.ConfigureHosts(ctx, registry.Options{HostsDir: cfg.HostsDir, DockerConfig: cfg.DockerConfig})
	var files *unpacked.Store
	if cfg.Passthrough {
		if files, err = unpacked.Open(filepath.Join(cfg.Root, "unpacked"), int64(cfg.PassthroughCacheSize)); err != nil {
			return err
		}
		defer files.Close()
	}
	var frames *fetch.FrameCache
	if cfg.FrameCacheSize > 0 {
		frames = fetch.NewFrameCache(int64(cfg.FrameCacheSize))
	}
	store, err := layerstore.New(layerstore.Config{
		Hosts:           hosts,
		Cache:           cache,
		Fill:            cfg.Fill,
		FillDelay:       time.Duration(cfg.FillDelay),
		Eager:           cfg.Eager,
		ReadTimeout:     time.Duration(cfg.ReadTimeout),
		Registerer:      reg,
		FetchMetrics:    fetchMetrics,
		Keeper:          keeper,
		FrameCache:      frames,
		Unpacked:        files,
		UnpackedMinSize: int64(cfg.PassthroughMinSize),
	})
	if err != nil {
		return err
	}
	// Take over the mounts a previous daemon left running before the
	// snapshotter restores its layers, so it finds them served instead
	// of detaching them from the containers using them.
	restored, err := store.Restore(ctx)
	if err != nil {
		log.G(ctx).WithError(err).Error("take over layer mounts of the previous daemon")
	}
	sn, err := snapshotter.New(ctx, cfg.Root, store)
	if err != nil {
		return fmt.Errorf("open snapshotter: %w", err)
	}
	unmountOrphans(ctx, sn, store, restored)
	defer func() {
		if err := sn.Close(); err != nil {
			log.G(ctx).WithError(err).Error("close snapshotter")
		}
	}()

	d := &daemon{sn: sn, store: store, cache: cache, files: files}
	httpSrv := &http.Server{Handler: d.handler(reg), ReadHeaderTimeout: 10 * time.Second}
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			l.Close()
		}
	}()
	statusL, err := listenUnix(StatusSocket(cfg.Address))
	if err != nil {
		return err
	}
	listeners = append(listeners, statusL)
	if cfg.MetricsAddress != "" {
		l, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("listen on metrics address: %w", err)
		}
		listeners = append(listeners, l)
	}

	// The gRPC socket appears last: containerd and the test harness take
	// its existence to mean the daemon is ready.
	grpcSrv := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(grpcSrv, snapshotservice.FromSnapshotter(sn))
	grpcL, err := listenUnix(cfg.Address)
	if err != nil {
		return err
	}

	errc := make(chan error, len(listeners)+1)
	for _, l := range listeners {
		go func() {
			if err := httpSrv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("serve http on %s: %w", l.Addr(), err)
			}
		}()
	}
	go func() {
		if err := grpcSrv.Serve(grpcL); err != nil {
			errc <- fmt.Errorf("serve grpc: %w", err)
		}
	}()
	d.ready.Store(true)
	log.G(ctx).WithField("address", cfg.Address).WithField("root", cfg.Root).WithField("metrics", cfg.MetricsAddress).Info("containerd-envsnap serving")

	var runErr error
	select {
	case <-ctx.Done():
		log.G(ctx).Info("shutting down")
	case runErr = <-errc:
		log.G(ctx).WithError(runErr).Error("server failed; shutting down")
	}
	d.ready.Store(false)

	stopped := make(chan struct{})
	go func() { grpcSrv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(shutdownGrace):
		grpcSrv.Stop()
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	httpSrv.Shutdown(shutCtx)
	os.Remove(cfg.Address)
	os.Remove(StatusSocket(cfg.Address))
	return runErr
}

// unmountOrphans unmounts taken-over mounts that no snapshot uses any more
// (their last snapshot was removed while the daemon was down, or the
// previous daemon could not unmount them on its way out).
func unmountOrphans(ctx context.Context, sn *snapshotter.Snapshotter, store *layerstore.Store, restored []string) {
	used := map[string]bool{}
	for _, l := range sn.Layers() {
		if l.Mounted {
			used[l.Mountpoint] = true
		}
	}
	for _, mp := range restored {
		if used[mp] {
			continue
		}
		if err := store.Unmount(ctx, mp); err != nil {
			log.G(ctx).WithError(err).WithField("mountpoint", mp).Warn("unmount layer no snapshot uses")
		}
	}
	if len(restored) > 0 {
		log.G(ctx).WithField("layers", len(restored)).Info("took over layer mounts of the previous daemon")
	}
}

// listenUnix listens on a fresh unix socket readable only by root: the
// snapshot API can mount anything anywhere.
func listenUnix(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("remove stale socket: %w", err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("restrict socket %s: %w", path, err)
	}
	return l, nil
}

type daemon struct {
	sn    *snapshotter.Snapshotter
	store *layerstore.Store
	cache *chunkcache.Cache
	files *unpacked.Store // nil without passthrough
	ready atomic.Bool
}

func (d *daemon) handler(reg *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if !d.ready.Load() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/footprints", func(w http.ResponseWriter, r *http.Request) {
		out := map[string]string{}
		for d, frames := range d.store.Footprints() {
			out[d.String()] = layerfmt.FormatPrefetch(frames)
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(out)
	})
	// Profiles of the live daemon (root-only status socket, or the
	// metrics address when one is configured): what docs/fetching.md's
	// cold-read numbers were found with.
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	mux.HandleFunc("/status", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(d.status())
	})
	return mux
}

// Status is what /status serves and `containerd-envsnap status` prints.
type Status struct {
	Layers   []LayerStatus    `json:"layers"`
	Cache    chunkcache.Stats `json:"cache"`
	Unpacked *unpacked.Stats  `json:"unpacked,omitempty"`
}

// LayerStatus joins the snapshotter's view of a layer mount (which
// snapshots use it) with the data plane's (what has been fetched).
type LayerStatus struct {
	snapshotter.LayerStatus
	Ref          string  `json:"ref,omitempty"`
	BlobSize     int64   `json:"blob_size"`
	FetchedBytes int64   `json:"fetched_bytes"`
	FetchedPct   float64 `json:"fetched_percent"`
}

func (d *daemon) status() Status {
	st := Status{Cache: d.cache.Stats()}
	if d.files != nil {
		us := d.files.Stats()
		st.Unpacked = &us
	}
	data := d.store.Status()
	for _, l := range d.sn.Layers() {
		ls := LayerStatus{LayerStatus: l}
		if m, ok := data[l.Mountpoint]; ok {
			ls.Ref = m.Ref
			ls.BlobSize = m.BlobSize
			ls.FetchedBytes = m.CachedBytes
			if m.TotalBytes > 0 {
				ls.FetchedPct = 100 * float64(m.CachedBytes) / float64(m.TotalBytes)
			}
		}
		st.Layers = append(st.Layers, ls)
	}
	sort.Slice(st.Layers, func(i, j int) bool { return st.Layers[i].Digest < st.Layers[j].Digest })
	return st
}
