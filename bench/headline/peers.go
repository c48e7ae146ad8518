package headline

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/devenv"
)

// PeersConfig is the peer tier's scenario: Nodes nodes, each a network
// namespace with its own containerd and envsnap daemon, the namespaces on
// a bridge, one registry behind the shaped link; every node starts
// EnvsPerNode environments at once from an empty cache, first without
// peers, then with them, in one run.
type PeersConfig struct {
	Tasks       string
	Nodes       int
	EnvsPerNode int
	RTT         time.Duration
	Rate        int64
	Timeout     time.Duration
	NoPrefetch  bool
	// SlowHedgeAfter and SlowTimeout, when set, add a third mode: peers
	// with these hedge_after and timeout instead of the defaults (which
	// assume owners that accept within 200 ms), for a machine whose load
	// delays every daemon.
	SlowHedgeAfter time.Duration
	SlowTimeout    time.Duration
	Log            io.Writer
}

// Peer tier modes, in the order they run.
const (
	NoPeers   = "no peers"
	WithPeers = "peers"
)

// PeersReport is what the scenario measured.
type PeersReport struct {
	Started     time.Time     `json:"started"`
	Duration    time.Duration `json:"duration_ns"`
	Machine     string        `json:"machine"`
	Link        string        `json:"link"`
	Workload    string        `json:"workload"`
	Nodes       int           `json:"nodes"`
	EnvsPerNode int           `json:"envs_per_node"`
	// Load is /proc/loadavg's 1-minute value as each mode started and
	// ended: other work on the machine.
	Load  map[string][2]float64 `json:"load"`
	Modes map[string]PeersMode  `json:"modes"`
	// Order is the modes in the order they ran.
	Order []string `json:"order"`
	// Runs are the environments of both modes.
	Runs    []Run    `json:"runs"`
	Command string   `json:"command"`
	Notes   []string `json:"notes"`
}

// PeersMode is one mode's outcome over every node.
type PeersMode struct {
	RegistryBytes int64            `json:"registry_bytes"` // every blob byte the registry sent
	Ready         Summary          `json:"ready_s"`
	Episode       Summary          `json:"episode_s"`
	Makespan      float64          `json:"makespan_s"`
	Failed        int              `json:"failed"`
	PeerFetched   int64            `json:"peer_fetched_bytes"`
	PeerServed    int64            `json:"peer_served_bytes"`
	Hedges        int64            `json:"hedges"`
	BadMarks      int64            `json:"bad_marks"`
	Outcomes      map[string]int64 `json:"outcomes"` // peer request outcomes over the nodes
}

// peerPort is where each node's peer server listens, on its namespace's
// address: the daemon's default.
const peerPort = "9168"

func (c *PeersConfig) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, format+"\n", args...)
	}
}

