//go:build linux

package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/containerd/containerd/api/types"
	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/evalgroup"
)

// Evaluator isolation (docs/plans.md, "Evaluator-only groups"): the
// layers of a plan's evaluator group are kept out of the container's
// root file system (by the envsnap snapshotter, or here for an annotated
// spec) and mounted, read-only, only when the first evaluator process is
// executed.
const (
	// AnnEvaluatorLayers names the evaluator's layers by position in the
	// image, counted from the lowest layer (0): "5" or "5-6".
	AnnEvaluatorLayers = ShimAnnotationPrefix + "evaluator-layers"
	// AnnEvaluatorDir is the directory of the image the evaluator's files
	// live under (default DefaultEvaluatorDir): it is empty in the
	// container until evaluation.
	AnnEvaluatorDir = ShimAnnotationPrefix + "evaluator-dir"
	// EvaluatorEnv, set to "1" in an exec's process environment, marks
	// the evaluator's process.
	EvaluatorEnv        = "ENVSNAP_EVALUATOR"
	DefaultEvaluatorDir = "/evaluator"
)

// evaluator is one container's held-back evaluator group.
type evaluator struct {
	lowers []string // the layers' directories, topmost first (overlay order)
	dir    string   // in the container
	stage  string   // host mount point propagated to dir in the container
	layers string   // host mount point of the layers' union

	mu      sync.Mutex
	mounted bool
}

// parseLayerRange parses AnnEvaluatorLayers.
func parseLayerRange(v string) (lo, hi int, err error) {
	a, b, isRange := strings.Cut(v, "-")
	if lo, err = strconv.Atoi(a); err != nil || lo < 0 {
		return 0, 0, fmt.Errorf("annotation %s=%q: want N or N-M, layer positions from the lowest (0)", AnnEvaluatorLayers, v)
	}
	hi = lo
	if isRange {
		if hi, err = strconv.Atoi(b); err != nil || hi < lo {
			return 0, 0, fmt.Errorf("annotation %s=%q: want N or N-M with N <= M", AnnEvaluatorLayers, v)
		}
	}
	return lo, hi, nil
}

// splitLowers takes the layers at positions lo..hi (from the lowest, 0)
// out of an overlay lowerdir list, which names the topmost layer first.
func splitLowers(lowers []string, lo, hi int) (held, rest []string, err error) {
	n := len(lowers)
	if hi >= n {
		return nil, nil, fmt.Errorf("the image has only %d layers", n)
	}
	top, bottom := n-1-hi, n-1-lo
	held = slices.Clone(lowers[top : bottom+1])
	rest = slices.Delete(slices.Clone(lowers), top, bottom+1)
	if len(rest) == 0 {
		return nil, nil, fmt.Errorf("nothing of the image would be left")
	}
	return held, rest, nil
}

// holdBackEvaluator sets up the evaluator of a container, if it has one,
// and adds to the spec the mount at which it appears at evaluation time.
// The envsnap snapshotter has already left the evaluator's layers out of
// rootfs and recorded them (internal/evalgroup); with another
// snapshotter the spec annotations name them, and they are removed here
// from the overlay in rootfs. It returns nil when there is no evaluator.
// It fails, rather than run the container with the answers in view,
// when the annotated layers cannot be taken out.
func holdBackEvaluator(s *specs.Spec, rootfs []*types.Mount, bundle string) (*evaluator, error) {
	held, dir, err := recordedEvaluator(rootfs)
	if err != nil {
		return nil, err
	}
	if held == nil {
		if held, dir, err = annotatedEvaluator(s, rootfs); held == nil || err != nil {
			return nil, err
		}
	}
	e := &evaluator{
		lowers: held,
		dir:    dir,
		stage:  filepath.Join(bundle, "evaluator"),
		layers: filepath.Join(bundle, "evaluator-layers"),
	}
	if err := e.prepareStage(); err != nil {
		return nil, err
	}
	// rslave: what the shim mounts on the stage later appears in the
	// container; nothing the container mounts goes back.
	s.Mounts = append(s.Mounts, specs.Mount{Destination: dir, Type: "bind", Source: e.stage, Options: []string{"rbind", "ro", "rslave"}})
	return e, nil
}

// recordedEvaluator returns the layers the snapshotter held back from
// rootfs, topmost first, and their directory; nil when it held none.
// The spec's annotations, if any, are ignored: their positions count
// layers the rootfs no longer has.
func recordedEvaluator(rootfs []*types.Mount) ([]string, string, error) {
	upper := upperDir(rootfs)
	if upper == "" {
		return nil, "", nil
	}
	r, ok, err := evalgroup.Read(upper)
	if err != nil || !ok {
		return nil, "", err
	}
	return r.Lowers, r.Dir, nil
}

