//go:build linux

package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/egress"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim/config"
)

// EgressPollPeriod is how often the shim reads an environment's denial
// counters; each increase is logged with the environment's id.
const EgressPollPeriod = time.Second

// Capabilities the egress policy cannot coexist with: CAP_NET_ADMIN can
// delete the table from inside, so such a container is refused;
// CAP_NET_RAW can send frames on a packet socket, which no inet hook sees,
// so it is removed from the container's capability sets.
const (
	capNetAdmin = "CAP_NET_ADMIN"
	capNetRaw   = "CAP_NET_RAW"
)

// egressPolicy returns the policy of the container in spec, or nil when
// none applies. Sandbox containers get none: their namespace is the one
// the pod's containers are confined in, by their own Create.
func (s *Service) egressPolicy(ctx context.Context, spec *specs.Spec) (*egress.Policy, error) {
	if s.opts.Egress == nil || spec.Linux == nil || spec.Annotations[annContainerType] == containerSandbox {
		return nil, nil
	}
	lookup := s.opts.EgressLookup
	if lookup == nil {
		lookup = egress.LookupIP
	}
	nodeAddrs := s.opts.NodeAddresses
	if nodeAddrs == nil {
		nodeAddrs = egress.NodeAddresses
	}
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	p, ok, err := s.opts.Egress.Policy(lctx, spec.Annotations, lookup, nodeAddrs)
	if err != nil || !ok {
		return nil, err
	}
	return &p, nil
}

// prepareEgress checks that the policy can hold for the container in
// bundle and removes CAP_NET_RAW from its spec.
func prepareEgress(bundle string, spec *specs.Spec) error {
	if err := checkOwnNetns(spec); err != nil {
		return err
	}
	if c := spec.Process; c != nil && c.Capabilities != nil {
		for _, set := range [][]string{c.Capabilities.Bounding, c.Capabilities.Effective, c.Capabilities.Permitted, c.Capabilities.Ambient, c.Capabilities.Inheritable} {
			if slices.Contains(set, capNetAdmin) {
				return fmt.Errorf("egress policy: the container holds %s and could remove its rules: %w", capNetAdmin, errdefs.ErrFailedPrecondition)
			}
		}
	}
	// The spec in memory loses it too: a later rewrite of the bundle (the
	// guard's hardening) writes that spec and must not bring it back.
	if c := spec.Process; c != nil && c.Capabilities != nil {
		for _, set := range []*[]string{&c.Capabilities.Bounding, &c.Capabilities.Effective, &c.Capabilities.Permitted, &c.Capabilities.Ambient, &c.Capabilities.Inheritable} {
			*set = slices.DeleteFunc(*set, func(s string) bool { return s == capNetRaw })
		}
	}
	return dropCapability(bundle, capNetRaw)
}

// checkOwnNetns refuses a container that would share the node's network
// namespace: rules there would confine the node, not the environment.
func checkOwnNetns(spec *specs.Spec) error {
	shared, err := sharesNodeNetns(spec)
	if err != nil {
		return fmt.Errorf("egress policy: %w", err)
	}
	if shared {
		return fmt.Errorf("egress policy: the container shares the node's network namespace (host network), where no per-environment rule applies: %w", errdefs.ErrFailedPrecondition)
	}
	return nil
}

// sharesNodeNetns reports whether the container in spec would run in the
// node's network namespace (the shim's): its spec asks for no network
// namespace (runc then leaves it where it is), or names the node's.
func sharesNodeNetns(spec *specs.Spec) (bool, error) {
	if spec.Linux == nil {
		return true, nil
	}
	for _, ns := range spec.Linux.Namespaces {
		if ns.Type != specs.NetworkNamespace {
			continue
		}
		if ns.Path == "" {
			return false, nil // runc makes a new one
		}
		same, err := sameNetns(ns.Path, "/proc/self/ns/net")
		if err != nil {
			return false, fmt.Errorf("network namespace %s: %w", ns.Path, err)
		}
		return same, nil
	}
	return true, nil
}

