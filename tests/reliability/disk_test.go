package reliability_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/images"

	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/tests/testenv"
)

// smallFS mounts a tmpfs of size bytes for the test.
func smallFS(t *testing.T, size int64) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "envsnap-rel-fs")
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", size)); err != nil {
		os.Remove(dir)
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
		os.Remove(dir)
	})
	return dir
}

func daemonConfig(t *testing.T, toml string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.toml")
	if err := os.WriteFile(p, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDiskFull: the chunk cache lives on a file system much smaller than
// its bound, and something else fills that file system. Reads of more data
// than fits still return the right bytes (served without caching), the
// cache never claims more than the file system holds, nothing cached is
// corrupt, and once space returns caching resumes.
func TestDiskFull(t *testing.T) {
	const fsSize = 16 << 20
	fsDir := smallFS(t, fsSize)
	cfg := daemonConfig(t, fmt.Sprintf("cache_dir = %q\ncache_size = \"1GiB\"\n", filepath.Join(fsDir, "cache")))
	env := testenv.New(t, testenv.WithEnvsnap("--config", cfg, "--fill=false"))
	var files []testenv.File
	for i := range 6 {
		files = append(files, testenv.RandomFile(fmt.Sprintf("/data/f%d.bin", i), 4<<20, int64(200+i)))
	}
	img := pushLazy(t, env, "rel/disk:1", files)
	image := env.Pull(t, img.Ref, "envsnap")
	read := func(f testenv.File) {
		t.Helper()
		res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
		if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
			t.Fatalf("read %s: exit %d stdout %q stderr %q", f.Path, res.ExitCode, res.Stdout, res.Stderr)
		}
	}
	read(files[0]) // busybox and one file cached while there is room
	before := envsnapStatus(t, env).Cache

	// Fill the file system up to the last few KiB.
	filler := filepath.Join(fsDir, "filler")
	fillUp(t, filler)

	for _, f := range files[1:4] {
		read(f) // 12 MiB that cannot be cached
	}
	full := envsnapStatus(t, env).Cache
	if full.PutErrors == before.PutErrors {
		t.Fatalf("no cache write failed on a full file system (stats %+v): the test proves nothing", full)
	}
	if full.Size > fsSize {
		t.Errorf("cache claims %d bytes on a %d-byte file system", full.Size, fsSize)
	}
	t.Logf("full: cache %d bytes in %d entries, %d failed puts, %d evictions", full.Size, full.Entries, full.PutErrors, full.Evictions)
	if exited, err := env.Envsnap.Exited(); exited {
		t.Fatalf("daemon exited on a full disk: %v", err)
	}

	// Space returns: the next reads are cached again.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	read(files[4])
	after := envsnapStatus(t, env).Cache
	if after.Size <= full.Size || after.Entries <= full.Entries {
		t.Errorf("caching did not resume once space returned: %+v, was %+v", after, full)
	}
	// Everything read so far reads back right in a fresh container,
	// whether from the cache or the registry.
	for _, f := range files[:5] {
		read(f)
	}
	if after := envsnapStatus(t, env).Cache; after.Corrupt != 0 {
		t.Errorf("%d corrupt cache entries", after.Corrupt)
	}
}

// fillUp writes p until the file system is full, then frees 4 KiB.
func fillUp(t *testing.T, p string) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	for {
		if _, err := f.Write(buf); err != nil {
			break
		}
	}
	if fi, err := f.Stat(); err == nil && fi.Size() > 4096 {
		f.Truncate(fi.Size() - 4096)
	}
}

// TestCacheBound: with a cache bound far below what is read, the cache
// stays within it: the chunks of mounted layers are pinned (reads beyond
// the bound are served uncached), and those of unmounted layers are
// evicted to make room. Every read is right.
func TestCacheBound(t *testing.T) {
	const bound = 6 << 20
	env := testenv.New(t, testenv.WithEnvsnap("--cache-size", fmt.Sprint(bound), "--fill=false"))
	readAll := func(name string, seed int64) {
		t.Helper()
		var files []testenv.File
		for i := range 3 {
			files = append(files, testenv.RandomFile(fmt.Sprintf("/data/%s%d.bin", name, i), 4<<20, seed+int64(i)))
		}
		img := pushLazy(t, env, "rel/bound-"+name+":1", files)
		image := env.Pull(t, img.Ref, "envsnap")
		args := []string{"sha256sum"}
		for _, f := range files {
			args = append(args, f.Path)
		}
		res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: args})
		if res.ExitCode != 0 {
			t.Fatalf("exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		for _, f := range files {
			if !strings.Contains(res.Stdout, f.Digest().Encoded()+"  "+f.Path) {
				t.Errorf("%s: wrong or missing sha256 in %q", f.Path, res.Stdout)
			}
		}
		st := envsnapStatus(t, env).Cache
		if st.Size > bound || st.MaxBytes != bound {
			t.Errorf("cache %d bytes, bound %d (reported %d)", st.Size, bound, st.MaxBytes)
		}
		t.Logf("after 12 MiB of %s: cache %d/%d bytes, %d entries (%d pinned), %d evictions, %d uncached puts", name, st.Size, st.MaxBytes, st.Entries, st.Pinned, st.Evictions, st.PutErrors)
		if err := env.Client.ImageService().Delete(env.Context(), img.Ref, images.SynchronousDelete()); err != nil {
			t.Fatalf("delete image %s: %v", img.Ref, err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for len(envsnapStatus(t, env).Layers) != 0 {
			if time.Now().After(deadline) {
				t.Fatal("layers still mounted after removing the image")
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	readAll("a", 300)
	if st := envsnapStatus(t, env).Cache; st.PutErrors == 0 {
		t.Errorf("12 MiB through a 6 MiB cache of pinned chunks never refused a put: %+v", st)
	}
	readAll("b", 400)
	if st := envsnapStatus(t, env).Cache; st.Evictions == 0 {
		t.Errorf("unpinned chunks of a removed image were not evicted for new ones: %+v", st)
	}
}
