package deploy

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/opencontainers/image-spec/identity"

	"github.com/envsnap/envsnap/tests/testenv"
)

// labelLayerDigest is one of the image-info labels a remote snapshotter
// needs on Prepare (containerd's pkg/snapshotters); the unpacker passes the
// same options to Commit, so the committed snapshot records whether the
// client sent them.
const labelLayerDigest = "containerd.io/snapshot/cri.layer-digest"

// TestCtrCommandsFromClientsDoc runs the ctr command lines docs/clients.md
// gives, with the real ctr against a containerd that imports the shipped
// drop-in (its unpack_config, with the arch-less "linux" platform, is the
// one in force), and checks the claims made next to them: which pulls
// carry the layer labels envsnap needs to serve layers lazily, and that
// `ctr run` with our runtime and an envlet annotation works.
func TestCtrCommandsFromClientsDoc(t *testing.T) {
	env := envWithDropIn(t)
	ctr := func(t *testing.T, args ...string) string {
		t.Helper()
		full := append([]string{"--address", env.Address, "--namespace", env.Namespace}, args...)
		out, err := exec.Command(testenv.Tool(t, "ctr"), full...).CombinedOutput()
		if err != nil {
			t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	ctx := namespaces.WithNamespace(env.Context(), env.Namespace)

	for _, tc := range []struct {
		name       string
		pull       []string
		wantLabels bool
	}{
		{"transfer service", []string{"images", "pull", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap"}, true},
		{"local pull", []string{"images", "pull", "--local", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Distinct content per case: images sharing layers would share
			// the snapshot the first pull committed.
			img := env.PushImage(t, "deploy/ctr-"+strings.ReplaceAll(tc.name, " ", "-")+":1",
				[]testenv.File{{Path: "/msg", Data: []byte("hello from ctr, " + tc.name + "\n")}})
			ctr(t, append(tc.pull, img.Ref)...)
			i, err := env.Client.GetImage(ctx, img.Ref)
			if err != nil {
				t.Fatal(err)
			}
			diffIDs, err := i.RootFS(ctx)
			if err != nil {
				t.Fatal(err)
			}
			info, err := env.Client.SnapshotService("envsnap").Stat(ctx, identity.ChainID(diffIDs).String())
			if err != nil {
				t.Fatalf("image not unpacked into envsnap: %v", err)
			}
			if _, got := info.Labels[labelLayerDigest]; got != tc.wantLabels {
				t.Errorf("top layer snapshot has %s = %v, want %v (labels %v)", labelLayerDigest, got, tc.wantLabels, info.Labels)
			}
			if !tc.wantLabels {
				return
			}
			out := ctr(t, "run", "--rm", "--snapshotter", "envsnap", "--runtime", "io.containerd.envlet.v2",
				"--annotation", "io.envsnap.envlet.initial-cpu=1", "--annotation", "io.envsnap.envlet.initial-memory=256Mi",
				img.Ref, "deploy-ctr-run", "cat", "/msg")
			if !strings.Contains(out, "hello from ctr") {
				t.Errorf("ctr run output %q", out)
			}
		})
	}
}
