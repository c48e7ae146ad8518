// Package daemon wires the envsnap node daemon together: configuration, the
// snapshotter with its lazy layer store, the containerd snapshots gRPC
// service, and the HTTP endpoints for metrics, health and status.
package daemon

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/envsnap/envsnap/internal/diskcap"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/peer"
	"github.com/envsnap/envsnap/internal/tomlconf"
	"github.com/envsnap/envsnap/snapshotter"
)

// Defaults, all in one place.
const (
	DefaultConfigPath = "/etc/envsnap/config.toml"
	DefaultRoot       = "/var/lib/containerd-envsnap"
	DefaultAddress    = "/run/containerd-envsnap/containerd-envsnap.sock"
	DefaultHostsDir   = "/etc/containerd/certs.d"
	DefaultCacheSize  = Size(20 << 30)
	// DefaultPassthroughCacheSize bounds the unpacked copies of fully
	// cached files that the kernel reads directly (passthrough).
	DefaultPassthroughCacheSize = Size(10 << 30)
	// DefaultFrameCacheSize bounds the decoded frames kept in memory for
	// every layer of the node: a cold go test of the headline workload
	// decoded its task layer's 43-87 frames 1,200-2,000 times with 4 MiB
	// per layer; 128 MiB for the node decoded each once.
	DefaultFrameCacheSize = Size(128 << 20)
	// DefaultPassthroughMinSize: smaller files stay on the chunk path,
	// where the page cache (kept across opens) already serves repeat
	// reads; a copy per small file would cost an inode and a build for
	// one FUSE round trip saved per cold open.
	DefaultPassthroughMinSize = Size(64 << 10)
	DefaultReadTimeout        = Duration(30 * time.Second)
	// DefaultLazyMinSize: layers under 2 MiB are unpacked by containerd.
	// The first lazy read of any file fetches a whole frame (up to 2 MiB
	// of tar) and 1 MiB of read-ahead, and on the benchmark's link
	// (1 Gbit/s, 20 ms) such a blob downloads in 17 ms: less than the
	// round trip for the TOC a lazy mount needs first. A FUSE lower
	// costs more: overlayfs looks every name up in each lower above the
	// one holding it, so a small layer on top of the stack (a task's
	// patch, an evaluator) puts a daemon round trip in front of the first
	// lookup of every path of the container (docs/snapshotter.md, "Small
	// layers are not lazy").
	DefaultLazyMinSize = Size(2 << 20)
	// DefaultFillDelay: none. A fill starting at mount time used to
	// double the cold start on the 2-core test machine (its receiving,
	// verification and cache writes took the CPU the container start
	// needed), which a 3 s delay hid; the fill now yields to foreground
	// work node-wide (see fetch.Layer.StartFill), BenchmarkColdStart.
	DefaultFillDelay = Duration(0)
	// DefaultServeNice: nice -10 took the mean latency of a FUSE round
	// trip on a saturated 2-core node from 475 us to 124 us and its p99
	// from 7.2 ms to 1.4 ms (TestBenchRoundTripNice, docs/lazyfs.md).
	DefaultServeNice = -10
	// DefaultWritableDiskLimit: a hard cap by default, so that a writer
	// fails at its cap instead of filling the node's disk between two
	// measurements of the shim's watcher; it costs a sparse file, mkfs
	// and a loop mount per container start (docs/snapshotter.md, "Disk
	// cap of the writable layer").
	DefaultWritableDiskLimit = Size(20 << 30)
	DefaultLogLevel          = "info"
	// StatusSocketSuffix is appended to the gRPC address for the local
	// HTTP socket that serves /status, /footprints, /healthz and
	// /metrics, so the status command finds a daemon from its address
	// alone.
	StatusSocketSuffix = ".http"
)

