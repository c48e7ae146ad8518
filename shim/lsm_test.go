//go:build linux

package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/lsm"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/shim/config"
)

func TestNodeSockets(t *testing.T) {
	env := map[string]string{"GRPC_ADDRESS": "/run/containerd/containerd.sock", "TTRPC_ADDRESS": "unix:///run/containerd/containerd.sock.ttrpc"}
	got := NodeSockets(func(k string) string { return env[k] })
	if len(got) != 2 || got[0] != env["GRPC_ADDRESS"] || got[1] != "/run/containerd/containerd.sock.ttrpc" {
		t.Errorf("NodeSockets = %q", got)
	}
	if got := NodeSockets(func(string) string { return "" }); len(got) != 0 {
		t.Errorf("no addresses: %q", got)
	}
}

// TestStartLSM confines a process in a cgroup of its own the way Create
// does: with rules where the kernel runs them, else without, reported in
// the environment's status.
func TestStartLSM(t *testing.T) {
	prereq.RequireRoot(t)
	own, err := lsm.ProcessCgroup(os.Getpid())
	if err != nil {
		prereq.Missing(t, "%v", err)
	}
	dir := filepath.Join(own.Dir, fmt.Sprintf("envsnap-shim-lsm-%d", os.Getpid()))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir) })
	cg, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })

	protected := t.TempDir()
	s := New(context.Background(), nil, nil, Options{Guard: config.GuardLimits{LSM: true, Protected: []string{protected, filepath.Join(protected, "absent")}}})
	if err := s.startLSM(context.Background(), "c1", uint32(cmd.Process.Pid)); err != nil {
		t.Fatal(err)
	}
	l := s.lsm["c1"]
	var st envlet.Status
	l.status(&st)
	_, loadErr := lsm.New(lsm.Cgroup{ID: 1, Level: 1, Dir: dir}, nil)
	switch {
	case errors.Is(loadErr, lsm.ErrUnavailable):
		if !st.LSMUnavailable || l.guard != nil {
			t.Errorf("BPF LSM unavailable (%v), status %+v", loadErr, st)
		}
	case l.guard == nil || st.LSMUnavailable:
		t.Errorf("BPF LSM available, but the environment runs without rules: %s", l.unavailable)
	}
	s.stopLSM("c1")
	if s.lsm["c1"] != nil {
		t.Error("rules still registered after stopLSM")
	}
	// A process that is gone has no cgroup: Create fails.
	if err := s.startLSM(context.Background(), "c2", 1<<22+7); err == nil {
		t.Error("startLSM of a missing process succeeded")
	}
}
