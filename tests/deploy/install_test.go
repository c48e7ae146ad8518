package deploy

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

// installer runs deploy/install-node.sh against a fake host root, the way
// the DaemonSet's init container runs it against /host.
type installer struct {
	t        *testing.T
	shell    []string
	hostRoot string
	srcDir   string
}

// shells are the POSIX shells the installer must run under: the image's
// /bin/sh (dash on Debian) and, where installed, busybox's (what a minimal
// image would have).
func shells() [][]string {
	s := [][]string{{"/bin/sh"}}
	if bb, err := exec.LookPath("busybox"); err == nil {
		s = append(s, []string{bb, "sh"})
	}
	return s
}

func newInstaller(t *testing.T) *installer {
	return newInstallerWithShell(t, []string{"/bin/sh"})
}

func newInstallerWithShell(t *testing.T, shell []string) *installer {
	in := &installer{t: t, shell: shell, hostRoot: t.TempDir(), srcDir: t.TempDir()}
	in.writeSource("containerd-shim-envlet-v2", []byte("#!/bin/sh\necho shim v1\n"), 0o755)
	in.writeSource("containerd-envsnap", []byte("#!/bin/sh\necho envsnap v1\n"), 0o755)
	in.writeSource("containerd-envsnap.toml", repoFile(t, "deploy/containerd/envsnap.toml"), 0o644)
	in.writeSource("envlet.toml", repoFile(t, "deploy/envsnap/envlet.toml"), 0o644)
	return in
}

func (in *installer) writeSource(name string, b []byte, mode os.FileMode) {
	in.t.Helper()
	if err := os.WriteFile(filepath.Join(in.srcDir, name), b, mode); err != nil {
		in.t.Fatal(err)
	}
}

func (in *installer) host(p string) string { return filepath.Join(in.hostRoot, p) }

