package envlet

import (
	"strings"
	"testing"
	"time"
)

func TestDefaultConfigValid(t *testing.T) {
	cfg := DefaultConfig()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if cfg.Initial != (Resources{CPU: 2, Memory: 8 * GiB}) || cfg.Cap != (Resources{CPU: 64, Memory: 32 * GiB}) {
		t.Fatalf("defaults %v / %v differ from docs/envlet.md", cfg.Initial, cfg.Cap)
	}
}

func TestApplyAnnotations(t *testing.T) {
	tests := []struct {
		name    string
		ann     map[string]string
		check   func(c Config) bool
		wantErr string
	}{
		{"quantities", map[string]string{
			"io.envsnap.envlet.initial-cpu": "250m", "io.envsnap.envlet.initial-memory": "256Mi",
			"io.envsnap.envlet.cap-cpu": "2", "io.envsnap.envlet.cap-memory": "6Gi",
		}, func(c Config) bool {
			return c.Initial == Resources{CPU: 0.25, Memory: 256 * MiB} && c.Cap == Resources{CPU: 2, Memory: 6 * GiB}
		}, ""},
		{"durations and fractions", map[string]string{
			"io.envsnap.envlet.mem-shrink-after": "5s", "io.envsnap.envlet.cpu-grow-util": "0.9",
			"io.envsnap.envlet.fail-ooms": "3", "io.envsnap.envlet.cpu-burst": "false",
		}, func(c Config) bool {
			return c.MemShrinkAfter == 5*time.Second && c.CPUGrowUtil == 0.9 && c.FailOOMs == 3 && !c.CPUBurst
		}, ""},
		{"other keys ignored", map[string]string{"io.kubernetes.cri.container-type": "container"}, func(c Config) bool {
			return c.Initial == DefaultConfig().Initial
		}, ""},
		{"unknown knob", map[string]string{"io.envsnap.envlet.initial-cpus": "1"}, nil, "unknown annotation"},
		{"bad memory", map[string]string{"io.envsnap.envlet.initial-memory": "lots"}, nil, "invalid memory quantity"},
		{"bad cpu", map[string]string{"io.envsnap.envlet.cap-cpu": "-1"}, nil, "invalid cpu quantity"},
		{"bad duration", map[string]string{"io.envsnap.envlet.sample-period": "0s"}, nil, "must be positive"},
		{"cap below initial", map[string]string{"io.envsnap.envlet.cap-memory": "1Gi"}, nil, "below initial"},
		{"no hysteresis", map[string]string{"io.envsnap.envlet.mem-shrink-ws": "0.35"}, nil, "hysteresis"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			err := cfg.ApplyAnnotations(tt.ann)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got %v, want error containing %q", err, tt.wantErr)
				}
				if cfg != DefaultConfig() {
					t.Fatal("a rejected annotation set changed the config")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tt.check(cfg) {
				t.Fatalf("config %+v", cfg)
			}
		})
	}
}

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]int64{"1024": 1024, "1Ki": 1024, "256Mi": 256 * MiB, "1.5Gi": 3 * GiB / 2, "2G": 2e9, "1k": 1000} {
		got, err := ParseBytes(in)
		if err != nil || got != want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "Mi", "-1Gi", "1Xi", "NaN"} {
		if _, err := ParseBytes(in); err == nil {
			t.Errorf("ParseBytes(%q) accepted", in)
		}
	}
}
