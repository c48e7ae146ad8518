// Package config reads the envlet shim's node configuration: policy
// defaults, node size, the arbiter's address and the egress policy.
// containerd's runtime `options` cannot carry it (CRI would send
// runtimeoptions that runc's task service rejects), so it is a TOML file
// found through the environment the shim inherits from containerd.
package config

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/egress"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/tomlconf"
)

const (
	// EnvVar names the config file; DefaultPath is used when it is unset.
	EnvVar      = "ENVLET_CONFIG"
	DefaultPath = "/etc/envsnap/envlet.toml"
)

// Config is the file's content. Every field is optional.
type Config struct {
	// Disabled runs containers exactly like runc, without a controller.
	Disabled bool `toml:"disabled"`
	// Policy holds envlet knobs by their annotation names without the
	// prefix (initial-cpu = "0.5", cap-memory = "16Gi", ...): the node's
	// defaults, which per-container annotations override.
	Policy map[string]string `toml:"policy"`
	Node   Node              `toml:"node"`
	// Arbiter locates the node arbiter.
	Arbiter Arbiter `toml:"arbiter"`
	// Egress is the node's egress allow-list policy (package egress).
	Egress Egress `toml:"egress"`
	// Guard holds the rules for hostile workloads: seccomp, pids and
	// output caps.
	Guard Guard `toml:"guard"`
	// Shim is how shim processes are shared and how they mark the
	// containers they start.
	Shim Shim `toml:"shim"`
}

// Shim is [shim].
type Shim struct {
	// GroupSize is how many containers of a containerd namespace one shim
	// process serves at most (default DefaultGroupSize); 1 gives every
	// container its own shim, as runc's does outside a pod.
	GroupSize *int `toml:"group-size"`
	// MemoryMerge marks the shim's memory mergeable by the kernel's
	// same-page merging before it starts any container, so every
	// process it starts is too (package ksm; Linux >= 6.4). Identical
	// pages of the node's environments (agent runtimes of one harness)
	// are then merged while the node runs ksmd
	// (/sys/kernel/mm/ksm/run = 1, the operator's setting). Default off.
	MemoryMerge bool `toml:"memory-merge"`
}

// DefaultGroupSize bounds what one shim's crash takes down with it (every
// container it serves) while sharing its process among enough
// environments that watching one costs less than the runc shim running
// it (docs/shim.md, "Shared shims").
const DefaultGroupSize = 16

// GroupSize is [shim] group-size, or its default.
func (c Config) GroupSize() int {
	if c.Shim.GroupSize == nil {
		return DefaultGroupSize
	}
	return *c.Shim.GroupSize
}

// Egress is [egress].
type Egress struct {
	// Enforce gives every container an allow-list: Allow, unless its
	// io.envsnap.egress annotation names another. Without it only
	// annotated containers are confined.
	Enforce bool `toml:"enforce"`
	// Allow is the default allow-list, entries as in the annotation
	// ("10.0.0.0/8:443/tcp", "mirror.example.com:5000/tcp").
	Allow []string `toml:"allow"`
	// Resolvers are the only addresses DNS may reach.
	Resolvers []string `toml:"resolvers"`
	// Deny lists CIDRs always denied besides the node's own addresses
	// and the metadata service (e.g. the node's public address behind
	// NAT, the control plane).
	Deny []string `toml:"deny"`
}

// EgressNode is the node's side of every environment's egress policy.
func (c Config) EgressNode() (egress.Node, error) {
	n := egress.Node{Enforce: c.Egress.Enforce}
	for _, a := range c.Egress.Allow {
		es, err := egress.Parse(a)
		if err != nil {
			return n, fmt.Errorf("[egress] allow: %w", err)
		}
		n.Allow = append(n.Allow, es...)
	}
	for _, r := range c.Egress.Resolvers {
		a, err := netip.ParseAddr(r)
		if err != nil {
			return n, fmt.Errorf("[egress] resolvers: %w", err)
		}
		n.Resolvers = append(n.Resolvers, a.Unmap())
	}
	for _, d := range c.Egress.Deny {
		p, err := netip.ParsePrefix(d)
		if err != nil {
			a, aerr := netip.ParseAddr(d)
			if aerr != nil {
				return n, fmt.Errorf("[egress] deny: %w", err)
			}
			p = netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
		}
		n.Deny = append(n.Deny, p.Masked())
	}
	return n, nil
}

