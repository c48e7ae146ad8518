//go:build linux

package shim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/runtime-spec/specs-go"
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
			raw, _ := os.ReadFile(filepath.Join(bundle, "config.json"))
			_ = json.Unmarshal(raw, &doc)
			if doc["x-future"] != "kept" {
				t.Errorf("unknown field lost: %s", raw)
			}
		})
	}
}
