package arbiter

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

// TestEnvTableState: the STATE column says what the controller's status
// and the listing say, the end first, then a pause, then idleness.
func TestEnvTableState(t *testing.T) {
	status := func(st envlet.Status) json.RawMessage {
		b, err := json.Marshal(st)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	now := time.Now()
	envs := []EnvInfo{
		{Env: "ns/running", Status: status(envlet.Status{})},
		{Env: "ns/idle", Status: status(envlet.Status{Idle: true})},
		{Env: "ns/frozen", Status: status(envlet.Status{Idle: true, Paused: true})},
		{Env: "ns/parked", Status: status(envlet.Status{Idle: true, Paused: true, PushedOut: 96 * envlet.MiB})},
		{Env: "ns/gone", Status: status(envlet.Status{Paused: true}), Ended: now, Reason: "exited"},
	}
	for i := range envs {
		envs[i].Admitted = now.Add(-time.Minute)
	}
	var buf bytes.Buffer
	if err := WriteEnvTable(&buf, envs); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"ns/running": "running",
		"ns/idle":    "idle",
		"ns/frozen":  "paused",
		"ns/parked":  "paused, 96.0Mi pushed out",
		"ns/gone":    "ended: exited",
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != len(envs)+1 {
		t.Fatalf("table:\n%s", buf.String())
	}
	for _, l := range lines[1:] {
		env := strings.Fields(l)[0]
		if !strings.Contains(l, "  "+want[env]+"  ") {
			t.Errorf("row of %s: %q, want state %q", env, l, want[env])
		}
	}
}
