package smoke

import (
	"encoding/json"
	"os"
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
	pod := writeJSON(t, dir, "pod.json", map[string]any{
		"metadata":      map[string]any{"name": "smoke", "namespace": "default", "uid": "smoke-uid", "attempt": 0},
		"log_directory": filepath.Join(dir, "logs"),
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	})
	ctr := writeJSON(t, dir, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "main"},
		"image":    map[string]any{"image": ref},
		"command":  []string{"/bin/sh", "-c", "cat /msg; sleep 300"},
		"log_path": "main.log",
	})
	crictl := func(args ...string) string {
		t.Helper()
		out, err := env.Crictl(t, args...)
		if err != nil {
			t.Fatalf("crictl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(out)
	}
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

func writeJSON(t *testing.T, dir, name string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
