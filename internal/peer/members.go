package peer

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
)

// Members is a source of the cluster's peer addresses (host:port), this
// node's own included.
type Members interface {
	Members() []string
}

// Static is a fixed member list.
type Static []string

// Members implements Members.
func (s Static) Members() []string { return s }

// Watched is a member list refreshed periodically by a lookup (DNS, a
// file). A failed lookup, or one that finds no member, keeps the last good
// list: a DNS hiccup, or a file read while it is being rewritten, must not
// empty the cluster.
type Watched struct {
	mu   sync.Mutex
	list []string
}

// Members implements Members.
func (w *Watched) Members() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.list
}

// Watch runs lookup now and then every interval until ctx ends. The first
// lookup's error is returned (the caller decides whether an empty start is
// fatal); later errors are logged.
func Watch(ctx context.Context, every time.Duration, what string, lookup func(context.Context) ([]string, error)) (*Watched, error) {
	w := &Watched{}
	refresh := func() error {
		lctx, cancel := context.WithTimeout(ctx, max(every, time.Second))
		defer cancel()
		list, err := lookup(lctx)
		if err == nil && len(list) == 0 {
			err = errors.New("no members listed")
		}
		if err != nil {
			return fmt.Errorf("look up peers (%s): %w", what, err)
		}
		list = normalize(list)
		w.mu.Lock()
		changed := !slices.Equal(w.list, list)
		w.list = list
		w.mu.Unlock()
		if changed {
			log.G(ctx).WithField("source", what).WithField("members", len(list)).Info("peer members changed")
		}
		return nil
	}
	err := refresh()
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if err := refresh(); err != nil {
					log.G(ctx).WithError(err).Warn("keeping the previous peer list")
				}
			}
		}
	}()
	return w, err
}

func normalize(list []string) []string {
	out := slices.Clone(list)
	slices.Sort(out)
	return slices.Compact(out)
}

// LookupDNS returns the members behind name, as a headless Kubernetes
// Service publishes them: the SRV records of name when there are any
// (target:port), else its A/AAAA records with port.
func LookupDNS(ctx context.Context, r *net.Resolver, name string, port int) ([]string, error) {
	if _, srvs, err := r.LookupSRV(ctx, "", "", name); err == nil && len(srvs) > 0 {
		var out []string
		for _, s := range srvs {
			addrs, err := r.LookupHost(ctx, strings.TrimSuffix(s.Target, "."))
			if err != nil {
				return nil, fmt.Errorf("resolve SRV target %s: %w", s.Target, err)
			}
			for _, a := range addrs {
				out = append(out, net.JoinHostPort(a, strconv.Itoa(int(s.Port))))
			}
		}
		return out, nil
	}
	addrs, err := r.LookupHost(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", name, err)
	}
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = net.JoinHostPort(a, strconv.Itoa(port))
	}
	return out, nil
}

// ReadMembersFile parses a member list file: one host:port a line, blank
// lines and lines starting with # ignored.
func ReadMembersFile(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read peer list: %w", err)
	}
	return ParseMembers(b)
}

// ParseMembers parses the member list format of ReadMembersFile.
func ParseMembers(b []byte) ([]string, error) {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if _, err := ValidateAddress(line); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, line)
	}
	return out, sc.Err()
}

// ValidateAddress checks that addr is host:port with a numeric port and
// returns the port.
func ValidateAddress(addr string) (int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, fmt.Errorf("peer address %q: %w", addr, err)
	}
	port, err := strconv.Atoi(p)
	if err != nil || port <= 0 || port > 65535 || host == "" || strings.ContainsAny(host, "/?#@ ") {
		return 0, fmt.Errorf("peer address %q: want host:port", addr)
	}
	return port, nil
}

// LocalAddress reports whether member is this node's peer server: its port
// is port and its host one of the node's interface addresses. Used when no
// advertise address is configured (every pod of a DaemonSet has the same
// configuration but its own addresses).
func LocalAddress(member string, port int) bool {
	host, p, err := net.SplitHostPort(member)
	if err != nil || p != strconv.Itoa(port) {
		return false
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return false
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
			return true
		}
	}
	return false
}
