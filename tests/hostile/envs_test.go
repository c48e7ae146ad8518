package hostile_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestEnvsListsFailureReasons: `containerd-envsnap envs --all` says why
// each environment ended, for every limit the shim's guard enforces (the
// controller releases its lease when the shim stops it, before the shim
// could say why), and "exited" for one that just exited.
func TestEnvsListsFailureReasons(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{}))
	tools := []testenv.File{{Path: "/agent", Mode: 0o755, Data: agentBinary(t)}}
	img := env.PushImageLayers(t, "hostile/envs:1", [][]testenv.File{tools}, testenv.WithLazyLayers())
	image := env.Pull(t, img.Ref, "envsnap")
	failures := (&episode{env: env}).failures(t)

	cases := []struct {
		reason, script string
		ann            map[string]string
	}{
		{envlet.ReasonPidsExhausted, "exec /agent forkbomb", map[string]string{shim.AnnPidsLimit: "64"}},
		{envlet.ReasonOutputCapExceeded, "yes hostile-output-line", map[string]string{shim.AnnOutputLimit: fmt.Sprint(64 << 10)}},
		{envlet.ReasonDiskCapExceeded, "dd if=/dev/zero of=/fill bs=1M count=64 2>/dev/null; sleep 60", map[string]string{shim.AnnDiskLimit: fmt.Sprint(8 << 20)}},
		{"exited", "exit 3", nil},
	}
	ids := make([]string, len(cases))
	for i, tc := range cases {
		res := env.RunContainer(t, image, testenv.RunOptions{
			Snapshotter: "envsnap", Runtime: envletRuntime, Annotations: tc.ann,
			Args: []string{"/bin/sh", "-c", tc.script}, Timeout: 90 * time.Second,
		})
		ids[i] = res.ID
		if tc.reason != "exited" {
			// The event has always been right; the listing is the question.
			if f := waitFailure(t, failures, res.ID); f.Reason != tc.reason {
				t.Fatalf("%s: failure event %+v (exit %d)", tc.reason, f, res.ExitCode)
			}
		} else if res.ExitCode != 3 {
			t.Fatalf("exit 3 ended with %d", res.ExitCode)
		}
	}

	out, err := env.EnvsnapCLI("envs", "--all", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var envs []arbiter.EnvInfo
	if err := json.Unmarshal([]byte(out), &envs); err != nil {
		t.Fatalf("envs --all --json: %v\n%s", err, out)
	}
	table, err := env.EnvsnapCLI("envs", "--all")
	if err != nil {
		t.Fatal(err)
	}
	for i, tc := range cases {
		name := env.Namespace + "/" + ids[i]
		var got *arbiter.EnvInfo
		for j := range envs {
			if envs[j].Env == name {
				got = &envs[j]
			}
		}
		switch {
		case got == nil:
			t.Errorf("%s: %s not listed by envs --all", tc.reason, name)
		case got.Ended.IsZero() || got.Reason != tc.reason:
			t.Errorf("%s: envs --all lists %s as ended %v with reason %q", tc.reason, name, got.Ended, got.Reason)
		}
		line := ""
		for _, l := range strings.Split(table, "\n") {
			if strings.HasPrefix(l, name+" ") {
				line = l
			}
		}
		if !strings.Contains(line, "ended: "+tc.reason) {
			t.Errorf("%s: table line of %s is %q, want it to say ended: %s", tc.reason, name, line, tc.reason)
		}
	}
}