// MeasurePeers runs the peer tier's scenario.
func MeasurePeers(ctx context.Context, cfg PeersConfig) (_ *PeersReport, retErr error) {
	if cfg.Nodes < 2 || cfg.EnvsPerNode < 1 {
		return nil, fmt.Errorf("peers scenario: %d nodes of %d environments: want 2 nodes or more, 1 environment or more", cfg.Nodes, cfg.EnvsPerNode)
	}
	rep := &PeersReport{Started: time.Now(), Machine: machine(), Nodes: cfg.Nodes, EnvsPerNode: cfg.EnvsPerNode,
		Load: map[string][2]float64{}, Modes: map[string]PeersMode{}}
	w, err := episode.LoadWorkload(cfg.Tasks)
	if err != nil {
		return nil, err
	}
	rep.Workload = reportPath(cfg.Tasks)

	link, err := netshape.NewLink(ctx, netshape.WithLinkRate(cfg.Rate))
	if err != nil {
		return nil, fmt.Errorf("shaped link: %w", err)
	}
	defer link.Close(context.Background())
	br, err := netshape.NewBridge(ctx, fmt.Sprintf("%speers-%d", netshape.NamePrefix, os.Getpid()), cfg.Nodes)
	if err != nil {
		return nil, fmt.Errorf("node namespaces: %w", err)
	}
	// Deferred before the nodes' Close: runs after their daemons stop.
	defer func() {
		if err := br.Close(context.Background()); err != nil && retErr == nil {
			retErr = err
		}
	}()
	regNet := netshape.NewRegistryNet(ctx, link, cfg.RTT)

	dir, err := os.MkdirTemp("", "envsnap-bench-peers-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(fmt.Sprintf("bench-peer-token-%d\n", time.Now().UnixNano())), 0o600); err != nil {
		return nil, err
	}
	var members []string
	for _, n := range br.Nodes {
		members = append(members, strconv.Quote(net.JoinHostPort(n.Addr.String(), peerPort)))
	}
	// One daemon config per mode; every node has the same (it finds
	// itself in the member list by its namespace's address).
	configs := map[string]string{NoPeers: filepath.Join(dir, "nopeers.toml"), WithPeers: filepath.Join(dir, "peers.toml")}
	if err := os.WriteFile(configs[NoPeers], nil, 0o600); err != nil {
		return nil, err
	}
	peersTOML := fmt.Sprintf("[peers]\nenabled = true\nlisten = \":%s\"\nmembers = [%s]\ntoken_file = %q\n", peerPort, strings.Join(members, ", "), token)
	if err := os.WriteFile(configs[WithPeers], []byte(peersTOML), 0o600); err != nil {
		return nil, err
	}
	rep.Order = []string{NoPeers, WithPeers}
	if cfg.SlowHedgeAfter > 0 || cfg.SlowTimeout > 0 {
		slow := fmt.Sprintf("peers, hedge_after %s, timeout %s", cfg.SlowHedgeAfter, cfg.SlowTimeout)
		configs[slow] = filepath.Join(dir, "peers-slow.toml")
		toml := peersTOML + fmt.Sprintf("hedge_after = %q\ntimeout = %q\n", cfg.SlowHedgeAfter, cfg.SlowTimeout)
		if err := os.WriteFile(configs[slow], []byte(toml), 0o600); err != nil {
			return nil, err
		}
		rep.Order = append(rep.Order, slow)
	}

	nodes := make([]*bench, cfg.Nodes)
	for i, bn := range br.Nodes {
		opts := []devenv.Option{devenv.WithEnvsnap("--config", configs[NoPeers], "--fill=true"), devenv.WithNetNS(bn.Path()),
			devenv.WithDirPrefix("envsnap-bench-"), devenv.WithEnvlet(devenv.EnvletConfig{})}
		if i == 0 {
			opts = append(opts, devenv.WithRegistryNetwork(regNet), devenv.WithRegistryListenIP(br.HostAddr.String()))
		}
		denv, err := devenv.Start(ctx, opts...)
		if err != nil {
			return nil, fmt.Errorf("start node %d: %w", i, err)
		}
		defer denv.Close()
		// Each node's daemon metrics stay in its namespace: the bench
		// reads what it needs from the status socket.
		nodes[i] = &bench{cfg: Config{Timeout: cfg.Timeout, Log: cfg.Log}, env: denv, sys: Envsnap, metrics: "http://127.0.0.1:19166/metrics"}
	}
	reg := nodes[0].env
	for _, b := range nodes[1:] {
		if err := devenv.WriteHostsDir(b.env.HostsDir, reg.Registry.Host); err != nil {
			return nil, err
		}
	}
	rep.Link = fmt.Sprintf("%s; %d nodes, each a network namespace on bridge %s (unshaped)", regNet.Describe(), cfg.Nodes, br.Prefix)

	cfg.logf("publishing groups through the shaped link")
	pub, err := episode.PublishGroups(ctx, reg.Hosts(), reg.Registry.Host, w)
	if err != nil {
		return nil, err
	}
	if !cfg.NoPrefetch {
		cfg.logf("recording footprints with one episode of %s on node 0", w.Tasks[0].ID)
		note, err := nodes[0].recordPrefetch(ctx, pub, w.Tasks[0])
		if err != nil {
			return nil, fmt.Errorf("record prefetch lists: %w", err)
		}
		rep.Notes = append(rep.Notes, note)
	}
	envs, err := composeEnvs(ctx, reg.Hosts(), reg.Registry.Host, pub, w.Tasks, cfg.Nodes*cfg.EnvsPerNode)
	if err != nil {
		return nil, err
	}

	for _, mode := range rep.Order {
		for i, b := range nodes {
			b.env.SetEnvsnapArgs("--config", configs[mode], "--fill=true")
			if err := b.reset(); err != nil {
				return nil, fmt.Errorf("%s: reset node %d: %w", mode, i, err)
			}
		}
		load0 := loadAverage()
		m, rs := runNodes(ctx, cfg, nodes, envs, mode)
		rep.Load[mode] = [2]float64{load0, loadAverage()}
		rep.Modes[mode] = m
		rep.Runs = append(rep.Runs, rs...)
		cfg.logf("%s: registry %s, ready p50 %.2fs p95 %.2fs, episode p50 %.2fs p95 %.2fs, %d failed; from peers %s, %d hedges, %d bad marks; load %.1f -> %.1f",
			mode, mib(m.RegistryBytes), m.Ready.Median, m.Ready.P95, m.Episode.Median, m.Episode.P95, m.Failed,
			mib(m.PeerFetched), m.Hedges, m.BadMarks, load0, rep.Load[mode][1])
	}
	rep.Duration = time.Since(rep.Started)
	return rep, nil
}

