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
	"strings"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/egress"
)

func TestPrepareEgress(t *testing.T) {
	caps := func(c ...string) *specs.LinuxCapabilities {
		return &specs.LinuxCapabilities{Bounding: c, Effective: c, Permitted: c}
	}
	ownNet := []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.NetworkNamespace}}
	for _, tc := range []struct {
		name    string
		spec    specs.Spec
		wantErr bool
	}{
		{"own namespace", specs.Spec{Process: &specs.Process{Capabilities: caps("CAP_CHOWN", capNetRaw)}, Linux: &specs.Linux{Namespaces: ownNet}}, false},
		{"host network", specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}}}}, true},
		{"the node's namespace by path", specs.Spec{Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/proc/self/ns/net"}}}}, true},
		{"net admin", specs.Spec{Process: &specs.Process{Capabilities: caps(capNetAdmin)}, Linux: &specs.Linux{Namespaces: ownNet}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bundle := t.TempDir()
			b, _ := json.Marshal(tc.spec)
			// A field this spec version does not know must survive.
			var doc map[string]any
			_ = json.Unmarshal(b, &doc)
			doc["x-future"] = "kept"
			b, _ = json.Marshal(doc)
			if err := os.WriteFile(filepath.Join(bundle, "config.json"), b, 0o600); err != nil {
				t.Fatal(err)
			}
			err := prepareEgress(bundle, &tc.spec)
			if tc.wantErr {
				if !errdefs.IsFailedPrecondition(err) {
					t.Fatalf("got %v, want a failed precondition", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got, err := readSpec(bundle)
			if err != nil {
				t.Fatal(err)
			}
			c := got.Process.Capabilities
			for _, set := range [][]string{c.Bounding, c.Effective, c.Permitted} {
				if slices.Contains(set, capNetRaw) || !slices.Contains(set, "CAP_CHOWN") {
					t.Errorf("capabilities after prepare: %v", set)
				}
			}
			mc := tc.spec.Process.Capabilities
			for _, set := range [][]string{mc.Bounding, mc.Effective, mc.Permitted} {
				if slices.Contains(set, capNetRaw) {
					t.Errorf("capabilities of the spec in memory after prepare: %v (a later writeSpec would restore it)", set)
				}
			}
			raw, _ := os.ReadFile(filepath.Join(bundle, "config.json"))
			_ = json.Unmarshal(raw, &doc)
			if doc["x-future"] != "kept" {
				t.Errorf("unknown field lost: %s", raw)
			}
		})
	}
}

func TestCreateEgress(t *testing.T) {
	ownNet := func(id string, ann map[string]string) *specs.Spec {
		s := linuxSpec(id, ann)
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.NetworkNamespace}}
		return s
	}
	// The node's namespace by path: bundle leaves a spec that names one
	// as it is.
	hostNet := func(id string) *specs.Spec {
		s := linuxSpec(id, nil)
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/proc/self/ns/net"}}
		return s
	}
	noLookups := func(_ context.Context, host string) ([]netip.Addr, error) {
		return nil, fmt.Errorf("%s: no such host", host)
	}
	for _, tc := range []struct {
		name      string
		node      egress.Node
		spec      *specs.Spec
		wantErr   func(error) bool
		wantCalls []string
		released  string
		hostNet   bool // [guard] allow-host-network
	}{
		{
			name:      "no policy: host network is fine where the node allows it",
			node:      egress.Node{},
			spec:      hostNet("a"),
			hostNet:   true,
			wantCalls: []string{"create a"},
		},
		{
			name:    "bad annotation: nothing created",
			node:    egress.Node{},
			spec:    ownNet("b", map[string]string{egress.Annotation: "10.0.0.1:443"}),
			wantErr: errdefs.IsInvalidArgument,
		},
		{
			name:    "unresolvable name: nothing created",
			node:    egress.Node{Enforce: true, Allow: []egress.Entry{{Host: "mirror.invalid", Ports: egress.AllPorts, Proto: egress.TCP}}},
			spec:    ownNet("c", nil),
			wantErr: errdefs.IsInvalidArgument,
		},
		{
			name:    "host network under a policy: nothing created, even where the node allows it",
			node:    egress.Node{Enforce: true},
			spec:    hostNet("d"),
			hostNet: true,
			wantErr: errdefs.IsFailedPrecondition,
		},
		{
			// The created task's namespace cannot be opened (its pid is
			// above pid_max): the container is deleted before it ever
			// starts, and its admission returned.
			name:      "rules not installed: created container deleted",
			node:      egress.Node{Enforce: true},
			spec:      ownNet("e", nil),
			wantErr:   func(err error) bool { return err != nil },
			wantCalls: []string{"create e", "delete e"},
			released:  "egress policy failed",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.runc.pid = 1 << 30
			f.svc.opts.Guard.HostNetwork = tc.hostNet
			node := tc.node
			f.svc.opts.Egress = &node
			f.svc.opts.EgressLookup = noLookups
			f.svc.opts.NodeAddresses = func() ([]netip.Prefix, error) { return nil, nil }
			id := tc.spec.Linux.CgroupsPath[len("/test/"):]
			_, err := f.svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: id, Bundle: bundle(t, tc.spec)})
			if err != nil {
				err = errgrpc.ToNative(err)
			}
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !tc.wantErr(err) {
				t.Fatalf("Create: %v", err)
			}
			f.runc.mu.Lock()
			calls := slices.Clone(f.runc.calls)
			f.runc.mu.Unlock()
			if !slices.Equal(calls, tc.wantCalls) {
				t.Errorf("runc calls %v, want %v", calls, tc.wantCalls)
			}
			if tc.released != "" {
				if r, ok := f.arb.releasedReason(id); !ok || r != tc.released {
					t.Errorf("admission of %s released %v with %q, want %q", id, ok, r, tc.released)
				}
			}
		})
	}
}

