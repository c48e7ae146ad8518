package layerfmt

import (
	"maps"
	"testing"

	"github.com/opencontainers/go-digest"
)

func TestHints(t *testing.T) {
	layer := digest.FromString("layer")
	toc := digest.FromString("toc")
	ann := map[string]string{AnnotationTOCDigest: toc.String(), "other": "kept"}
	orig := maps.Clone(ann)
	got := WithHints(ann, "registry.example/envsnap/base", layer, 1234)
	if !maps.Equal(ann, orig) {
		t.Fatalf("WithHints changed its input: %v", ann)
	}
	h, ok, err := ParseHints(got)
	if err != nil || !ok {
		t.Fatalf("ParseHints(%v) = %v, %v", got, ok, err)
	}
	if want := (Hints{Source: "registry.example/envsnap/base", Layer: layer, Size: 1234, TOC: toc}); h != want || got["other"] != "kept" {
		t.Fatalf("hints %+v (annotations %v), want %+v", h, got, want)
	}
	// Not a layer in the format, or no source: nothing to hint.
	for _, tc := range []struct {
		ann    map[string]string
		source string
	}{{map[string]string{"other": "x"}, "registry.example/a"}, {ann, ""}} {
		if out := WithHints(tc.ann, tc.source, layer, 1); !maps.Equal(out, tc.ann) {
			t.Errorf("WithHints(%v, %q) = %v, want unchanged", tc.ann, tc.source, out)
		}
	}
	if _, ok, err := ParseHints(map[string]string{"other": "x"}); ok || err != nil {
		t.Errorf("no hints: ok %v err %v", ok, err)
	}
	for _, k := range []string{AnnotationHintSource, AnnotationHintLayer, AnnotationHintSize, AnnotationHintTOC} {
		bad := maps.Clone(got)
		delete(bad, k)
		if _, ok, err := ParseHints(bad); ok || err == nil {
			t.Errorf("hints without %s accepted", k)
		}
		bad[k] = "garbage"
		if k != AnnotationHintSource {
			if _, ok, err := ParseHints(bad); ok || err == nil {
				t.Errorf("hints with %s=garbage accepted", k)
			}
		}
	}
}

func FuzzParseHints(f *testing.F) {
	f.Add("registry.example/envsnap/base", digest.FromString("layer").String(), "1234", digest.FromString("toc").String())
	f.Add("", "sha256:", "-1", "md5:x")
	f.Fuzz(func(t *testing.T, src, layer, size, toc string) {
		h, ok, err := ParseHints(map[string]string{AnnotationHintSource: src, AnnotationHintLayer: layer, AnnotationHintSize: size, AnnotationHintTOC: toc})
		if err != nil {
			if ok {
				t.Fatal("ok with an error")
			}
			return
		}
		if !ok {
			if src != "" || layer != "" || size != "" || toc != "" {
				t.Fatalf("hints %q %q %q %q neither parsed nor refused", src, layer, size, toc)
			}
			return
		}
		if h.Source == "" || h.Size <= 0 || h.Layer.Validate() != nil || h.TOC.Validate() != nil {
			t.Fatalf("accepted invalid hints %+v", h)
		}
	})
}
