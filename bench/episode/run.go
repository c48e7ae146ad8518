package episode

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/envsnap/envsnap/internal/devenv"
)

// ReadyMarker is printed once the agent harness answers --version.
const ReadyMarker = "__ENVSNAP_READY__"

// Script is the episode a container runs: the agent harness starts (ready),
// then the scripted agent steps and the evaluator.
func Script(t Task) string {
	return fmt.Sprintf("agent --version && echo %s && /opt/evaluator/episode.sh %s %s", ReadyMarker, t.Repo, t.FixInRootfs)
}

// Result is one episode in one system.
type Result struct {
	Task    string        `json:"task"`
	System  string        `json:"system"`
	Phase   string        `json:"phase"` // cold or warm
	Ready   time.Duration `json:"ready_ns"`
	Episode time.Duration `json:"episode_ns"`
	Reward  int           `json:"reward"`
	Exit    uint32        `json:"exit"`
	// RegistryBytes are blob bytes the registry served for this
	// environment (valid when environments run one at a time);
	// ReadyRegistryBytes the part served by the time it was ready.
	RegistryBytes      int64  `json:"registry_bytes"`
	ReadyRegistryBytes int64  `json:"ready_registry_bytes"`
	ImageBytes         int64  `json:"image_bytes"`
	Error              string `json:"error,omitempty"`
	Output             string `json:"-"`
	// Steps are the seconds each step of the episode script took, as
	// it printed them ("episode step=NAME rc=N seconds=S").
	Steps map[string]float64 `json:"steps,omitempty"`
	// Container is the container's ID in the env's namespace.
	Container string `json:"container"`
	// Refused counts the creates the envlet arbiter refused before the
	// container was admitted (devenv.RunAdmitted).
	Refused int `json:"admission_refused,omitempty"`
}

// System is a way of starting environments.
type System struct {
	Name        string
	Snapshotter string
	Runtime     string
	Annotations map[string]string
}

// readyClock records when the ready marker first appears on stdout, and
// calls onReady then.
type readyClock struct {
	mu      sync.Mutex
	buf     bytes.Buffer
	ready   time.Time
	onReady func()
}

func (r *readyClock) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ready.IsZero() {
		r.buf.Write(p)
		if bytes.Contains(r.buf.Bytes(), []byte(ReadyMarker)) {
			r.ready = time.Now()
			if r.onReady != nil {
				r.onReady()
			}
		}
	}
	return len(p), nil
}

func (r *readyClock) at() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ready
}

var (
	rewardRE = regexp.MustCompile(`reward=(\d)`)
	stepRE   = regexp.MustCompile(`(?m)^episode step=(\S+) rc=\d+ seconds=([0-9.]+)$`)
)

// Run pulls ref with sys and runs t's episode in it. Ready and Episode are
// measured from the start of the pull: the whole cost of starting an
// environment from an image reference.
func Run(ctx context.Context, env *devenv.Env, ref string, t Task, sys System, timeout time.Duration) Result {
	res := Result{Task: t.ID, System: sys.Name}
	before := env.Registry.BlobBytesServed()
	start := time.Now()
	img, err := env.Pull(ctx, ref, sys.Snapshotter)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	clock := &readyClock{onReady: func() { res.ReadyRegistryBytes = env.Registry.BlobBytesServed() - before }}
	// A container the envlet arbiter refuses is placed again (as a
	// scheduler would); the wait counts in Ready.
	out, refused, err := env.RunAdmitted(ctx, img, devenv.RunOptions{
		Snapshotter: sys.Snapshotter,
		Runtime:     sys.Runtime,
		Annotations: sys.Annotations,
		Args:        []string{"/bin/sh", "-c", Script(t)},
		Timeout:     timeout,
		Stdout:      clock,
	}, timeout)
	res.Refused = refused
	res.Episode = time.Since(start)
	res.RegistryBytes = env.Registry.BlobBytesServed() - before
	if ready := clock.at(); !ready.IsZero() {
		res.Ready = ready.Sub(start)
	}
	if err != nil {
		res.Error = err.Error()
		return res
	}
	res.Exit, res.Output, res.Container = out.ExitCode, out.Stdout+out.Stderr, out.ID
	res.Reward, _ = ParseReward(out.Stdout)
	res.Steps = parseSteps(out.Stdout)
	if res.Ready == 0 {
		res.Error = "environment never became ready: " + LastLines(res.Output, 5)
	}
	return res
}

// ParseReward is the last reward the evaluator printed (reward=N);
// false when it printed none.
func ParseReward(stdout string) (int, bool) {
	m := rewardRE.FindAllStringSubmatch(stdout, -1)
	if len(m) == 0 {
		return 0, false
	}
	return int(m[len(m)-1][1][0] - '0'), true
}

// StepOrder is the order in which the episode script
// (bench/workload/evaluator/episode.sh) runs its steps, the total last.
var StepOrder = []string{"harness-version", "git-status", "git-log", "list-files", "grep-funcs", "read-files",
	"test-before", "apply-fix", "test-after", "git-diff", "total-before-eval"}

// parseSteps returns the step times the episode script printed; nil when
// it printed none.
func parseSteps(stdout string) map[string]float64 {
	var steps map[string]float64
	for _, m := range stepRE.FindAllStringSubmatch(stdout, -1) {
		if v, err := strconv.ParseFloat(m[2], 64); err == nil {
			if steps == nil {
				steps = map[string]float64{}
			}
			steps[m[1]] = v
		}
	}
	return steps
}

// LastLines joins the last n lines of s, for an error message.
func LastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
