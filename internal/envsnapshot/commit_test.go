//go:build linux

package envsnapshot

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/group"
)

// TestManifestPushNotCutOff: a cancellation that arrives while the
// manifest's request is with the registry (a SIGTERM during the push)
// does not cut it off: the push completes and says so, where a client
// that gave up could report "not pushed" for a tag the registry moved.
func TestManifestPushNotCutOff(t *testing.T) {
	rig := newUploadRig(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	target := rig.reg.Host + "/commit/snap:0"
	pusher, err := group.NewPusher(ctx, rig.hosts, target)
	if err != nil {
		t.Fatal(err)
	}
	blob := func(mediaType string, b []byte) ocispec.Descriptor {
		t.Helper()
		d := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
		if _, err := group.PushBytes(ctx, pusher, d, b); err != nil {
			t.Fatal(err)
		}
		return d
	}
	cfg := blob(ocispec.MediaTypeImageConfig, []byte(`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}`))
	layer := blob(ocispec.MediaTypeImageLayer, []byte("not a real layer, only bytes"))
	img := &snapshotImage{manifest: ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, Config: cfg, Layers: []ocispec.Descriptor{layer}}}
	if img.manifestRaw, err = json.Marshal(img.manifest); err != nil {
		t.Fatal(err)
	}
	img.desc = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(img.manifestRaw), Size: int64(len(img.manifestRaw))}

	// The registry gets the manifest's PUT; the caller is cancelled while
	// it waits for the answer.
	rig.reg.Intercept(func(w http.ResponseWriter, req *http.Request) bool {
		if req.Method == http.MethodPut && strings.Contains(req.URL.Path, "/manifests/") {
			cancel()
			time.Sleep(100 * time.Millisecond)
		}
		return false
	})
	if err := img.pushManifest(ctx, pusher, target, &Result{}, nil); err != nil {
		t.Fatalf("manifest push cancelled half way: %v", err)
	}
	req, err := http.NewRequest(http.MethodHead, "http://"+rig.reg.Host+"/v2/commit/snap/manifests/0", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", ocispec.MediaTypeImageManifest)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("HEAD of the pushed manifest: %s", resp.Status)
	}
	// A cancellation before the push starts stops it.
	if err := img.pushManifest(ctx, pusher, rig.reg.Host+"/commit/snap:1", &Result{}, nil); err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Fatalf("push after the caller was cancelled: %v", err)
	}
}