// Config is the daemon configuration (TOML, see config.toml in docs).
type Config struct {
	// Root holds snapshots, their metadata, the layer mounts and the cache.
	Root string `toml:"root"`
	// Address is the unix socket containerd's proxy plugin connects to.
	Address string `toml:"address"`
	// HostsDir is a containerd certs.d tree (hosts.toml per registry).
	HostsDir string `toml:"hosts_dir"`
	// HintSources lists the registry hosts ("registry.example.com") and
	// repository prefixes ending in "/" that a layer's hint annotations
	// may send the daemon to, with its credentials, when no client named
	// the image (see registry.SourcePolicy). Unset means every registry
	// with its own directory in HostsDir; an empty list allows none.
	HintSources []string `toml:"hint_sources"`
	// DockerConfig is a docker config.json for registry credentials;
	// empty means $DOCKER_CONFIG/config.json or ~/.docker/config.json.
	DockerConfig string `toml:"docker_config"`
	// MetricsAddress is a TCP address (host:port) serving /metrics alone;
	// empty disables it. A port without a host (":9166") listens on
	// 127.0.0.1, not on every interface: give the host (e.g.
	// "0.0.0.0:9166") to expose it. /status, /footprints and /healthz are
	// served only on the root-only unix socket Address+StatusSocketSuffix
	// (with /metrics).
	MetricsAddress string `toml:"metrics_address"`
	// CacheDir defaults to <Root>/cache.
	CacheDir string `toml:"cache_dir"`
	// CacheSize bounds the node chunk cache ("20GiB", "512MiB", bytes).
	CacheSize Size `toml:"cache_size"`
	// FrameCacheSize bounds the decoded frames kept in memory, shared by
	// every layer (0: a few MiB per layer). The daemon's Go memory limit
	// grows by as much.
	FrameCacheSize Size `toml:"frame_cache_size"`
	// Passthrough lets the kernel read files of at least
	// PassthroughMinSize directly from a local copy (FUSE passthrough,
	// Linux 6.9+; older kernels ignore it): with NativeLowers the file of
	// the layer's complete native copy; without, a decompressed copy of
	// the file alone, built once its chunks are all in the chunk cache (in
	// <Root>/unpacked, emptied at start, bounded by PassthroughCacheSize).
	// Off by default: a mount that may hand out copies must see every
	// open, two round trips to the daemon each (open and release), where
	// one without answers the first open with ENOSYS and the kernel opens
	// the rest itself (docs/lazyfs.md, "Opens, closes and seeks"); copies
	// only serve containers that started before their layer was complete.
	Passthrough          bool `toml:"passthrough"`
	PassthroughMinSize   Size `toml:"passthrough_min_size"`
	PassthroughCacheSize Size `toml:"passthrough_cache_size"`
	// NativeLowers builds a plain directory copy of every layer whose
	// chunks are all in the chunk cache (in <Root>/native, kept across
	// restarts) and gives it to containers started afterwards as their
	// overlay lower directory instead of the FUSE mount. The copies share
	// CacheSize with the chunks and are dropped first when it is short.
	NativeLowers bool `toml:"native_lowers"`
	// Fill starts fetching a layer's remaining chunks in the background
	// as soon as it is mounted.
	Fill bool `toml:"fill"`
	// FillDelay postpones the background fill after a layer is mounted.
	// The fill yields to foreground work by itself, so 0 is the default.
	FillDelay Duration `toml:"fill_delay"`
	// FillPolicy says when the background fill yields to foreground work
	// of the node.
	FillPolicy FillPolicyConfig `toml:"fill_policy"`
	// ServeNice is the nice value of the daemon's threads (-20 to 19; 0
	// leaves them as started): every file-system request of a running
	// environment is a round trip through one, which on a node whose
	// cores the environments keep busy waits for a core behind them
	// unless it outranks them (idleprio.RaiseForeground). Background
	// work (fill, native copies) still runs at idle priority. Under
	// systemd on cgroup v2 the service's CPUWeight ranks the daemon
	// against the containers instead.
	ServeNice int `toml:"serve_nice"`
	// PrefetchPolicy shapes the fetches of a layer's prefetch list.
	PrefetchPolicy PrefetchPolicyConfig `toml:"prefetch_policy"`
	// Eager fetches every layer completely before serving it (on-demand
	// fetching off).
	Eager bool `toml:"eager"`
	// LazyMinSize: layers whose blob is smaller are not served lazily;
	// containerd downloads and unpacks them as it would for overlayfs
	// (0: every layer in our format is lazy). See DefaultLazyMinSize.
	LazyMinSize Size `toml:"lazy_min_size"`
	// ReadTimeout bounds one FUSE read; a read that cannot be served in
	// time fails with EIO.
	ReadTimeout Duration `toml:"read_timeout"`
	// WritableDiskLimit gives every container's writable layer a hard
	// size (DefaultWritableDiskLimit; 0 for none): its upper and work
	// directories live on an ext4 file system of that size, loop-mounted
	// for the container (internal/diskcap), and writing past it fails
	// with ENOSPC. A container's snapshot label
	// containerd.io/snapshot/envsnap.disk-limit (bytes; 0 for none)
	// overrides it. WritableInodeLimit caps the files of such a layer (0:
	// one inode per 16 KiB). WritableDiskReserve is the percentage of the
	// root's file system that no layer may take: a cap larger than the
	// free space beyond it shrinks to that space when the layer is made.
	WritableDiskLimit   Size  `toml:"writable_disk_limit"`
	WritableInodeLimit  int64 `toml:"writable_inode_limit"`
	WritableDiskReserve int   `toml:"writable_disk_reserve"`
	// WritableVolatile mounts every container's writable layer with
	// overlayfs' volatile option (snapshotter.WithVolatileWritable): no
	// sync of the container's writes reaches the disk, and a layer that
	// was mounted when the host went down is refused afterwards.
	WritableVolatile bool `toml:"writable_volatile"`
	// LogLevel is one of trace, debug, info, warn, error.
	LogLevel string `toml:"log_level"`
	// Peers is the cluster tier: nodes fetch frames from each other
	// before the registry (off by default).
	Peers PeerConfig `toml:"peers"`

	// KeeperCommand starts the descriptor keeper, which keeps layer
	// mounts alive across restarts of the daemon, when none answers on
	// KeeperSocket: the command with `fdstore --socket <KeeperSocket>`
	// appended. Its first word is the containerd-envsnap binary, or a
	// launcher ending in it that hands the keeper to a service manager
	// (under Kubernetes: nsenter into the host and systemd-run, so the
	// keeper outlives the pod; fdstore.Start). Set by the serve command,
	// not the file; empty runs without a keeper (mounts then die with the
	// daemon).
	KeeperCommand []string `toml:"-"`
	// NativeBuildCommand is the containerd-envsnap binary that builds
	// native layer copies, each in a process of its own
	// (native.Store.SetBuildCommand). Set by the serve command, not the
	// file; empty builds them in the daemon's process.
	NativeBuildCommand []string `toml:"-"`
}