// checkHostNetwork refuses a container on the node's network unless the
// node allows it ([guard] allow-host-network). Loopback is no boundary:
// there the environment reaches the arbiter's metrics (every
// environment's name and usage), containerd's streaming server, the
// registry and whatever else listens on the node. It applies to every
// container of the runtime, the CRI sandbox included, so a hostNetwork pod
// fails at its sandbox, before any of its containers exists.
func checkHostNetwork(spec *specs.Spec, allowed bool) error {
	if allowed {
		return nil
	}
	shared, err := sharesNodeNetns(spec)
	if err != nil {
		return fmt.Errorf("check for host network: %w", err)
	}
	if shared {
		return fmt.Errorf("the container would run in the node's network namespace (host network), where it reaches every service on the node's loopback; "+
			"refused unless the node allows it with allow-host-network = true under [guard] in the envlet config ($%s, default %s): %w",
			config.EnvVar, config.DefaultPath, errdefs.ErrFailedPrecondition)
	}
	return nil
}

func sameNetns(a, b string) (bool, error) {
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		return false, err
	}
	if err := unix.Stat(b, &sb); err != nil {
		return false, err
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino, nil
}

// dropCapability removes capability from every set of the bundle's
// config.json, editing the JSON generically so that fields this shim's
// spec version does not know survive.
func dropCapability(bundle, capability string) error {
	path := filepath.Join(bundle, "config.json")
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read bundle spec: %w", err)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(b, &doc); err != nil {
		return fmt.Errorf("parse bundle spec: %w", err)
	}
	var proc map[string]json.RawMessage
	if raw, ok := doc["process"]; !ok || json.Unmarshal(raw, &proc) != nil {
		return nil
	}
	var caps map[string][]string
	if raw, ok := proc["capabilities"]; !ok || json.Unmarshal(raw, &caps) != nil {
		return nil
	}
	changed := false
	for set, list := range caps {
		if i := slices.Index(list, capability); i >= 0 {
			caps[set] = slices.Delete(list, i, i+1)
			changed = true
		}
	}
	if !changed {
		return nil
	}
	if proc["capabilities"], err = json.Marshal(caps); err != nil {
		return err
	}
	if doc["process"], err = json.Marshal(proc); err != nil {
		return err
	}
	if b, err = json.Marshal(doc); err != nil {
		return err
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("write bundle spec: %w", err)
	}
	return nil
}

// egressEnv is one environment's installed policy and counter reader.
type egressEnv struct {
	key    string
	ctrs   *egress.Counters
	stop   chan struct{}
	done   chan struct{}
	once   sync.Once
	mu     sync.Mutex
	counts map[egress.Kind]uint64
	seen   map[egress.Attempt]bool // recorded destinations already logged
}

// A scan fills the kernel's record of denied destinations faster than
// anyone reads a log: per read, at most maxLoggedDestinations addresses
// are logged, each with at most maxLoggedPorts of its ports.
const (
	maxLoggedDestinations = 16
	maxLoggedPorts        = 10
)

// startEgress installs p in the network namespace of the created (not yet
// started) init process pid and starts reading its counters.
func (s *Service) startEgress(ctx context.Context, id string, pid uint32, p *egress.Policy) error {
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return fmt.Errorf("egress policy of %s: open network namespace: %w", id, err)
	}
	if same, err := sameNetns(f.Name(), "/proc/self/ns/net"); err != nil || same {
		f.Close()
		return fmt.Errorf("egress policy of %s: the container is in the node's network namespace (%v): %w", id, err, errdefs.ErrFailedPrecondition)
	}
	defer f.Close()
	rules, err := p.Rules()
	if err == nil {
		err = egress.Apply(int(f.Fd()), rules)
	}
	var ctrs *egress.Counters
	if err == nil {
		ctrs, err = egress.OpenCounters(int(f.Fd()))
	}
	if err != nil {
		return fmt.Errorf("egress policy of %s: %w", id, err)
	}
	e := &egressEnv{key: s.envKey(id), ctrs: ctrs, stop: make(chan struct{}), done: make(chan struct{}), counts: map[egress.Kind]uint64{}, seen: map[egress.Attempt]bool{}}
	log.G(ctx).WithField("env", e.key).WithField("allow", len(p.Allow)).WithField("deny", fmt.Sprint(prefixes(p.Deny))).Info("egress: policy installed")
	s.mu.Lock()
	if old := s.egress[id]; old != nil {
		defer old.close()
	}
	s.egress[id] = e
	s.mu.Unlock()
	go e.run(log.WithLogger(context.WithoutCancel(s.ctx), log.G(s.ctx).WithField("env", e.key)))
	return nil
}

