package devenv

import (
	"archive/tar"
	"bytes"
	"os"
	"testing"
)

func TestLayerTarModes(t *testing.T) {
	tb, err := LayerTar([]File{
		{Path: "/bin/su", Data: []byte("x"), Mode: 0o755 | os.ModeSetuid},
		{Path: "/tmp", Dir: true, Mode: 0o777 | os.ModeSticky},
		{Path: "/srv/g", Data: []byte("y"), Mode: 0o750 | os.ModeSetgid},
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"bin/su": 0o4755, "tmp/": 0o1777, "srv/g": 0o2750}
	tr := tar.NewReader(bytes.NewReader(tb))
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		if m, ok := want[h.Name]; ok {
			if h.Mode != m {
				t.Errorf("%s: mode %o, want %o", h.Name, h.Mode, m)
			}
			delete(want, h.Name)
		}
	}
	if len(want) > 0 {
		t.Errorf("entries missing: %v", want)
	}
}
