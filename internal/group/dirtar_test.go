package group

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestWriteDirTarDeterministicWithPrefix(t *testing.T) {
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "bin"), 0o755)
	os.WriteFile(filepath.Join(dir, "bin", "agent"), []byte("#!/bin/sh\n"), 0o775)
	os.WriteFile(filepath.Join(dir, "data"), []byte("x"), 0o600)
	os.Link(filepath.Join(dir, "data"), filepath.Join(dir, "data-link"))
	os.Symlink("bin/agent", filepath.Join(dir, "run"))
	uid, gid := 0, 0
	epoch := time.Unix(0, 0)
	o := DirOptions{Prefix: "/opt/harness", UID: &uid, GID: &gid, ModeMask: 0o755, ModTime: &epoch}

	var a, b bytes.Buffer
	if err := WriteDirTar(context.Background(), &a, dir, o); err != nil {
		t.Fatal(err)
	}
	// Touching mtimes must not change the output when ModTime is fixed.
	os.Chtimes(filepath.Join(dir, "data"), time.Now(), time.Now())
	if err := WriteDirTar(context.Background(), &b, dir, o); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("same tree gave different tars")
	}
	tr := tar.NewReader(&a)
	got := map[string]*tar.Header{}
	var order []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
		order = append(order, h.Name)
	}
	want := []string{"opt/", "opt/harness/", "opt/harness/bin/", "opt/harness/bin/agent", "opt/harness/data", "opt/harness/data-link", "opt/harness/run"}
	if len(order) != len(want) {
		t.Fatalf("entries = %v, want %v", order, want)
	}
	for i := range want {
		if order[i] != want[i] {
			t.Fatalf("entries = %v, want %v", order, want)
		}
	}
	if h := got["opt/harness/bin/agent"]; h.Mode&0o777 != 0o755 || h.Uid != 0 {
		t.Errorf("agent mode %o uid %d, want 755 and 0", h.Mode, h.Uid)
	}
	if h := got["opt/harness/data-link"]; h.Typeflag != tar.TypeLink || h.Linkname != "opt/harness/data" {
		t.Errorf("hard link = %+v", h)
	}
	if h := got["opt/harness/run"]; h.Typeflag != tar.TypeSymlink || h.Linkname != "bin/agent" {
		t.Errorf("symlink = %+v", h)
	}
}