// annotatedEvaluator takes the layers the spec annotations name out of
// the overlay in rootfs and returns them, topmost first, with their
// directory; nil when the spec names none.
func annotatedEvaluator(s *specs.Spec, rootfs []*types.Mount) ([]string, string, error) {
	v, ok := s.Annotations[AnnEvaluatorLayers]
	if !ok {
		return nil, "", nil
	}
	lo, hi, err := parseLayerRange(v)
	if err != nil {
		return nil, "", err
	}
	dir := DefaultEvaluatorDir
	if d, ok := s.Annotations[AnnEvaluatorDir]; ok {
		if dir, err = evalgroup.CheckDir(d); err != nil {
			return nil, "", fmt.Errorf("annotation %s: %w", AnnEvaluatorDir, err)
		}
	}
	if len(rootfs) != 1 || rootfs[0].Type != "overlay" {
		return nil, "", fmt.Errorf("evaluator layers %s: the root file system is not one overlay mount", v)
	}
	m := rootfs[0]
	i := slices.IndexFunc(m.Options, func(o string) bool { return strings.HasPrefix(o, "lowerdir=") })
	if i < 0 {
		return nil, "", fmt.Errorf("evaluator layers %s: the rootfs overlay has no lowerdir", v)
	}
	held, rest, err := splitLowers(strings.Split(strings.TrimPrefix(m.Options[i], "lowerdir="), ":"), lo, hi)
	if err != nil {
		return nil, "", fmt.Errorf("evaluator layers %s: %w", v, err)
	}
	m.Options[i] = "lowerdir=" + strings.Join(rest, ":")
	return held, dir, nil
}

// prepareStage makes the stage an empty shared mount point.
func (e *evaluator) prepareStage() error {
	if err := os.MkdirAll(e.stage, 0o700); err != nil {
		return fmt.Errorf("evaluator stage: %w", err)
	}
	if err := unix.Mount(e.stage, e.stage, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("evaluator stage: bind %s: %w", e.stage, err)
	}
	if err := unix.Mount("", e.stage, "", unix.MS_SHARED, ""); err != nil {
		_ = unix.Unmount(e.stage, unix.MNT_DETACH)
		return fmt.Errorf("evaluator stage: make %s shared: %w", e.stage, err)
	}
	return nil
}

// isEvaluatorExec tells whether an exec's process spec marks the
// evaluator.
func isEvaluatorExec(spec []byte) (bool, error) {
	var p specs.Process
	if err := json.Unmarshal(spec, &p); err != nil {
		return false, fmt.Errorf("decode exec process: %w", err)
	}
	return slices.Contains(p.Env, EvaluatorEnv+"=1"), nil
}

// mount shows the evaluator's layers at its directory in the container,
// read-only, once.
func (e *evaluator) mount() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mounted {
		return nil
	}
	if err := os.MkdirAll(e.layers, 0o700); err != nil {
		return fmt.Errorf("evaluator layers: %w", err)
	}
	var err error
	if len(e.lowers) == 1 {
		err = unix.Mount(e.lowers[0], e.layers, "", unix.MS_BIND, "")
		if err == nil {
			// A bind's read-only flag needs a remount.
			if err = unix.Mount("", e.layers, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
				_ = unix.Unmount(e.layers, unix.MNT_DETACH)
			}
		}
	} else {
		// Only lower layers: overlay mounts it read-only.
		err = unix.Mount("overlay", e.layers, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(e.lowers, ":"))
	}
	if err != nil {
		return fmt.Errorf("mount evaluator layers: %w", err)
	}
	// The bind onto the stage must be read-only when it is made: the
	// container's copy of it is made then, by propagation, and a later
	// remount of the stage would not reach it. A bind of a read-only
	// mount is read-only.
	src := filepath.Join(e.layers, e.dir)
	if err := unix.Mount(src, e.stage, "", unix.MS_BIND, ""); err != nil {
		_ = unix.Unmount(e.layers, unix.MNT_DETACH)
		return fmt.Errorf("mount evaluator directory %s: %w", e.dir, err)
	}
	e.mounted = true
	return nil
}

// unmount removes everything mount and holdBackEvaluator mounted.
func (e *evaluator) unmount() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	var errs []error
	// The stage holds the bind of the evaluator's directory, if mounted,
	// on top of its own bind.
	for range 2 {
		if err := unix.Unmount(e.stage, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount evaluator stage: %w", err))
		}
	}
	if e.mounted {
		if err := unix.Unmount(e.layers, unix.MNT_DETACH); err != nil {
			errs = append(errs, fmt.Errorf("unmount evaluator layers: %w", err))
		}
	}
	e.mounted = false
	return errors.Join(errs...)
}
