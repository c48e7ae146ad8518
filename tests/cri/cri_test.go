// Package cri_test runs a Kubernetes-style pod through CRI (crictl) with
// the envlet RuntimeClass handler on an image composed from envsnap layer
// groups: the image is served lazily, the application container runs
// under the envlet controller, the sandbox does not, and the usual crictl
// verbs work.
package cri_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/internal/plan"
	"github.com/envsnap/envsnap/tests/testenv"
)

// lazyImage publishes a busybox base group and a data group holding a
// 32 MiB file nobody reads, and composes them into ref.
func lazyImage(t *testing.T, env *testenv.Env, ref string) int64 {
	t.Helper()
	ctx := env.Context()
	dir := t.TempDir()
	bb, err := testenv.BusyboxFiles()
	if err != nil {
		t.Fatal(err)
	}
	pub := &group.Publisher{Hosts: env.Hosts()}
	var refs []string
	for _, g := range []struct {
		kind  string
		files []testenv.File
	}{
		{"base", bb},
		{"data", []testenv.File{{Path: "/msg", Data: []byte("envlet-lazy\n")}, testenv.RandomFile("/data/unread.bin", 32<<20, 7)}},
	} {
		tb, err := testenv.LayerTar(g.files)
		if err != nil {
			t.Fatal(err)
		}
		tarPath := filepath.Join(dir, g.kind+".tar")
		if err := os.WriteFile(tarPath, tb, 0o644); err != nil {
			t.Fatal(err)
		}
		gref := fmt.Sprintf("%s/cri/%s:1", env.Registry.Host, g.kind)
		meta := group.Meta{Kind: g.kind}
		if g.kind == "base" {
			meta.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
		}
		if _, err := pub.Publish(ctx, gref, []group.TarSource{group.TarFileSource(tarPath)}, meta); err != nil {
			t.Fatal(err)
		}
		refs = append(refs, gref)
	}
	c := &plan.Composer{Hosts: env.Hosts()}
	img, err := c.Compose(ctx, &plan.Plan{Name: "cri", Groups: refs})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Push(ctx, img, ref); err != nil {
		t.Fatal(err)
	}
	var size int64
	for _, l := range img.Manifest.Layers {
		size += l.Size
	}
	return size
}

func TestEnvletPodOnLazyImage(t *testing.T) {
	// No background fill: what the registry serves is what was read.
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithEnvlet(testenv.EnvletConfig{
		Policy: map[string]string{"initial-cpu": "0.5", "initial-memory": "256Mi"},
		// No CNI on the test node: the pod is on the host network.
		AllowHostNetwork: true,
	}))
	ref := env.Registry.Host + "/cri/env:1"
	imageBytes := lazyImage(t, env, ref)
	tmp := t.TempDir()
	crictl := func(args ...string) string { t.Helper(); return env.MustCrictl(t, args...) }

	// The pull for the envlet handler (kubelet says so with its
	// RuntimeClassInImageCriApi gate; crictl with this annotation).
	env.Registry.ResetCounters()
	pullCfg := testenv.WriteJSON(t, tmp, "pull.json", map[string]any{
		"metadata":    map[string]any{"name": "pull", "namespace": "default", "uid": "pull-uid"},
		"annotations": map[string]string{"io.containerd.cri.runtime-handler": "envlet"},
	})
	crictl("pull", "--pod-config", pullCfg, ref)

	pod := testenv.WriteJSON(t, tmp, "pod.json", map[string]any{
		"metadata":      map[string]any{"name": "rollout", "namespace": "default", "uid": "rollout-uid"},
		"log_directory": filepath.Join(tmp, "logs"),
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
	})
	ctrCfg := testenv.WriteJSON(t, tmp, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "agent"},
		"image":    map[string]any{"image": ref},
		"command":  []string{"/bin/sh", "-c", "cat /msg; exec sleep 300"},
		"log_path": "agent.log",
	})
	podID := crictl("runp", "--runtime", "envlet", pod)
	t.Cleanup(func() { env.Crictl(t, "stopp", podID); env.Crictl(t, "rmp", "-f", podID) })
	ctrID := crictl("create", podID, ctrCfg, pod)
	crictl("start", ctrID)

	if out := crictl("exec", ctrID, "cat", "/msg"); out != "envlet-lazy" {
		t.Errorf("crictl exec: %q, want envlet-lazy", out)
	}
	var logs string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if logs = crictl("logs", ctrID); strings.Contains(logs, "envlet-lazy") {
			break
		}
	}
	if !strings.Contains(logs, "envlet-lazy") {
		t.Errorf("crictl logs: %q, want the container's output", logs)
	}
	if out := crictl("stats", "--id", ctrID, "-o", "json"); !strings.Contains(out, ctrID) || !strings.Contains(out, "memory") {
		t.Errorf("crictl stats does not report the container:\n%s", out)
	}

	// Lazily served: the 32 MiB file was never read, so the registry served
	// a small fraction of the image (metadata, busybox, /msg).
	served := env.Registry.BlobBytesServed()
	t.Logf("registry served %d of %d image bytes (%.1f%%) for pull, start, exec", served, imageBytes, 100*float64(served)/float64(imageBytes))
	if served*100 > imageBytes*15 {
		t.Errorf("registry served %d of %d image bytes: the image was not served lazily", served, imageBytes)
	}

	// Under the controller: the arbiter knows the application container,
	// admitted at the configured initial quota, and not the sandbox.
	out, err := env.EnvsnapCLI("envs", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var envs []struct {
		Env  string
		Base struct {
			CPU    float64
			Memory int64
		}
	}
	if err := json.Unmarshal([]byte(out), &envs); err != nil {
		t.Fatalf("envs --json: %v\n%s", err, out)
	}
	if len(envs) != 1 || envs[0].Env != "k8s.io/"+ctrID {
		t.Fatalf("environments under the controller %+v, want only the application container %s (sandbox %s untouched)", envs, ctrID, podID)
	}
	if envs[0].Base.CPU != 0.5 || envs[0].Base.Memory != 256<<20 {
		t.Errorf("admitted with %+v, want the configured 0.5 cores / 256 MiB", envs[0].Base)
	}

	crictl("stop", "-t", "1", ctrID)
	crictl("rm", ctrID)
	crictl("stopp", podID)
	crictl("rmp", podID)
	if out, _ := env.EnvsnapCLI("envs"); strings.Contains(out, ctrID) {
		t.Errorf("removed container still listed by the arbiter:\n%s", out)
	}
}
