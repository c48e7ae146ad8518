package convert

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/internal/registry"
	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

// layerTar is a small tar whose content depends on seed.
func layerTar(t *testing.T, seed string) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for k, name := range []string{"etc/", "etc/" + seed + ".conf", "usr/bin/" + seed} {
		h := &tar.Header{Name: name, Mode: 0o644, ModTime: time.Unix(1700000000, 0), Typeflag: tar.TypeReg}
		data := bytes.Repeat([]byte(seed+fmt.Sprint(k)), 1000*(k+1))
		if name[len(name)-1] == '/' {
			h.Typeflag, h.Mode, data = tar.TypeDir, 0o755, nil
		}
		h.Size = int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write(data)
	}
	tw.Close()
	return buf.Bytes()
}

func gz(b []byte) []byte {
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	w.Write(b)
	w.Close()
	return buf.Bytes()
}

func zst(b []byte) []byte {
	e, _ := zstd.NewWriter(nil)
	return e.EncodeAll(b, nil)
}

// layoutWriter builds an OCI layout directory.
type layoutWriter struct {
	t   *testing.T
	dir string
}

func (l layoutWriter) blob(mediaType string, b []byte) ocispec.Descriptor {
	d := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
	p := filepath.Join(l.dir, "blobs", "sha256", d.Digest.Encoded())
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		l.t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		l.t.Fatal(err)
	}
	return d
}

func (l layoutWriter) json(mediaType string, v any) ocispec.Descriptor {
	b, err := json.Marshal(v)
	if err != nil {
		l.t.Fatal(err)
	}
	return l.blob(mediaType, b)
}

// sourceLayout writes a two-platform image: each platform has a shared
// gzip layer, a platform-specific layer (plain tar on amd64, zstd on
// arm64), and arm64 an attestation manifest as buildkit writes.
func sourceLayout(t *testing.T) (string, map[string][]byte) {
	dir := t.TempDir()
	l := layoutWriter{t, dir}
	tars := map[string][]byte{"base": layerTar(t, "base"), "amd": layerTar(t, "amd"), "arm": layerTar(t, "arm")}
	base := l.blob(ocispec.MediaTypeImageLayerGzip, gz(tars["base"]))
	amd := l.blob(ocispec.MediaTypeImageLayer, tars["amd"])
	arm := l.blob(ocispec.MediaTypeImageLayerZstd, zst(tars["arm"]))
	var manifests []ocispec.Descriptor
	for _, p := range []struct {
		arch  string
		layer ocispec.Descriptor
		tar   []byte
	}{{"amd64", amd, tars["amd"]}, {"arm64", arm, tars["arm"]}} {
		cfg := map[string]any{
			"architecture": p.arch, "os": "linux",
			"config":  map[string]any{"Env": []string{"PATH=/usr/bin"}},
			"rootfs":  ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(tars["base"]), digest.FromBytes(p.tar)}},
			"history": []map[string]string{{"created_by": "test"}},
		}
		m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest,
			Config: l.json(ocispec.MediaTypeImageConfig, cfg), Layers: []ocispec.Descriptor{base, p.layer}}
		m.SchemaVersion = 2
		md := l.json(ocispec.MediaTypeImageManifest, m)
		md.Platform = &ocispec.Platform{OS: "linux", Architecture: p.arch}
		manifests = append(manifests, md)
	}
	att := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest,
		Config: l.blob("application/vnd.oci.image.config.v1+json", []byte("{}")),
		Layers: []ocispec.Descriptor{l.blob("application/vnd.in-toto+json", []byte(`{"predicate":{}}`))}}
	att.SchemaVersion = 2
	ad := l.json(ocispec.MediaTypeImageManifest, att)
	ad.Platform = &ocispec.Platform{OS: "unknown", Architecture: "unknown"}
	ad.Annotations = map[string]string{"vnd.docker.reference.type": "attestation-manifest", "vnd.docker.reference.digest": manifests[1].Digest.String()}
	manifests = append(manifests, ad)
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: manifests}
	idx.SchemaVersion = 2
	root := l.json(ocispec.MediaTypeImageIndex, idx)
	top := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{root}}
	top.SchemaVersion = 2
	b, _ := json.Marshal(top)
	os.WriteFile(filepath.Join(dir, "index.json"), b, 0o644)
	os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
	return dir, tars
}

func readLayoutBlob(t *testing.T, dir string, d ocispec.Descriptor, v any) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "blobs", d.Digest.Algorithm().String(), d.Digest.Encoded()))
	if err != nil {
		t.Fatal(err)
	}
	if digest.FromBytes(b) != d.Digest {
		t.Fatalf("blob %s has the wrong digest", d.Digest)
	}
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatal(err)
		}
	}
	return b
}

