// Package pulls_test checks that pulls whose client adds no remote-snapshot
// labels are lazy all the same: containerd's unpacker passes a layer's
// containerd.io/snapshot/ annotations to the snapshotter, and the layers
// that convert, group publish and compose write carry envsnap's hints
// there. Every test runs containerd without the labels (CRI's
// disable_snapshot_annotations at its default, no remote-snapshot export
// for the transfer service), so only the hints can make a pull lazy.
package pulls_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/platforms"
	"github.com/opencontainers/image-spec/identity"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/snapshotter"
	"github.com/envsnap/envsnap/tests/testenv"
)

const message = "hello from a hinted layer\n"

// files is the image content: a message and 32 MiB nobody reads.
func files() []testenv.File {
	return []testenv.File{{Path: "/msg", Data: []byte(message)}, testenv.RandomFile("/data/unread.bin", 32<<20, 7)}
}

// convertedImage pushes a busybox image with files(), converts it with
// `containerd-envsnap convert` to ref and returns the converted layers'
// total size.
func convertedImage(t *testing.T, env *testenv.Env, ref string) int64 {
	t.Helper()
	src := env.PushImage(t, "pulls/src:1", files())
	out, err := exec.Command(testenv.Binary(t, "containerd-envsnap"), "convert", "--hosts-dir", env.HostsDir, src.Ref, ref).CombinedOutput()
	if err != nil {
		t.Fatalf("convert: %v\n%s", err, out)
	}
	ctx := env.Context()
	resolver := env.Resolver()
	name, desc, err := resolver.Resolve(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	fetcher, err := resolver.Fetcher(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	rc, err := fetcher.Fetch(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var m ocispec.Manifest
	if err := json.NewDecoder(rc).Decode(&m); err != nil {
		t.Fatal(err)
	}
	var size int64
	for _, l := range m.Layers {
		if l.Annotations[layerfmt.AnnotationHintSource] != strings.TrimSuffix(ref, ":1") {
			t.Fatalf("layer %s has no hints naming the repository it was pushed to: %v", l.Digest, l.Annotations)
		}
		size += l.Size
	}
	return size
}

// requireHinted fails t unless every layer of img is a lazy snapshot found
// through its hints, with no CRI label on it.
func requireHinted(t *testing.T, ctx context.Context, env *testenv.Env, img client.Image) {
	t.Helper()
	diffIDs, err := img.RootFS(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sn := env.Client.SnapshotService("envsnap")
	for i := range diffIDs {
		info, err := sn.Stat(ctx, identity.ChainID(diffIDs[:i+1]).String())
		if err != nil {
			t.Fatal(err)
		}
		if info.Labels[snapshotter.LabelTOCDigest] == "" || info.Labels[snapshotter.LabelLayerDigest] == "" {
			t.Fatalf("layer %d of %s is not served lazily through its hints (labels %v)", i, img.Name(), info.Labels)
		}
		for k := range info.Labels {
			if strings.HasPrefix(k, "containerd.io/snapshot/cri.") {
				t.Fatalf("layer %d of %s got the CRI label %s: the test would not test hints", i, img.Name(), k)
			}
		}
	}
}

// checkLazy fails t unless the registry served well under the image's
// bytes since its counters were reset.
func checkLazy(t *testing.T, env *testenv.Env, imageBytes int64) {
	t.Helper()
	served := env.Registry.BlobBytesServed()
	t.Logf("registry served %d of %d image bytes (%.2f%%)", served, imageBytes, 100*float64(served)/float64(imageBytes))
	if served*10 > imageBytes {
		t.Errorf("registry served %d of %d image bytes: the pull was not lazy", served, imageBytes)
	}
}

// TestGoClientPull: the Go client's plain Pull, with no info handler
// wrapper (nerdctl adds one only for snapshotters it knows by name).
func TestGoClientPull(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithoutSnapshotLabels())
	ref := env.Registry.Host + "/pulls/go-client:1"
	imageBytes := convertedImage(t, env, ref)
	ctx := env.Context()

	env.Registry.ResetCounters()
	img, err := env.Client.Pull(ctx, ref, client.WithResolver(env.Resolver()), client.WithPullUnpack, client.WithPullSnapshotter("envsnap"))
	if err != nil {
		t.Fatal(err)
	}
	requireHinted(t, ctx, env, img)
	res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"cat", "/msg"}})
	if res.ExitCode != 0 || res.Stdout != message {
		t.Fatalf("container exited %d with %q (stderr %q)", res.ExitCode, res.Stdout, res.Stderr)
	}
	checkLazy(t, env, imageBytes)
}

// TestCRIPull: CRI with disable_snapshot_annotations at its default, for
// the runtime handler whose snapshotter is envsnap.
func TestCRIPull(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithoutSnapshotLabels())
	ref := env.Registry.Host + "/pulls/cri:1"
	imageBytes := convertedImage(t, env, ref)

	env.Registry.ResetCounters()
	pullCfg := testenv.WriteJSON(t, t.TempDir(), "pull.json", map[string]any{
		"metadata":    map[string]any{"name": "pull", "namespace": "default", "uid": "pull-uid"},
		"annotations": map[string]string{"io.containerd.cri.runtime-handler": "envlet"},
	})
	env.MustCrictl(t, "pull", "--pod-config", pullCfg, ref)
	ctx := namespaces.WithNamespace(context.Background(), "k8s.io")
	img, err := env.Client.GetImage(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	requireHinted(t, ctx, env, img)
	res, err := env.Run(ctx, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"cat", "/msg"}})
	if err != nil || res.ExitCode != 0 || res.Stdout != message {
		t.Fatalf("container: %v, exited %d with %q (stderr %q)", err, res.ExitCode, res.Stdout, res.Stderr)
	}
	checkLazy(t, env, imageBytes)
}