// WritableCap is the disk cap of container snapshots.
func (c *Config) WritableCap() diskcap.Limits {
	return diskcap.Limits{Bytes: int64(c.WritableDiskLimit), Inodes: c.WritableInodeLimit}
}

// PeerConfig configures the peer tier (internal/peer). Exactly one member
// source is used: Members, DNS or MembersFile. At least one of TokenFile
// and the TLS files is required.
type PeerConfig struct {
	Enabled bool `toml:"enabled"`
	// Listen is the peer server's TCP address (default ":9168", every
	// interface: other nodes must reach it).
	Listen string `toml:"listen"`
	// Advertise is this node's address as the member list names it;
	// empty: the member whose host is one of the node's addresses and
	// whose port is Listen's.
	Advertise string `toml:"advertise"`
	// Members is a static list of host:port, this node included.
	Members []string `toml:"members"`
	// DNS is the name of a headless Service: its SRV records, or its A
	// records with Listen's port, refreshed every Refresh.
	DNS string `toml:"dns"`
	// DNSServer, when set (host:port), is the DNS server DNS is looked
	// up with instead of the node's resolv.conf: a DaemonSet on the host
	// network resolves registries like the node (dnsPolicy Default) and
	// reaches cluster DNS names only by asking the cluster DNS service.
	DNSServer string `toml:"dns_server"`
	// MembersFile lists host:port one a line, read again every Refresh.
	MembersFile string   `toml:"members_file"`
	Refresh     Duration `toml:"refresh"`
	// TokenFile holds the shared bearer token (a mounted Secret); read
	// again when it changes.
	TokenFile string `toml:"token_file"`
	// TLSCert and TLSKey are this node's certificate, presented to peers
	// as server and as client; TLSCA signs every peer's; TLSServerName is
	// the name their certificates carry (peer.DefaultTLSServerName).
	TLSCert       string `toml:"tls_cert"`
	TLSKey        string `toml:"tls_key"`
	TLSCA         string `toml:"tls_ca"`
	TLSServerName string `toml:"tls_server_name"`
	// HedgeAfter (the least hedge delay), Timeout (the longest a
	// request to a peer may go without progress) and BadFor: see
	// peer.Options.
	HedgeAfter Duration `toml:"hedge_after"`
	Timeout    Duration `toml:"timeout"`
	BadFor     Duration `toml:"bad_for"`
	// MaxServing bounds the peers' requests this node answers at once
	// (0: peer.DefaultMaxServing); past it they are refused at once and
	// read from the registry.
	MaxServing int `toml:"max_serving"`
}

