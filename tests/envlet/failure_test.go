package envlet_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/envlet/envlettest"
)

// A task needing 2 GiB on a node that can grant 870 MiB: the controller
// grows as far as the node allows, the task sleeps at the limit (paused,
// not OOM-killed), and 2 s later Run returns MEM_NODE_EXHAUSTED with the
// numbers, leaving the kill to the caller.
func TestNodeExhaustedFails(t *testing.T) {
	m := envlettest.RequireV1(t)
	v1 := envlettest.NewV1(t, m)
	p := envlettest.Start(t)
	v1.Add(t, p.Pid())
	cg, err := envlet.OpenCgroup(v1.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cg.Close() })
	cfg := envlet.DefaultConfig()
	cfg.Initial = envlet.Resources{CPU: 1, Memory: 256 * MiB}
	cfg.Cap = envlet.Resources{CPU: 2, Memory: 8 * GiB}
	arb := envlet.NewNodeArbiter(envlet.Resources{CPU: 2, Memory: 1 * GiB}, envlet.DefaultReserve)
	ctl, err := envlet.NewController("exhausted", cg, cfg, arb)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ctl.Run(context.Background()) }()
	waitFor(t, 5*time.Second, "first sample", func() bool { return len(ctl.Timeline()) > 0 })
	start := time.Now()
	allocated := make(chan error, 1)
	go func() { _, err := p.Do("alloc 2048"); allocated <- err }()
	var runErr error
	select {
	case runErr = <-done:
	case err := <-allocated:
		t.Fatalf("the 2 GiB allocation finished (%v) on a node granting 870 MiB", err)
	case <-time.After(60 * time.Second):
		t.Fatal("no failure within 60 s")
	}
	printTimeline(t, ctl.Timeline(), start, time.Now(), true)
	var fe *envlet.FailureError
	if !errors.As(runErr, &fe) {
		t.Fatalf("Run returned %v, want a FailureError", runErr)
	}
	t.Logf("failure after %v: %s", time.Since(start).Round(time.Millisecond), fe.Error())
	if fe.Reason != envlet.ReasonNodeExhausted || fe.Granted != envlet.GiB*85/100 || fe.Cap != 1*GiB || fe.WorkingSet < 800*MiB {
		t.Fatalf("failure %+v", fe.Failure)
	}
	if n := v1.OOMKills(t); n != 0 {
		t.Errorf("%d OOM kills before the controller decided", n)
	}
	if len(arb.Leases()) != 0 {
		t.Errorf("lease not released: %v", arb.Leases())
	}
}
