// Package convert_test checks converted images end to end: the convert
// command pushes an image whose layers are in the lazy layer format, and a
// containerd that never saw the source pulls and runs it, with the
// overlayfs snapshotter and with envsnap.
package convert_test

import (
	"archive/tar"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/opencontainers/image-spec/identity"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/snapshotter"
	"github.com/envsnap/envsnap/tests/testenv"
)

// sourceLayers is a three-layer source image: a busybox userland, a layer
// with what tar can carry (owners, set-id bits, xattrs, hard and symbolic
// links, a large file), and a layer that deletes a file and makes a
// directory opaque.
func sourceLayers(t *testing.T) [][]byte {
	t.Helper()
	bb, err := testenv.BusyboxFiles()
	if err != nil {
		t.Fatal(err)
	}
	base, err := testenv.LayerTar(bb)
	if err != nil {
		t.Fatal(err)
	}
	big := testenv.RandomFile("/data/big.bin", 5<<20, 7)
	bigData, err := io.ReadAll(big.Reader())
	if err != nil {
		t.Fatal(err)
	}
	dir := func(name string, mode int64) tarEntry {
		return tarEntry{name: name, typ: tar.TypeDir, mode: mode}
	}
	file := func(name string, mode int64, data string) tarEntry {
		return tarEntry{name: name, typ: tar.TypeReg, mode: mode, data: []byte(data)}
	}
	tool := file("usr/local/bin/tool", 0o4750, "#!/bin/sh\necho tool\n")
	tool.uid, tool.gid = 1000, 100
	attr := file("data/attr.txt", 0o640, "has xattrs\n")
	attr.xattrs = map[string]string{"user.envsnap.test": "hello", "user.envsnap.other": "x\x00y"}
	owned := dir("data/owned", 0o2775)
	owned.uid, owned.gid = 65534, 65534
	second := layerTar(t, []tarEntry{
		dir("data/", 0o755),
		file("data/hello.txt", 0o644, "hello from a converted layer\n"),
		{name: "data/hard", typ: tar.TypeLink, link: "data/hello.txt", mode: 0o644},
		{name: "data/link", typ: tar.TypeSymlink, link: "hello.txt", mode: 0o777},
		attr,
		file("data/gone.txt", 0o644, "deleted by the next layer\n"),
		{name: "data/big.bin", typ: tar.TypeReg, mode: 0o644, data: bigData},
		owned,
		dir("opaque/", 0o755),
		file("opaque/old.txt", 0o644, "hidden by the opaque directory above\n"),
		dir("usr/", 0o755), dir("usr/local/", 0o755), dir("usr/local/bin/", 0o755),
		tool,
	})
	third := layerTar(t, []tarEntry{
		dir("data/", 0o755),
		file("data/.wh.gone.txt", 0o644, ""),
		dir("opaque/", 0o755),
		file("opaque/.wh..wh..opq", 0o644, ""),
		file("opaque/new.txt", 0o644, "only this is left\n"),
	})
	return [][]byte{base, second, third}
}