// checkLayout verifies a converted layout: every layer in the format with
// annotations that verify, diff_ids that are the sha256 of what a plain
// zstd decoder makes of the blob, and file contents equal to the source.
func checkLayout(t *testing.T, dir string, tars map[string][]byte, wantArchs []string) {
	t.Helper()
	var top ocispec.Index
	b, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	json.Unmarshal(b, &top)
	root := top.Manifests[0]
	var idx ocispec.Index
	readLayoutBlob(t, dir, root, &idx)
	var archs []string
	for _, md := range idx.Manifests {
		archs = append(archs, md.Platform.Architecture)
		var m ocispec.Manifest
		readLayoutBlob(t, dir, md, &m)
		var cfg struct {
			RootFS  ocispec.RootFS    `json:"rootfs"`
			History []json.RawMessage `json:"history"`
		}
		readLayoutBlob(t, dir, m.Config, &cfg)
		if len(cfg.History) != 1 {
			t.Errorf("config lost its other fields")
		}
		for k, l := range m.Layers {
			if l.MediaType != layerfmt.MediaTypeLayer || l.Annotations[layerfmt.AnnotationVersion] != "1" {
				t.Fatalf("layer %d: %s %v", k, l.MediaType, l.Annotations)
			}
			blob := readLayoutBlob(t, dir, l, nil)
			r, err := layerfmt.NewReader(bytes.NewReader(blob), int64(len(blob)), digest.Digest(l.Annotations[layerfmt.AnnotationTOCDigest]))
			if err != nil {
				t.Fatalf("layer %d: %v", k, err)
			}
			plain, err := zstd.DecodeTo(nil, blob)
			if err != nil {
				t.Fatal(err)
			}
			if digest.FromBytes(plain) != cfg.RootFS.DiffIDs[k] {
				t.Errorf("layer %d: diff_id %s is not the digest of the decompressed blob", k, cfg.RootFS.DiffIDs[k])
			}
			src := tars["base"]
			if k == 1 {
				src = tars[map[string]string{"amd64": "amd", "arm64": "arm"}[md.Platform.Architecture]]
			}
			tr := tar.NewReader(bytes.NewReader(src))
			for {
				h, err := tr.Next()
				if err != nil {
					break
				}
				want, _ := io.ReadAll(tr)
				if h.Typeflag == tar.TypeReg {
					got, err := fsReadFile(r, h.Name)
					if err != nil || !bytes.Equal(got, want) {
						t.Errorf("layer %d %s: %v", k, h.Name, err)
					}
				}
			}
		}
	}
	if !slices.Equal(archs, wantArchs) {
		t.Errorf("platforms %v, want %v", archs, wantArchs)
	}
}

