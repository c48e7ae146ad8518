package layerfmt

import (
	"archive/tar"
	"bytes"
	"context"
	"testing"
)

// TestOverlayXattrs: a layer's overlay view shows an extended attribute
// when an entry has one HiddenXattr does not hide, or a directory is
// opaque (its marker, or a whiteout of it beside it); otherwise none.
func TestOverlayXattrs(t *testing.T) {
	dir := func(name string) *tar.Header { return &tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755} }
	file := func(name string, pax map[string]string) *tar.Header {
		return &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, PAXRecords: pax}
	}
	for _, tc := range []struct {
		name    string
		entries []*tar.Header
		want    bool
	}{
		{"plain files", []*tar.Header{dir("d/"), file("d/f", nil), file("g", nil)}, false},
		{"a whiteout of a file", []*tar.Header{dir("d/"), file("d/.wh.gone", nil)}, false},
		{"trusted xattr only (hidden)", []*tar.Header{file("f", map[string]string{"SCHILY.xattr.trusted.overlay.redirect": "x"})}, false},
		{"user.overlay xattr only (hidden)", []*tar.Header{file("f", map[string]string{"SCHILY.xattr.user.overlay.opaque": "y"})}, false},
		{"file capability", []*tar.Header{file("bin/ping", map[string]string{"SCHILY.xattr.security.capability": "\x01\x00\x00\x02"})}, true},
		{"user xattr on a directory", []*tar.Header{{Typeflag: tar.TypeDir, Name: "d/", Mode: 0o755, PAXRecords: map[string]string{"SCHILY.xattr.user.x": "y"}}}, true},
		{"opaque marker", []*tar.Header{dir("d/"), file("d/.wh..wh..opq", nil)}, true},
		{"directory replacing a lower one", []*tar.Header{file(".wh.d", nil), dir("d/")}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			for _, h := range tc.entries {
				if err := tw.WriteHeader(h); err != nil {
					t.Fatal(err)
				}
			}
			if err := tw.Close(); err != nil {
				t.Fatal(err)
			}
			blob, res := convert(t, buf.Bytes())
			toc, err := ReadTOC(context.Background(), bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
			if err != nil {
				t.Fatal(err)
			}
			if got := toc.OverlayXattrs(); got != tc.want {
				t.Fatalf("OverlayXattrs() = %v, want %v", got, tc.want)
			}
		})
	}
}