// run runs the script with POSIX sh (dash here, like busybox sh in small
// images: no bashisms).
func (in *installer) run(env ...string) (string, error) {
	in.t.Helper()
	args := append(append([]string(nil), in.shell[1:]...), filepath.Join(testenv.RepoRoot(in.t), "deploy/install-node.sh"))
	cmd := exec.Command(in.shell[0], args...)
	cmd.Env = append([]string{
		"PATH=" + os.Getenv("PATH"),
		"HOST_ROOT=" + in.hostRoot,
		"ENVSNAP_SHIM=" + filepath.Join(in.srcDir, "containerd-shim-envlet-v2"),
		"ENVSNAP_DAEMON=" + filepath.Join(in.srcDir, "containerd-envsnap"),
		"ENVSNAP_DROPIN=" + filepath.Join(in.srcDir, "containerd-envsnap.toml"),
		"ENVSNAP_ENVLET_CONFIG=" + filepath.Join(in.srcDir, "envlet.toml"),
	}, env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (in *installer) mustRun(env ...string) string {
	in.t.Helper()
	out, err := in.run(env...)
	if err != nil {
		in.t.Fatalf("install-node.sh: %v\n%s", err, out)
	}
	return out
}

func (in *installer) requireSame(hostPath, src string) {
	in.t.Helper()
	got, err := os.ReadFile(in.host(hostPath))
	if err != nil {
		in.t.Fatalf("not installed: %v", err)
	}
	want, _ := os.ReadFile(filepath.Join(in.srcDir, src))
	if !bytes.Equal(got, want) {
		in.t.Errorf("%s differs from its source %s", hostPath, src)
	}
}

func TestInstallNodeFreshHost(t *testing.T) {
	for _, tc := range []struct {
		name       string
		mainConfig string // "" = none
		env        []string
		wantWarn   bool
		wantMain   bool // a config.toml exists afterwards
	}{
		{name: "no main config", wantWarn: true},
		{name: "no main config, create it", env: []string{"ENVSNAP_CREATE_MAIN_CONFIG=true"}, wantMain: true},
		{name: "main config imports conf.d", mainConfig: "version = 3\nimports = [\"/etc/containerd/conf.d/*.toml\"]\n", wantMain: true},
		{name: "main config without imports", mainConfig: "version = 2\n[plugins]\n", wantWarn: true, wantMain: true},
		{name: "imports elsewhere", mainConfig: "version = 3\nimports = [\"/etc/containerd/other/*.toml\"]\n", wantWarn: true, wantMain: true},
		{name: "existing config is never rewritten", mainConfig: "version = 2\n", env: []string{"ENVSNAP_CREATE_MAIN_CONFIG=true"}, wantWarn: true, wantMain: true},
	} {
		for _, sh := range shells() {
			t.Run(filepath.Base(strings.Join(sh, " "))+"/"+tc.name, func(t *testing.T) {
				testInstallFresh(t, newInstallerWithShell(t, sh), tc.mainConfig, tc.env, tc.wantWarn, tc.wantMain)
			})
		}
	}
}

func testInstallFresh(t *testing.T, in *installer, mainConfig string, env []string, wantWarn, wantMain bool) {
	if mainConfig != "" {
		if err := os.MkdirAll(in.host("etc/containerd"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(in.host("etc/containerd/config.toml"), []byte(mainConfig), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := in.mustRun(env...)
	in.requireSame("usr/local/bin/containerd-shim-envlet-v2", "containerd-shim-envlet-v2")
	in.requireSame("usr/local/bin/containerd-envsnap", "containerd-envsnap")
	in.requireSame("etc/containerd/conf.d/envsnap.toml", "containerd-envsnap.toml")
	in.requireSame("etc/envsnap/envlet.toml", "envlet.toml")
	if fi, err := os.Stat(in.host("usr/local/bin/containerd-shim-envlet-v2")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("shim mode: %v %v", fi.Mode(), err)
	}
	if got := strings.Contains(out, "WARNING"); got != wantWarn {
		t.Errorf("warning printed = %v, want %v:\n%s", got, wantWarn, out)
	}
	if !strings.Contains(out, "containerd must be restarted") {
		t.Errorf("a first install does not say containerd must be restarted:\n%s", out)
	}
	main, err := os.ReadFile(in.host("etc/containerd/config.toml"))
	if (err == nil) != wantMain {
		t.Fatalf("main config exists = %v, want %v", err == nil, wantMain)
	}
	if mainConfig != "" && string(main) != mainConfig {
		t.Errorf("existing main config was modified:\n%s", main)
	}
	leftovers, _ := filepath.Glob(in.host("*/*/.*envsnap-tmp*"))
	more, _ := filepath.Glob(in.host("*/*/*/.*envsnap-tmp*"))
	if len(leftovers)+len(more) > 0 {
		t.Errorf("temporary files left: %v %v", leftovers, more)
	}
}

// TestInstallNodeIdempotentAndUpgrade: a second run changes nothing (the
// pod restarting must not ask for another containerd restart); a new shim
// replaces the old one by rename, so a shim binary that is running is
// upgraded without ETXTBSY and keeps running from the old inode.
func TestInstallNodeIdempotentAndUpgrade(t *testing.T) {
	in := newInstaller(t)
	in.mustRun("ENVSNAP_CREATE_MAIN_CONFIG=true")
	dropin := in.host("etc/containerd/conf.d/envsnap.toml")
	before, err := os.Stat(dropin)
	if err != nil {
		t.Fatal(err)
	}
	out := in.mustRun()
	if !strings.Contains(out, "up to date") || strings.Contains(out, "restarted") {
		t.Errorf("second run:\n%s", out)
	}
	if after, _ := os.Stat(dropin); !os.SameFile(before, after) {
		t.Error("second run replaced an unchanged drop-in")
	}

	// Run the installed "shim" (a copy of sleep), then upgrade it.
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		prereq.Missing(t, "no sleep binary: %v", err)
	}
	sleepBin, err := os.ReadFile(sleep)
	if err != nil {
		t.Fatal(err)
	}
	in.writeSource("containerd-shim-envlet-v2", sleepBin, 0o755)
	in.mustRun()
	shim := in.host("usr/local/bin/containerd-shim-envlet-v2")
	running := exec.Command(shim, "60")
	if err := running.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = running.Process.Kill()
		_ = running.Wait()
	})
	old, err := os.Stat(shim)
	if err != nil {
		t.Fatal(err)
	}
	// Writing into the running binary in place fails with ETXTBSY: make
	// sure this machine enforces that, or the check below proves nothing.
	if f, err := os.OpenFile(shim, os.O_WRONLY, 0); err == nil {
		f.Close()
		t.Fatal("opened a running executable for writing: ETXTBSY is not enforced here")
	} else if !errorsIsErrno(err, syscall.ETXTBSY) {
		t.Fatalf("open running executable: %v", err)
	}
	in.writeSource("containerd-shim-envlet-v2", []byte("#!/bin/sh\necho shim v2\n"), 0o755)
	out = in.mustRun()
	if !strings.Contains(out, "installed /usr/local/bin/containerd-shim-envlet-v2") {
		t.Errorf("upgrade run:\n%s", out)
	}
	in.requireSame("usr/local/bin/containerd-shim-envlet-v2", "containerd-shim-envlet-v2")
	if cur, _ := os.Stat(shim); os.SameFile(old, cur) {
		t.Error("the shim was rewritten in place, not replaced")
	}
	if strings.Contains(out, "containerd must be restarted") {
		t.Errorf("a shim upgrade alone asks for a containerd restart:\n%s", out)
	}
	// The running process is unaffected.
	time.Sleep(50 * time.Millisecond)
	if err := running.Process.Signal(syscall.Signal(0)); err != nil {
		t.Errorf("running shim died during the upgrade: %v", err)
	}
}

func TestInstallNodeMissingSource(t *testing.T) {
	in := newInstaller(t)
	if err := os.Remove(filepath.Join(in.srcDir, "envlet.toml")); err != nil {
		t.Fatal(err)
	}
	out, err := in.run()
	if err == nil {
		t.Fatalf("install-node.sh succeeded without envlet.toml:\n%s", out)
	}
	if _, err := os.Stat(in.host("etc/containerd/conf.d/envsnap.toml")); err == nil {
		t.Error("a failed install still installed the drop-in")
	}
}

// TestInstallNodeUnwritableHost: a write failure fails the init container
// (set -e), instead of reporting success with nothing installed.
func TestInstallNodeUnwritableHost(t *testing.T) {
	in := newInstaller(t)
	// A regular file where a directory must be created: fails even for root.
	if err := os.MkdirAll(in.host("etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(in.host("etc/containerd"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := in.run()
	if err == nil {
		t.Fatalf("install-node.sh succeeded although /etc/containerd is a file:\n%s", out)
	}
}

func errorsIsErrno(err error, errno syscall.Errno) bool {
	var e syscall.Errno
	return errors.As(err, &e) && e == errno
}
