package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/image-spec/identity"

	"github.com/envsnap/envsnap/tests/testenv"
)

// criNamespace is where CRI keeps its containers and images.
const criNamespace = "k8s.io"

// TestCRIEnvletPodWithDropIn runs a pod the way kubelet would for
// runtimeClassName: envlet, on a containerd that gets the envlet handler's
// annotation pass-through only from the shipped drop-in (imported over the
// harness config, with the proxy address pointed at the test daemon):
//   - a pull for the envlet handler lands in the envsnap snapshotter, a
//     plain pull in the default one (what docs/kubernetes.md tells
//     operators about kubelet's RuntimeClassInImageCriApi gate);
//   - the pod runs under our shim;
//   - the pod's io.envsnap.envlet.* annotations and kubelet's
//     terminationMessagePath reach the container's OCI spec, where the shim
//     reads them, and other annotations do not.
func TestCRIEnvletPodWithDropIn(t *testing.T) {
	env := envWithDropIn(t)
	img := env.PushImage(t, "deploy/envlet:1", []testenv.File{{Path: "/msg", Data: []byte("envlet\n")}})
	plain := env.PushImage(t, "deploy/plain:1", []testenv.File{{Path: "/msg", Data: []byte("plain\n")}})

	crictl := func(args ...string) string { t.Helper(); return env.MustCrictl(t, args...) }
	tmp := t.TempDir()
	// kubelet sends the runtime handler with PullImage only with its
	// RuntimeClassInImageCriApi feature gate; crictl can only say it with
	// the (deprecated) sandbox annotation CRI still honours.
	pullCfg := testenv.WriteJSON(t, tmp, "pull.json", map[string]any{
		"metadata":    map[string]any{"name": "pull", "namespace": "default", "uid": "pull-uid"},
		"annotations": map[string]string{"io.containerd.cri.runtime-handler": "envlet"},
	})
	crictl("pull", "--pod-config", pullCfg, img.Ref)
	crictl("pull", plain.Ref)

	ctx := namespaces.WithNamespace(env.Context(), criNamespace)
	snapshotterOf := func(ref string) []string {
		t.Helper()
		i, err := env.Client.GetImage(ctx, ref)
		if err != nil {
			t.Fatalf("image %s: %v", ref, err)
		}
		diffIDs, err := i.RootFS(ctx)
		if err != nil {
			t.Fatal(err)
		}
		chain := identity.ChainID(diffIDs).String()
		var in []string
		for _, sn := range []string{"overlayfs", "envsnap"} {
			_, err := env.Client.SnapshotService(sn).Stat(ctx, chain)
			switch {
			case err == nil:
				in = append(in, sn)
			case !errdefs.IsNotFound(err):
				t.Fatalf("stat %s in %s: %v", chain, sn, err)
			}
		}
		return in
	}
	if got := snapshotterOf(img.Ref); strings.Join(got, ",") != "envsnap" {
		t.Errorf("image pulled for the envlet handler is unpacked in %v, want [envsnap]", got)
	}
	if got := snapshotterOf(plain.Ref); strings.Join(got, ",") != "overlayfs" {
		t.Errorf("image pulled without a handler is unpacked in %v, want [overlayfs]", got)
	}

	pod := testenv.WriteJSON(t, tmp, "pod.json", map[string]any{
		"metadata":      map[string]any{"name": "envlet", "namespace": "default", "uid": "envlet-uid"},
		"log_directory": filepath.Join(tmp, "logs"),
		"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
		"annotations": map[string]string{
			"io.envsnap.envlet.initial-cpu":    "1",
			"io.envsnap.envlet.initial-memory": "256Mi",
			"io.envsnap.envlet.cap-memory":     "1Gi",
			"example.com/not-for-the-runtime":  "x",
		},
	})
	ctrCfg := testenv.WriteJSON(t, tmp, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "env"},
		"image":    map[string]any{"image": img.Ref},
		"command":  []string{"/bin/sh", "-c", "cat /msg; sleep 300"},
		"log_path": "env.log",
		"annotations": map[string]string{
			"io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
		},
	})
	podID := crictl("runp", "--runtime", "envlet", pod)
	t.Cleanup(func() { env.Crictl(t, "stopp", podID); env.Crictl(t, "rmp", "-f", podID) })
	ctrID := crictl("create", podID, ctrCfg, pod)
	crictl("start", ctrID)
	if out := crictl("exec", ctrID, "cat", "/msg"); out != "envlet" {
		t.Errorf("exec output %q, want envlet", out)
	}
	// kubelet's stats summary stats the filesystem CRI names for each
	// container's writable layer: for envsnap the proxy plugin's root export,
	// which CRI gives only a snapshotter its image service names (the
	// drop-in's runtime_platforms.envlet). An empty name fails kubelet's
	// whole summary, and with it every eviction.
	out := crictl("stats", "-o", "json", ctrID)
	mounts := regexp.MustCompile(`"mountpoint":\s*"([^"]*)"`).FindAllStringSubmatch(out, -1)
	if len(mounts) != 1 || mounts[0][1] != "/var/lib/containerd-envsnap" {
		t.Errorf("crictl stats of the envlet container names the writable layer's filesystem %v, want the drop-in's root export /var/lib/containerd-envsnap:\n%s", mounts, out)
	}

	c, err := env.Client.LoadContainer(ctx, ctrID)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Runtime.Name != "io.containerd.envlet.v2" || info.Snapshotter != "envsnap" {
		t.Errorf("container runs on runtime %q snapshotter %q, want io.containerd.envlet.v2 on envsnap", info.Runtime.Name, info.Snapshotter)
	}
	spec, err := c.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]string{
		"io.envsnap.envlet.initial-cpu":                  "1",
		"io.envsnap.envlet.initial-memory":               "256Mi",
		"io.envsnap.envlet.cap-memory":                   "1Gi",
		"io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
	} {
		if got, ok := spec.Annotations[k]; !ok || got != want {
			t.Errorf("OCI spec annotation %s = %q (present %v), want %q", k, got, ok, want)
		}
	}
	if _, ok := spec.Annotations["example.com/not-for-the-runtime"]; ok {
		t.Error("an annotation no pattern allows reached the OCI spec: the test cannot tell pass-through from copy-all")
	}

	// What kubelet without the feature gate gets: the image was pulled (in
	// full) into the default snapshotter, so CRI unpacks it again into
	// envsnap when it creates the container, from the blobs already in the
	// content store. Nothing fails, but nothing was lazy either.
	plainCfg := testenv.WriteJSON(t, tmp, "plain.json", map[string]any{
		"metadata": map[string]any{"name": "plain"},
		"image":    map[string]any{"image": plain.Ref},
		"command":  []string{"/bin/sh", "-c", "sleep 300"},
		"log_path": "plain.log",
	})
	plainID := crictl("create", podID, plainCfg, pod)
	if got := snapshotterOf(plain.Ref); strings.Join(got, ",") != "overlayfs,envsnap" {
		t.Errorf("after creating an envlet container from an image pulled without a handler it is unpacked in %v, want [overlayfs envsnap]", got)
	}
	crictl("rm", plainID)

	crictl("stop", "-t", "1", ctrID)
	crictl("rm", ctrID)
	crictl("stopp", podID)
	crictl("rmp", podID)
}