// runNodes starts every node's environments at once and waits for them;
// nodes[i] runs envs[k] for k = i, i+len(nodes), ...
func runNodes(ctx context.Context, cfg PeersConfig, nodes []*bench, envs []env, mode string) (PeersMode, []Run) {
	reg := nodes[0].env.Registry
	reg.ResetCounters()
	out := make([]Run, len(envs))
	var wg sync.WaitGroup
	start := time.Now()
	for k, e := range envs {
		b := nodes[k%len(nodes)]
		wg.Go(func() {
			res := episode.Run(ctx, b.env, e.ref, e.task, b.system(Envsnap), cfg.Timeout)
			res.System, res.Phase, res.ImageBytes = Envsnap+"/"+mode, "cold", episode.ImageSize(e.image)
			// Node 0's registry serves every node: per environment
			// bytes cannot be told apart.
			res.RegistryBytes, res.ReadyRegistryBytes = 0, 0
			out[k] = Run{Result: res, Concurrent: true}
			cfg.logf("%s: node %d %-28s ready %6.2fs episode %6.2fs reward %d %s", mode, k%len(nodes), e.name, res.Ready.Seconds(), res.Episode.Seconds(), res.Reward, res.Error)
		})
	}
	wg.Wait()
	m := PeersMode{RegistryBytes: reg.BlobBytesServed(), Makespan: time.Since(start).Seconds(), Outcomes: map[string]int64{}}
	var ready, ep []time.Duration
	for _, r := range out {
		if r.Error != "" {
			m.Failed++
			continue
		}
		ready, ep = append(ready, r.Ready), append(ep, r.Episode)
	}
	m.Ready, m.Episode = summarize(seconds(ready)), summarize(seconds(ep))
	for _, b := range nodes {
		st, err := daemon.GetStatus(ctx, b.env.SnapshotterSocket)
		if err != nil || st.Peers == nil {
			continue
		}
		m.PeerFetched += st.Peers.FetchedBytes
		m.PeerServed += st.Peers.ServedBytes
		m.Hedges += st.Peers.Hedges
		m.BadMarks += st.Peers.BadMarks
		for k, v := range st.Peers.Outcomes {
			m.Outcomes[k] += v
		}
	}
	return m, out
}

// loadAverage is the 1-minute load average (0 when unreadable).
func loadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

// Markers around the peer tier's section of docs/benchmarks.md, below
// KeptMarker: the headline run keeps it, a peers run replaces it.
const (
	peersBegin = "<!-- Peer tier: generated by envsnap-bench -publish -peers; its next such run replaces this section. -->"
	peersEnd   = "<!-- End of the peer tier section. -->"
)