// TestHostNetwork: a container on the node's network namespace is
// refused at Create, before runc or the arbiter hears of it, unless the
// node allows it ([guard] allow-host-network); the refusal names the
// option. The CRI sandbox and containers that run unmanaged are no
// exception; a node with the shim disabled runs specs as runc would.
func TestHostNetwork(t *testing.T) {
	sandbox := map[string]string{annContainerType: containerSandbox}
	noNetns := func(id string, ann map[string]string) *specs.Spec {
		s := linuxSpec(id, ann)
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.PIDNamespace}}
		return s
	}
	nodeNetns := func(id string, ann map[string]string) *specs.Spec {
		s := linuxSpec(id, ann)
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.NetworkNamespace, Path: "/proc/self/ns/net"}}
		return s
	}
	ownNetns := func(id string, ann map[string]string) *specs.Spec {
		s := linuxSpec(id, ann)
		s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.NetworkNamespace}}
		return s
	}
	for _, tc := range []struct {
		name            string
		spec            *specs.Spec
		allow, disabled bool
		refused         bool
	}{
		{name: "no network namespace", spec: noNetns("a", nil), refused: true},
		{name: "the node's namespace by path", spec: nodeNetns("b", nil), refused: true},
		{name: "a sandbox on the host network", spec: noNetns("c", sandbox), refused: true},
		{name: "unmanaged by annotation", spec: noNetns("d", map[string]string{AnnDisable: "true"}), refused: true},
		{name: "own namespace", spec: ownNetns("e", nil)},
		{name: "a sandbox with its own namespace", spec: ownNetns("f", sandbox)},
		{name: "allowed by the node", spec: noNetns("g", nil), allow: true},
		{name: "a sandbox allowed by the node", spec: nodeNetns("h", sandbox), allow: true},
		{name: "shim disabled", spec: noNetns("i", nil), disabled: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.svc.opts.Guard.HostNetwork = tc.allow
			f.svc.opts.Disabled = tc.disabled
			id := tc.spec.Linux.CgroupsPath[len("/test/"):]
			_, err := f.svc.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: id, Bundle: bundle(t, tc.spec)})
			if err != nil {
				err = errgrpc.ToNative(err)
			}
			f.runc.mu.Lock()
			calls := slices.Clone(f.runc.calls)
			f.runc.mu.Unlock()
			if !tc.refused {
				if err != nil || !slices.Equal(calls, []string{"create " + id}) {
					t.Fatalf("Create: %v, runc calls %v; want it created", err, calls)
				}
				return
			}
			if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "allow-host-network = true under [guard]") || !strings.Contains(err.Error(), "host network") {
				t.Fatalf("Create: %v; want a failed precondition naming host network and allow-host-network", err)
			}
			if len(calls) != 0 {
				t.Errorf("runc calls %v for a refused container", calls)
			}
			f.arb.mu.Lock()
			_, admitted := f.arb.admitted[id]
			f.arb.mu.Unlock()
			if admitted {
				t.Errorf("%s admitted by the arbiter", id)
			}
		})
	}
}
