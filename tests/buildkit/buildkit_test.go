// Package buildkit_test runs a real BuildKit (buildkitd and buildctl built
// by `make deps`) and takes its OCI output through envsnap: group publish
// --from-image, compose, and a lazy pull and run.
package buildkit_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/opencontainers/image-spec/identity"

	"github.com/envsnap/envsnap/snapshotter"
	"github.com/envsnap/envsnap/tests/testenv"
)

const dockerfile = `FROM scratch
COPY busybox /bin/busybox
COPY msg /etc/msg
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox echo built by buildkit > /etc/built && /bin/busybox ln -s busybox /bin/sh"]
ENV PATH=/bin
`

// startBuildkitd runs a rootful buildkitd with workerArgs, its own root
// and socket below dir, stopped by PID at cleanup, and returns its address
// once it answers.
func startBuildkitd(t *testing.T, dir string, workerArgs ...string) string {
	t.Helper()
	addr := "unix://" + filepath.Join(dir, "buildkitd.sock")
	env := []string{"PATH=" + testenv.ToolsDir(t) + ":" + os.Getenv("PATH")}
	testenv.StartProcess(t, dir, "buildkitd", env, testenv.Tool(t, "buildkitd"),
		append([]string{"--root", filepath.Join(dir, "root"), "--addr", addr}, workerArgs...)...)
	buildctl := testenv.Tool(t, "buildctl")
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := exec.Command(buildctl, "--addr", addr, "debug", "workers").CombinedOutput()
		if err == nil && strings.Contains(string(out), "linux/") {
			return addr
		}
		if time.Now().After(deadline) {
			t.Fatalf("buildkitd did not answer within 60s: %v\n%s", err, out)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func TestBuildctlOCIOutputToGroup(t *testing.T) {
	// containerd as it comes: the pull below is lazy through the hints
	// that group publish and compose write, not through client labels.
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithoutSnapshotLabels())
	// Unix socket paths are short: below the env's directory.
	dir, err := os.MkdirTemp(env.Dir, "bk-")
	if err != nil {
		t.Fatal(err)
	}
	// The runc worker; no CNI on the test machine, and the build needs no
	// network.
	addr := startBuildkitd(t, dir, "--oci-worker=true", "--containerd-worker=false", "--oci-worker-net=host")

	ctxDir := t.TempDir()
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatalf("read /bin/busybox (busybox-static, make deps): %v", err)
	}
	for name, data := range map[string][]byte{"Dockerfile": []byte(dockerfile), "busybox": bb, "msg": []byte("hello from buildkit\n")} {
		mode := os.FileMode(0o644)
		if name == "busybox" {
			mode = 0o755
		}
		if err := os.WriteFile(filepath.Join(ctxDir, name), data, mode); err != nil {
			t.Fatal(err)
		}
	}
	archive := filepath.Join(t.TempDir(), "out.tar")
	build := exec.Command(testenv.Tool(t, "buildctl"), "--addr", addr, "build", "--frontend", "dockerfile.v0",
		"--local", "context="+ctxDir, "--local", "dockerfile="+ctxDir, "--output", "type=oci,dest="+archive)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("buildctl build: %v\n%s", err, out)
	}

	bin := testenv.Binary(t, "containerd-envsnap")
	cli := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(bin, append(args, "--hosts-dir", env.HostsDir)...).CombinedOutput()
		if err != nil {
			t.Fatalf("containerd-envsnap %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	base := env.Registry.Host + "/buildkit/base:1"
	cli("group", "publish", "--kind", "base", "--from-image", "oci-archive:"+archive, base)
	planPath := filepath.Join(t.TempDir(), "plan.toml")
	if err := os.WriteFile(planPath, []byte(fmt.Sprintf("name = \"bk\"\ngroups = [%q]\n", base)), 0o644); err != nil {
		t.Fatal(err)
	}
	target := env.Registry.Host + "/buildkit/env:1"
	cli("compose", "--target", target, planPath)

	ctx := env.Context()
	img, err := env.Client.Pull(ctx, target, client.WithResolver(env.Resolver()), client.WithPullUnpack, client.WithPullSnapshotter("envsnap"))
	if err != nil {
		t.Fatal(err)
	}
	diffIDs, err := img.RootFS(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(diffIDs) < 3 {
		t.Fatalf("%d layers, want one per COPY and RUN", len(diffIDs))
	}
	for i := range diffIDs {
		info, err := env.Client.SnapshotService("envsnap").Stat(ctx, identity.ChainID(diffIDs[:i+1]).String())
		if err != nil {
			t.Fatal(err)
		}
		if info.Labels[snapshotter.LabelTOCDigest] == "" {
			t.Fatalf("layer %d of the composed image was not served lazily through its hints (labels %v)", i, info.Labels)
		}
	}
	res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sh", "-c", "cat /etc/msg /etc/built; echo $PATH"}})
	if want := "hello from buildkit\nbuilt by buildkit\n/bin\n"; res.ExitCode != 0 || res.Stdout != want {
		t.Fatalf("container exited %d with %q (stderr %q), want %q", res.ExitCode, res.Stdout, res.Stderr, want)
	}
}

// TestContainerdWorkerFromIsLazy: BuildKit's containerd worker, building
// FROM an image converted by envsnap, reads the base lazily through the
// layers' hint annotations. BuildKit passes layer annotations to Prepare
// only for a snapshotter named "stargz", so containerd knows the envsnap
// daemon by that name here.
func TestContainerdWorkerFromIsLazy(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithoutSnapshotLabels(), testenv.WithProxyName("stargz"))
	src := env.PushImage(t, "buildkit/src:1", []testenv.File{
		{Path: "/msg", Data: []byte("from a lazy base\n")},
		testenv.RandomFile("/data/unread.bin", 32<<20, 7),
	})
	base := env.Registry.Host + "/buildkit/lazy-base:1"
	if out, err := exec.Command(testenv.Binary(t, "containerd-envsnap"), "convert", "--hosts-dir", env.HostsDir, src.Ref, base).CombinedOutput(); err != nil {
		t.Fatalf("convert: %v\n%s", err, out)
	}
	dir, err := os.MkdirTemp(env.Dir, "bk-")
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "buildkitd.toml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("[registry.%q]\n  http = true\n", env.Registry.Host)), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := startBuildkitd(t, dir, "--config", cfg, "--oci-worker=false", "--containerd-worker=true",
		"--containerd-worker-addr", env.Address, "--containerd-worker-snapshotter", env.ProxyName(),
		"--containerd-worker-net=host")

	ctxDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(ctxDir, "Dockerfile"), []byte("FROM "+base+"\nRUN cat /msg > /copied && test \"$(cat /copied)\" = 'from a lazy base'\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env.Registry.ResetCounters()
	// No output: exporting would need every blob of the base.
	build := exec.Command(testenv.Tool(t, "buildctl"), "--addr", addr, "build", "--frontend", "dockerfile.v0",
		"--local", "context="+ctxDir, "--local", "dockerfile="+ctxDir)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("buildctl build: %v\n%s", err, out)
	}
	served, imageBytes := env.Registry.BlobBytesServed(), int64(0)
	status, err := exec.Command(testenv.Binary(t, "containerd-envsnap"), "status", "--address", env.SnapshotterSocket, "--json").Output()
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	var st struct {
		Layers []struct {
			BlobSize int64 `json:"blob_size"`
		} `json:"layers"`
	}
	if err := json.Unmarshal(status, &st); err != nil || len(st.Layers) != 2 {
		t.Fatalf("status: %v, want the base's 2 layers mounted lazily:\n%s", err, status)
	}
	for _, l := range st.Layers {
		imageBytes += l.BlobSize
	}
	t.Logf("registry served %d of %d base image bytes (%.2f%%)", served, imageBytes, 100*float64(served)/float64(imageBytes))
	if served*10 > imageBytes {
		t.Errorf("registry served %d of %d base image bytes: the FROM image was not read lazily", served, imageBytes)
	}
}