// TestRefusedHint: a hint naming a registry the daemon's policy does not
// allow (here one without a directory in its hosts dir) is logged and
// ignored; the daemon never contacts that registry and the layer is
// downloaded and unpacked normally.
func TestRefusedHint(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithoutSnapshotLabels())
	other := testenv.StartRegistry(t, t.TempDir())
	bb, err := testenv.BusyboxFiles()
	if err != nil {
		t.Fatal(err)
	}
	var layers []testenv.LayerBlob
	var imageBytes int64
	for _, fs := range [][]testenv.File{bb, files()} {
		tb, err := testenv.LayerTar(fs)
		if err != nil {
			t.Fatal(err)
		}
		var blob bytes.Buffer
		res, err := layerfmt.Convert(context.Background(), &blob, bytes.NewReader(tb))
		if err != nil {
			t.Fatal(err)
		}
		layers = append(layers, testenv.LayerBlob{
			Desc: ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: res.Digest, Size: res.Size,
				Annotations: layerfmt.WithHints(res.Annotations(), other.Host+"/pulls/elsewhere", res.Digest, res.Size)},
			DiffID: res.DiffID, Data: blob.Bytes(),
		})
		imageBytes += res.Size
	}
	pushed := env.PushLayerBlobs(t, "pulls/refused:1", layers)
	// The named registry has the blobs: a daemon that followed the hint
	// would serve the layers lazily from there.
	hostsDir := t.TempDir()
	testenv.WriteHostsDir(t, hostsDir, other.Host)
	resolver := docker.NewResolver(docker.ResolverOptions{Hosts: config.ConfigureHosts(context.Background(), config.HostOptions{HostDir: config.HostDirFromRoot(hostsDir)})})
	pusher, err := resolver.Pusher(env.Context(), other.Host+"/pulls/elsewhere:1")
	if err != nil {
		t.Fatal(err)
	}
	if err := remotes.PushContent(env.Context(), pusher, pushed.Manifest, env.ContentStore, nil, platforms.All, nil); err != nil {
		t.Fatal(err)
	}
	other.ResetCounters()

	env.Registry.ResetCounters()
	ctx := env.Context()
	img, err := env.Client.Pull(ctx, pushed.Ref, client.WithResolver(env.Resolver()), client.WithPullUnpack, client.WithPullSnapshotter("envsnap"))
	if err != nil {
		t.Fatalf("pull with refused hints: %v", err)
	}
	diffIDs, err := img.RootFS(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range diffIDs {
		info, err := env.Client.SnapshotService("envsnap").Stat(ctx, identity.ChainID(diffIDs[:i+1]).String())
		if err != nil {
			t.Fatal(err)
		}
		if v, ok := info.Labels[snapshotter.LabelLayerDigest]; ok {
			t.Errorf("layer %d served lazily (layer %s) through a refused hint", i, v)
		}
	}
	res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"cat", "/msg"}})
	if res.ExitCode != 0 || res.Stdout != message {
		t.Fatalf("container exited %d with %q (stderr %q)", res.ExitCode, res.Stdout, res.Stderr)
	}
	if n, b := other.BlobRequests(), other.BlobBytesServed(); n != 0 || b != 0 {
		t.Errorf("the registry a refused hint named served %d blob requests, %d bytes", n, b)
	}
	if served := env.Registry.BlobBytesServed(); served < imageBytes {
		t.Errorf("registry served %d of %d image bytes: the layers were not downloaded", served, imageBytes)
	}
	log, err := os.ReadFile(env.Envsnap.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(log, []byte("refusing its hint")) || !bytes.Contains(log, []byte(other.Host+"/pulls/elsewhere")) {
		t.Errorf("the daemon's log does not say it refused the hint:\n%s", tail(log, 40))
	}
}

func tail(b []byte, lines int) string {
	ls := strings.Split(string(b), "\n")
	return strings.Join(ls[max(0, len(ls)-lines):], "\n")
}

// TestTransferServicePull: `ctr images pull` through the transfer service,
// whose proxy plugin here does not export
// enable_remote_snapshot_annotations.
func TestTransferServicePull(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false"), testenv.WithoutSnapshotLabels())
	ref := env.Registry.Host + "/pulls/transfer:1"
	imageBytes := convertedImage(t, env, ref)

	env.Registry.ResetCounters()
	out, err := exec.Command(testenv.Tool(t, "ctr"), "--address", env.Address, "--namespace", env.Namespace,
		"images", "pull", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap", ref).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images pull: %v\n%s", err, out)
	}
	ctx := env.Context()
	img, err := env.Client.GetImage(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	requireHinted(t, ctx, env, img)
	checkLazy(t, env, imageBytes)
}
