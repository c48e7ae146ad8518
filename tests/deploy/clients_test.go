package deploy

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/platforms"
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

// TestConvertOCIArchiveThenCRIPull follows the BuildKit path of
// docs/clients.md with the real binaries: an OCI image archive (what
// `buildctl --output type=oci` and `ctr images export` write) is converted
// with `containerd-envsnap convert oci-archive:... REF`, then pulled by CRI
// for the envlet handler through the shipped drop-in, and its layers are
// mounted without being downloaded, as `containerd-envsnap status` shows.
func TestConvertOCIArchiveThenCRIPull(t *testing.T) {
	// No background fill: what the registry served is what the pull cost.
	env := envWithDropIn(t, "--fill=false")
	plain := env.PushImage(t, "deploy/app:1", []testenv.File{testenv.RandomFile("/data/blob.bin", 16<<20, 7)})
	ctr := func(args ...string) {
		t.Helper()
		full := append([]string{"--address", env.Address, "--namespace", env.Namespace}, args...)
		if out, err := exec.Command(testenv.Tool(t, "ctr"), full...).CombinedOutput(); err != nil {
			t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	archive := filepath.Join(t.TempDir(), "app.tar")
	ctr("images", "pull", "--local", "--hosts-dir", env.HostsDir, plain.Ref)
	// --local: see TestPublishGroupFromOCIArchive (the transfer path of
	// ctr 2.4 can exit before the archive is fully written).
	ctr("images", "export", "--local", archive, plain.Ref)

	lazyRef := env.Registry.Host + "/deploy/app:1-envsnap"
	envsnap := testenv.Binary(t, "containerd-envsnap")
	if out, err := exec.Command(envsnap, "convert", "--hosts-dir", env.HostsDir, "oci-archive:"+archive, lazyRef).CombinedOutput(); err != nil {
		t.Fatalf("containerd-envsnap convert: %v\n%s", err, out)
	}

	pullCfg := testenv.WriteJSON(t, t.TempDir(), "pull.json", map[string]any{
		"metadata":    map[string]any{"name": "pull", "namespace": "default", "uid": "pull-uid"},
		"annotations": map[string]string{"io.containerd.cri.runtime-handler": "envlet"},
	})
	env.Registry.ResetCounters()
	if out, err := env.Crictl(t, "pull", "--pod-config", pullCfg, lazyRef); err != nil {
		t.Fatalf("crictl pull: %v\n%s", err, out)
	}

	ctx := namespaces.WithNamespace(env.Context(), criNamespace)
	img, err := env.Client.GetImage(ctx, lazyRef)
	if err != nil {
		t.Fatal(err)
	}
	m, err := images.Manifest(ctx, env.Client.ContentStore(), img.Target(), platforms.Default())
	if err != nil {
		t.Fatal(err)
	}
	var total, served int64
	for _, l := range m.Layers {
		total += l.Size
		served += env.Registry.BlobBytesServedFor(l.Digest.String())
	}
	t.Logf("CRI pull of %s: registry served %d of %d layer bytes", lazyRef, served, total)
	if served*10 >= total {
		t.Errorf("CRI pull of the converted image fetched %d of %d layer bytes: not lazy", served, total)
	}

	out, err := exec.Command(envsnap, "status", "--address", env.SnapshotterSocket, "--json").Output()
	if err != nil {
		t.Fatalf("containerd-envsnap status: %v", err)
	}
	var st struct {
		Layers []struct {
			Digest  string `json:"digest"`
			Mounted bool   `json:"mounted"`
			Ref     string `json:"ref"`
		} `json:"layers"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	mounted := map[string]bool{}
	for _, l := range st.Layers {
		if l.Mounted && l.Ref == lazyRef {
			mounted[l.Digest] = true
		}
	}
	for _, l := range m.Layers {
		if !mounted[l.Digest.String()] {
			t.Errorf("layer %s of %s is not a mounted lazy layer in `containerd-envsnap status`: %s", l.Digest, lazyRef, out)
		}
	}
}
