// Package hostile_test runs a hostile episode: an agent that is root in
// its container and tries the known shortcuts on the file system and the
// node's resources (docs/reliability.md, "Adversarial agents"). Every
// attempt must be denied or contained, a contained one must end the
// environment loudly with a reason, and the daemon and a neighbouring
// environment from the same image must not notice.
package hostile_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim"
	"github.com/envsnap/envsnap/tests/testenv"
)

const envletRuntime = "io.containerd.envlet.v2"

// genuineBash is the image's /bin/bash: what every environment must see
// whatever another one did to its own copy.
const genuineBash = "#!/bin/sh\necho genuine-bash\n"

// answersText is what the evaluator knows and the agent must not.
const answersText = "the answer is 42\n"

// evaluatorAnn holds the image's evaluator layer (position 2) back, to be
// mounted at /evaluator at evaluation time.
var evaluatorAnn = map[string]string{shim.AnnEvaluatorLayers: "2", shim.AnnEvaluatorDir: "/evaluator"}

// withEvaluator returns ann plus evaluatorAnn.
func withEvaluator(ann map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range []map[string]string{evaluatorAnn, ann} {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

// agentBinary builds ./agent as a static binary.
func agentBinary(t *testing.T) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "agent")
	cmd := exec.Command("go", "build", "-ldflags=-s -w", "-o", out, "./agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build agent: %v\n%s", err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// episode is the stack the hostile episode runs on: containerd with the
// envsnap snapshotter and the envlet shim, and the episode's image pulled
// lazily.
type episode struct {
	env   *testenv.Env
	image client.Image
}

func (ep *episode) run(t *testing.T, ann map[string]string, script string, opts ...oci.SpecOpts) testenv.RunResult {
	t.Helper()
	return ep.env.RunContainer(t, ep.image, testenv.RunOptions{
		Snapshotter: "envsnap", Runtime: envletRuntime, Annotations: withEvaluator(ann),
		Args: []string{"/bin/sh", "-c", script}, SpecOpts: opts, Timeout: 90 * time.Second,
	})
}

// failures collects the shim's failure events of the namespace.
func (ep *episode) failures(t *testing.T) func() []envlet.Failure {
	ctx, cancel := context.WithCancel(ep.env.Context())
	t.Cleanup(cancel)
	ch, errs := ep.env.Client.Subscribe(ctx, `topic=="`+shim.FailedEventTopic+`"`)
	var mu sync.Mutex
	var got []envlet.Failure
	go func() {
		for {
			select {
			case e := <-ch:
				if e == nil {
					continue
				}
				v, err := typeurl.UnmarshalAny(e.Event)
				if err != nil {
					continue
				}
				if u, ok := v.(*eventstypes.ContainerUpdate); ok {
					if f, err := shim.ParseFailureEvent(u); err == nil {
						mu.Lock()
						got = append(got, f)
						mu.Unlock()
					}
				}
			case <-errs:
				return
			case <-ctx.Done():
				return
			}
		}
	}()
	return func() []envlet.Failure {
		mu.Lock()
		defer mu.Unlock()
		return append([]envlet.Failure(nil), got...)
	}
}

// neighbour is a long-running environment of the same image that the
// episode must not disturb.
type neighbour struct {
	task    client.Task
	statusC <-chan client.ExitStatus
}

func (ep *episode) startNeighbour(t *testing.T) *neighbour {
	t.Helper()
	ctx := ep.env.Context()
	id := "neighbour"
	c, err := ep.env.Client.NewContainer(ctx, id,
		client.WithSnapshotter("envsnap"),
		client.WithNewSnapshot(id+"-snap", ep.image),
		client.WithRuntime(envletRuntime, nil),
		client.WithNewSpec(oci.WithImageConfig(ep.image), oci.WithProcessArgs("/bin/sleep", "3600"), oci.WithAnnotations(evaluatorAnn)),
	)
	if err != nil {
		t.Fatalf("create neighbour: %v", err)
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(ep.env.Context(), 30*time.Second)
		defer cancel()
		_ = c.Delete(dctx, client.WithSnapshotCleanup)
	})
	task, err := c.NewTask(ctx, cio.NullIO)
	if err != nil {
		t.Fatalf("neighbour task: %v", err)
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(ep.env.Context(), 30*time.Second)
		defer cancel()
		_, _ = task.Delete(dctx, client.WithProcessKill)
	})
	statusC, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatalf("start neighbour: %v", err)
	}
	return &neighbour{task: task, statusC: statusC}
}

