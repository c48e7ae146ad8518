package snapshotter_test

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/internal/layerstore"
	"github.com/envsnap/envsnap/tests/testenv"
)

// waitNativeCopies waits until the daemon holds n native layer copies.
func waitNativeCopies(t testing.TB, env *testenv.Env, n int, timeout time.Duration) daemon.Status {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		st := envsnapStatus(t, env)
		if st.Native != nil && st.Native.Copies >= n {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d native copies wanted after %s: %+v, layers %+v\n%s", n, timeout, st.Native, st.Layers, env.Envsnap.LogTail(30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// rootLowers runs a container that prints the sha256 of path and its own
// mountinfo, and returns the lower directories of its root overlay.
func rootLowers(t testing.TB, env *testenv.Env, image client.Image, f testenv.File) []string {
	t.Helper()
	res := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sh", "-c", "sha256sum " + f.Path + " && cat /proc/self/mountinfo"}})
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, f.Digest().Encoded()) {
		t.Fatalf("container: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
	for _, line := range strings.Split(res.Stdout, "\n") {
		fields := strings.Fields(line)
		if len(fields) < 5 || fields[4] != "/" {
			continue
		}
		for i, f := range fields {
			if f != "-" || i+3 >= len(fields) || fields[i+1] != "overlay" {
				continue
			}
			for _, opt := range strings.Split(fields[i+3], ",") {
				if v, ok := strings.CutPrefix(opt, "lowerdir="); ok {
					return strings.Split(v, ":")
				}
			}
		}
	}
	t.Fatalf("no root overlay with lowerdir in the container's mountinfo:\n%s", res.Stdout)
	return nil
}

// TestNativeLower: once a layer's chunks are all local, a container
// started afterwards gets the native copies as its overlay lowers (not
// the FUSE mounts) and reads the right bytes; a restarted daemon finds
// the copies again without rebuilding them.
func TestNativeLower(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap())
	f := testenv.RandomFile("/data/f.bin", 6<<20, 11)
	img := pushLazyImage(t, env, "lazy/native:1", []testenv.File{f}, "/bin/true")
	image := env.Pull(t, img.Ref, "envsnap")

	// The first container starts on FUSE; the fill completes and the
	// copies are built behind it, at idle priority.
	env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: []string{"sha256sum", f.Path}})
	waitFilled(t, env, time.Minute)
	st := waitNativeCopies(t, env, len(img.Layers), time.Minute)
	// serve has them built by processes of their own.
	if st.Native.ProcessBuilds != st.Native.Builds {
		t.Errorf("%d of %d native copies built in a process of their own, want all", st.Native.ProcessBuilds, st.Native.Builds)
	}
	if st.Cache.Charged != st.Native.Size || st.Native.Size == 0 {
		t.Errorf("native copies take %d bytes but the cache has %d charged", st.Native.Size, st.Cache.Charged)
	}
	for _, l := range st.Layers {
		if l.Fill.State != fetch.FillComplete || l.Native != layerstore.NativeReady {
			t.Errorf("layer %s: fill %+v, native %q; want complete and ready", l.Digest, l.Fill, l.Native)
		}
	}
	out, err := env.EnvsnapCLI("status", "--address", env.SnapshotterSocket)
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	for _, l := range img.Layers {
		if !regexp.MustCompile(`(?m)^` + l.Digest.Encoded()[:12] + `\s.*\s100\.0%\s+complete\s+ready\s`).MatchString(out) {
			t.Errorf("status does not show layer %s complete with its native copy ready:\n%s", l.Digest, out)
		}
	}

	nativeRoot := filepath.Join(env.EnvsnapRoot, "native")
	checkNative := func(when string) {
		t.Helper()
		lowers := rootLowers(t, env, image, f)
		if len(lowers) != len(img.Layers) {
			t.Fatalf("%s: %d lowers for %d layers: %v", when, len(lowers), len(img.Layers), lowers)
		}
		for i, l := range img.Layers {
			// overlay lists the top layer first.
			want := filepath.Join(nativeRoot, l.Digest.Algorithm().String(), l.Digest.Encoded())
			if got := lowers[len(lowers)-1-i]; got != want {
				t.Errorf("%s: lower of layer %d is %s, want the native copy %s", when, i, got, want)
			}
		}
	}
	checkNative("after the fill")

	env.Envsnap.Stop(20 * time.Second)
	env.StartEnvsnap(t)
	st = envsnapStatus(t, env)
	if st.Native == nil || st.Native.Copies != len(img.Layers) || st.Native.Builds != 0 {
		t.Fatalf("after restart: native %+v, want %d copies found, none built", st.Native, len(img.Layers))
	}
	checkNative("after a restart")
}