func prefixes(ps []netip.Prefix) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = p.String()
	}
	return out
}

func (e *egressEnv) run(ctx context.Context) {
	defer close(e.done)
	t := time.NewTimer(envlet.UntilTick(time.Now(), EgressPollPeriod))
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			e.poll(ctx)
			return
		case <-t.C:
			t.Reset(envlet.UntilTick(time.Now(), EgressPollPeriod))
			e.poll(ctx)
		}
	}
}

// poll logs every counter that grew since the last read.
func (e *egressEnv) poll(ctx context.Context) {
	now, err := e.ctrs.Read()
	if err != nil {
		log.G(ctx).WithError(err).Debug("egress: read counters")
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, k := range egress.Kinds {
		if n := now[k]; n > e.counts[k] {
			log.G(ctx).WithField("kind", string(k)).WithField("denied", n-e.counts[k]).WithField("total", n).Warn("egress: denied")
			e.counts[k] = n
		}
	}
	attempts, err := e.ctrs.Denied()
	if err != nil {
		log.G(ctx).WithError(err).Debug("egress: read denied destinations")
		return
	}
	// A destination is logged when it enters the kernel's record, and
	// again if it is tried after its entry expired.
	current := make(map[egress.Attempt]bool, len(attempts))
	var fresh []egress.Attempt
	for _, a := range attempts {
		current[a] = true
		if !e.seen[a] {
			fresh = append(fresh, a)
		}
	}
	e.seen = current
	logAttempts(ctx, fresh)
}

// logAttempts logs newly denied destinations, one line per address and
// protocol with the ports tried (a scan is one line, not thousands).
func logAttempts(ctx context.Context, fresh []egress.Attempt) {
	type dst struct {
		addr  netip.Addr
		proto egress.Proto
	}
	ports := map[dst][]uint16{}
	var order []dst
	for _, a := range fresh {
		d := dst{a.Dst.Addr(), a.Proto}
		if _, ok := ports[d]; !ok {
			order = append(order, d)
		}
		ports[d] = append(ports[d], a.Dst.Port())
	}
	slices.SortFunc(order, func(a, b dst) int {
		if c := a.addr.Compare(b.addr); c != 0 {
			return c
		}
		return int(a.proto) - int(b.proto)
	})
	for i, d := range order {
		if i == maxLoggedDestinations {
			log.G(ctx).WithField("more", len(order)-i).Warn("egress: more denied destinations")
			break
		}
		ps := ports[d]
		slices.Sort(ps)
		shown := make([]string, 0, maxLoggedPorts)
		for _, p := range ps[:min(len(ps), maxLoggedPorts)] {
			shown = append(shown, strconv.Itoa(int(p)))
		}
		list := strings.Join(shown, ",")
		if len(ps) > maxLoggedPorts {
			list += ",..."
		}
		log.G(ctx).WithField("dst", d.addr.String()).WithField("proto", d.proto.String()).
			WithField("ports", list).WithField("count", len(ps)).Warn("egress: denied destination")
	}
}

// denied is the number of packets rejected so far, all kinds.
func (e *egressEnv) denied() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	var n uint64
	for _, c := range e.counts {
		n += c
	}
	return int(n)
}

// close reads the counters a last time and lets the namespace go (the
// counters' socket holds it).
func (e *egressEnv) close() {
	e.once.Do(func() {
		close(e.stop)
		<-e.done
		e.ctrs.Close()
	})
}

// stopEgress ends id's counter reader.
func (s *Service) stopEgress(id string) {
	s.mu.Lock()
	e := s.egress[id]
	delete(s.egress, id)
	s.mu.Unlock()
	if e != nil {
		e.close()
	}
}

// egressStatus adds the environment's denials to its controller's status
// (envlet_status_egress_denied at the arbiter).
type egressStatus struct {
	Controller
	eg *egressEnv
}

func (w egressStatus) Status() envlet.Status {
	st := w.Controller.Status()
	st.EgressDenied = w.eg.denied()
	return st
}
