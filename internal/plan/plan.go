// Package plan composes environments from layer groups. A plan lists group
// references lowest first, the process defaults and an optional per-task
// mutation; composing it yields an ordinary OCI image whose layer list is
// the concatenation of the groups' layers (plus one small layer when a
// mutation changes files) and whose config merges the groups' environment
// contributions. Composition is metadata only: no group layer is
// downloaded, unpacked or re-uploaded.
package plan

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/envsnap/envsnap/internal/tomlconf"
)

// Plan is one environment: the format of plan files (TOML or JSON) and of
// each line of a task list (JSON lines). docs/plans.md specifies it.
type Plan struct {
	// Name identifies the environment (the task id in a task list).
	Name string `toml:"name" json:"name"`
	// Groups are group references, lowest (base) first.
	Groups []string `toml:"groups" json:"groups"`
	// Process overrides the composed image's process defaults.
	Process Process `toml:"process" json:"process"`
	// Mutation is the optional per-task change to the task group.
	Mutation *Mutation `toml:"mutation" json:"mutation,omitempty"`
	// Target is where the composed image goes: a registry reference, or
	// the image name in local mode. Compose options may supply a pattern
	// instead.
	Target string `toml:"target" json:"target,omitempty"`
	// Labels are added to the image config.
	Labels map[string]string `toml:"labels" json:"labels,omitempty"`
	// Evaluator marks one group evaluator-only: hidden from the agent
	// until evaluation (docs/plans.md, "Evaluator-only groups").
	Evaluator *Evaluator `toml:"evaluator" json:"evaluator,omitempty"`
}

// Evaluator names the plan's evaluator-only group and the directory of
// the image its files live under.
type Evaluator struct {
	// Group is a reference from Groups or a kind; default the group of
	// kind "evaluator".
	Group string `toml:"group" json:"group,omitempty"`
	// Dir is the one directory holding every file of the group, e.g.
	// "/opt/evaluator".
	Dir string `toml:"dir" json:"dir"`
}

// Process holds process defaults; empty fields keep the groups' values.
type Process struct {
	Entrypoint []string `toml:"entrypoint" json:"entrypoint,omitempty"`
	Cmd        []string `toml:"cmd" json:"cmd,omitempty"`
	Env        []string `toml:"env" json:"env,omitempty"`
	WorkingDir string   `toml:"working_dir" json:"working_dir,omitempty"`
}

// Mutation is a patch (git unified diff) applied to the files of one group,
// typically the task group: a fault injection, or the diff to the task's
// commit. Only the files it touches are read, and the result is one small
// extra layer.
type Mutation struct {
	// Patch is the diff itself; PatchFile a file holding it (relative to
	// the plan or task-list file).
	Patch     string `toml:"patch" json:"patch,omitempty"`
	PatchFile string `toml:"patch_file" json:"patch_file,omitempty"`
	// Dir is the directory in the image that the diff's paths are relative
	// to, e.g. "/workspace/uuid".
	Dir string `toml:"dir" json:"dir"`
	// Group selects the group whose files are patched: a reference from
	// Groups, or a kind; default the group of kind "task", else the top one.
	Group string `toml:"group" json:"group,omitempty"`
}

// Validate reports what is wrong with p, if anything.
func (p *Plan) Validate() error {
	if len(p.Groups) == 0 {
		return fmt.Errorf("plan %q: no groups", p.Name)
	}
	for i, g := range p.Groups {
		if strings.TrimSpace(g) == "" {
			return fmt.Errorf("plan %q: group %d is empty", p.Name, i)
		}
	}
	if ev := p.Evaluator; ev != nil {
		if d := path.Clean(ev.Dir); !strings.HasPrefix(ev.Dir, "/") || d == "/" {
			return fmt.Errorf("plan %q: evaluator dir %q must be an absolute directory below / in the image", p.Name, ev.Dir)
		}
	}
	if m := p.Mutation; m != nil {
		if (m.Patch == "") == (m.PatchFile == "") {
			return fmt.Errorf("plan %q: mutation needs exactly one of patch and patch_file", p.Name)
		}
		if !strings.HasPrefix(m.Dir, "/") {
			return fmt.Errorf("plan %q: mutation dir %q must be an absolute path in the image", p.Name, m.Dir)
		}
	}
	return nil
}

// PatchText returns the mutation's diff, reading PatchFile if needed.
func (m *Mutation) PatchText() ([]byte, error) {
	if m.Patch != "" {
		return []byte(m.Patch), nil
	}
	b, err := os.ReadFile(m.PatchFile)
	if err != nil {
		return nil, fmt.Errorf("read patch: %w", err)
	}
	return b, nil
}

// Load reads a plan file: TOML unless the name ends in .json.
func Load(path string) (*Plan, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read plan: %w", err)
	}
	var p Plan
	if strings.HasSuffix(path, ".json") {
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		err = dec.Decode(&p)
	} else {
		err = tomlconf.Decode(bytes.NewReader(b), &p)
	}
	if err != nil {
		return nil, fmt.Errorf("parse plan %s: %w", path, err)
	}
	p.resolvePaths(filepath.Dir(path))
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &p, nil
}

func (p *Plan) resolvePaths(dir string) {
	if p.Mutation != nil && p.Mutation.PatchFile != "" && !filepath.IsAbs(p.Mutation.PatchFile) {
		p.Mutation.PatchFile = filepath.Join(dir, p.Mutation.PatchFile)
	}
}

// ReadTasks reads a task list: one JSON plan per line; blank lines and
// lines starting with # are skipped. Relative patch files are resolved
// against dir.
func ReadTasks(r io.Reader, dir string) ([]*Plan, error) {
	var plans []*Plan
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	line := 0
	for sc.Scan() {
		line++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 || text[0] == '#' {
			continue
		}
		var p Plan
		dec := json.NewDecoder(bytes.NewReader(text))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return nil, fmt.Errorf("task list line %d: %w", line, err)
		}
		if p.Name == "" {
			p.Name = fmt.Sprintf("task-%d", line)
		}
		p.resolvePaths(dir)
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("task list line %d: %w", line, err)
		}
		plans = append(plans, &p)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read task list: %w", err)
	}
	return plans, nil
}

// MergeEnv layers env entries: each later list overrides earlier ones,
// except PATH-like variables (PATH and any name ending in PATH, e.g.
// LD_LIBRARY_PATH, PYTHONPATH), whose later entries are put in front of the
// earlier ones with duplicates dropped - so a harness group contributing
// PATH=/opt/harness/bin keeps the base's PATH behind it.
func MergeEnv(lists ...[]string) []string {
	var order []string
	vals := map[string]string{}
	for _, list := range lists {
		for _, kv := range list {
			k, v, _ := strings.Cut(kv, "=")
			old, seen := vals[k]
			if !seen {
				order = append(order, k)
			}
			if seen && strings.HasSuffix(k, "PATH") {
				v = joinPathList(v, old)
			}
			vals[k] = v
		}
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+vals[k])
	}
	return out
}

func joinPathList(front, back string) string {
	seen := map[string]bool{}
	var parts []string
	for _, p := range append(strings.Split(front, ":"), strings.Split(back, ":")...) {
		if p == "" || seen[p] {
			continue
		}
		seen[p] = true
		parts = append(parts, p)
	}
	return strings.Join(parts, ":")
}
