// Package smoke checks the test harness itself: a private registry and
// containerd come up, an image built by the harness is pushed, pulled and
// run, and everything is torn down.
package smoke

import (
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

func TestPullAndRunOverlayfs(t *testing.T) {
	env := testenv.New(t)
	ref := env.PushImage(t, "smoke/hello:1", []testenv.File{
		{Path: "/hello.txt", Data: []byte("hello from envsnap\n")},
	}).Ref

	img := env.Pull(t, ref, "overlayfs")
	res := env.RunContainer(t, img, testenv.RunOptions{Args: []string{"/bin/sh", "-c", "cat /hello.txt; echo exit-code-test >&2; exit 3"}})
	if res.Stdout != "hello from envsnap\n" {
		t.Errorf("stdout = %q, want the file's contents", res.Stdout)
	}
	if !strings.Contains(res.Stderr, "exit-code-test") {
		t.Errorf("stderr = %q, want it to carry the container's stderr", res.Stderr)
	}
	if res.ExitCode != 3 {
		t.Errorf("exit code = %d, want 3", res.ExitCode)
	}
	if env.Registry.BlobBytesServed() == 0 {
		t.Error("the registry served no blob bytes: the pull did not go through it")
	}
}
