package hostile_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/mount"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/diskcap"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/tests/testenv"
)

// ctrIn runs the real ctr against env's containerd.
func ctrIn(t *testing.T, env *testenv.Env, args ...string) (string, error) {
	t.Helper()
	full := append([]string{"--address", env.Address, "--namespace", env.Namespace}, args...)
	ctx, cancel := context.WithTimeout(env.Context(), 90*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, testenv.Tool(t, "ctr"), full...).CombinedOutput()
	if ctx.Err() != nil {
		t.Logf("ctr %s: timed out", strings.Join(args, " "))
	}
	return string(out), err
}

func mustCtr(t *testing.T, env *testenv.Env, args ...string) string {
	t.Helper()
	out, err := ctrIn(t, env, args...)
	if err != nil {
		t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// capLeftovers lists the loop devices backed by a file under root, and
// the ext4 mounts under it.
func capLeftovers(t *testing.T, root string) []string {
	t.Helper()
	var left []string
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(string(bytes.TrimSpace(b)), root) {
			left = append(left, "loop "+filepath.Base(filepath.Dir(filepath.Dir(f)))+": "+string(bytes.TrimSpace(b)))
		}
	}
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(root))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.FSType == "ext4" {
			left = append(left, "mount "+m.Mountpoint)
		}
	}
	return left
}

// deleteContainer deletes a container of ctr run, task first.
func deleteContainer(t *testing.T, env *testenv.Env, id string) {
	t.Helper()
	_, _ = ctrIn(t, env, "task", "kill", "--signal", "SIGKILL", id)
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := ctrIn(t, env, "task", "delete", id)
		if err == nil || strings.Contains(out, "not found") || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	mustCtr(t, env, "containers", "delete", id)
}

// shimPid finds the envlet shim serving container id in env's namespace:
// the parent of the task's init process (the shim is its subreaper). A
// shim serves a group of containers, and its command line names only the
// first.
func shimPid(t *testing.T, env *testenv.Env, id string) int {
	t.Helper()
	out := mustCtr(t, env, "task", "ls")
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != id {
			continue
		}
		raw, err := os.ReadFile("/proc/" + f[1] + "/stat")
		if err != nil {
			t.Fatalf("task %s: %v", id, err)
		}
		// The command name may hold spaces: fields start after the last ')'.
		st := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+1:]))
		if len(st) < 2 {
			t.Fatalf("task %s: short stat %q", id, raw)
		}
		pid, err := strconv.Atoi(st[1])
		if err != nil {
			t.Fatal(err)
		}
		return pid
	}
	t.Fatalf("no task %s in:\n%s", id, out)
	return 0
}