func TestConvertLayoutToLayout(t *testing.T) {
	ctx := context.Background()
	srcDir, tars := sourceLayout(t)
	dstDir := t.TempDir()
	var events []LayerEvent
	s, err := Run(ctx, Location{Kind: Layout, Path: srcDir}, Location{Kind: Layout, Path: dstDir},
		Options{Progress: func(e LayerEvent) { events = append(events, e) }})
	if err != nil {
		t.Fatal(err)
	}
	if s.Manifests != 2 || s.Layers != 3 || s.Converted != 3 || s.Dropped != 1 || len(events) != 3 {
		t.Errorf("summary %+v, %d events", s, len(events))
	}
	checkLayout(t, dstDir, tars, []string{"amd64", "arm64"})

	// Converting the converted image again keeps every layer.
	again := t.TempDir()
	s2, err := Run(ctx, Location{Kind: Layout, Path: dstDir}, Location{Kind: Layout, Path: again}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if s2.Converted != 0 || s2.Layers != 3 || s2.Root.Digest != s.Root.Digest {
		t.Errorf("second conversion: %+v (first root %s)", s2, s.Root.Digest)
	}

	// One platform only.
	one := t.TempDir()
	if _, err := Run(ctx, Location{Kind: Layout, Path: srcDir}, Location{Kind: Layout, Path: one}, Options{Platforms: []string{"linux/arm64"}}); err != nil {
		t.Fatal(err)
	}
	checkLayout(t, one, tars, []string{"arm64"})
}

func TestConvertArchiveAndRegistry(t *testing.T) {
	if _, err := os.Stat(filepath.Join(testenv.ToolsDir(t), "registry")); err != nil {
		prereq.Missing(t, "registry binary not installed (run make deps): %v", err)
	}
	ctx := context.Background()
	srcDir, tars := sourceLayout(t)
	reg := testenv.StartRegistry(t, t.TempDir())
	ro := registry.Options{PlainHTTP: true}

	// layout -> archive -> registry -> registry (another repo) -> layout
	arch := filepath.Join(t.TempDir(), "image.tar")
	if _, err := Run(ctx, Location{Kind: Layout, Path: srcDir}, Location{Kind: Archive, Path: arch}, Options{}); err != nil {
		t.Fatal(err)
	}
	ref := reg.Host + "/test/app:v1"
	s1, err := Run(ctx, Location{Kind: Archive, Path: arch}, Location{Kind: Registry, Ref: ref}, Options{Registry: ro})
	if err != nil {
		t.Fatal(err)
	}
	if s1.Converted != 0 {
		t.Errorf("archive of a converted image was converted again: %+v", s1)
	}
	reg.ResetCounters()
	ref2 := reg.Host + "/other/app:v1"
	// The layers' hints name the first repository, which holds them too:
	// nothing else changes.
	s2, err := Run(ctx, Location{Kind: Registry, Ref: ref}, Location{Kind: Registry, Ref: ref2}, Options{Registry: ro, HintSource: reg.Host + "/test/app"})
	if err != nil {
		t.Fatal(err)
	}
	if s2.Root.Digest != s1.Root.Digest {
		t.Errorf("re-push changed the image: %s vs %s", s2.Root.Digest, s1.Root.Digest)
	}
	// Layers already in the format come from the same registry: mounted,
	// not uploaded.
	if len(reg.MountRequests()) != 3 {
		t.Errorf("mount requests %v, want the 3 layers", reg.MountRequests())
	}
	for _, d := range reg.UploadedDigests() {
		for _, m := range reg.MountRequests() {
			if d == m {
				t.Errorf("layer %s uploaded instead of mounted", d)
			}
		}
	}
	out := t.TempDir()
	if _, err := Run(ctx, Location{Kind: Registry, Ref: ref2}, Location{Kind: Layout, Path: out}, Options{Registry: ro}); err != nil {
		t.Fatal(err)
	}
	checkLayout(t, out, tars, []string{"amd64", "arm64"})
}

func TestParseLocation(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Location
	}{
		{"oci-layout:/tmp/x", Location{Kind: Layout, Path: "/tmp/x"}},
		{"oci-archive:img.tar", Location{Kind: Archive, Path: "img.tar"}},
		{"alpine", Location{Kind: Registry, Ref: "docker.io/library/alpine:latest"}},
		{"127.0.0.1:5000/a/b:v1", Location{Kind: Registry, Ref: "127.0.0.1:5000/a/b:v1"}},
	} {
		got, err := ParseLocation(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseLocation(%q) = %+v, %v", tc.in, got, err)
		}
	}
	for _, bad := range []string{"oci-layout:", "oci-archive:", "bad ref!", ""} {
		if _, err := ParseLocation(bad); err == nil {
			t.Errorf("ParseLocation(%q) accepted", bad)
		}
	}
}

// TestConvertDockerMediaTypes converts a Docker schema 2 image (what
// `docker save`-era tooling and some registries still serve): the result
// is an OCI manifest and config with the converted layer.
func TestConvertDockerMediaTypes(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	l := layoutWriter{t, dir}
	lt := layerTar(t, "docker")
	layer := l.blob(images.MediaTypeDockerSchema2LayerGzip, gz(lt))
	cfg := map[string]any{"architecture": "amd64", "os": "linux",
		"rootfs": ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(lt)}}}
	m := map[string]any{"schemaVersion": 2, "mediaType": images.MediaTypeDockerSchema2Manifest,
		"config": l.json(images.MediaTypeDockerSchema2Config, cfg), "layers": []ocispec.Descriptor{layer}}
	md := l.json(images.MediaTypeDockerSchema2Manifest, m)
	top := ocispec.Index{Manifests: []ocispec.Descriptor{md}}
	top.SchemaVersion = 2
	b, _ := json.Marshal(top)
	os.WriteFile(filepath.Join(dir, "index.json"), b, 0o644)

	out := t.TempDir()
	s, err := Run(ctx, Location{Kind: Layout, Path: dir}, Location{Kind: Layout, Path: out}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if s.Root.MediaType != ocispec.MediaTypeImageManifest || s.Converted != 1 {
		t.Fatalf("summary %+v", s)
	}
	var om ocispec.Manifest
	readLayoutBlob(t, out, s.Root, &om)
	var oc ocispec.Image
	readLayoutBlob(t, out, om.Config, &oc)
	blob := readLayoutBlob(t, out, om.Layers[0], nil)
	plain, err := zstd.DecodeTo(nil, blob)
	if err != nil {
		t.Fatal(err)
	}
	if om.Config.MediaType != ocispec.MediaTypeImageConfig || om.Layers[0].MediaType != layerfmt.MediaTypeLayer ||
		oc.RootFS.DiffIDs[0] != digest.FromBytes(plain) || oc.Architecture != "amd64" {
		t.Errorf("manifest %+v config %+v", om, oc)
	}
}
