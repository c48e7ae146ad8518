package shim_test

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// criRuntime is an envlet handler on the plain overlayfs snapshotter, so
// this test needs no snapshotter daemon; annotations pass through as the
// deploy drop-in configures them.
const criRuntime = `
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.envletov]
  runtime_type = "io.containerd.envlet.v2"
  pod_annotations = ["io.envsnap.envlet.*", "io.envsnap.shim.*"]
  container_annotations = ["io.envsnap.envlet.*", "io.envsnap.shim.*"]
`

// TestCRIPod runs a pod through CRI with the envlet handler: one shim
// serves the pod, the pause container runs unmanaged, the application
// container is admitted with the pod's envlet annotations.
func TestCRIPod(t *testing.T) {
	s := newSuite(t, node{hostNetwork: true}, testenv.WithConfig(criRuntime))
	dir := t.TempDir()
	pod := testenv.WriteJSON(t, dir, "pod.json", map[string]any{
		"metadata":      map[string]any{"name": "envlet", "namespace": "default", "uid": "envlet-uid", "attempt": 0},
		"log_directory": filepath.Join(dir, "logs"),
		"annotations":   map[string]string{"io.envsnap.envlet.initial-cpu": "0.5", "io.envsnap.envlet.initial-memory": "384Mi"},
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	})
	ctrCfg := testenv.WriteJSON(t, dir, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "main"},
		"image":    map[string]any{"image": s.img.Name()},
		"command":  []string{"/workload", "-mode", "idle", "-hold", "60s"},
		"log_path": "main.log",
	})
	crictl := func(args ...string) string { t.Helper(); return s.env.MustCrictl(t, args...) }
	crictl("pull", s.img.Name())
	podID := crictl("runp", "--runtime", "envletov", pod)
	t.Cleanup(func() { s.env.Crictl(t, "stopp", podID); s.env.Crictl(t, "rmp", "-f", podID) })
	ctrID := crictl("create", podID, ctrCfg, pod)
	crictl("start", ctrID)

	var envs []struct {
		Env  string
		Base struct {
			CPU    float64
			Memory int64
		}
	}
	if err := json.Unmarshal([]byte(s.envsnap(t, "envs", "--json")), &envs); err != nil {
		t.Fatal(err)
	}
	// CRI runs pods in containerd's k8s.io namespace.
	if len(envs) != 1 || envs[0].Env != "k8s.io/"+ctrID {
		t.Fatalf("environments %+v, want only the application container %s (not the sandbox %s)", envs, ctrID, podID)
	}
	if envs[0].Base.CPU != 0.5 || envs[0].Base.Memory != 384<<20 {
		t.Errorf("admitted with %+v, want the pod annotations' 0.5 cores / 384 MiB", envs[0].Base)
	}
	crictl("stop", "-t", "1", ctrID)
	crictl("rm", ctrID)
	if out := s.envsnap(t, "envs"); strings.Contains(out, ctrID) {
		t.Errorf("stopped container still listed:\n%s", out)
	}
}
