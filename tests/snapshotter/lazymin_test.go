package snapshotter_test

import (
	"context"
	"testing"

	"github.com/containerd/containerd/v2/core/snapshots"

	"github.com/envsnap/envsnap/snapshotter"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestSmallLayersUnpacked: with the daemon's default lazy_min_size, a
// small layer on top of the image (a task's patch) is unpacked by
// containerd rather than served through FUSE, the large layer below it is
// lazy, and the container reads the right bytes from both: its root
// overlay has exactly one FUSE-backed lower less than it has layers.
func TestSmallLayersUnpacked(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithDefaultLazyMinSize())
	big := testenv.RandomFile("/data/big.bin", 6<<20, 21)
	patch := testenv.File{Path: "/task/patch.go", Data: []byte("package task\n\nconst Fixed = true\n")}
	img := env.PushImageLayers(t, "lazy/small-on-top:1", [][]testenv.File{{big}, {patch}},
		testenv.WithLazyLayers())
	// busybox, the large file, the patch.
	if len(img.Layers) != 3 || img.Layers[0].Size >= 2<<20 || img.Layers[1].Size < 2<<20 || img.Layers[2].Size >= 2<<20 {
		t.Fatalf("layers %+v: want a large one between small ones", img.Layers)
	}
	image := env.Pull(t, img.Ref, "envsnap")

	lazy := map[string]bool{}
	if err := env.Client.SnapshotService("envsnap").Walk(env.Context(), func(_ context.Context, info snapshots.Info) error {
		if d, ok := info.Labels[snapshotter.LabelLayerDigest]; ok {
			lazy[d] = true
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !lazy[img.Layers[1].Digest.String()] || len(lazy) != 1 {
		t.Fatalf("lazy layers %v: want only the large layer %s", lazy, img.Layers[1].Digest)
	}

	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", big.Path, patch.Path}})
	want := big.Digest().Encoded() + "  " + big.Path + "\n" + patch.Digest().Encoded() + "  " + patch.Path + "\n"
	if res.ExitCode != 0 || res.Stdout != want {
		t.Fatalf("container: exit %d stdout %q stderr %q, want %q", res.ExitCode, res.Stdout, res.Stderr, want)
	}
}