// WriteJSON writes the raw report.
func (rep *PeersReport) WriteJSON(path string) error { return writeJSON(path, rep) }

// WriteMarkdown puts the scenario's section into the report at path,
// replacing the one an earlier run wrote and keeping everything else.
func (rep *PeersReport) WriteMarkdown(path, jsonRel string) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	doc := string(old)
	section := rep.markdown(jsonRel)
	if i, j := strings.Index(doc, peersBegin), strings.Index(doc, peersEnd); i >= 0 && j > i {
		doc = doc[:i] + section + doc[j+len(peersEnd):]
	} else if i := strings.Index(doc, KeptMarker); i >= 0 {
		at := i + len(KeptMarker)
		doc = doc[:at] + "\n\n" + section + doc[at:]
	} else {
		doc = strings.TrimRight(doc, "\n") + "\n\n" + KeptMarker + "\n\n" + section + "\n"
	}
	return os.WriteFile(path, []byte(doc), 0o644)
}

func (rep *PeersReport) markdown(jsonRel string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n\n## Peer tier: %d nodes x %d environments, with and without peers\n\n", peersBegin, rep.Nodes, rep.EnvsPerNode)
	fmt.Fprintf(&b, "Generated by `make bench` (`%s`) on %s in %s. Raw data: `%s`.\n\n",
		rep.Command, rep.Started.UTC().Format("2006-01-02 15:04 MST"), rep.Duration.Round(time.Second), jsonRel)
	fmt.Fprintf(&b, "%d nodes on one machine, each a network namespace with its own containerd, envsnap daemon (background fill on) and envlet arbiter; the namespaces share a bridge, and one registry sits behind the shaped link (%s). Every node starts %d environments of the workload (`%s`) at once from an empty cache, %d in all, once per mode, every cache emptied in between: without peers; with peers (`[peers]` listing every node and a token file, the daemon's defaults otherwise)",
		rep.Nodes, rep.Link, rep.EnvsPerNode, rep.Workload, rep.Nodes*rep.EnvsPerNode)
	if len(rep.Order) > 2 {
		fmt.Fprintf(&b, "; with peers and a longer hedge delay and timeout")
	}
	fmt.Fprintf(&b, ". Target: registry egress <= 0.3x and cold ready p95 <= 1.0x of no peers.\n\n")
	np := rep.Modes[NoPeers]
	ratio := func(a, b float64) string {
		if b <= 0 {
			return "-"
		}
		return fmt.Sprintf("%.2fx", a/b)
	}
	fmt.Fprintf(&b, "| mode | registry egress | / no peers | cold ready p50 | cold ready p95 | / no peers | episode p50 | episode p95 | all done | failed | from peers | hedges | timeouts | bad marks | load (1 min) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, mode := range rep.Order {
		m := rep.Modes[mode]
		fmt.Fprintf(&b, "| %s | %.1f MiB | **%s** | %.2f s | %.2f s | **%s** | %.2f s | %.2f s | %.1f s | %d | %.1f MiB | %d | %d | %d | %.1f to %.1f |\n",
			mode, float64(m.RegistryBytes)/(1<<20), ratio(float64(m.RegistryBytes), float64(np.RegistryBytes)),
			m.Ready.Median, m.Ready.P95, ratio(m.Ready.P95, np.Ready.P95), m.Episode.Median, m.Episode.P95, m.Makespan, m.Failed,
			float64(m.PeerFetched)/(1<<20), m.Hedges, m.Outcomes["timeout"], m.BadMarks, rep.Load[mode][0], rep.Load[mode][1])
	}
	fmt.Fprintf(&b, "\nReady and episode times run from the start of the pull, as in the headline; percentiles are nearest-rank over the environments that finished. Machine: %s.\n", rep.Machine)
	for _, n := range rep.Notes {
		fmt.Fprintf(&b, "\n- Note: %s\n", n)
	}
	fmt.Fprintf(&b, "\n%s", peersEnd)
	return b.String()
}
