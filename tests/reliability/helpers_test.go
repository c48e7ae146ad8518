// Package reliability_test proves the guarantees of docs/reliability.md
// end to end: daemon restarts under running containers, access control,
// registry faults, disk pressure, hostile layers and load. Each test fails
// when its guarantee breaks.
package reliability_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

// lazyImage is a converted image pushed to the harness registry.
type lazyImage struct {
	testenv.Image
	Results []*layerfmt.WriteResult // per layer, lowest first
}

// pushLazy builds busybox plus files, converts every layer to the envsnap
// format and pushes the image as name.
func pushLazy(t testing.TB, env *testenv.Env, name string, files []testenv.File, opts ...layerfmt.WriteOption) lazyImage {
	t.Helper()
	img := env.PushImage(t, name, files, testenv.WithLazyLayers(opts...), testenv.WithCmd("/bin/true"))
	return lazyImage{Image: img, Results: img.LayerResults}
}

// pushBlobs pushes already converted layer blobs (results describe them).
func pushBlobs(t testing.TB, env *testenv.Env, name string, blobs [][]byte, results []*layerfmt.WriteResult) lazyImage {
	t.Helper()
	layers := make([]testenv.LayerBlob, len(blobs))
	for i, b := range blobs {
		res := results[i]
		layers[i] = testenv.LayerBlob{
			Desc:   ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: res.Digest, Size: res.Size, Annotations: res.Annotations()},
			DiffID: res.DiffID, Data: b, Result: res,
		}
	}
	img := env.PushLayerBlobs(t, name, layers, testenv.WithCmd("/bin/true"))
	return lazyImage{Image: img, Results: results}
}

// statusGet fetches path from the daemon's status socket.
func statusGet(t testing.TB, env *testenv.Env, path string) []byte {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", daemon.StatusSocket(env.SnapshotterSocket))
		},
	}}
	resp, err := hc.Get("http://envsnap" + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func envsnapStatus(t testing.TB, env *testenv.Env) daemon.Status {
	t.Helper()
	var st daemon.Status
	if err := json.Unmarshal(statusGet(t, env, "/status"), &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// metric returns the value of an unlabelled metric from /metrics.
func metric(t testing.TB, env *testenv.Env, name string) (float64, bool) {
	t.Helper()
	for _, line := range strings.Split(string(statusGet(t, env, "/metrics")), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err == nil {
				return f, true
			}
		}
	}
	return 0, false
}

// syncBuffer collects a container's output while it runs.
type syncBuffer = testenv.OutputBuffer

// contentBytes reads a blob the test wrote to the env's content store.
func contentBytes(env *testenv.Env, desc ocispec.Descriptor) ([]byte, error) {
	return content.ReadBlob(env.Context(), env.ContentStore, desc)
}

// metricSum sums every series of a metric whose labels contain all of
// labels (e.g. `op="read"`).
func metricSum(t testing.TB, env *testenv.Env, name string, labels ...string) float64 {
	t.Helper()
	var sum float64
	for _, line := range strings.Split(string(statusGet(t, env, "/metrics")), "\n") {
		if !strings.HasPrefix(line, name+"{") {
			continue
		}
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(line, l)
		}
		i := strings.LastIndexByte(line, ' ')
		var f float64
		if _, err := fmt.Sscan(line[i+1:], &f); ok && err == nil {
			sum += f
		}
	}
	return sum
}
