//go:build linux

package shim

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/runtime-spec/specs-go"
)

func TestTerminationMessageFile(t *testing.T) {
	dir := t.TempDir()
	file := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	def, custom, kube := file("default"), file("custom"), file("kube")
	mounts := []specs.Mount{
		{Destination: "/dev/termination-log", Source: def},
		{Destination: "/tmp/why", Source: custom},
		{Destination: "/var/log/kube-msg", Source: kube},
		{Destination: "/data", Source: dir}, // a directory, never written
	}
	for _, tc := range []struct {
		name string
		ann  map[string]string
		want string
	}{
		{"kubelet default path", nil, def},
		{"kube annotation", map[string]string{annKubeTermination: "/var/log/kube-msg"}, kube},
		{"shim annotation wins", map[string]string{annKubeTermination: "/var/log/kube-msg", AnnTerminationMessagePath: "/tmp/why/"}, custom},
		{"not a file", map[string]string{AnnTerminationMessagePath: "/data"}, ""},
		{"no such mount", map[string]string{AnnTerminationMessagePath: "/nowhere"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := terminationMessageFile(&specs.Spec{Annotations: tc.ann, Mounts: mounts})
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}
