package shim_test

import (
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestCtrEvents: containerd's own `ctr events` decodes the failure event
// and prints its topic and reason (it used to print "cannot unmarshal an
// event from Any ... google.protobuf.Struct: not found").
func TestCtrEvents(t *testing.T) {
	s := newSuite(t, node{cpu: "1", memory: "1Gi", overcommit: "1"})
	out := &syncBuffer{}
	cmd := exec.Command(testenv.Tool(t, "ctr"), "--address", s.env.Address, "events", `topic=="`+shim.FailedEventTopic+`"`)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	if _, err := s.run(t, map[string]string{"initial-cpu": "0.25", "initial-memory": "768Mi"}, "-mode", "idle", "-hold", "60s"); err != nil {
		t.Fatal(err)
	}
	// ctr says nothing when its subscription is up: refuse a container
	// (admitting by request, a second 768 MiB container on a 1 GiB node) until ctr prints the event.
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), shim.FailedEventTopic) {
		if time.Now().After(deadline) {
			t.Fatalf("ctr events printed no %s within 30 s:\n%s", shim.FailedEventTopic, out.String())
		}
		if _, err := s.run(t, map[string]string{"initial-cpu": "0.25", "initial-memory": "768Mi"}, "-mode", "idle", "-hold", "1s"); err == nil {
			t.Fatal("a 768 MiB container was admitted next to another on a 1 GiB node admitting by request")
		}
		time.Sleep(500 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the rest of the line
	got := out.String()
	t.Logf("ctr events:\n%s", got)
	if strings.Contains(got, "cannot unmarshal") || !strings.Contains(got, `"reason":"ADMISSION_REJECTED"`) {
		t.Fatalf("ctr events did not decode the failure:\n%s", got)
	}
}

// TestRunAdmittedPlacesAgain: two containers that the node (1 GiB,
// admitting by request) can hold only one at a time, both started through
// devenv.RunAdmitted as the benchmarks start theirs: the one the arbiter
// refuses is placed again once the other has ended, and both finish. The
// headline iteration counted such refusals as failed environments.
func TestRunAdmittedPlacesAgain(t *testing.T) {
	s := newSuite(t, node{cpu: "1", memory: "1Gi", overcommit: "1"})
	opts := testenv.RunOptions{
		Runtime: envletRuntime,
		Annotations: map[string]string{
			envlet.AnnotationPrefix + "initial-cpu":    "0.25",
			envlet.AnnotationPrefix + "initial-memory": "768Mi",
		},
		Args:    []string{"/workload", "-mode", "idle", "-hold", "3s"},
		Timeout: time.Minute,
	}
	var (
		wg      sync.WaitGroup
		refused [2]int
		errs    [2]error
	)
	for i := range 2 {
		wg.Go(func() {
			var out testenv.RunResult
			out, refused[i], errs[i] = s.env.RunAdmitted(s.env.Context(), s.img, opts, time.Minute)
			if errs[i] == nil && out.ExitCode != 0 {
				errs[i] = fmt.Errorf("exit %d: %s", out.ExitCode, out.Stderr)
			}
		})
	}
	wg.Wait()
	t.Logf("refusals before admission: %v", refused)
	for i, err := range errs {
		if err != nil {
			t.Errorf("container %d: %v", i, err)
		}
	}
	if refused[0]+refused[1] == 0 {
		t.Error("two 768 MiB containers ran at once on a 1 GiB node admitting by request: nothing was refused, the test proves nothing")
	}
}