// TestConvertedImageOnFreshContainerd converts an image and runs the result
// on a containerd that never saw the source, so every layer is read from
// the converted blobs: once downloaded and unpacked by containerd
// (overlayfs: the blobs must be valid tar+zstd) and once served lazily by
// envsnap. The root filesystems of both must equal the source's, entry by
// entry: contents, modes, owners, xattrs, hard links, symlinks, deleted
// files and opaque directories.
func TestConvertedImageOnFreshContainerd(t *testing.T) {
	ctx := context.Background()
	srcEnv := testenv.New(t)
	var layers []testenv.LayerBlob
	for _, tb := range sourceLayers(t) {
		l, err := testenv.GzipLayer(tb)
		if err != nil {
			t.Fatal(err)
		}
		layers = append(layers, l)
	}
	src := srcEnv.PushLayerBlobs(t, "convert/src:v1", layers)
	dst := srcEnv.Registry.Host + "/convert/dst:v1"
	cmd := exec.Command(testenv.Binary(t, "containerd-envsnap"), "convert", "--hosts-dir", srcEnv.HostsDir, src.Ref, dst)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("convert: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "3 layers (3 converted)") {
		t.Errorf("summary line missing or wrong:\n%s", out)
	}

	// The pushed manifest: every layer in the format, annotated.
	resolver, err := registry.NewResolver(ctx, registry.Options{HostsDir: srcEnv.HostsDir})
	if err != nil {
		t.Fatal(err)
	}
	name, desc, err := resolver.Resolve(ctx, dst)
	if err != nil {
		t.Fatal(err)
	}
	fetcher, _ := resolver.Fetcher(ctx, name)
	var m ocispec.Manifest
	fetchJSON(t, ctx, fetcher, desc, &m)
	if desc.MediaType != ocispec.MediaTypeImageManifest || len(m.Layers) != 3 {
		t.Fatalf("manifest %s with %d layers", desc.MediaType, len(m.Layers))
	}
	for _, l := range m.Layers {
		if l.MediaType != layerfmt.MediaTypeLayer || l.Annotations[layerfmt.AnnotationTOCDigest] == "" {
			t.Errorf("layer %s: %s %v", l.Digest, l.MediaType, l.Annotations)
		}
	}

	// The reference: the source image, pulled and unpacked by a plain
	// containerd.
	srcImg := srcEnv.Pull(t, src.Ref, "overlayfs")
	want := treeOf(t, srcEnv.Context(), srcEnv.Client, srcImg, "overlayfs")
	checkSourceTree(t, want)

	// A containerd that never saw the source, reading the same registry.
	env := testenv.New(t, testenv.WithEnvsnap())
	testenv.WriteHostsDir(t, env.HostsDir, srcEnv.Registry.Host)
	script := []string{"sh", "-c", "cat /data/hello.txt /opaque/new.txt; readlink /data/link; sha256sum /data/big.bin; ls /opaque; test ! -e /data/gone.txt"}
	for _, sn := range []string{"envsnap", "overlayfs"} {
		img := env.Pull(t, dst, sn)
		if sn == "envsnap" {
			requireLazyChain(t, env, img)
		}
		got := treeOf(t, env.Context(), env.Client, img, sn)
		if diffs := devenv.DiffTrees(want, got); len(diffs) > 0 {
			t.Errorf("converted image on %s differs from the source (first: source, second: converted):\n%s", sn, strings.Join(diffs, "\n"))
		}
		res := env.RunContainer(t, img, testenv.RunOptions{Snapshotter: sn, Args: script})
		wantOut := "hello from a converted layer\nonly this is left\nhello.txt\n" + testenv.RandomFile("", 5<<20, 7).Digest().Encoded() + "  /data/big.bin\nnew.txt\n"
		if res.ExitCode != 0 || res.Stdout != wantOut {
			t.Errorf("container on %s exited %d with %q (stderr %q), want %q", sn, res.ExitCode, res.Stdout, res.Stderr, wantOut)
		}
		if err := env.Client.ImageService().Delete(env.Context(), img.Name(), images.SynchronousDelete()); err != nil {
			t.Fatal(err)
		}
	}

	// containerd's own stores as the source: the image pulled above.
	layout := t.TempDir()
	cmd = exec.Command(testenv.Binary(t, "containerd-envsnap"), "convert", "--address", srcEnv.Address, "--namespace", srcEnv.Namespace,
		"--hint-source", srcEnv.Registry.Host+"/convert/dst", "containerd:"+srcImg.Name(), "oci-layout:"+layout)
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "3 layers (3 converted)") {
		t.Fatalf("convert from containerd: %v\n%s", err, out)
	}
	var top ocispec.Index
	b, err := os.ReadFile(filepath.Join(layout, "index.json"))
	if err != nil || json.Unmarshal(b, &top) != nil || len(top.Manifests) != 1 {
		t.Fatalf("layout index: %v %s", err, b)
	}
	// Converting is deterministic: the same manifest as pushed above
	// (whose hints name the repository it was pushed to).
	if top.Manifests[0].Digest != desc.Digest {
		t.Errorf("converted from containerd to %s, from the registry to %s", top.Manifests[0].Digest, desc.Digest)
	}
}

// checkSourceTree checks that the reference tree has what the source
// layers were made to exercise, so that a comparison with it means
// something.
func checkSourceTree(t *testing.T, tree map[string]string) {
	t.Helper()
	for p, want := range map[string]string{
		"/data/hello.txt":     "links=/data/hard,/data/hello.txt",
		"/data/link":          "-> hello.txt",
		"/data/attr.txt":      `user.envsnap.test="hello"`,
		"/data/owned":         "mode=42775 owner=65534:65534",
		"/usr/local/bin/tool": "mode=104750 owner=1000:100",
		"/opaque/new.txt":     "size=18",
	} {
		if !strings.Contains(tree[p], want) {
			t.Errorf("source tree: %s is %q, want it to contain %q", p, tree[p], want)
		}
	}
	for _, p := range []string{"/data/gone.txt", "/opaque/old.txt", "/data/.wh.gone.txt", "/opaque/.wh..wh..opq"} {
		if line, ok := tree[p]; ok {
			t.Errorf("source tree has %s (%s)", p, line)
		}
	}
}

// requireLazyChain fails t unless every layer of img is a lazy snapshot of
// envsnap's: otherwise the comparison would not test the lazy path.
func requireLazyChain(t *testing.T, env *testenv.Env, img client.Image) {
	t.Helper()
	diffIDs, err := img.RootFS(env.Context())
	if err != nil {
		t.Fatal(err)
	}
	sn := env.Client.SnapshotService("envsnap")
	for i := range diffIDs {
		chain := identity.ChainID(diffIDs[:i+1]).String()
		info, err := sn.Stat(env.Context(), chain)
		if err != nil {
			t.Fatal(err)
		}
		if info.Labels[snapshotter.LabelLayerDigest] == "" {
			t.Fatalf("layer %d of %s was unpacked, not served lazily (labels %v)", i, img.Name(), info.Labels)
		}
	}
}

func fetchJSON(t *testing.T, ctx context.Context, f remotes.Fetcher, desc ocispec.Descriptor, v any) {
	t.Helper()
	rc, err := f.Fetch(ctx, desc)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, desc.Size))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatal(err)
	}
}
