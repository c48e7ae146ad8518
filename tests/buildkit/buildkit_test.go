// Package buildkit_test runs a real BuildKit (buildkitd and buildctl built
// by `make deps`) and takes its OCI output through envsnap: group publish
// --from-image, compose, and a lazy pull and run.
package buildkit_test

import (
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

// startBuildkitd runs a rootful buildkitd with the runc worker, its own
// root and socket below dir, stopped by PID at cleanup, and returns its
// address once it answers.
func startBuildkitd(t *testing.T, dir string) string {
	t.Helper()
	addr := "unix://" + filepath.Join(dir, "buildkitd.sock")
	env := []string{"PATH=" + testenv.ToolsDir(t) + ":" + os.Getenv("PATH")}
	testenv.StartProcess(t, dir, "buildkitd", env, testenv.Tool(t, "buildkitd"),
		"--root", filepath.Join(dir, "root"), "--addr", addr,
		"--oci-worker=true", "--containerd-worker=false",
		// No CNI on the test machine; the build needs no network.
		"--oci-worker-net=host")
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
	addr := startBuildkitd(t, dir)

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
