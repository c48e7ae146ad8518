// Package episode turns the benchmark workload (bench/workload) into
// published layer groups and composed environments, and runs agent
// episodes in them on a devenv stack, measuring what users care about:
// time until the environment is ready, the whole episode, the reward, and
// the bytes pulled from the registry. `make demo` and `make bench` use it.
package episode

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/internal/plan"
)

// Kinds in stacking order, lowest first.
var Kinds = []string{group.KindBase, group.KindTask, group.KindHarness, group.KindEvaluator}

// Task is one line of the workload's tasks.jsonl. Its file paths may be
// relative to the list's directory; LoadWorkload makes them absolute.
type Task struct {
	ID          string            `json:"id"`
	Groups      map[string]string `json:"groups"` // kind -> rootfs fragment tar
	Repo        string            `json:"repo"`
	Patch       string            `json:"patch"`
	Fix         string            `json:"fix"`
	FixInRootfs string            `json:"fix_in_rootfs"`
}

// Workload is a task list and the fragments it references.
type Workload struct {
	Path  string
	Tasks []Task
}

// LoadWorkload reads a tasks.jsonl written by bench/workload/build.sh.
func LoadWorkload(path string) (*Workload, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	w := &Workload{Path: path}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var t Task
		if err := json.Unmarshal([]byte(line), &t); err != nil {
			return nil, fmt.Errorf("%s line %d: %w", path, n, err)
		}
		for _, k := range Kinds {
			if t.Groups[k] == "" {
				return nil, fmt.Errorf("%s line %d: task %s has no %s group", path, n, t.ID, k)
			}
			t.Groups[k] = resolve(path, t.Groups[k])
		}
		t.Patch, t.Fix = resolve(path, t.Patch), resolve(path, t.Fix)
		w.Tasks = append(w.Tasks, t)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(w.Tasks) == 0 {
		return nil, fmt.Errorf("%s: no tasks", path)
	}
	return w, nil
}

// resolve makes p, a path in the task list at list, absolute: build.sh
// writes paths relative to the list's directory, so a workload cache
// still works when it is moved or linked into another checkout.
func resolve(list, p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(filepath.Dir(list), p)
}

// GroupRef names the group published from a fragment: task-uuid.tar of
// kind task becomes HOST/envsnap/task/uuid:1.
func GroupRef(registry, kind, tarPath string) string {
	name := strings.TrimSuffix(filepath.Base(tarPath), ".tar")
	name = strings.TrimPrefix(name, kind+"-")
	return fmt.Sprintf("%s/envsnap/%s/%s:1", registry, kind, name)
}

// Published is the outcome of publishing a workload's groups.
type Published struct {
	Refs     map[string]string // fragment tar -> group reference
	Results  map[string]*group.Result
	Duration time.Duration
}

// Env contributions of the workload's groups: the harness puts its agent
// on PATH, the base provides the Go toolchain.
var contributions = map[string]group.Meta{
	group.KindBase:      {Env: []string{"PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "GOFLAGS=-mod=mod", "GOPROXY=off", "GOTOOLCHAIN=local"}},
	group.KindHarness:   {Env: []string{"PATH=/opt/harness/bin"}},
	group.KindEvaluator: {},
	group.KindTask:      {},
}

// PublishGroups publishes every distinct fragment of w once.
func PublishGroups(ctx context.Context, hosts docker.RegistryHosts, registry string, w *Workload) (*Published, error) {
	start := time.Now()
	kindOf := map[string]string{}
	for _, t := range w.Tasks {
		for k, p := range t.Groups {
			kindOf[p] = k
		}
	}
	paths := make([]string, 0, len(kindOf))
	for p := range kindOf {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	pub := &Published{Refs: map[string]string{}, Results: map[string]*group.Result{}}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(2)
	for _, p := range paths {
		kind := kindOf[p]
		ref := GroupRef(registry, kind, p)
		g.Go(func() error {
			meta := contributions[kind]
			meta.Kind = kind
			res, err := (&group.Publisher{Hosts: hosts}).Publish(gctx, ref, []group.TarSource{group.TarFileSource(p)}, meta)
			if err != nil {
				return fmt.Errorf("publish %s: %w", p, err)
			}
			mu.Lock()
			pub.Refs[p], pub.Results[p] = ref, res
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	pub.Duration = time.Since(start)
	return pub, nil
}

// Plan is the environment plan of t over the published groups.
func (p *Published) Plan(t Task) *plan.Plan {
	pl := &plan.Plan{Name: t.ID}
	for _, k := range Kinds {
		pl.Groups = append(pl.Groups, p.Refs[t.Groups[k]])
	}
	pl.Process.WorkingDir = t.Repo
	if t.Patch != "" {
		pl.Mutation = &plan.Mutation{PatchFile: t.Patch, Dir: t.Repo, Group: group.KindTask}
	}
	return pl
}

// ImageSize is the sum of img's layer sizes (what a full pull moves).
func ImageSize(img *plan.Image) int64 {
	var n int64
	for _, l := range img.Manifest.Layers {
		n += l.Size
	}
	return n
}