var execCount int

// exec runs args in the neighbour and returns its stdout.
func (n *neighbour) exec(t *testing.T, ep *episode, args ...string) string {
	t.Helper()
	out, errOut, code := n.execEnv(t, ep, nil, args...)
	if code != 0 {
		t.Fatalf("%v in neighbour: exit %d, stderr %q", args, code, errOut)
	}
	return out
}

// execEnv runs args with env added in the neighbour.
func (n *neighbour) execEnv(t *testing.T, ep *episode, env []string, args ...string) (stdout, stderr string, code uint32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ep.env.Context(), 60*time.Second)
	defer cancel()
	spec, err := n.task.Spec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pspec := *spec.Process
	pspec.Args = args
	pspec.Env = append(append([]string(nil), pspec.Env...), env...)
	execCount++
	var out, errOut testenv.OutputBuffer
	p, err := n.task.Exec(ctx, fmt.Sprintf("probe-%d", execCount), &pspec, cio.NewCreator(cio.WithStreams(nil, &out, &errOut)))
	if err != nil {
		t.Fatalf("exec in neighbour: %v", err)
	}
	defer p.Delete(context.WithoutCancel(ctx))
	st, err := p.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(ctx); err != nil {
		t.Fatalf("start exec in neighbour: %v", err)
	}
	s := <-st
	if p.IO() != nil {
		p.IO().Wait()
	}
	code, _, err = s.Result()
	if err != nil {
		t.Fatal(err)
	}
	return out.String(), errOut.String(), code
}

// alive fails t unless the neighbour still runs and sees the image's
// /bin/bash.
func (n *neighbour) alive(t *testing.T, ep *episode) {
	t.Helper()
	select {
	case s := <-n.statusC:
		t.Fatalf("neighbour exited: %d", s.ExitCode())
	default:
	}
	if got := n.exec(t, ep, "/bin/bash"); got != "genuine-bash\n" {
		t.Errorf("neighbour's /bin/bash printed %q", got)
	}
}

