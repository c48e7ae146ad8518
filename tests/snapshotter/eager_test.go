package snapshotter_test

import (
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// TestEagerFetchesWholeLayersFirst: with on-demand fetching off (--eager)
// the pull does not finish before every layer is local, and running the
// container then reads nothing from the registry.
func TestEagerFetchesWholeLayersFirst(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--eager"))
	big := testenv.RandomFile("/data/big", 8<<20, 11)
	img := pushLazyImage(t, env, "eager/img:1", []testenv.File{big}, "/bin/sh")
	var size int64
	for _, l := range img.Layers {
		size += l.Size
	}
	env.Registry.ResetCounters()
	ci := env.Pull(t, img.Ref, "envsnap")
	pulled := env.Registry.BlobBytesServed()
	if pulled < size {
		t.Fatalf("pull returned after %d of %d layer bytes: layers were not fetched whole before mounting", pulled, size)
	}
	env.Registry.ResetCounters()
	res := env.RunContainer(t, ci, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"/bin/sh", "-c", "sha256sum /data/big"}})
	want := strings.TrimPrefix(big.Digest().String(), "sha256:")
	if !strings.HasPrefix(res.Stdout, want) {
		t.Errorf("sha256sum = %q, want %s", res.Stdout, want)
	}
	if n := env.Registry.BlobBytesServed(); n != 0 {
		t.Errorf("the container's reads fetched %d bytes from the registry after an eager pull", n)
	}
}
