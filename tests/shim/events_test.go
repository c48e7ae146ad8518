package shim_test

import (
	"os/exec"
	"strings"
	"testing"
	"time"

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
