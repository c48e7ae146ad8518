package groups_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/tests/testenv"
)

// groupLayers returns the layer digests of a published group.
func groupLayers(t *testing.T, env *testenv.Env, ref string) []string {
	t.Helper()
	ctx := env.Context()
	name, desc, err := env.Resolver().Resolve(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	f, err := env.Resolver().Fetcher(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := f.Fetch(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var m ocispec.Manifest
	b, _ := io.ReadAll(rc)
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range m.Layers {
		out = append(out, l.Digest.String())
	}
	return out
}

// TestArtifactArithmetic: 200 tasks over 5 repositories and 2 harnesses
// need 5 + 2 + 2 groups, not 400 images; composing every plan uploads no
// layer; a harness update republishes one group and recomposes all plans,
// still without a layer upload.
func TestArtifactArithmetic(t *testing.T) {
	const N, R, H = 200, 5, 2
	env := testenv.New(t)
	f := publishGroups(t, env)
	reg := env.Registry.Host

	published := 2 // base and evaluator, from publishGroups (its task and harness are not used below)
	var tasks, harnesses []string
	for r := 0; r < R; r++ {
		repo := writeTree(t, filepath.Join(f.dir, fmt.Sprintf("repo%d", r)), map[string]string{
			"calc.sh": calcSh, "test.sh": calcTestSh, "README": fmt.Sprintf("repository %d\n", r),
		})
		ref := fmt.Sprintf("%s/envsnap/task/repo%d:1", reg, r)
		f.cli(t, "group", "publish", "--kind", "task", "--from-dir", repo, "--prefix", "/workspace/calc", "--mtime", "0", ref)
		tasks = append(tasks, ref)
		published++
	}
	publishHarness := func(h int, version string) string {
		dir := writeTree(t, filepath.Join(f.dir, fmt.Sprintf("harness%d-%s", h, version)), map[string]string{
			"bin/agent": fmt.Sprintf("#!/bin/sh\necho agent-%d %s\n", h, version),
		})
		ref := fmt.Sprintf("%s/envsnap/harness/agent%d:latest", reg, h)
		return f.cli(t, "group", "publish", "--kind", "harness", "--from-dir", dir, "--prefix", "/opt/harness", "--mtime", "0", "--env", "PATH=/opt/harness/bin", ref)
	}
	for h := 0; h < H; h++ {
		publishHarness(h, "1.0")
		harnesses = append(harnesses, fmt.Sprintf("%s/envsnap/harness/agent%d:latest", reg, h))
		published++
	}
	if published != R+H+2 {
		t.Fatalf("published %d groups, want R+H+2 = %d", published, R+H+2)
	}
	layerSet := map[string]bool{}
	for _, ref := range append(append([]string{f.base, f.eval}, tasks...), harnesses...) {
		for _, d := range groupLayers(t, env, ref) {
			layerSet[d] = true
		}
	}

	var lines []string
	for i := 0; i < N; i++ {
		p := map[string]any{
			"name":   fmt.Sprintf("task-%03d", i),
			"groups": []string{f.base, tasks[i%R], harnesses[i%H], f.eval},
		}
		b, _ := json.Marshal(p)
		lines = append(lines, string(b))
	}
	taskList := filepath.Join(f.dir, "tasks.jsonl")
	if err := os.WriteFile(taskList, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	compose := func() string {
		env.Registry.ResetCounters()
		out := f.cli(t, "compose", "--quiet", "--tasks", taskList, "--target-pattern", reg+"/envsnap/env/{name}:1")
		for _, d := range env.Registry.UploadedDigests() {
			if layerSet[d] {
				t.Errorf("composition uploaded group layer %s", d)
			}
		}
		if mounts := len(env.Registry.MountRequests()); mounts == 0 {
			t.Error("composition made no cross-repository mount requests: layers were not linked")
		}
		if !strings.Contains(out, fmt.Sprintf("composed %d plans from %d distinct groups", N, R+H+2)) {
			t.Errorf("compose summary = %q", out)
		}
		return strings.TrimSpace(out)
	}
	t.Logf("first composition: %s", compose())

	// A harness update: one publish, one new layer, then every plan again.
	env.Registry.ResetCounters()
	out := publishHarness(0, "2.0")
	if !strings.Contains(out, "uploaded=1 ") {
		t.Errorf("harness update: %s, want exactly one layer uploaded", out)
	}
	for _, d := range groupLayers(t, env, harnesses[0]) {
		layerSet[d] = true
	}
	t.Logf("after harness update: %s", compose())

	// Unchanged content republished uploads nothing.
	env.Registry.ResetCounters()
	out = publishHarness(0, "2.0")
	if !strings.Contains(out, "uploaded=0 ") {
		t.Errorf("republishing unchanged harness: %s, want no layer uploaded", out)
	}
}

// TestEnvironmentsShareLayerMounts: two environments composed from the same
// groups run at once on one FUSE mount per layer.
func TestEnvironmentsShareLayerMounts(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := publishGroups(t, env)
	reg := env.Registry.Host
	layers := map[string]bool{}
	for _, ref := range []string{f.base, f.task, f.harn, f.eval} {
		for _, d := range groupLayers(t, env, ref) {
			layers[d] = true
		}
	}
	var imgs []client.Image
	for i := 0; i < 2; i++ {
		target := fmt.Sprintf("%s/envsnap/env/shared-%d:1", reg, i)
		p := map[string]any{"name": fmt.Sprintf("shared-%d", i), "groups": []string{f.base, f.task, f.harn, f.eval}, "labels": map[string]string{"env": fmt.Sprint(i)}}
		b, _ := json.Marshal(p)
		planPath := filepath.Join(f.dir, fmt.Sprintf("shared-%d.json", i))
		os.WriteFile(planPath, b, 0o644)
		f.cli(t, "compose", "--target", target, planPath)
		imgs = append(imgs, env.Pull(t, target, "envsnap"))
	}
	ctx := env.Context()
	for i, img := range imgs {
		id := fmt.Sprintf("shared-%d", i)
		c, err := env.Client.NewContainer(ctx, id, client.WithSnapshotter("envsnap"), client.WithNewSnapshot(id, img),
			client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs("/bin/sh", "-c", "agent --version; sleep 60")))
		if err != nil {
			t.Fatal(err)
		}
		task, err := c.NewTask(ctx, cio.NullIO)
		if err != nil {
			t.Fatal(err)
		}
		if err := task.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(env.Context(), 20*time.Second)
			defer cancel()
			task.Delete(cctx, client.WithProcessKill)
			c.Delete(cctx, client.WithSnapshotCleanup)
		})
	}
	var fuse []string
	for _, mp := range testenv.MountsBelow(env.EnvsnapRoot) {
		if fs := mountFSType(mp); strings.HasPrefix(fs, "fuse") {
			fuse = append(fuse, mp)
		}
	}
	t.Logf("%d FUSE mounts for %d distinct lazy layers across 2 running environments: %v", len(fuse), len(layers), fuse)
	if len(fuse) != len(layers) {
		t.Errorf("%d FUSE mounts for %d distinct layers: environments do not share one mount per layer", len(fuse), len(layers))
	}
}

// mountFSType returns the filesystem type mounted at mp.
func mountFSType(mp string) string {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 3 && f[1] == mp {
			return f[2]
		}
	}
	return ""
}
