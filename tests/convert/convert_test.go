// Package convert_test checks converted images end to end: the convert
// command pushes an image whose layers are in the lazy layer format, and a
// plain containerd with the overlayfs snapshotter pulls and runs it.
package convert_test

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/remotes"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

func TestConvertedImageRunsOnPlainContainerd(t *testing.T) {
	env := testenv.New(t)
	src := env.PushImage(t, "convert/src:v1", []testenv.File{
		{Path: "/data/hello.txt", Data: []byte("hello from a converted layer\n")},
		{Path: "/data/link", Symlink: "hello.txt"},
		{Path: "/usr/local/bin/tool", Mode: 0o750, Data: []byte("#!/bin/sh\n")},
		testenv.RandomFile("/data/big.bin", 5<<20, 7),
	})
	dst := env.Registry.Host + "/convert/dst:v1"
	cmd := exec.Command(testenv.Binary(t, "containerd-envsnap"), "convert", "--hosts-dir", env.HostsDir, src.Ref, dst)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("convert: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "2 layers (2 converted)") {
		t.Errorf("summary line missing or wrong:\n%s", out)
	}

	// The pushed manifest: every layer in the format, annotated.
	ctx := context.Background()
	resolver, err := registry.NewResolver(ctx, registry.Options{HostsDir: env.HostsDir})
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
	if desc.MediaType != ocispec.MediaTypeImageManifest || len(m.Layers) != 2 {
		t.Fatalf("manifest %s with %d layers", desc.MediaType, len(m.Layers))
	}
	for _, l := range m.Layers {
		if l.MediaType != layerfmt.MediaTypeLayer || l.Annotations[layerfmt.AnnotationTOCDigest] == "" {
			t.Errorf("layer %s: %s %v", l.Digest, l.MediaType, l.Annotations)
		}
	}

	// A plain containerd (overlayfs, no envsnap) pulls and runs it.
	// The same script on the source image is the reference.
	script := []string{"sh", "-c", "cat /data/hello.txt; readlink /data/link; stat -c '%a %u:%g %Y' /usr/local/bin/tool /data /bin/busybox; md5sum /data/big.bin; ls -la /bin | wc -l"}
	// The source first: conversion keeps diff IDs when the source tar is
	// already canonical, and containerd then skips downloading the layers
	// of whichever image of the same snapshot chain is pulled second,
	// which the containerd-store conversion below needs.
	srcImg := env.Pull(t, src.Ref, "overlayfs")
	img := env.Pull(t, dst, "overlayfs")
	res := env.RunContainer(t, img, testenv.RunOptions{Args: script})
	if res.ExitCode != 0 {
		t.Fatalf("container exited %d: %s", res.ExitCode, res.Stderr)
	}
	t.Logf("converted image:\n%s", res.Stdout)
	ref := env.RunContainer(t, srcImg, testenv.RunOptions{Args: script})
	if !strings.HasPrefix(res.Stdout, "hello from a converted layer\nhello.txt\n750 ") || res.Stdout != ref.Stdout {
		t.Errorf("converted image prints %q, source image %q", res.Stdout, ref.Stdout)
	}

	// containerd's own stores as the source: the image pulled above.
	layout := t.TempDir()
	cmd = exec.Command(testenv.Binary(t, "containerd-envsnap"), "convert", "--address", env.Address, "--namespace", env.Namespace,
		"containerd:"+srcImg.Name(), "oci-layout:"+layout)
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "2 layers (2 converted)") {
		t.Fatalf("convert from containerd: %v\n%s", err, out)
	}
	var top ocispec.Index
	b, err := os.ReadFile(filepath.Join(layout, "index.json"))
	if err != nil || json.Unmarshal(b, &top) != nil || len(top.Manifests) != 1 {
		t.Fatalf("layout index: %v %s", err, b)
	}
	// Converting is deterministic: the same manifest as pushed above.
	if top.Manifests[0].Digest != desc.Digest {
		t.Errorf("converted from containerd to %s, from the registry to %s", top.Manifests[0].Digest, desc.Digest)
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