// FillPolicyConfig holds fetch.FillPolicy: a fill batch waits while a
// foreground read waits on the network and Quiet after it; AfterMount
// after a mount; within Startup of a mount, Quiet after any file-system
// operation; the second and third workers Calm after any read; and the first worker, held MaxPause, sends
// one batch anyway. A layer of at most SmallLayer is fetched whole at its
// first miss. The
// defaults (fetch.DefaultFillPolicy) were measured on 2-core nodes with a
// 1 Gbit/s link, each for the reason docs/fetching.md ("Background fill")
// gives; a node with more cores to spare may shorten them.
type FillPolicyConfig struct {
	Quiet      Duration `toml:"quiet"`
	AfterMount Duration `toml:"after_mount"`
	Startup    Duration `toml:"startup"`
	Calm       Duration `toml:"calm"`
	MaxPause   Duration `toml:"max_pause"`
	// FreeCPU is read so that configurations written for earlier
	// daemons still load, and ignored with a warning (FreeCPUIgnored):
	// the fill no longer waits for idle cores, its work runs at idle
	// priority (idleprio).
	FreeCPU float64 `toml:"free_cpu"`
	// SmallLayer is in compressed bytes; 0 turns it off.
	SmallLayer Size `toml:"small_layer"`
}

func defaultFillPolicy() FillPolicyConfig {
	p := fetch.DefaultFillPolicy()
	return FillPolicyConfig{
		Quiet:      Duration(p.Quiet),
		AfterMount: Duration(p.AfterMount),
		Startup:    Duration(p.Startup),
		Calm:       Duration(p.Calm),
		MaxPause:   Duration(p.MaxPause),
		SmallLayer: Size(p.SmallLayer),
	}
}

// FreeCPUIgnored reports whether the configuration sets free_cpu, which
// the daemon no longer uses.
func (c FillPolicyConfig) FreeCPUIgnored() bool { return c.FreeCPU != 0 }

// Policy returns the fill policy these durations make.
func (c FillPolicyConfig) Policy() fetch.FillPolicy {
	p := fetch.DefaultFillPolicy()
	p.Quiet = time.Duration(c.Quiet)
	p.AfterMount = time.Duration(c.AfterMount)
	p.Startup = time.Duration(c.Startup)
	p.Calm = time.Duration(c.Calm)
	p.MaxPause = time.Duration(c.MaxPause)
	p.SmallLayer = int64(c.SmallLayer)
	return p
}

func (c FillPolicyConfig) validate() error {
	if c.Quiet < 0 || c.AfterMount < 0 || c.Startup < 0 || c.Calm < 0 || c.MaxPause < 0 {
		return fmt.Errorf("fill_policy %+v: durations must not be negative", c)
	}
	if c.SmallLayer < 0 {
		return fmt.Errorf("fill_policy: small_layer %d: must not be negative", c.SmallLayer)
	}
	return nil
}

// PrefetchPolicyConfig holds fetch.PrefetchPolicy: the list is taken in
// windows of Window compressed bytes, each sorted by offset and coalesced
// into requests of up to Batch; Parallel requests of one layer and
// Inflight of the node are in flight at once, each sent no earlier than
// Lead before its first frame was read in the recorded run. The defaults
// (fetch.DefaultPrefetchPolicy) fill the 1 Gbit/s, 20 ms link they were
// measured on (docs/fetching.md, "Prefetch lists").
type PrefetchPolicyConfig struct {
	Window   Size     `toml:"window"`
	Batch    Size     `toml:"batch"`
	Parallel int      `toml:"parallel"`
	Inflight int      `toml:"inflight"`
	Lead     Duration `toml:"lead"`
}

func defaultPrefetchPolicy() PrefetchPolicyConfig {
	p := fetch.DefaultPrefetchPolicy()
	return PrefetchPolicyConfig{Window: Size(p.Window), Batch: Size(p.Batch), Parallel: p.Parallel, Inflight: p.Inflight, Lead: Duration(p.Lead)}
}

// Policy returns the prefetch policy these values make.
func (c PrefetchPolicyConfig) Policy() fetch.PrefetchPolicy {
	return fetch.PrefetchPolicy{Window: int64(c.Window), Batch: int64(c.Batch), Parallel: c.Parallel, Inflight: c.Inflight, Lead: time.Duration(c.Lead)}
}