// TestHardDiskCap runs containers with a hard cap on their writable
// layer (the snapshot label diskcap.LabelBytes, set with ctr's
// --snapshotter-label): writing past it fails with ENOSPC inside, the
// shim ends the environment with DISK_CAP_EXCEEDED, and deleting the
// container
// leaves no loop device or mount, also after the shim or the envsnap
// daemon was killed.
func TestHardDiskCap(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{}))
	img := env.PushImageLayers(t, "hostile/diskcap:1", nil, testenv.WithLazyLayers())
	failures := (&episode{env: env}).failures(t)
	mustCtr(t, env, "images", "pull", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap", img.Ref)
	const capBytes = 32 << 20
	run := func(id string, args ...string) []string {
		return append([]string{"run", "-d", "--snapshotter", "envsnap", "--runtime", "io.containerd.envlet.v2",
			"--snapshotter-label", fmt.Sprintf("%s=%d", diskcap.LabelBytes, capBytes)}, append([]string{img.Ref, id}, args...)...)
	}
	// containerd removes a deleted container's snapshot from the
	// snapshotter at its next garbage collection, soon after.
	noLeftovers := func(t *testing.T) {
		t.Helper()
		// The loop device and mount go before the snapshot's directory
		// (and its image file) is removed: wait for both.
		var left, imgs []string
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			left = capLeftovers(t, env.EnvsnapRoot)
			imgs, _ = filepath.Glob(filepath.Join(env.EnvsnapRoot, "snapshots", "*", "writable.ext4"))
			if len(left) == 0 && len(imgs) == 0 {
				break
			}
		}
		if len(left) > 0 {
			t.Errorf("left behind: %v", left)
		}
		if len(imgs) > 0 {
			t.Errorf("image files left: %v", imgs)
		}
	}

	t.Run("fill", func(t *testing.T) {
		const id = "cap-fill"
		fg := run(id, "/bin/sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=64; echo dd-exit=$?; sleep 60")
		out, _ := ctrIn(t, env, append(fg[:1], fg[2:]...)...) // in the foreground
		t.Cleanup(func() { _, _ = ctrIn(t, env, "containers", "delete", id) })
		if !strings.Contains(out, "No space left on device") || !strings.Contains(out, "dd-exit=1") {
			t.Errorf("dd of 64 MiB against a 32 MiB cap printed %q, want ENOSPC", out)
		}
		f := waitFailure(t, failures, id)
		if f.Reason != envlet.ReasonDiskCapExceeded || f.Cap != capBytes {
			t.Errorf("failure %+v, want %s at cap %d", f, envlet.ReasonDiskCapExceeded, capBytes)
		}
		t.Logf("%s: %s", f.Reason, f.Message)
		if left := capLeftovers(t, env.EnvsnapRoot); len(left) != 2 {
			t.Errorf("while the container exists: %v, want its loop device and mount", left)
		}
		deleteContainer(t, env, id)
		noLeftovers(t)
	})

	t.Run("shim killed", func(t *testing.T) {
		const id = "cap-shim"
		mustCtr(t, env, run(id, "/bin/sleep", "600")...)
		if err := syscall.Kill(shimPid(t, env, id), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		deleteContainer(t, env, id)
		noLeftovers(t)
	})

	t.Run("daemon killed", func(t *testing.T) {
		const id = "cap-daemon"
		mustCtr(t, env, run(id, "/bin/sleep", "600")...)
		env.Envsnap.Kill()
		env.StartEnvsnap(t)
		// The cap holds across the restart, and the layer still works.
		out, _ := ctrIn(t, env, "task", "exec", "--exec-id", "fill", id, "/bin/sh", "-c",
			"echo ok > /ok && cat /ok; dd if=/dev/zero of=/fill bs=1M count=64 2>&1; true")
		if !strings.Contains(out, "ok\n") || !strings.Contains(out, "No space left on device") {
			t.Errorf("after the daemon restart: %q, want a working layer with its cap", out)
		}
		deleteContainer(t, env, id)
		noLeftovers(t)
	})
}

// smallNode makes a file system of size bytes and inodes files for the
// envsnap daemon's root, loop-mounted in a temp dir, so that filling the
// node's disk fills it and not the host's.
func smallNode(t *testing.T, size, inodes int64) string {
	t.Helper()
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Fatalf("mkfs.ext4 (e2fsprogs): %v", err)
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "node.ext4")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-m", "0", "-N", strconv.FormatInt(inodes, 10), img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v\n%s", err, out)
	}
	root := filepath.Join(dir, "root")
	if err := os.Mkdir(root, 0o700); err != nil {
		t.Fatal(err)
	}
	m := mount.Mount{Type: "ext4", Source: img, Options: []string{"loop"}}
	if err := m.Mount(root); err != nil {
		t.Fatal(err)
	}
	// Registered before the env's, so it runs after the env is gone.
	t.Cleanup(func() {
		if err := unix.Unmount(root, 0); err != nil {
			// Busy: something is still mounted below it.
			t.Errorf("unmount the test node's file system: %v (left below it: %v)", err, capLeftovers(t, root))
			_ = unix.Unmount(root, unix.MNT_DETACH)
		}
	})
	return root
}

