package hostile_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/envlet/cgroupfs"
	"github.com/envsnap/envsnap/tests/testenv"
)

const (
	// snapshotHang is how long a snapshot may take before it counts as
	// hung: far above what one takes even on an overloaded machine (the
	// issue's target is 10 s, and the test logs the longest it saw; at a
	// load average of 80 on 2 cores one took 53 s), so the test fails on
	// a hang, not on a slow machine.
	snapshotHang = 3 * time.Minute
	// sigtermGrace is how long `env snapshot` may take to exit after
	// SIGTERM: a cancelled upload session is deleted with a 10 s
	// deadline, and the rest on a loaded machine.
	sigtermGrace = time.Minute
	// raceBudget stops the raced snapshots early, after at least
	// minRaced, on a machine too loaded to take them all in CI's time.
	raceBudget = 6 * time.Minute
	minRaced   = 10
)

// snapEnv is an environment under attack, snapshotted again and again.
type snapEnv struct {
	env  *testenv.Env
	id   string
	task client.Task
	n    int
}

// startSnapEnv runs /bin/sleep in an envlet environment of img (its
// evaluator layer held back) and returns once it runs.
func startSnapEnv(t *testing.T, env *testenv.Env, img client.Image, id string) *snapEnv {
	t.Helper()
	ctx := env.Context()
	c, err := env.Client.NewContainer(ctx, id,
		client.WithSnapshotter("envsnap"),
		client.WithNewSnapshot(id, img),
		client.WithRuntime(envletRuntime, nil),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs("/bin/sleep", "100000"), oci.WithAnnotations(evaluatorAnn)),
	)
	if err != nil {
		t.Fatalf("create %s: %v", id, err)
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(env.Context(), 30*time.Second)
		defer cancel()
		_ = c.Delete(dctx, client.WithSnapshotCleanup)
	})
	task, err := c.NewTask(ctx, cio.NullIO)
	if err != nil {
		t.Fatalf("task %s: %v", id, err)
	}
	t.Cleanup(func() {
		// A snapshot killed while it held the cgroup frozen would leave
		// it so, and a frozen task cannot be killed.
		if fz, err := cgroupfs.FreezerOf(int(task.Pid())); err == nil {
			_ = fz.Thaw()
		}
		dctx, cancel := context.WithTimeout(env.Context(), 30*time.Second)
		defer cancel()
		_, _ = task.Delete(dctx, client.WithProcessKill)
	})
	if err := task.Start(ctx); err != nil {
		t.Fatalf("start %s: %v", id, err)
	}
	return &snapEnv{env: env, id: id, task: task}
}

// attack starts args as a process of the environment (an exec) and
// leaves it running.
func (s *snapEnv) attack(t *testing.T, args ...string) {
	t.Helper()
	ctx := s.env.Context()
	spec, err := s.task.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	p := *spec.Process
	p.Args = args
	s.n++
	var errOut testenv.OutputBuffer
	proc, err := s.task.Exec(ctx, fmt.Sprintf("attack-%d", s.n), &p, cio.NewCreator(cio.WithStreams(nil, io.Discard, &errOut)))
	if err != nil {
		t.Fatalf("exec %v: %v", args, err)
	}
	exited, err := proc.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := proc.Start(ctx); err != nil {
		t.Fatalf("start %v: %v", args, err)
	}
	// Its set-up is done when the names it swaps exist; a loop that
	// stops is a broken test, not a passed one.
	time.Sleep(500 * time.Millisecond)
	select {
	case st := <-exited:
		t.Fatalf("%v exited %d: %s", args, st.ExitCode(), errOut.String())
	default:
	}
	t.Cleanup(func() {
		select {
		case st := <-exited:
			t.Errorf("%v stopped during the test: exit %d: %s", args, st.ExitCode(), errOut.String())
		default:
		}
	})
}

// outcome is one `env snapshot` run.
type outcome struct {
	ref    string // REF@DIGEST when it succeeded
	err    error
	output string
	took   time.Duration
}

// snapshot runs `containerd-envsnap env snapshot` against the environment;
// term, if set, is when to send it SIGTERM. A run still going after
// snapshotHang is sent SIGTERM, and fails the test if it is still there
// sigtermGrace later.
func (s *snapEnv) snapshot(t *testing.T, target string, term time.Duration) outcome {
	t.Helper()
	e := s.env
	cmd := exec.Command(testenv.Binary(t, "containerd-envsnap"), "env", "snapshot",
		"--address", e.Address, "--namespace", e.Namespace, "--hosts-dir", e.HostsDir, "--push", target, s.id)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	wait := snapshotHang
	if term > 0 {
		wait = term
	}
	var err error
	select {
	case err = <-done:
	case <-time.After(wait):
		if term == 0 {
			t.Errorf("snapshot %s still running after %s: sending SIGTERM", target, snapshotHang)
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err = <-done:
		case <-time.After(sigtermGrace):
			_ = cmd.Process.Kill()
			<-done
			t.Fatalf("snapshot %s ignored SIGTERM for %s (killed); output:\n%s", target, sigtermGrace, out.String())
		}
	}
	o := outcome{err: err, output: out.String(), took: time.Since(start)}
	if err == nil {
		for l := range strings.Lines(o.output) {
			if strings.HasPrefix(l, target+"@sha256:") {
				o.ref = strings.TrimSpace(l)
			}
		}
		if o.ref == "" {
			t.Fatalf("snapshot %s: no %s@DIGEST in its output:\n%s", target, target, o.output)
		}
	}
	s.thawed(t)
	return o
}

