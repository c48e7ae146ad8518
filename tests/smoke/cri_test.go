package smoke

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// TestCRIPodLifecycle runs a host-network pod through crictl with the
// default runc handler: the harness's CRI configuration (pause image from
// the test registry, certs.d, restrict_oom_score_adj) works.
func TestCRIPodLifecycle(t *testing.T) {
	env := testenv.New(t)
	ref := env.PushImage(t, "smoke/cri:1", []testenv.File{{Path: "/msg", Data: []byte("from-cri\n")}}).Ref

	dir := t.TempDir()
	pod := testenv.WriteJSON(t, dir, "pod.json", map[string]any{
		"metadata":      map[string]any{"name": "smoke", "namespace": "default", "uid": "smoke-uid", "attempt": 0},
		"log_directory": filepath.Join(dir, "logs"),
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	})
	ctr := testenv.WriteJSON(t, dir, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "main"},
		"image":    map[string]any{"image": ref},
		"command":  []string{"/bin/sh", "-c", "cat /msg; sleep 300"},
		"log_path": "main.log",
	})
	crictl := func(args ...string) string { t.Helper(); return env.MustCrictl(t, args...) }
	crictl("pull", ref)
	podID := crictl("runp", pod)
	t.Cleanup(func() { env.Crictl(t, "stopp", podID); env.Crictl(t, "rmp", "-f", podID) })
	ctrID := crictl("create", podID, ctr, pod)
	crictl("start", ctrID)
	if out := crictl("exec", ctrID, "cat", "/msg"); out != "from-cri" {
		t.Errorf("crictl exec output = %q, want from-cri", out)
	}
	crictl("stop", "-t", "1", ctrID)
	logs := crictl("logs", ctrID)
	if !strings.Contains(logs, "from-cri") {
		t.Errorf("crictl logs = %q, want from-cri", logs)
	}
	crictl("rm", ctrID)
	crictl("stopp", podID)
	crictl("rmp", podID)
}