// runFiller runs ctr in the foreground and returns its output, when the
// line "filler-exit" came and when ctr ended.
func runFiller(t *testing.T, env *testenv.Env, args ...string) (out string, failed, ended time.Time) {
	t.Helper()
	ctx, cancel := context.WithTimeout(env.Context(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.Tool(t, "ctr"), append([]string{"--address", env.Address, "--namespace", env.Namespace}, args...)...)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	var b strings.Builder
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "filler-exit") && failed.IsZero() {
			failed = time.Now()
		}
		b.WriteString(sc.Text() + "\n")
	}
	r.Close()
	_ = cmd.Wait()
	return b.String(), failed, time.Now()
}

// TestDefaultDiskCap: under the defaults (no label, the daemon's and the
// shim's default configuration), an environment that writes more than
// the node's disk holds, or creates more files than it has inodes,
// fails with DISK_CAP_EXCEEDED while its neighbour keeps writing. The
// snapshotter's root is a 256 MiB ext4 with 8192 inodes made for the
// test: the filler asks for 400 MiB, then 30,000 files.
func TestDefaultDiskCap(t *testing.T) {
	root := smallNode(t, 256<<20, 8192)
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvsnapRoot(root), testenv.WithEnvlet(testenv.EnvletConfig{}))
	img := env.PushImageLayers(t, "hostile/diskcap-default:1", nil, testenv.WithLazyLayers())
	failures := (&episode{env: env}).failures(t)
	mustCtr(t, env, "images", "pull", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap", img.Ref)
	if out, err := ctrIn(t, env, "run", "-d", "--snapshotter", "envsnap", "--runtime", "io.containerd.envlet.v2", img.Ref, "neighbour", "/bin/sleep", "600"); err != nil {
		t.Fatalf("start the neighbour: %v\n%s", err, out)
	}
	t.Cleanup(func() { deleteContainer(t, env, "neighbour") })
	neighbourWrites := func(t *testing.T, what string) {
		t.Helper()
		out, err := ctrIn(t, env, "task", "exec", "--exec-id", "w"+strconv.FormatInt(time.Now().UnixNano(), 36), "neighbour", "/bin/sh", "-c",
			"mkdir -p /n/"+what+" && cd /n/"+what+" && seq 1 200 | xargs touch && dd if=/dev/zero of=data bs=1M count=8 conv=fsync 2>&1 && echo neighbour-ok")
		if err != nil || !strings.Contains(out, "neighbour-ok") {
			t.Errorf("after %s the neighbour could not write 200 files and 8 MiB: %v\n%s", what, err, out)
		}
	}
	nodeFree := func() string {
		var st unix.Statfs_t
		if err := unix.Statfs(root, &st); err != nil {
			t.Fatal(err)
		}
		return fmt.Sprintf("%s and %d inodes free", envlet.FormatBytes(int64(st.Bavail)*st.Bsize), st.Ffree)
	}
	// A filler's layer must be gone (containerd removes a deleted
	// container's snapshot at its next garbage collection) before the
	// next one is sized from the free space.
	layersGone := func(t *testing.T) {
		t.Helper()
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			if left := capLeftovers(t, filepath.Join(root, "snapshots")); len(left) <= 2 { // the neighbour's loop device and mount
				return
			}
		}
		t.Fatalf("the filler's layer was not removed: %v", capLeftovers(t, filepath.Join(root, "snapshots")))
	}
	// The filler prints "filler-exit" once its writes failed, then sleeps
	// 60 s: killed for the failure, it never prints "not-killed".
	for _, tc := range []struct {
		id, script string
	}{
		{"fill-bytes", "dd if=/dev/zero of=/fill bs=1M count=400 2>&1; echo filler-exit=$?; sleep 60; echo not-killed"},
		{"fill-inodes", "mkdir /d && cd /d && seq 1 30000 | xargs touch 2>&1 | head -n 3; echo filler-exit; sleep 60; echo not-killed"},
	} {
		t.Run(tc.id, func(t *testing.T) {
			t.Cleanup(func() { deleteContainer(t, env, tc.id); layersGone(t) })
			out, failed, ended := runFiller(t, env, append([]string{"run", "--snapshotter", "envsnap", "--runtime", "io.containerd.envlet.v2", img.Ref, tc.id, "/bin/sh", "-c"}, tc.script)...)
			if !strings.Contains(out, "No space left on device") || strings.Contains(out, "not-killed") {
				t.Errorf("the filler printed %q, want ENOSPC and no %q", lastLines(out, 5), "not-killed")
			}
			if !failed.IsZero() {
				t.Logf("the environment ended %s after its writes failed; the node has %s", ended.Sub(failed).Round(time.Millisecond), nodeFree())
			}
			neighbourWrites(t, tc.id)
			f := waitFailure(t, failures, tc.id)
			t.Logf("%s: %s", f.Reason, f.Message)
			if f.Reason != envlet.ReasonDiskCapExceeded {
				t.Errorf("failure %+v, want %s", f, envlet.ReasonDiskCapExceeded)
			}
		})
	}
}