// thawed fails t unless the environment runs, its cgroup not frozen.
func (s *snapEnv) thawed(t *testing.T) {
	t.Helper()
	fz, err := cgroupfs.FreezerOf(int(s.task.Pid()))
	if err != nil {
		t.Fatalf("freezer of %s: %v", s.id, err)
	}
	if frozen, err := fz.Frozen(); err != nil || frozen {
		t.Fatalf("%s left frozen (%v, %v)", s.id, frozen, err)
	}
	st, err := s.task.Status(s.env.Context())
	if err != nil || st.Status != client.Running {
		t.Fatalf("%s: status %v, %v; want running", s.id, st.Status, err)
	}
}

// diffLayer returns the uncompressed tar of the top layer of ref
// (REF@DIGEST): the snapshot's diff.
func diffLayer(t *testing.T, env *testenv.Env, ref string) []byte {
	t.Helper()
	ctx := env.Context()
	res := env.Resolver()
	name, desc, err := res.Resolve(ctx, ref)
	if err != nil {
		t.Fatalf("resolve %s: %v", ref, err)
	}
	f, err := res.Fetcher(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	read := func(d ocispec.Descriptor) []byte {
		rc, err := f.Fetch(ctx, d)
		if err != nil {
			t.Fatalf("fetch %s: %v", d.Digest, err)
		}
		defer rc.Close()
		b, err := io.ReadAll(rc)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(read(desc), &m); err != nil {
		t.Fatal(err)
	}
	// An envsnap layer decompresses to the diff's tar (its TOC is in a
	// skippable frame).
	dec, err := zstd.NewReader(bytes.NewReader(read(m.Layers[len(m.Layers)-1])))
	if err != nil {
		t.Fatal(err)
	}
	defer dec.Close()
	tarBytes, err := io.ReadAll(dec)
	if err != nil {
		t.Fatalf("decompress the diff layer of %s: %v", ref, err)
	}
	return tarBytes
}

// TestHostileSnapshot snapshots environments whose agent, root inside,
// races the snapshot in its own writable layer (docs/snapshots.md,
// "Reading a hostile writable layer"): directories exchanged with
// symlinks to a host directory and to the evaluator layer's host
// directory, whose paths an agent reads in /proc/self/mountinfo; regular
// files exchanged with FIFOs and sockets. No snapshot may hold a byte from
// outside the writable layer, every one must end (done or failed) with
// the environment thawed, and SIGTERM must stop one.
func TestHostileSnapshot(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{}))
	tools := []testenv.File{{Path: "/agent", Mode: 0o755, Data: agentBinary(t)}}
	answers := []testenv.File{{Path: "/evaluator/answers.txt", Mode: 0o644, Data: []byte(answersText)}}
	pushed := env.PushImageLayers(t, "hostile/snap-episode:1", [][]testenv.File{tools, answers}, testenv.WithLazyLayers(), testenv.WithCmd("/bin/true"))
	img := env.Pull(t, pushed.Ref, "envsnap")

	hostDir := t.TempDir()
	hostSecret := fmt.Sprintf("HOST-ONLY-%d\n", time.Now().UnixNano())
	if err := os.WriteFile(filepath.Join(hostDir, "secret.txt"), []byte(hostSecret), 0o644); err != nil {
		t.Fatal(err)
	}
	rounds := 50
	if testing.Short() {
		rounds = 10
	}

	t.Run("directories exchanged with symlinks to the host", func(t *testing.T) {
		s := startSnapEnv(t, env, img, "swap-dirs")
		// The evaluator's layer, held back from the environment, is the
		// image's top layer: lowerdir's first directory.
		evalDir := filepath.Join(layerDirs(t, env, s.id)[0], "evaluator")
		if b, err := os.ReadFile(filepath.Join(evalDir, "answers.txt")); err != nil || string(b) != answersText {
			t.Fatalf("the evaluator layer on the host: %q, %v", b, err)
		}
		pad := fmt.Sprint(2 << 20)
		// The agent sees where its layers are on the host.
		mountinfo, _, _ := (&neighbour{task: s.task}).execEnv(t, &episode{env: env}, nil, "cat", "/proc/self/mountinfo")
		for _, dir := range layerDirs(t, env, s.id)[1:] {
			if !strings.Contains(mountinfo, dir) {
				t.Errorf("the environment's mountinfo does not show its layer %s:\n%s", dir, mountinfo)
			}
		}
		s.attack(t, "/agent", "swap", "/w/host", "secret.txt", hostDir, "8", pad)
		s.attack(t, "/agent", "swap", "/w/eval", "answers.txt", evalDir, "8", pad)
		var leaked, failed, taken int
		var longest time.Duration
		var took []time.Duration
		start := time.Now()
		for i := range rounds {
			if i >= minRaced && time.Since(start) > raceBudget {
				t.Logf("stopping after %d raced snapshots (%s): the machine is too loaded for %d", i, time.Since(start).Round(time.Second), rounds)
				break
			}
			taken++
			o := s.snapshot(t, fmt.Sprintf("%s/hostile/snap-dirs:%d", env.Registry.Host, i), 0)
			longest = max(longest, o.took)
			if o.err != nil {
				failed++
				t.Logf("snapshot %d failed after %s: %v\n%s", i, o.took.Round(time.Millisecond), o.err, lastLines(o.output, 3))
				continue
			}
			took = append(took, o.took)
			if testing.Verbose() {
				t.Logf("snapshot %d: %s", i, lastLines(o.output, 1))
			}
			diff := diffLayer(t, env, o.ref)
			if !bytes.Contains(diff, []byte("inside 7\n")) {
				t.Fatalf("snapshot %d holds none of the agent's own files: the race did not run", i)
			}
			// A reader that states the agent's 9-byte file and then
			// opens the host's reads the host file's first 9 bytes.
			var what []string
			if bytes.Contains(diff, []byte(hostSecret[:8])) {
				what = append(what, "the host directory's secret.txt")
			}
			if bytes.Contains(diff, []byte(answersText[:8])) {
				what = append(what, "the evaluator's answers")
			}
			if len(what) > 0 {
				leaked++
				t.Errorf("snapshot %d (%s) holds %s", i, o.ref, strings.Join(what, " and "))
			}
		}
		t.Logf("%d raced snapshots: %d with bytes from outside the writable layer, %d failed; longest %s", taken, leaked, failed, longest.Round(time.Millisecond))
		if failed > taken/2 {
			t.Errorf("%d of %d snapshots failed: the race must not stop snapshots", failed, taken)
		}
		if len(took) == 0 {
			return
		}

		// SIGTERM while a snapshot runs (half way through, by the
		// snapshots above): it stops, thaws, pushes no image. One that
		// finished first, or got the signal before it could catch it,
		// proves nothing: try again, earlier or later.
		slices.Sort(took)
		after := took[len(took)/2] / 2
		cancelled := false
		for i := range 6 {
			target := fmt.Sprintf("%s/hostile/snap-term:%d", env.Registry.Host, i)
			o := s.snapshot(t, target, after)
			t.Logf("SIGTERM after %s: exited after %s: %v: %s", after.Round(time.Millisecond), o.took.Round(time.Millisecond), o.err, lastLines(o.output, 1))
			var exit *exec.ExitError
			switch {
			case o.err == nil:
				after /= 2
				continue
			case !errors.As(o.err, &exit):
				t.Fatalf("snapshot after SIGTERM: %v", o.err)
			case !exit.Exited():
				// Killed by the signal before the handler was in place.
				after *= 3
				continue
			case !strings.Contains(o.output, "context canceled") && !strings.Contains(o.output, "signal received"):
				// Failed for another reason: not what this checks.
				continue
			}
			// Cancelled: the error names the context's end, or, from an
			// HTTP request of the push, its cause (SIGTERM).
			if _, _, err := env.Resolver().Resolve(env.Context(), target); err == nil {
				t.Errorf("a cancelled snapshot pushed %s", target)
			}
			cancelled = true
			break
		}
		if !cancelled {
			t.Error("no snapshot was cancelled by SIGTERM while it ran in 6 tries")
		}
	})

	t.Run("regular files exchanged with FIFOs and sockets", func(t *testing.T) {
		s := startSnapEnv(t, env, img, "swap-fifos")
		s.attack(t, "/agent", "swapfifo", "/w/fifo", "16")
		n := max(rounds/5, 5)
		var failed int
		var longest time.Duration
		for i := range n {
			o := s.snapshot(t, fmt.Sprintf("%s/hostile/snap-fifos:%d", env.Registry.Host, i), 0)
			longest = max(longest, o.took)
			if o.err != nil {
				failed++
				t.Logf("snapshot %d failed after %s: %v\n%s", i, o.took.Round(time.Millisecond), o.err, lastLines(o.output, 3))
			}
		}
		t.Logf("%d snapshots against FIFO and socket swaps: %d failed; longest %s (target 10 s)", n, failed, longest.Round(time.Millisecond))
		if failed > n/2 {
			t.Errorf("%d of %d snapshots failed", failed, n)
		}

	})
}

// layerDirs lists the host directories of the image layers of container
// id's snapshot, topmost first (overlay's lowerdir).
func layerDirs(t *testing.T, env *testenv.Env, id string) []string {
	t.Helper()
	ctx := env.Context()
	c, err := env.Client.LoadContainer(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mounts, err := env.Client.SnapshotService(info.Snapshotter).Mounts(ctx, info.SnapshotKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mounts {
		for _, o := range m.Options {
			if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
				return strings.Split(v, ":")
			}
		}
	}
	t.Fatalf("no lowerdir in the mounts of %s: %+v", id, mounts)
	return nil
}
