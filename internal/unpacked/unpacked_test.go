package unpacked

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

func open(t *testing.T, dir string, max int64) *Store {
	t.Helper()
	s, err := Open(dir, max)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func writer(b []byte) func(context.Context, io.Writer) error {
	return func(ctx context.Context, w io.Writer) error {
		_, err := w.Write(b)
		return err
	}
}

func read(t *testing.T, s *Store, key digest.Digest) ([]byte, bool) {
	t.Helper()
	f, ok := s.Get(key)
	if !ok {
		return nil, false
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return b, true
}

func TestBuildThenGet(t *testing.T) {
	s := open(t, t.TempDir(), 1<<20)
	key := digest.FromString("a")
	want := bytes.Repeat([]byte("x"), 1000)
	if _, ok := s.Get(key); ok {
		t.Fatal("Get before Build found a copy")
	}
	s.Build(key, int64(len(want)), writer(want))
	s.Wait()
	got, ok := read(t, s, key)
	if !ok || !bytes.Equal(got, want) {
		t.Fatalf("Get after Build: ok=%v, %d bytes", ok, len(got))
	}
	// A second Build of the same key does nothing.
	s.Build(key, int64(len(want)), func(context.Context, io.Writer) error { t.Error("rebuilt an existing copy"); return nil })
	s.Wait()
	if st := s.Stats(); st.Builds != 1 || st.Entries != 1 || st.Size != 1000 || st.Hits != 1 {
		t.Errorf("stats %+v", st)
	}
}

// TestFailedBuildsLeaveNothing: a writer that fails, writes too little or
// too much never leaves a copy, nor a temporary file.
func TestFailedBuildsLeaveNothing(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, 1<<20)
	cases := map[string]func(context.Context, io.Writer) error{
		"error": func(ctx context.Context, w io.Writer) error {
			w.Write([]byte("part"))
			return errors.New("chunk missing")
		},
		"short": writer([]byte("short")),
		"long":  writer(bytes.Repeat([]byte("y"), 200)),
	}
	for name, write := range cases {
		key := digest.FromString(name)
		s.Build(key, 100, write)
		s.Wait()
		if _, ok := s.Get(key); ok {
			t.Errorf("%s: a failed build left a copy", name)
		}
	}
	if st := s.Stats(); st.Failed != 3 || st.Entries != 0 || st.Size != 0 {
		t.Errorf("stats %+v", st)
	}
	left, _ := os.ReadDir(dir)
	if len(left) != 0 {
		t.Errorf("files left after failed builds: %v", left)
	}
}

// TestEvictsLeastRecentlyOpened, and an evicted copy still open stays
// readable.
func TestEvictsLeastRecentlyOpened(t *testing.T) {
	s := open(t, t.TempDir(), 250)
	a, b, c := digest.FromString("a"), digest.FromString("b"), digest.FromString("c")
	s.Build(a, 100, writer(bytes.Repeat([]byte("a"), 100)))
	s.Wait()
	s.Build(b, 100, writer(bytes.Repeat([]byte("b"), 100)))
	s.Wait()
	held, ok := s.Get(a) // a is now the most recently opened
	if !ok {
		t.Fatal("no copy of a")
	}
	defer held.Close()
	s.Build(c, 100, writer(bytes.Repeat([]byte("c"), 100)))
	s.Wait()
	if _, ok := s.Get(b); ok {
		t.Error("b, least recently opened, was not evicted")
	}
	for _, k := range []digest.Digest{a, c} {
		if _, ok := read(t, s, k); !ok {
			t.Errorf("%s evicted", k)
		}
	}
	// Too big for the store at all: not built.
	s.Build(digest.FromString("huge"), 300, writer(make([]byte, 300)))
	s.Wait()
	if st := s.Stats(); st.Evicted != 1 || st.Entries != 2 || st.Failed != 0 {
		t.Errorf("stats %+v", st)
	}
	if got, err := io.ReadAll(held); err != nil || len(got) != 100 {
		t.Errorf("held copy: %d bytes, %v", len(got), err)
	}
}

// TestOpenStartsEmpty: copies of an earlier run are not trusted.
func TestOpenStartsEmpty(t *testing.T) {
	dir := t.TempDir()
	s := open(t, dir, 1<<20)
	key := digest.FromString("a")
	s.Build(key, 3, writer([]byte("abc")))
	s.Wait()
	s.Close()
	if err := os.WriteFile(filepath.Join(dir, digest.FromString("planted").Encoded()), []byte("evil"), 0o600); err != nil {
		t.Fatal(err)
	}
	s2 := open(t, dir, 1<<20)
	if _, ok := s2.Get(key); ok {
		t.Error("a copy of the previous run was served")
	}
	if left, _ := os.ReadDir(dir); len(left) != 0 {
		t.Errorf("files kept from the previous run: %v", left)
	}
	// They are deleted in the background.
	for i := 0; ; i++ {
		stale, _ := filepath.Glob(dir + ".stale-*")
		if len(stale) == 0 {
			break
		}
		if i == 500 {
			t.Fatalf("copies of the previous run still on disk: %v", stale)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCloseCancelsBuilds: Close does not wait for a slow writer to finish
// on its own.
func TestCloseCancelsBuilds(t *testing.T) {
	s := open(t, t.TempDir(), 1<<20)
	started := make(chan struct{})
	s.Build(digest.FromString("slow"), 10, func(ctx context.Context, w io.Writer) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	})
	<-started
	s.Close()
	if st := s.Stats(); st.Entries != 0 || st.Failed != 1 {
		t.Errorf("stats %+v", st)
	}
	s.Build(digest.FromString("late"), 1, writer([]byte("x")))
	s.Wait()
	if st := s.Stats(); st.Builds != 0 {
		t.Errorf("built after Close: %+v", st)
	}
}