// BenchmarkDefaultDiskCap sets the default hard cap against no cap (the
// snapshot label 0, the default before it), side by side in one env: the
// wall time of `ctr run --rm` of a container that exits at once, and the
// throughput of a 64 MiB dd with fsync into the writable layer.
func BenchmarkDefaultDiskCap(b *testing.B) {
	env := testenv.New(b, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{}))
	img := env.PushImageLayers(b, "hostile/diskcap-bench:1", nil, testenv.WithLazyLayers())
	if out, err := benchCtr(b, env, "images", "pull", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap", img.Ref); err != nil {
		b.Fatalf("pull: %v\n%s", err, out)
	}
	type side struct {
		name, label string
		start, ddTm time.Duration
	}
	sides := []*side{{name: "nocap", label: "0"}, {name: "default"}}
	runOnce := func(id string, s *side, script string) (string, time.Duration) {
		args := []string{"run", "--rm", "--snapshotter", "envsnap", "--runtime", "io.containerd.envlet.v2"}
		if s.label != "" {
			args = append(args, "--snapshotter-label", diskcap.LabelBytes+"="+s.label)
		}
		start := time.Now()
		out, err := benchCtr(b, env, append(args, img.Ref, id, "/bin/sh", "-c", script)...)
		if err != nil {
			b.Fatalf("run: %v\n%s", err, out)
		}
		return out, time.Since(start)
	}
	for i := 0; b.Loop(); i++ {
		for _, s := range sides {
			_, d := runOnce(fmt.Sprintf("start-%d-%s", i, s.name), s, "true")
			s.start += d
			out, _ := runOnce(fmt.Sprintf("write-%d-%s", i, s.name), s, "time -p dd if=/dev/zero of=/f bs=1M count=64 conv=fsync 2>&1")
			var secs float64
			for _, l := range strings.Split(out, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), "real "); ok {
					secs, _ = strconv.ParseFloat(v, 64)
				}
			}
			if secs <= 0 {
				b.Fatalf("no time in dd's output %q", out)
			}
			s.ddTm += time.Duration(secs * float64(time.Second))
		}
	}
	n := float64(b.N)
	plain, capped := sides[0], sides[1]
	b.ReportMetric(plain.start.Seconds()*1000/n, "ms-start-nocap")
	b.ReportMetric(capped.start.Seconds()*1000/n, "ms-start-cap")
	b.ReportMetric(capped.start.Seconds()/plain.start.Seconds(), "x-start")
	b.ReportMetric(64*n/plain.ddTm.Seconds(), "MiB/s-nocap")
	b.ReportMetric(64*n/capped.ddTm.Seconds(), "MiB/s-cap")
	b.ReportMetric(capped.ddTm.Seconds()/plain.ddTm.Seconds(), "x-write-time")
}

// benchCtr runs ctr against env's containerd.
func benchCtr(b *testing.B, env *testenv.Env, args ...string) (string, error) {
	full := append([]string{"--address", env.Address, "--namespace", env.Namespace}, args...)
	ctx, cancel := context.WithTimeout(env.Context(), 90*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, testenv.Tool(b, "ctr"), full...).CombinedOutput()
	return string(out), err
}