// Guard is [guard]: what the shim imposes on every environment whatever
// its spec says. Empty fields take the defaults below.
type Guard struct {
	// Seccomp is "default" (containerd's default profile plus
	// DeniedIoctls, for specs without a profile) or "none" (specs run as
	// given).
	Seccomp string `toml:"seccomp"`
	// Pids is the pids limit per environment; a spec's own lower limit
	// wins; 0 keeps the spec's.
	Pids *int64 `toml:"pids"`
	// PidsGrace is how long forks may keep failing at the limit before
	// the environment fails with PIDS_EXHAUSTED.
	PidsGrace string `toml:"pids-grace"`
	// Output caps what an environment's processes write to stdout and
	// stderr together ("1Gi"; "0" for no cap).
	Output string `toml:"output"`
	// Disk and Inodes cap what the environment's writable layer (the
	// rootfs overlay's upper directory) holds: bytes allocated ("20Gi";
	// "0" for no cap) and files. A watcher, not a hard limit.
	Disk   string `toml:"disk"`
	Inodes *int64 `toml:"inodes"`
	// LSM is "auto" (BPF LSM rules per environment where the kernel runs
	// them; elsewhere environments start without them, and say so) or
	// "off".
	LSM string `toml:"lsm"`
	// Protected are paths, besides DefaultProtected and the node's
	// sockets the shim knows (containerd's, the arbiter's), that no
	// environment may open or connect to, nor anything under them.
	Protected []string `toml:"protected"`
	// AllowHostNetwork lets containers run in the node's network
	// namespace (ctr run --net-host, a hostNetwork pod). Off, they are
	// refused at create: on the node's network an environment reaches
	// every service listening on the node's loopback and addresses.
	AllowHostNetwork bool `toml:"allow-host-network"`
}

// Guard defaults.
const (
	SeccompDefault   = "default"
	SeccompNone      = "none"
	DefaultPids      = 4096
	DefaultPidsGrace = 2 * time.Second
	DefaultOutput    = envlet.GiB
	DefaultDisk      = 20 * envlet.GiB
	DefaultInodes    = 2_000_000
	LSMAuto          = "auto"
	LSMOff           = "off"
)

// DefaultProtected are always protected (package lsm): the directory of
// containerd's shim sockets (each one serves the task API of the
// containers it runs) and that of the envsnap daemon's sockets
// (daemon.DefaultAddress, with the root-only status socket).
var DefaultProtected = []string{"/run/containerd/s", "/run/containerd-envsnap"}

// GuardLimits is [guard] resolved.
type GuardLimits struct {
	Seccomp   bool
	Pids      int64
	PidsGrace time.Duration
	Output    int64
	Disk      int64
	Inodes    int64
	LSM       bool
	// Protected is DefaultProtected and [guard] protected.
	Protected []string
	// HostNetwork is [guard] allow-host-network.
	HostNetwork bool
}

// GuardLimits resolves [guard] with the defaults.
func (c Config) GuardLimits() (GuardLimits, error) {
	g := GuardLimits{Seccomp: true, Pids: DefaultPids, PidsGrace: DefaultPidsGrace, Output: DefaultOutput, Disk: DefaultDisk, Inodes: DefaultInodes, LSM: true,
		HostNetwork: c.Guard.AllowHostNetwork}
	switch c.Guard.LSM {
	case "", LSMAuto:
	case LSMOff:
		g.LSM = false
	default:
		return g, fmt.Errorf("[guard] lsm %q: want %q or %q", c.Guard.LSM, LSMAuto, LSMOff)
	}
	g.Protected = append(slices.Clone(DefaultProtected), c.Guard.Protected...)
	for _, p := range c.Guard.Protected {
		if !filepath.IsAbs(p) {
			return g, fmt.Errorf("[guard] protected %q: must be an absolute path", p)
		}
	}
	switch c.Guard.Seccomp {
	case "", SeccompDefault:
	case SeccompNone:
		g.Seccomp = false
	default:
		return g, fmt.Errorf("[guard] seccomp %q: want %q or %q", c.Guard.Seccomp, SeccompDefault, SeccompNone)
	}
	if c.Guard.Pids != nil {
		if *c.Guard.Pids < 0 {
			return g, fmt.Errorf("[guard] pids %d: must not be negative", *c.Guard.Pids)
		}
		g.Pids = *c.Guard.Pids
	}
	if c.Guard.PidsGrace != "" {
		d, err := time.ParseDuration(c.Guard.PidsGrace)
		if err != nil || d < 0 {
			return g, fmt.Errorf("[guard] pids-grace %q: must be a duration", c.Guard.PidsGrace)
		}
		g.PidsGrace = d
	}
	for _, f := range []struct {
		name, v string
		dst     *int64
	}{{"output", c.Guard.Output, &g.Output}, {"disk", c.Guard.Disk, &g.Disk}} {
		switch f.v {
		case "":
		case "0":
			*f.dst = 0
		default:
			n, err := envlet.ParseBytes(f.v)
			if err != nil {
				return g, fmt.Errorf("[guard] %s: %w", f.name, err)
			}
			*f.dst = n
		}
	}
	if c.Guard.Inodes != nil {
		if *c.Guard.Inodes < 0 {
			return g, fmt.Errorf("[guard] inodes %d: must not be negative", *c.Guard.Inodes)
		}
		g.Inodes = *c.Guard.Inodes
	}
	return g, nil
}

