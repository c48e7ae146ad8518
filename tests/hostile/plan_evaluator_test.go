package hostile_test

import (
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/plan"
	"github.com/envsnap/envsnap/shim"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestPlanEvaluatorWithCtr composes a plan whose evaluator group holds
// the answers, pulls it and runs it with the real ctr, which passes no
// evaluator annotation: the snapshotter keeps the group out of every
// container of the image, the envlet shim shows it, read-only, to the
// evaluator's exec only, and under plain runc it is never there.
func TestPlanEvaluatorWithCtr(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{}))
	ctx := env.Context()
	agent := env.PushImageLayers(t, "hostile/plan-agent:1", [][]testenv.File{{{Path: "/bin/bash", Mode: 0o755, Data: []byte(genuineBash)}}},
		testenv.WithLazyLayers(), testenv.WithCmd("/bin/sleep", "3600"))
	evaluator := env.PushImageLayers(t, "hostile/plan-evaluator:1", [][]testenv.File{{
		{Path: "/evaluator/answers.txt", Mode: 0o644, Data: []byte(answersText)},
		{Path: "/evaluator/score.sh", Mode: 0o755, Data: []byte("#!/bin/sh\ncat /evaluator/answers.txt\n")},
	}}, testenv.WithoutBusybox()) // gzip: containerd unpacks it into a plain directory
	harness := env.PushImageLayers(t, "hostile/plan-harness:1", [][]testenv.File{{{Path: "/harness/run", Mode: 0o755, Data: []byte("#!/bin/sh\n")}}},
		testenv.WithLazyLayers(), testenv.WithoutBusybox())

	c := &plan.Composer{Hosts: env.Hosts()}
	// The evaluator group in the middle: a group above it must not move
	// the marking.
	p := &plan.Plan{Name: "hostile-plan", Groups: []string{agent.Ref, evaluator.Ref, harness.Ref},
		Evaluator: &plan.Evaluator{Group: evaluator.Ref, Dir: "/evaluator"}}
	img, err := c.Compose(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	target := env.Registry.Host + "/hostile/plan:1"
	if _, err := c.Push(ctx, img, target); err != nil {
		t.Fatal(err)
	}

	ctr := func(t *testing.T, args ...string) (string, error) {
		t.Helper()
		full := append([]string{"--address", env.Address, "--namespace", env.Namespace}, args...)
		cmd := exec.CommandContext(ctx, testenv.Tool(t, "ctr"), full...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	must := func(t *testing.T, args ...string) string {
		t.Helper()
		out, err := ctr(t, args...)
		if err != nil {
			t.Fatalf("ctr %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	// Through the transfer service: containerd's unpacker passes the
	// layer annotations, and so the marking, to the snapshotter.
	must(t, "images", "pull", "--hosts-dir", env.HostsDir, "--snapshotter", "envsnap", target)

	const id = "plan-env"
	must(t, "run", "-d", "--snapshotter", "envsnap", "--runtime", "io.containerd.envlet.v2", target, id)
	t.Cleanup(func() {
		_, _ = ctr(t, "task", "kill", "--signal", "SIGKILL", id)
		for range 50 {
			if out, _ := ctr(t, "task", "delete", id); !strings.Contains(out, "running") {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		_, _ = ctr(t, "containers", "delete", id)
	})

	// The agent, root, searches the whole file system.
	out := must(t, "task", "exec", "--exec-id", "agent", id, "/bin/sh", "-c",
		"cat /evaluator/answers.txt 2>&1; ls -A /evaluator | wc -l; find / -xdev -name 'answers*' 2>/dev/null; /bin/bash; ls /harness; true")
	// ctr's output carries containerd's log lines, whose timestamps can
	// hold any two digits: look for the answers' text, not their number.
	answers := strings.TrimSpace(answersText)
	if strings.Contains(out, answers) || strings.Contains(out, "answers.txt\n") || !strings.Contains(out, "genuine-bash") || !strings.Contains(out, "run") {
		t.Errorf("the agent's exec printed %q: want no answers, and the other groups' files", out)
	}
	// The evaluator reads them, and cannot change them. ctr cannot add
	// to an exec's environment: the harness's Go client does it.
	cont, err := env.Client.LoadContainer(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	task, err := cont.Task(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	stdout, stderr, code := (&neighbour{task: task}).execEnv(t, &episode{env: env}, []string{shim.EvaluatorEnv + "=1"}, "/bin/sh", "-c",
		"/evaluator/score.sh; echo x >> /evaluator/answers.txt && echo CHANGED; true")
	if code != 0 || stdout != answersText || !strings.Contains(stderr, "Read-only file system") {
		t.Errorf("evaluator exec: exit %d stdout %q stderr %q: want the answers and a read-only directory", code, stdout, stderr)
	}

	// Without the envlet runtime the evaluator is not there at all.
	out, err = ctr(t, "run", "--rm", "--snapshotter", "envsnap", target, "plan-runc", "/bin/sh", "-c",
		"cat /evaluator/answers.txt 2>&1; find / -xdev -name 'answers*' 2>/dev/null; true")
	if err != nil || strings.Contains(out, answers) || strings.Contains(out, "answers.txt\n") {
		t.Errorf("a runc container of the plan image: %v, output %q", err, out)
	}
}
