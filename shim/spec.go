//go:build linux

package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/envlet"
)

// Annotations the shim reads besides envlet's policy knobs
// (envlet.AnnotationPrefix + knob).
const (
	// annSandboxType marks CRI's pause container, which runs unmanaged.
	annContainerType = "io.kubernetes.cri.container-type"
	containerSandbox = "sandbox"
	// annKubeTermination is kubelet's record of the container's
	// terminationMessagePath. CRI passes it into the OCI spec only when the
	// runtime's container_annotations allow it; kubelet's default path is
	// the fallback.
	annKubeTermination = "io.kubernetes.container.terminationMessagePath"
	defaultTermination = "/dev/termination-log"
	// ShimAnnotationPrefix prefixes the shim's own per-container keys.
	// They are not envlet knobs, so they live outside envlet's prefix
	// (which rejects unknown keys).
	ShimAnnotationPrefix = "io.envsnap.shim."
	// AnnDisable ("true") runs the container without a controller.
	AnnDisable = ShimAnnotationPrefix + "disable"
	// AnnTerminationMessagePath names the in-container path whose bind
	// mount receives the failure reason (for runtimes other than CRI).
	AnnTerminationMessagePath = ShimAnnotationPrefix + "termination-message-path"
)

// readSpec reads the OCI spec containerd wrote into the bundle.
func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("read bundle spec: %w", err)
	}
	var s specs.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("parse bundle spec %s: %w", bundle, err)
	}
	return &s, nil
}

// managed tells whether the container gets a controller.
func managed(s *specs.Spec, disabled bool) bool {
	if disabled || s.Annotations[annContainerType] == containerSandbox {
		return false
	}
	if v, ok := s.Annotations[AnnDisable]; ok {
		if off, err := strconv.ParseBool(v); err == nil && off {
			return false
		}
	}
	return s.Linux != nil
}

// cgroupsPath is the container's OCI cgroupsPath, in whichever form the
// runtime's cgroup driver uses (systemd "slice:prefix:name", or a
// cgroupfs path): envlet.OpenCgroup resolves it as runc does.
func cgroupsPath(s *specs.Spec) string {
	if s.Linux == nil {
		return ""
	}
	return s.Linux.CgroupsPath
}

// specLimits returns the CPU and memory limits in r (zero when unset).
func specLimits(r *specs.LinuxResources) envlet.Resources {
	var l envlet.Resources
	if r == nil {
		return l
	}
	if c := r.CPU; c != nil && c.Quota != nil && *c.Quota > 0 && c.Period != nil && *c.Period > 0 {
		l.CPU = float64(*c.Quota) / float64(*c.Period)
	}
	if m := r.Memory; m != nil && m.Limit != nil && *m.Limit > 0 {
		l.Memory = *m.Limit
	}
	return l
}

// envConfig is the controller configuration of one container: the node's
// policy and the container's annotations, capped by the container's own
// limits (Kubernetes limits, `ctr run --memory-limit`) and by the node.
// Annotations come from the workload's owner and can only lower what the
// limits allow, never raise it.
func envConfig(policy envlet.Config, node envlet.Resources, s *specs.Spec) (envlet.Config, error) {
	cfg := policy
	if err := cfg.ApplyAnnotations(s.Annotations); err != nil {
		return cfg, err
	}
	var limits envlet.Resources
	if s.Linux != nil {
		limits = specLimits(s.Linux.Resources)
	}
	capTo(&cfg, limits)
	capTo(&cfg, node)
	return cfg, cfg.Validate()
}

// capTo lowers the cap (and the initial quota with it) to the non-zero
// fields of c.
func capTo(cfg *envlet.Config, c envlet.Resources) {
	if c.CPU > 0 && c.CPU < cfg.Cap.CPU {
		cfg.Cap.CPU = c.CPU
		cfg.Initial.CPU = min(cfg.Initial.CPU, c.CPU)
	}
	if c.Memory > 0 && c.Memory < cfg.Cap.Memory {
		cfg.Cap.Memory = c.Memory
		cfg.Initial.Memory = min(cfg.Initial.Memory, c.Memory)
	}
}

// terminationMessageFile returns the host file bind-mounted at the
// container's termination message path, or "" when there is none.
func terminationMessageFile(s *specs.Spec) string {
	dest := s.Annotations[AnnTerminationMessagePath]
	if dest == "" {
		dest = s.Annotations[annKubeTermination]
	}
	if dest == "" {
		dest = defaultTermination
	}
	for _, m := range s.Mounts {
		if filepath.Clean(m.Destination) != filepath.Clean(dest) || m.Source == "" {
			continue
		}
		if fi, err := os.Stat(m.Source); err == nil && fi.Mode().IsRegular() {
			return m.Source
		}
	}
	return ""
}