// Node is the capacity arbitrated on this node. Empty fields default to the
// machine (online CPUs, MemTotal).
type Node struct {
	CPU    string `toml:"cpu"`    // cores: "2", "1500m"
	Memory string `toml:"memory"` // bytes: "4Gi"
	// Reserve is the share of the node kept free of use; default 0.15.
	Reserve *float64 `toml:"reserve"`
	// Overcommit bounds the sum of initial quotas as a multiple of the
	// node (envlet.DefaultOvercommit: none, admission is by measured
	// use); 1 admits by request.
	Overcommit Overcommit `toml:"overcommit"`
	// Victims is the victim policy, e.g. "priority,youngest" (default).
	Victims string `toml:"victim-policy"`
}

// Overcommit is [node.overcommit].
type Overcommit struct {
	CPU    *float64 `toml:"cpu"`
	Memory *float64 `toml:"memory"`
}

// NodeOpts are the arbiter's admission options from [node].
func (c Config) NodeOpts() ([]envlet.NodeOpt, error) {
	o := envlet.DefaultOvercommit
	for _, f := range []struct {
		name string
		src  *float64
		dst  *float64
	}{{"cpu", c.Node.Overcommit.CPU, &o.CPU}, {"memory", c.Node.Overcommit.Memory, &o.Memory}} {
		if f.src == nil {
			continue
		}
		if *f.src < 1 {
			return nil, fmt.Errorf("[node.overcommit] %s %v: must be at least 1", f.name, *f.src)
		}
		*f.dst = *f.src
	}
	opts := []envlet.NodeOpt{envlet.WithOvercommit(o)}
	// The node is the whole machine (no [node] memory): what the machine
	// has in use outside the environments (the kernel, the node's
	// daemons, kubelet) is not theirs to take. A configured size is the
	// operator's share for envlet (Kubernetes' allocatable) and stands.
	if c.Node.Memory == "" {
		opts = append(opts, envlet.WithNodeMemory(envlet.ReadMeminfo))
	}
	if c.Node.Victims != "" {
		p, err := envlet.ParseVictimPolicy(c.Node.Victims)
		if err != nil {
			return nil, fmt.Errorf("[node] victim-policy: %w", err)
		}
		opts = append(opts, envlet.WithVictimPolicy(p))
	}
	return opts, nil
}

// Arbiter configures the shims' arbiter client.
type Arbiter struct {
	Socket   string `toml:"socket"`   // default /run/envsnap/arbiter.sock
	Timeout  string `toml:"timeout"`  // default 1s (arbiter.DefaultTimeout)
	Fallback string `toml:"fallback"` // "degraded" (default) or "local"
	// Ledger is where the arbiter daemon persists its leases; default
	// arbiter-ledger.json next to the socket; "none" keeps them in memory.
	Ledger string `toml:"ledger"`
}

// LedgerPath is the arbiter daemon's ledger file, "" for none.
func (c Config) LedgerPath() string {
	switch c.Arbiter.Ledger {
	case "none":
		return ""
	case "":
		socket := c.Arbiter.Socket
		if socket == "" {
			socket = arbiter.DefaultSocket
		}
		return arbiter.DefaultLedgerPath(socket)
	}
	return c.Arbiter.Ledger
}

// Load reads the file named by $ENVLET_CONFIG, or DefaultPath. A missing
// default file is an empty config; a missing file named explicitly is an
// error, as is any unknown key.
func Load() (Config, error) {
	path, explicit := os.LookupEnv(EnvVar)
	if !explicit || path == "" {
		path = DefaultPath
	}
	c, err := LoadFile(path)
	if errors.Is(err, os.ErrNotExist) && !explicit {
		return Config{}, nil
	}
	return c, err
}

