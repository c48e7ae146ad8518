package groups_test

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// TestPublishGroupFromOCIArchive: an image exported as an OCI archive (the
// layout `buildctl --output type=oci` and `ctr images export` write) and a
// registry image are published as groups with --from-image, composed and
// run lazily; the archive image's Env is the group's contribution.
func TestPublishGroupFromOCIArchive(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := &fixture{env: env, dir: t.TempDir(), bin: testenv.Binary(t, "containerd-envsnap")}
	src := env.PushImage(t, "built/tool:1", []testenv.File{
		{Path: "/opt/tool/bin/hello", Mode: 0o755, Data: []byte("#!/bin/sh\necho hello from $TOOL_NAME\n")},
	}, testenv.WithImageEnv("TOOL_NAME=oci-archive", "PATH=/opt/tool/bin:/usr/sbin:/usr/bin:/sbin:/bin"))
	env.Pull(t, src.Ref, "overlayfs")
	archive := filepath.Join(f.dir, "tool.tar")
	// --local: through the transfer service, ctr 2.4 copies the archive
	// stream into the file in a goroutine that Transfer does not wait
	// for (core/transfer/archive ImageExportStream.MarshalAny), so ctr
	// can exit with the file short of its last blob (seen in CI: "short
	// read: expected 1147547 bytes but got 1114112").
	out, err := exec.Command(testenv.Tool(t, "ctr"), "--address", env.Address, "--namespace", env.Namespace,
		"images", "export", "--local", archive, src.Ref).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images export: %v\n%s", err, out)
	}

	base := env.Registry.Host + "/envsnap/base/from-oci:1"
	f.cli(t, "group", "publish", "--kind", "base", "--from-image", "oci-archive:"+archive, base)
	// The same image straight from the registry converts to the same
	// layers: published to the same repository, nothing is uploaded.
	again := env.Registry.Host + "/envsnap/base/from-oci:from-registry"
	if out := f.cli(t, "group", "publish", "--kind", "base", "--from-image", src.Ref, again); !strings.Contains(out, "uploaded=0 ") {
		t.Errorf("publishing the registry copy of the same image uploaded layers again:\n%s", out)
	}
	eval := writeTree(t, filepath.Join(f.dir, "evaluator"), map[string]string{"run.sh": "#!/bin/sh\nhello && echo reward=1\n"})
	evalRef := env.Registry.Host + "/envsnap/evaluator/hello:1"
	f.cli(t, "group", "publish", "--kind", "evaluator", "--from-dir", eval, "--prefix", "/opt/evaluator", "--mtime", "0", evalRef)

	target := env.Registry.Host + "/envsnap/env/from-oci:1"
	planPath := filepath.Join(f.dir, "plan.toml")
	writeTree(t, f.dir, map[string]string{"plan.toml": "name = \"from-oci\"\ngroups = [\"" + base + "\", \"" + evalRef + "\"]\n"})
	f.cli(t, "compose", "--target", target, planPath)
	img := env.Pull(t, target, "envsnap")
	res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/opt/evaluator/run.sh"}})
	if res.ExitCode != 0 || !strings.Contains(res.Stdout, "hello from oci-archive") || !strings.Contains(res.Stdout, "reward=1") {
		t.Errorf("exit %d, stdout %q: want the archive image's tool on its PATH with its Env", res.ExitCode, res.Stdout)
	}
}
