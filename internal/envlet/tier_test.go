package envlet

import (
	"context"
	"testing"
	"time"
)

func TestTierWeights(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want CPUWeights
	}{
		{"standard", CPUWeights{}},
		{"latency", CPUWeights{Shares: 10240, Weight: 1000}},
		{"besteffort", CPUWeights{Shares: 2, Weight: 1, Idle: true}},
	} {
		tier, err := ParseTier(tt.in)
		if err != nil {
			t.Fatal(err)
		}
		if got := tier.Weights(); got != tt.want {
			t.Errorf("%s: %+v, want %+v", tt.in, got, tt.want)
		}
	}
	cfg := DefaultConfig()
	if err := cfg.ApplyAnnotations(map[string]string{AnnotationPrefix + "tier": "fast"}); err == nil {
		t.Error("tier=fast accepted")
	}
	if err := cfg.ApplyAnnotations(map[string]string{AnnotationPrefix + "tier": "besteffort"}); err != nil || cfg.Tier != TierBestEffort {
		t.Errorf("tier=besteffort: %v, %q", err, cfg.Tier)
	}
}

// tierCgroup records the weights a controller applies.
type tierCgroup struct {
	*fakeCgroup
	set []CPUWeights
}

func (c *tierCgroup) SetTier(w CPUWeights) error {
	c.set = append(c.set, w)
	return nil
}

// Run applies the tier's weights once, before the initial quota.
func TestRunAppliesTier(t *testing.T) {
	cfg := testConfig()
	cfg.Tier = TierLatency
	cg := &tierCgroup{fakeCgroup: newFakeCgroup()}
	c, err := NewController("env", cg, cfg, bigNode(), WithClock(newFakeClock()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	for len(c.Timeline()) == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(cg.set) != 1 || cg.set[0] != TierLatency.Weights() {
		t.Fatalf("weights applied %+v, want the latency tier's once", cg.set)
	}
}

// A latency-tier environment gets its CPU whichever started first: the
// CPU best-effort work holds does not count against its admission nor its
// grows (the weights give it that CPU), so a quota taken by whoever grew
// first no longer decides. Before, the latency environment started after
// the best-effort ones was held at its initial quota.
func TestNodeArbiterTierCPU(t *testing.T) {
	ctx := context.Background()
	base := Resources{CPU: 0.25, Memory: 256 * MiB}
	for _, latencyFirst := range []bool{false, true} {
		a := NewNodeArbiter(Resources{CPU: 2, Memory: 8 * GiB}, DefaultReserve)
		admitLatency := func() {
			if err := a.Admit(ctx, "latency", base, WithTier(TierLatency)); err != nil {
				t.Fatalf("latency first %v: admit: %v", latencyFirst, err)
			}
		}
		if latencyFirst {
			admitLatency()
		}
		for _, id := range []string{"be1", "be2"} {
			if err := a.Admit(ctx, id, base, WithTier(TierBestEffort)); err != nil {
				t.Fatal(err)
			}
			g, err := a.Grow(ctx, id, Resources{CPU: 2})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := a.Report(ctx, id, g, Resources{CPU: g.CPU, Memory: 100 * MiB}); err != nil {
				t.Fatal(err)
			}
		}
		if !latencyFirst {
			admitLatency()
		}
		g, err := a.Grow(ctx, "latency", Resources{CPU: 1})
		if err != nil {
			t.Fatal(err)
		}
		if g.CPU != 1 {
			t.Fatalf("latency first %v: latency grew to %.3g cores next to best-effort work, want 1", latencyFirst, g.CPU)
		}
	}
}
