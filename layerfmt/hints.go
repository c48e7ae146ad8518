package layerfmt

import (
	"fmt"
	"maps"
	"strconv"

	"github.com/opencontainers/go-digest"
)

// Hint annotations, on the OCI layer descriptor of a layer in this format,
// say where the layer's blob can be fetched and how to check what is read
// from it. Their names start with "containerd.io/snapshot/" because
// containerd's unpacker copies every layer annotation with that prefix
// into the labels of the snapshot it prepares for the layer, whichever
// client pulls: a lazy snapshotter then learns where the layer lives even
// when the client adds no labels of its own (containerd tells a
// snapshotter neither the image reference nor the manifest or layer
// digest). A snapshotter must treat them as untrusted input.
const (
	// AnnotationHintSource is the repository the blob can be fetched from
	// ("registry.example.com/envsnap/base"), without tag or digest.
	AnnotationHintSource = "containerd.io/snapshot/envsnap.hint.source"
	// AnnotationHintLayer is the layer's digest (the descriptor's own).
	AnnotationHintLayer = "containerd.io/snapshot/envsnap.hint.layer"
	// AnnotationHintSize is the blob size in bytes, in decimal.
	AnnotationHintSize = "containerd.io/snapshot/envsnap.hint.size"
	// AnnotationHintTOC is the TOC digest (AnnotationTOCDigest's value).
	AnnotationHintTOC = "containerd.io/snapshot/envsnap.hint.toc"
)

// WithHints returns a copy of annotations, those of a layer in this format
// with the given digest and size, with the hint annotations set to
// source. Annotations without a TOC digest (not a layer in this format)
// are returned unchanged.
func WithHints(annotations map[string]string, source string, layer digest.Digest, size int64) map[string]string {
	toc := annotations[AnnotationTOCDigest]
	if toc == "" || source == "" {
		return annotations
	}
	out := maps.Clone(annotations)
	out[AnnotationHintSource] = source
	out[AnnotationHintLayer] = layer.String()
	out[AnnotationHintSize] = strconv.FormatInt(size, 10)
	out[AnnotationHintTOC] = toc
	return out
}

// Hints is a layer's hint annotations, parsed.
type Hints struct {
	Source string
	Layer  digest.Digest
	Size   int64
	TOC    digest.Digest
}

// ParseHints reads the hint annotations (or snapshot labels) in m. ok is
// false when m carries none; a malformed or incomplete set is an error.
func ParseHints(m map[string]string) (h Hints, ok bool, err error) {
	src, layer, size, toc := m[AnnotationHintSource], m[AnnotationHintLayer], m[AnnotationHintSize], m[AnnotationHintTOC]
	if src == "" && layer == "" && size == "" && toc == "" {
		return Hints{}, false, nil
	}
	if src == "" || layer == "" || size == "" || toc == "" {
		return Hints{}, false, fmt.Errorf("incomplete layer hints (source %q, layer %q, size %q, toc %q)", src, layer, size, toc)
	}
	h.Source = src
	if h.Layer, err = digest.Parse(layer); err != nil {
		return Hints{}, false, fmt.Errorf("layer hint %q: %w", layer, err)
	}
	if h.TOC, err = digest.Parse(toc); err != nil {
		return Hints{}, false, fmt.Errorf("TOC hint %q: %w", toc, err)
	}
	if h.Size, err = strconv.ParseInt(size, 10, 64); err != nil || h.Size <= 0 {
		return Hints{}, false, fmt.Errorf("size hint %q: not a positive integer", size)
	}
	return h, true, nil
}