// LoadFile reads one config file.
func LoadFile(path string) (Config, error) {
	var c Config
	b, err := os.ReadFile(path)
	if err != nil {
		return c, fmt.Errorf("read envlet config: %w", err)
	}
	if err := tomlconf.Decode(bytes.NewReader(b), &c); err != nil {
		return c, fmt.Errorf("parse envlet config %s: %w", path, err)
	}
	if _, err := c.Envlet(); err != nil {
		return c, fmt.Errorf("envlet config %s: %w", path, err)
	}
	if _, _, err := c.NodeSize(); err != nil {
		return c, fmt.Errorf("envlet config %s: %w", path, err)
	}
	if _, err := c.ArbiterClient(); err != nil {
		return c, fmt.Errorf("envlet config %s: %w", path, err)
	}
	if g := c.Shim.GroupSize; g != nil && *g < 1 {
		return c, fmt.Errorf("envlet config %s: [shim] group-size %d: want at least 1", path, *g)
	}
	if _, err := c.NodeOpts(); err != nil {
		return c, fmt.Errorf("envlet config %s: %w", path, err)
	}
	if _, err := c.EgressNode(); err != nil {
		return c, fmt.Errorf("envlet config %s: %w", path, err)
	}
	if _, err := c.GuardLimits(); err != nil {
		return c, fmt.Errorf("envlet config %s: %w", path, err)
	}
	return c, nil
}

// Envlet returns the controller defaults: envlet's published defaults with
// the file's [policy] applied.
func (c Config) Envlet() (envlet.Config, error) {
	ec := envlet.DefaultConfig()
	if len(c.Policy) == 0 {
		return ec, nil
	}
	a := make(map[string]string, len(c.Policy))
	for k, v := range c.Policy {
		a[envlet.AnnotationPrefix+k] = v
	}
	if err := ec.ApplyAnnotations(a); err != nil {
		return ec, fmt.Errorf("[policy]: %w", err)
	}
	return ec, nil
}

// NodeSize is the node capacity and admission reserve.
func (c Config) NodeSize() (envlet.Resources, float64, error) {
	var r envlet.Resources
	var err error
	if c.Node.CPU != "" {
		if r.CPU, err = envlet.ParseCPU(c.Node.CPU); err != nil {
			return r, 0, fmt.Errorf("[node] cpu: %w", err)
		}
	} else {
		r.CPU = float64(runtime.NumCPU())
	}
	if c.Node.Memory != "" {
		if r.Memory, err = envlet.ParseBytes(c.Node.Memory); err != nil {
			return r, 0, fmt.Errorf("[node] memory: %w", err)
		}
	} else if r.Memory, err = memTotal(); err != nil {
		return r, 0, err
	}
	reserve := envlet.DefaultReserve
	if c.Node.Reserve != nil {
		reserve = *c.Node.Reserve
		if reserve < 0 || reserve >= 1 {
			return r, 0, fmt.Errorf("[node] reserve %v: must be in [0, 1)", reserve)
		}
	}
	return r, reserve, nil
}

// ArbiterClient is the client configuration for the shims.
func (c Config) ArbiterClient() (arbiter.ClientConfig, error) {
	node, reserve, err := c.NodeSize()
	if err != nil {
		return arbiter.ClientConfig{}, err
	}
	cc := arbiter.ClientConfig{Socket: c.Arbiter.Socket, Node: node, Reserve: reserve, Fallback: c.Arbiter.Fallback}
	if c.Arbiter.Timeout != "" {
		d, err := time.ParseDuration(c.Arbiter.Timeout)
		if err != nil || d <= 0 {
			return cc, fmt.Errorf("[arbiter] timeout %q: must be a positive duration", c.Arbiter.Timeout)
		}
		cc.Timeout = d
	}
	switch cc.Fallback {
	case "", arbiter.FallbackDegraded, arbiter.FallbackLocal:
	default:
		return cc, fmt.Errorf("[arbiter] fallback %q: want %q or %q", cc.Fallback, arbiter.FallbackDegraded, arbiter.FallbackLocal)
	}
	return cc, nil
}

func memTotal() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("node memory size: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse MemTotal %q: %w", rest, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, fmt.Errorf("node memory size: no MemTotal in /proc/meminfo")
}