// envWithDropIn starts the harness with the shipped drop-in imported over
// its containerd config, the proxy address pointed at the harness daemon
// through a symlink (the only change to the file). The drop-in's tables
// merge over the harness's; its unpack_config list and proxy plugin replace
// the harness's, so what the tests see is the drop-in's behaviour.
func envWithDropIn(t *testing.T, envsnapArgs ...string) *testenv.Env {
	t.Helper()
	testenv.RequireRoot(t)
	dir := t.TempDir()
	link := filepath.Join(dir, "envsnap.sock")
	const shipped = `address = "/run/containerd-envsnap/containerd-envsnap.sock"`
	src := string(repoFile(t, "deploy/containerd/envsnap.toml"))
	if strings.Count(src, shipped) != 1 {
		t.Fatalf("drop-in does not contain %s exactly once", shipped)
	}
	dropin := filepath.Join(dir, "envsnap.toml")
	if err := os.WriteFile(dropin, []byte(strings.Replace(src, shipped, fmt.Sprintf("address = %q", link), 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	// CRI pods of these tests are on the host network (no CNI on a test
	// node), which the envlet shim refuses unless the node allows it.
	envletCfg := filepath.Join(dir, "envlet.toml")
	if err := os.WriteFile(envletCfg, []byte("[guard]\nallow-host-network = true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := testenv.New(t, testenv.WithEnvsnap(envsnapArgs...), testenv.WithImports(dropin), testenv.WithContainerdEnv("ENVLET_CONFIG="+envletCfg))
	// containerd dials the proxy lazily, so the link may follow the start.
	if err := os.Symlink(env.SnapshotterSocket, link); err != nil {
		t.Fatal(err)
	}
	return env
}
