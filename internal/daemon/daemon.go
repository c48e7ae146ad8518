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
	"strings"
	"sync/atomic"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/contrib/snapshotservice"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/fdstore"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/idleprio"
	"github.com/envsnap/envsnap/internal/layerstore"
	"github.com/envsnap/envsnap/internal/native"
	"github.com/envsnap/envsnap/internal/peer"
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
	// Before any background job lowers a thread: a lowered thread gets
	// back the nice value it had when it was lowered.
	if cfg.ServeNice != 0 {
		if err := idleprio.RaiseForeground(cfg.ServeNice); err != nil {
			log.G(ctx).WithError(err).Warn("file-system requests are served at the default priority")
		}
	}
	// The root first: everything below (the metadata database, the
	// cache, the layer mounts, the keeper) belongs to one daemon, and a
	// second one must learn that before it waits on any of them.
	rootLock, err := claimRoot(cfg.Root, cfg.Address)
	if err != nil {
		return err
	}
	defer rootLock.Close()
	lock, err := claimAddress(cfg.Address)
	if err != nil {
		return err
	}
	defer lock.Close()

	// The status socket answers from the start, /healthz with 503 until
	// the restore below is done; the gRPC socket appears only then.
	reg := prometheus.NewRegistry()
	d := &daemon{}
	d.phase.Store("restoring layer mounts")
	var servers []*http.Server
	errc := make(chan error, 4)
	serveHTTP := func(l net.Listener, h http.Handler) {
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("serve http on %s: %w", l.Addr(), err)
			}
		}()
	}
	defer func() {
		shutCtx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		for _, srv := range servers {
			srv.Shutdown(shutCtx)
		}
		os.Remove(StatusSocket(cfg.Address))
	}()
	statusL, err := listenUnix(StatusSocket(cfg.Address))
	if err != nil {
		return err
	}
	serveHTTP(statusL, d.handler(reg))
	if cfg.MetricsAddress != "" {
		// Only the metrics: the TCP address is reachable from wherever
		// the node's address is (containers included, under host
		// networking), and status and footprints name the images of the
		// node and what their workloads read.
		l, err := net.Listen("tcp", cfg.MetricsAddress)
		if err != nil {
			return fmt.Errorf("listen on metrics address: %w", err)
		}
		serveHTTP(l, metricsHandler(reg))
	}

	cache, err := chunkcache.Open(cfg.CacheDir, int64(cfg.CacheSize))
	if err != nil {
		return err
	}
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), cache.Collector())

	fetchMetrics, err := fetch.NewMetrics(reg)
	if err != nil {
		return fmt.Errorf("register fetch metrics: %w", err)
	}
	var keeper *fdstore.Client
	if len(cfg.KeeperCommand) > 0 {
		// Without the keeper the daemon still serves; only restarts
		// then break running containers.
		sock := KeeperSocket(cfg.Address)
		args := append(cfg.KeeperCommand[1:len(cfg.KeeperCommand):len(cfg.KeeperCommand)], "fdstore", "--socket", sock)
		if keeper, err = fdstore.Start(ctx, sock, cfg.KeeperCommand[0], args...); err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("start-up interrupted: %w", err)
			}
			log.G(ctx).WithError(err).Error("no descriptor keeper: layer mounts will not survive a restart of the daemon")
			keeper = nil
		} else {
			defer keeper.Close()
		}
	}
	hosts := registry.ConfigureHosts(ctx, registry.Options{HostsDir: cfg.HostsDir, DockerConfig: cfg.DockerConfig})
	var files *unpacked.Store
	if cfg.Passthrough && !cfg.NativeLowers {
		// With native lowers, passthrough hands out the files of the
		// native copies instead (layerstore.Config.Passthrough).
		if files, err = unpacked.Open(filepath.Join(cfg.Root, "unpacked"), int64(cfg.PassthroughCacheSize)); err != nil {
			return err
		}
		defer files.Close()
	}
	var copies *native.Store
	if cfg.NativeLowers {
		if copies, err = native.Open(ctx, filepath.Join(cfg.Root, "native"), cache); err != nil {
			return err
		}
		defer copies.Close()
		copies.SetBuildCommand(cfg.NativeBuildCommand)
		cache.SetTenant(copies)
	}
	peers, err := d.startPeerClient(ctx, cfg.Peers, reg)
	if err != nil {
		return err
	}
	var frames *fetch.FrameCache
	if cfg.FrameCacheSize > 0 {
		frames = fetch.NewFrameCache(int64(cfg.FrameCacheSize))
	}
	if cfg.FillPolicy.FreeCPUIgnored() {
		log.G(ctx).Warn("fill_policy.free_cpu is ignored: the background fill and native copies run at idle CPU and I/O priority instead of waiting for idle cores (docs/fetching.md)")
	}
	store, err := layerstore.New(layerstore.Config{
		Hosts:              hosts,
		Cache:              cache,
		Fill:               cfg.Fill,
		FillDelay:          time.Duration(cfg.FillDelay),
		FillPolicy:         cfg.FillPolicy.Policy(),
		PrefetchPolicy:     cfg.PrefetchPolicy.Policy(),
		Eager:              cfg.Eager,
		LazyMinSize:        int64(cfg.LazyMinSize),
		ReadTimeout:        time.Duration(cfg.ReadTimeout),
		Registerer:         reg,
		FetchMetrics:       fetchMetrics,
		Peers:              peers,
		Keeper:             keeper,
		FrameCache:         frames,
		Passthrough:        cfg.Passthrough,
		PassthroughMinSize: int64(cfg.PassthroughMinSize),
		Unpacked:           files,
		Native:             copies,
		Sources:            registry.SourcePolicy{Allowed: cfg.HintSources, HostsDir: cfg.HostsDir},
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
	if err := ctx.Err(); err != nil {
		// Told to stop while restoring: what was not taken over stays
		// with the keeper for the next daemon.
		return fmt.Errorf("start-up interrupted while restoring layer mounts: %w", err)
	}
	sn, err := snapshotter.New(ctx, cfg.Root, store, snapshotter.WithWritableCap(cfg.WritableCap()),
		snapshotter.WithWritableReserve(cfg.WritableDiskReserve),
		snapshotter.WithVolatileWritable(cfg.WritableVolatile),
		snapshotter.WithHealInterval(time.Duration(cfg.ReadTimeout)))
	if err != nil {
		return fmt.Errorf("open snapshotter: %w", err)
	}
	if copies != nil {
		copies.SetInUse(sn.NativeInUse)
	}
	if peers != nil {
		if err := d.servePeers(ctx, cfg.Peers, store.PeerSource(), errc); err != nil {
			return err
		}
	}
	unmountOrphans(ctx, sn, store, restored)
	defer func() {
		if err := sn.Close(); err != nil {
			log.G(ctx).WithError(err).Error("close snapshotter")
		}
	}()

	d.sn, d.store, d.cache, d.files, d.native = sn, store, cache, files, copies

	// The gRPC socket appears last: containerd and start scripts take its
	// existence to mean the daemon is ready, so /healthz says so first.
	grpcSrv := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(grpcSrv, snapshotservice.FromSnapshotter(sn))
	d.ready.Store(true)
	grpcL, err := listenUnix(cfg.Address)
	if err != nil {
		d.phase.Store("failed to listen")
		d.ready.Store(false)
		return err
	}
	go func() {
		if err := grpcSrv.Serve(grpcL); err != nil {
			errc <- fmt.Errorf("serve grpc: %w", err)
		}
	}()
	log.G(ctx).WithField("address", cfg.Address).WithField("root", cfg.Root).WithField("metrics", cfg.MetricsAddress).Info("containerd-envsnap serving")

	var runErr error
	select {
	case <-ctx.Done():
		log.G(ctx).Info("shutting down")
	case runErr = <-errc:
		log.G(ctx).WithError(runErr).Error("server failed; shutting down")
	}
	d.phase.Store("shutting down")
	d.ready.Store(false)

	stopped := make(chan struct{})
	go func() { grpcSrv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(shutdownGrace):
		grpcSrv.Stop()
	}
	os.Remove(cfg.Address)
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

// rootLockName is the file in the root a daemon holds a lock on while it
// runs; it says which process that is (its pid and address).
const rootLockName = "daemon.lock"

// claimRoot makes this process the only daemon using root, for as long as
// the returned file stays open (the kernel releases the lock when the
// process dies, SIGKILL included). Without it a second daemon with another
// address would wait forever on the metadata database's lock, having
// started a keeper of its own. The holder's pid and address are written
// into the file, so the second one can say who holds the root.
func claimRoot(root, address string) (*os.File, error) {
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("create root: %w", err)
	}
	path := filepath.Join(root, rootLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open root lock %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("root %s is in use by another containerd-envsnap (%s): %w", root, readHolder(path), errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("lock root %s: %w", path, err)
	}
	rec := fmt.Sprintf("pid %d, address %s\n", os.Getpid(), address)
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, fmt.Errorf("write root lock %s: %w", path, err)
	}
	if _, err := f.WriteAt([]byte(rec), 0); err != nil {
		f.Close()
		return nil, fmt.Errorf("write root lock %s: %w", path, err)
	}
	return f, nil
}

// readHolder says who holds the root lock at path. The holder writes its
// record just after taking the lock, so an empty file is read again for a
// moment before giving up.
func readHolder(path string) string {
	for i := 0; ; i++ {
		b, err := os.ReadFile(path)
		if rec := strings.TrimSpace(string(b)); err == nil && rec != "" {
			return rec
		}
		if i == 10 {
			return "holder not recorded"
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// claimAddress makes this process the only daemon serving address, for as
// long as the returned lock file stays open (the kernel releases it when
// the process dies, SIGKILL included). A second daemon fails here with a
// clear error instead of taking the sockets of the first. The socket files
// a killed daemon left are removed at once: the restore that follows can
// take a while, and until the new sockets are created their existence must
// not suggest that something listens.
func claimAddress(address string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	lockPath := address + ".lock"
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock %s: %w", lockPath, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("another containerd-envsnap serves %s (it holds %s): %w", address, lockPath, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("lock %s: %w", lockPath, err)
	}
	for _, p := range []string{address, StatusSocket(address)} {
		// A daemon that does not take the lock (an older version) may
		// still be serving: never remove a socket that answers.
		if c, err := net.DialTimeout("unix", p, time.Second); err == nil {
			c.Close()
			f.Close()
			return nil, fmt.Errorf("another process serves %s: %w", p, errdefs.ErrAlreadyExists)
		}
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			f.Close()
			return nil, fmt.Errorf("remove stale socket %s: %w", p, err)
		}
	}
	return f, nil
}

// listenUnix listens on a unix socket readable only by root (the snapshot
// API can mount anything anywhere), at a path claimAddress cleared.
func listenUnix(path string) (net.Listener, error) {
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

// metricsHandler serves the Prometheus metrics alone, for the TCP metrics
// address: counters and gauges of the cache, fetches and FUSE operations
// (per layer digest), no image references, paths or footprints.
func metricsHandler(reg *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

// daemon serves the HTTP endpoints of the status socket. Its fields are
// set before ready is first stored true, and read only when ready is true.
type daemon struct {
	sn     *snapshotter.Snapshotter
	store  *layerstore.Store
	cache  *chunkcache.Cache
	files  *unpacked.Store // nil without passthrough
	native *native.Store   // nil without native lowers
	peers  *peerTier       // nil without peers
	ready  atomic.Bool
	phase  atomic.Value // string: why not ready
}

func (d *daemon) handler(reg *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", d.whenReady(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	}))
	mux.HandleFunc("/footprints", d.whenReady(func(w http.ResponseWriter, r *http.Request) {
		out := map[string]string{}
		for d, frames := range d.store.Footprints() {
			out[d.String()] = layerfmt.FormatPrefetch(frames)
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(out)
	}))
	// Profiles of the live daemon, on the root-only status socket only:
	// what docs/fetching.md's cold-read numbers were found with.
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	mux.HandleFunc("/status", d.whenReady(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(d.status())
	}))
	return mux
}

// whenReady answers 503 with the reason, like /healthz, until the daemon
// serves (the state h reads does not exist before).
func (d *daemon) whenReady(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !d.ready.Load() {
			http.Error(w, "not ready: "+d.phase.Load().(string), http.StatusServiceUnavailable)
			return
		}
		h(w, r)
	}
}

// Status is what /status serves and `containerd-envsnap status` prints.
type Status struct {
	Layers   []LayerStatus    `json:"layers"`
	Cache    chunkcache.Stats `json:"cache"`
	Unpacked *unpacked.Stats  `json:"unpacked,omitempty"`
	Native   *native.Stats    `json:"native,omitempty"`
	Peers    *peer.Stats      `json:"peers,omitempty"`
}

// LayerStatus joins the snapshotter's view of a layer mount (which
// snapshots and images use it) with the data plane's (what has been
// fetched).
type LayerStatus struct {
	snapshotter.LayerStatus
	// Ref is the image that most recently pulled a snapshot still using
	// the layer (Refs[0]); the image the layer was first mounted for may
	// be long gone.
	Ref          string  `json:"ref,omitempty"`
	BlobSize     int64   `json:"blob_size"`
	FetchedBytes int64   `json:"fetched_bytes"`
	FetchedPct   float64 `json:"fetched_percent"`
	// Environments prepared over the layer since it was mounted (after a
	// restart, those whose snapshots still exist).
	Environments int `json:"environments"`
	// Fill is what the layer's background fill is doing, and since when;
	// a held fill says what it waits for.
	Fill fetch.FillStatus `json:"fill"`
	// Native is where the layer's native copy stands (empty when the
	// daemon builds none).
	Native layerstore.NativeState `json:"native,omitempty"`
}

func (d *daemon) status() Status {
	st := Status{Cache: d.cache.Stats()}
	if d.files != nil {
		us := d.files.Stats()
		st.Unpacked = &us
	}
	if d.native != nil {
		ns := d.native.Stats()
		st.Native = &ns
	}
	if d.peers != nil {
		ps := d.peers.metrics.Stats(len(d.peers.client.Members()))
		st.Peers = &ps
	}
	data := d.store.Status()
	for _, l := range d.sn.Layers() {
		ls := LayerStatus{LayerStatus: l}
		if len(l.Refs) > 0 {
			ls.Ref = l.Refs[0]
		}
		if m, ok := data[l.Mountpoint]; ok {
			ls.BlobSize = m.BlobSize
			ls.FetchedBytes = m.CachedBytes
			ls.Environments = m.Environments
			ls.Fill, ls.Native = m.Fill, m.Native
			if m.TotalBytes > 0 {
				ls.FetchedPct = 100 * float64(m.CachedBytes) / float64(m.TotalBytes)
			}
		}
		st.Layers = append(st.Layers, ls)
	}
	sort.Slice(st.Layers, func(i, j int) bool { return st.Layers[i].Digest < st.Layers[j].Digest })
	return st
}
