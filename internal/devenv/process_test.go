package devenv

import (
	"os"
	"path/filepath"
	"testing"
)

func TestCountLogLines(t *testing.T) {
	p := &Process{LogPath: filepath.Join(t.TempDir(), "log")}
	if p.LogSize() != 0 {
		t.Fatalf("a missing log has size %d, want 0", p.LogSize())
	}
	write := func(s string) {
		f, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteString(s); err != nil {
			t.Fatal(err)
		}
	}
	write("gap one\nother\n")
	from := p.LogSize()
	write("gap two\ngap three\nthe end")
	if n, err := p.CountLogLines(0, "gap"); err != nil || n != 3 {
		t.Errorf("whole log: %d lines, %v; want 3", n, err)
	}
	if n, err := p.CountLogLines(from, "gap"); err != nil || n != 2 {
		t.Errorf("after offset %d: %d lines, %v; want 2", from, n, err)
	}
	if _, err := p.CountLogLines(1<<20, "gap"); err == nil {
		t.Error("an offset past the log's end counted lines instead of failing")
	}
}