func (c PrefetchPolicyConfig) validate() error {
	if c.Window <= 0 || c.Batch <= 0 || c.Parallel < 1 || c.Inflight < 1 || c.Lead < 0 {
		return fmt.Errorf("prefetch_policy %+v: window and batch must be positive, parallel and inflight at least 1, lead not negative", c)
	}
	return nil
}

// Defaults of the peer tier the daemon adds to peer's own.
const (
	DefaultPeerListen  = ":9168"
	DefaultPeerRefresh = Duration(10 * time.Second)
)

func (p *PeerConfig) validate() error {
	if !p.Enabled {
		return nil
	}
	if p.Listen == "" {
		p.Listen = DefaultPeerListen
	}
	if _, err := net.ResolveTCPAddr("tcp", p.Listen); err != nil {
		return fmt.Errorf("peers.listen %q: %w", p.Listen, err)
	}
	sources := 0
	for _, set := range []bool{len(p.Members) > 0, p.DNS != "", p.MembersFile != ""} {
		if set {
			sources++
		}
	}
	if sources != 1 {
		return fmt.Errorf("peers: set exactly one of members, dns and members_file")
	}
	if p.DNSServer != "" {
		if _, err := peer.ValidateAddress(p.DNSServer); err != nil {
			return fmt.Errorf("peers.dns_server: %w", err)
		}
	}
	for _, m := range p.Members {
		if _, err := peer.ValidateAddress(m); err != nil {
			return fmt.Errorf("peers.members: %w", err)
		}
	}
	tls := p.TLSCert != "" || p.TLSKey != "" || p.TLSCA != ""
	if tls && (p.TLSCert == "" || p.TLSKey == "" || p.TLSCA == "") {
		return fmt.Errorf("peers: tls_cert, tls_key and tls_ca go together")
	}
	if !tls && p.TokenFile == "" {
		return fmt.Errorf("peers: set token_file or the TLS files: peers must authenticate each other")
	}
	if p.Refresh == 0 {
		p.Refresh = DefaultPeerRefresh
	}
	if p.Refresh < 0 || p.HedgeAfter < 0 || p.Timeout < 0 || p.BadFor < 0 {
		return fmt.Errorf("peers: durations must not be negative")
	}
	if p.Timeout != 0 && time.Duration(p.Timeout) < 2*peer.DefaultProgressEvery {
		// Owners report progress every DefaultProgressEvery while they
		// fetch: a shorter timeout would give up on every owner that
		// has to fetch what it was asked for.
		return fmt.Errorf("peers.timeout %s: must be at least %s (owners report progress every %s)", time.Duration(p.Timeout), 2*peer.DefaultProgressEvery, peer.DefaultProgressEvery)
	}
	if p.MaxServing < 0 {
		return fmt.Errorf("peers.max_serving %d: must not be negative", p.MaxServing)
	}
	return nil
}

// DefaultConfig returns the configuration used when nothing is set.
func DefaultConfig() Config {
	return Config{
		Root:                 DefaultRoot,
		Address:              DefaultAddress,
		HostsDir:             DefaultHostsDir,
		CacheSize:            DefaultCacheSize,
		FrameCacheSize:       DefaultFrameCacheSize,
		Passthrough:          false,
		PassthroughMinSize:   DefaultPassthroughMinSize,
		PassthroughCacheSize: DefaultPassthroughCacheSize,
		NativeLowers:         true,
		Fill:                 true,
		FillDelay:            DefaultFillDelay,
		FillPolicy:           defaultFillPolicy(),
		ServeNice:            DefaultServeNice,
		PrefetchPolicy:       defaultPrefetchPolicy(),
		ReadTimeout:          DefaultReadTimeout,
		LazyMinSize:          DefaultLazyMinSize,
		WritableDiskLimit:    DefaultWritableDiskLimit,
		WritableDiskReserve:  snapshotter.DefaultWritableReserve,
		WritableVolatile:     true,
		LogLevel:             DefaultLogLevel,
	}
}

// LoadConfig reads path over the defaults. A missing file at the default
// path is not an error (the daemon runs on defaults and flags); a missing
// file that was asked for explicitly is.
func LoadConfig(path string, explicit bool) (Config, error) {
	cfg := DefaultConfig()
	b, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) && !explicit {
			return cfg, nil
		}
		return cfg, fmt.Errorf("read config: %w", err)
	}
	if err := tomlconf.Decode(bytes.NewReader(b), &cfg); err != nil {
		return cfg, fmt.Errorf("parse config %s: %w", path, err)
	}
	return cfg, nil
}