func TestHostileEpisode(t *testing.T) {
	node := newNodeSide(t)
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{
		Protected: []string{node.secretDir}, ArbiterMetrics: fmt.Sprintf(":%d", node.metricsPort),
	}))
	node.arbiterSocket = filepath.Join(env.Dir, "arbiter.sock")
	tools := []testenv.File{
		{Path: "/bin/bash", Mode: 0o755, Data: []byte(genuineBash)},
		{Path: "/agent", Mode: 0o755, Data: agentBinary(t)},
	}
	// The evaluator group: its own layer on top (position 2 above busybox
	// and the tools), held back from every environment of the episode.
	answers := []testenv.File{
		{Path: "/evaluator/answers.txt", Mode: 0o644, Data: []byte(answersText)},
		{Path: "/evaluator/score.sh", Mode: 0o755, Data: []byte("#!/bin/sh\ncat /evaluator/answers.txt\n")},
	}
	img := env.PushImageLayers(t, "hostile/episode:1", [][]testenv.File{tools, answers}, testenv.WithLazyLayers(), testenv.WithCmd("/bin/true"))
	if len(img.Layers) != 3 {
		t.Fatalf("image has %d layers, want busybox, tools, evaluator", len(img.Layers))
	}
	ep := &episode{env: env, image: env.Pull(t, img.Ref, "envsnap")}
	failures := ep.failures(t)
	nb := ep.startNeighbour(t)
	nb.alive(t, ep)

	t.Run("overwrite /bin/bash", func(t *testing.T) {
		res := ep.run(t, nil, "printf '#!/bin/sh\\necho PWNED\\n' > /bin/bash && /bin/bash")
		if res.ExitCode != 0 || res.Stdout != "PWNED\n" {
			t.Fatalf("root could not change its own /bin/bash: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		nb.alive(t, ep)
		if res := ep.run(t, nil, "/bin/bash"); res.Stdout != "genuine-bash\n" {
			t.Errorf("the next environment's /bin/bash printed %q (stderr %q)", res.Stdout, res.Stderr)
		}
	})

	t.Run("cross-file ioctls", func(t *testing.T) {
		// Extents of a lower-layer file onto a writable one and back.
		res := ep.run(t, nil, "cp /bin/busybox /tmp/w && /agent ioctls /bin/bash /tmp/w && /agent ioctls /tmp/w /bin/bash")
		if res.ExitCode != 0 {
			t.Fatalf("exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		lines := strings.Split(strings.TrimSpace(res.Stdout), "\n")
		want := len(shim.DeniedIoctls) + 3
		if len(lines) != 2*want {
			t.Fatalf("agent printed %d lines, want %d:\n%s", len(lines), 2*want, res.Stdout)
		}
		for _, l := range lines {
			what, result, _ := strings.Cut(l, " ")
			switch what {
			case "FS_IOC_GETFLAGS":
				// Whatever the file system says, it is not the filter.
				if result == "EPERM" {
					t.Errorf("%s: EPERM: the filter refuses ordinary ioctls", what)
				}
			case "FIOCLEX":
				if result != "ok" {
					t.Errorf("%s: %s, want ok (ordinary ioctls must work)", what, result)
				}
			default:
				if result != "EPERM" {
					t.Errorf("%s: %s, want EPERM", what, result)
				}
			}
		}
		nb.alive(t, ep)
	})

	t.Run("masked and read-only paths without a client default", func(t *testing.T) {
		// A client that sends none of them (a hand-written spec) still
		// gets containerd's defaults.
		strip := func(_ context.Context, _ oci.Client, _ *containers.Container, s *specs.Spec) error {
			s.Linux.MaskedPaths, s.Linux.ReadonlyPaths = nil, nil
			return nil
		}
		// Paths of containerd's defaults that exist on these kernels.
		script := "wc -c < /proc/timer_list; ls /sys/firmware | wc -l; echo x > /proc/sys/kernel/domainname && echo SYSCTL-WRITTEN; true"
		res := ep.run(t, nil, script, strip)
		if res.ExitCode != 0 {
			t.Fatalf("exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		if strings.Contains(res.Stdout, "SYSCTL-WRITTEN") || !strings.Contains(res.Stderr, "Read-only file system") {
			t.Errorf("/proc/sys writable: stdout %q stderr %q", res.Stdout, res.Stderr)
		}
		if f := strings.Fields(res.Stdout); len(f) < 2 || f[0] != "0" || f[1] != "0" {
			t.Errorf("/proc/timer_list or /sys/firmware not masked (want 0 bytes, 0 entries): stdout %q stderr %q", res.Stdout, res.Stderr)
		}
	})

	t.Run("fork bomb", func(t *testing.T) {
		res := ep.run(t, map[string]string{shim.AnnPidsLimit: "64"}, "exec /agent forkbomb")
		if res.ExitCode != 137 {
			t.Errorf("fork bomb ended with exit %d, want 137 (killed by the shim); stderr %q", res.ExitCode, lastLines(res.Stderr, 3))
		}
		f := waitFailure(t, failures, res.ID)
		if f.Reason != envlet.ReasonPidsExhausted || f.Cap != 64 {
			t.Errorf("failure %+v, want %s at cap 64", f, envlet.ReasonPidsExhausted)
		}
		nb.alive(t, ep)
	})

	t.Run("output bomb", func(t *testing.T) {
		const limit = 1 << 20
		res := ep.run(t, map[string]string{shim.AnnOutputLimit: fmt.Sprint(limit)}, "yes hostile-output-line")
		if res.ExitCode != 137 {
			t.Errorf("output bomb ended with exit %d, want 137", res.ExitCode)
		}
		notice := "output cap of 1048576 bytes reached"
		if len(res.Stdout) > limit+200 || !strings.Contains(res.Stdout, notice) {
			t.Errorf("stdout %d bytes (cap %d), notice present %v; tail %q", len(res.Stdout), limit, strings.Contains(res.Stdout, notice), lastLines(res.Stdout, 2))
		}
		f := waitFailure(t, failures, res.ID)
		if f.Reason != envlet.ReasonOutputCapExceeded || f.Cap != limit {
			t.Errorf("failure %+v, want %s at cap %d", f, envlet.ReasonOutputCapExceeded, limit)
		}
		nb.alive(t, ep)
	})

	t.Run("disk and inode fill", func(t *testing.T) {
		for _, tc := range []struct {
			name, script string
			ann          map[string]string
		}{
			{"64 MiB against an 8 MiB cap", "dd if=/dev/zero of=/fill bs=1M count=64 2>/dev/null; sleep 60", map[string]string{shim.AnnDiskLimit: fmt.Sprint(8 << 20)}},
			{"files against a 2000-file cap", "i=0; while [ $i -lt 5000 ]; do : > /f$i; i=$((i+1)); done; sleep 60", map[string]string{shim.AnnInodeLimit: "2000"}},
		} {
			res := ep.run(t, tc.ann, tc.script)
			if res.ExitCode != 137 {
				t.Errorf("%s: exit %d, want 137; stderr %q", tc.name, res.ExitCode, lastLines(res.Stderr, 3))
			}
			if f := waitFailure(t, failures, res.ID); f.Reason != envlet.ReasonDiskCapExceeded {
				t.Errorf("%s: failure %+v, want %s", tc.name, f, envlet.ReasonDiskCapExceeded)
			} else {
				t.Logf("%s: %s", tc.name, f.Message)
			}
		}
		nb.alive(t, ep)
	})

	t.Run("evaluator files", func(t *testing.T) {
		// The agent, root, searches the whole file system.
		res := ep.run(t, nil, "cat /evaluator/answers.txt; ls -A /evaluator | wc -l; find / -xdev -name 'answers*' 2>/dev/null; true")
		if strings.Contains(res.Stdout, "42") || strings.Contains(res.Stdout, "answers") {
			t.Errorf("the agent found the evaluator's files: stdout %q", res.Stdout)
		}
		if f := strings.Fields(res.Stdout); len(f) != 1 || f[0] != "0" {
			t.Errorf("/evaluator is not empty during the episode: stdout %q stderr %q", res.Stdout, res.Stderr)
		}
		// A process that is not the evaluator, in a running environment.
		if out, _, _ := nb.execEnv(t, ep, nil, "/bin/sh", "-c", "cat /evaluator/answers.txt; ls -A /evaluator"); out != "" {
			t.Errorf("a plain exec read the evaluator's files: %q", out)
		}
		// The evaluator reads them, and cannot change them.
		out, errOut, code := nb.execEnv(t, ep, []string{shim.EvaluatorEnv + "=1"}, "/bin/sh", "-c", "/evaluator/score.sh; echo x >> /evaluator/answers.txt && echo CHANGED; true")
		if code != 0 || out != answersText {
			t.Errorf("evaluator exec: exit %d stdout %q stderr %q, want the answers", code, out, errOut)
		}
		if !strings.Contains(errOut, "Read-only file system") {
			t.Errorf("evaluator files writable: stdout %q stderr %q", out, errOut)
		}
		nb.alive(t, ep)
	})

	t.Run("node sockets and a forged arbiter request", func(t *testing.T) {
		nodeSockets(t, ep, node)
		nb.alive(t, ep)
	})

	t.Run("arbiter metrics port from the container", func(t *testing.T) {
		arbiterMetrics(t, ep, node)
	})

	t.Run("node sockets and a protected directory mounted in on purpose", func(t *testing.T) {
		mountedInOnPurpose(t, ep, node)
		nb.alive(t, ep)
	})

	t.Run("node unaffected", func(t *testing.T) {
		if res := ep.run(t, nil, "/bin/bash"); res.ExitCode != 0 || res.Stdout != "genuine-bash\n" {
			t.Errorf("a new environment after the episode: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		if exited, err := env.Envsnap.Exited(); exited {
			t.Errorf("envsnap daemon exited: %v", err)
		}
		nb.alive(t, ep)
		for _, f := range failures() {
			if f.Env == "neighbour" {
				t.Errorf("the neighbour failed: %+v", f)
			}
		}
	})
}

// waitFailure returns the failure event of container id.
func waitFailure(t *testing.T, failures func() []envlet.Failure, id string) envlet.Failure {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for _, f := range failures() {
			if f.Env == id {
				return f
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("no failure event for %s (events: %+v)", id, failures())
	return envlet.Failure{}
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}