// Validate checks the configuration and fills derived defaults.
func (c *Config) Validate() error {
	if c.Root == "" || !filepath.IsAbs(c.Root) {
		return fmt.Errorf("root %q: must be an absolute path", c.Root)
	}
	if c.Address == "" {
		return fmt.Errorf("address must be set")
	}
	if c.CacheDir == "" {
		c.CacheDir = filepath.Join(c.Root, "cache")
	}
	if c.CacheSize <= 0 {
		return fmt.Errorf("cache_size must be positive")
	}
	if c.FrameCacheSize < 0 {
		return fmt.Errorf("frame_cache_size must not be negative")
	}
	if c.Passthrough && (c.PassthroughCacheSize <= 0 || c.PassthroughMinSize < 0) {
		return fmt.Errorf("passthrough_cache_size must be positive and passthrough_min_size not negative")
	}
	if _, err := diskcap.FromLabels(nil, c.WritableCap()); err != nil || c.WritableInodeLimit < 0 {
		return fmt.Errorf("writable_disk_limit %d, writable_inode_limit %d: want 0 (none) or at least %d bytes, and a non-negative number of files", c.WritableDiskLimit, c.WritableInodeLimit, diskcap.MinBytes)
	}
	if c.WritableDiskReserve < 0 || c.WritableDiskReserve >= 100 {
		return fmt.Errorf("writable_disk_reserve %d: want a percentage from 0 to 99", c.WritableDiskReserve)
	}
	if c.FillDelay < 0 {
		return fmt.Errorf("fill_delay must not be negative")
	}
	if c.ServeNice < -20 || c.ServeNice > 19 {
		return fmt.Errorf("serve_nice %d: want a nice value from -20 to 19", c.ServeNice)
	}
	if err := c.FillPolicy.validate(); err != nil {
		return err
	}
	if err := c.PrefetchPolicy.validate(); err != nil {
		return err
	}
	if c.ReadTimeout <= 0 {
		return fmt.Errorf("read_timeout must be positive")
	}
	if c.LazyMinSize < 0 {
		return fmt.Errorf("lazy_min_size must not be negative")
	}
	if err := c.Peers.validate(); err != nil {
		return err
	}
	if c.MetricsAddress != "" {
		host, port, err := net.SplitHostPort(c.MetricsAddress)
		if err != nil {
			return fmt.Errorf("metrics_address %q: %w", c.MetricsAddress, err)
		}
		if host == "" {
			c.MetricsAddress = net.JoinHostPort("127.0.0.1", port)
		}
	}
	return nil
}

// StatusSocket is the local HTTP socket of a daemon serving address.
func StatusSocket(address string) string { return address + StatusSocketSuffix }

// KeeperSocketSuffix is appended to the gRPC address for the socket of the
// descriptor keeper, so a restarted daemon finds its predecessor's.
const KeeperSocketSuffix = ".fdstore"

// KeeperSocket returns the descriptor keeper's socket for a daemon address.
func KeeperSocket(address string) string { return address + KeeperSocketSuffix }

// Size is a byte count written as an integer or with a binary or decimal
// unit suffix ("10GiB", "500MB").
type Size int64

// UnmarshalText implements encoding.TextUnmarshaler.
func (s *Size) UnmarshalText(b []byte) error {
	v, err := ParseSize(string(b))
	if err != nil {
		return err
	}
	*s = Size(v)
	return nil
}

// String formats s in the largest binary unit that divides it.
func (s Size) String() string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v, i := int64(s), 0
	for i < len(units)-1 && v != 0 && v%1024 == 0 {
		v /= 1024
		i++
	}
	return strconv.FormatInt(v, 10) + units[i]
}

// ParseSize parses "1048576", "512MiB", "20GiB", "1.5GB".
func ParseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	mult := []struct {
		suffix string
		n      float64
	}{
		{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
		{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
		{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40}, {"B", 1},
	}
	for _, m := range mult {
		if num, ok := strings.CutSuffix(s, m.suffix); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(num), 64)
			if err != nil || f < 0 {
				return 0, fmt.Errorf("invalid size %q", s)
			}
			return int64(f * m.n), nil
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	return n, nil
}

// Duration is a time.Duration written as a Go duration string ("30s").
type Duration time.Duration

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("invalid duration %q: %w", b, err)
	}
	*d = Duration(v)
	return nil
}

// String formats d like time.Duration.
func (d Duration) String() string { return time.Duration(d).String() }
