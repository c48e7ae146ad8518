package plan

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/evalgroup"
	"github.com/envsnap/envsnap/layerfmt"
)

func TestMergeEnv(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lists [][]string
		want  []string
	}{
		{"override", [][]string{{"A=1", "B=2"}, {"B=3"}}, []string{"A=1", "B=3"}},
		{"path prepends", [][]string{{"PATH=/usr/bin:/bin"}, {"PATH=/opt/harness/bin"}}, []string{"PATH=/opt/harness/bin:/usr/bin:/bin"}},
		{"path dedup", [][]string{{"PATH=/usr/bin:/bin"}, {"PATH=/bin:/opt/x"}}, []string{"PATH=/bin:/opt/x:/usr/bin"}},
		{"suffix path", [][]string{{"LD_LIBRARY_PATH=/a"}, {"LD_LIBRARY_PATH=/b"}}, []string{"LD_LIBRARY_PATH=/b:/a"}},
		{"order kept", [][]string{{"Z=1"}, {"A=2"}, {"Z=3"}}, []string{"Z=3", "A=2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := MergeEnv(tc.lists...); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("MergeEnv = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestLoadPlanAndTasks(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "bug.diff"), []byte("x"), 0o644)
	tomlPlan := `name = "t1"
groups = ["r/base:1", "r/task:1"]
[process]
cmd = ["/bin/sh"]
working_dir = "/workspace"
[mutation]
patch_file = "bug.diff"
dir = "/workspace/repo"
`
	os.WriteFile(filepath.Join(dir, "p.toml"), []byte(tomlPlan), 0o644)
	p, err := Load(filepath.Join(dir, "p.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if p.Mutation.PatchFile != filepath.Join(dir, "bug.diff") || p.Process.WorkingDir != "/workspace" || len(p.Groups) != 2 {
		t.Errorf("plan = %+v", p)
	}
	os.WriteFile(filepath.Join(dir, "nogroups.json"), []byte(`{"name":"x"}`), 0o644)
	if _, err := Load(filepath.Join(dir, "nogroups.json")); err == nil || !strings.Contains(err.Error(), "no groups") {
		t.Errorf("plan without groups: err = %v", err)
	}

	tasks := `{"name":"a","groups":["r/b:1"]}
# comment

{"groups":["r/b:1"],"mutation":{"patch":"p","dir":"/w"}}
`
	ps, err := ReadTasks(strings.NewReader(tasks), dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ps) != 2 || ps[0].Name != "a" || ps[1].Name != "task-4" {
		t.Errorf("tasks = %+v %+v", ps[0], ps[1])
	}
	if _, err := ReadTasks(strings.NewReader(`{"groups":["x"],"mutation":{"patch":"p","dir":"rel"}}`), dir); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Errorf("relative mutation dir: err = %v", err)
	}
}

// A typo in a plan is refused with the field named, in every plan form.
func TestUnknownFieldNamed(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		file, text string
		want       []string
	}{
		{"top.toml", "groups = [\"a\"]\ngropus = [\"b\"]\n", []string{`"gropus" (line 2)`}},
		{"nested.toml", "groups = [\"a\"]\n[process]\ncwd = \"/w\"\n[mutation]\npatch = \"p\"\ndir = \"/w\"\ngroup_ref = \"x\"\n",
			[]string{`"process.cwd" (line 3)`, `"mutation.group_ref" (line 7)`}},
		{"top.json", `{"groups":["a"],"gropus":["b"]}`, []string{`"gropus"`}},
		{"nested.json", `{"groups":["a"],"process":{"cwd":"/w"}}`, []string{`"cwd"`}},
	} {
		name := filepath.Join(dir, tc.file)
		os.WriteFile(name, []byte(tc.text), 0o644)
		_, err := Load(name)
		if err == nil {
			t.Errorf("%s: unknown field accepted", tc.file)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not name %s", tc.file, err, w)
			}
		}
	}
	_, err := ReadTasks(strings.NewReader("{\"groups\":[\"a\"]}\n{\"groups\":[\"a\"],\"evaluator\":{\"dir\":\"/e\",\"grop\":\"x\"}}\n"), dir)
	if err == nil || !strings.Contains(err.Error(), "line 2") || !strings.Contains(err.Error(), `"grop"`) {
		t.Errorf("task list with unknown field: err = %v", err)
	}
}

// memLayer converts a tar into an envsnap layer held in memory.
type memLayer struct {
	desc ocispec.Descriptor
	blob []byte
}

type tarEntry struct {
	name, body string
	typ        byte
	mode       int64
	uid        int
}

func buildLayer(t *testing.T, entries []tarEntry) memLayer {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for _, e := range entries {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := e.mode
		if mode == 0 {
			mode = 0o644
			if typ == tar.TypeDir {
				mode = 0o755
			}
		}
		hdr := &tar.Header{Typeflag: typ, Name: e.name, Mode: mode, Uid: e.uid, Size: int64(len(e.body)), Format: tar.FormatPAX}
		if typ != tar.TypeReg {
			hdr.Size = 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	var blob bytes.Buffer
	wr, err := layerfmt.Convert(context.Background(), &blob, &tb)
	if err != nil {
		t.Fatal(err)
	}
	return memLayer{desc: ocispec.Descriptor{MediaType: layerfmt.MediaTypeLayer, Digest: wr.Digest, Size: wr.Size, Annotations: wr.Annotations()}, blob: blob.Bytes()}
}

// countingReaderAt counts the bytes read from a layer blob.
type countingReaderAt struct {
	r *bytes.Reader
	n *atomic.Int64
}

func (c countingReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n, err := c.r.ReadAt(p, off)
	c.n.Add(int64(n))
	return n, err
}

func memGroup(layers []memLayer, read *atomic.Int64) (*Group, LayerOpener) {
	g := &Group{Ref: "r/task:1", Kind: "task"}
	blobs := map[digest.Digest][]byte{}
	for _, l := range layers {
		g.Manifest.Layers = append(g.Manifest.Layers, l.desc)
		blobs[l.desc.Digest] = l.blob
	}
	open := func(ctx context.Context, g *Group, layer ocispec.Descriptor) (*layerfmt.Reader, error) {
		ra := countingReaderAt{bytes.NewReader(blobs[layer.Digest]), read}
		return layerfmt.NewReader(ra, layer.Size, digest.Digest(layer.Annotations[layerfmt.AnnotationTOCDigest]))
	}
	return g, open
}

func readLayerFiles(t *testing.T, b *Blob) map[string]string {
	t.Helper()
	r, err := layerfmt.NewReader(bytes.NewReader(b.Data), b.Desc.Size, digest.Digest(b.Desc.Annotations[layerfmt.AnnotationTOCDigest]))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	toc := r.TOC()
	for i := 1; i < toc.Len(); i++ {
		e := toc.Entry(i)
		switch e.Type {
		case layerfmt.TypeReg:
			f, err := r.Open(e.Name)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(f)
			f.Close()
			out[e.Name] = string(body)
		case layerfmt.TypeDir:
			out[e.Name+"/"] = e.Mode.Perm().String()
		}
	}
	return out
}

const mainGo = "package main\n\nfunc add(a, b int) int {\n\treturn a + b\n}\n"

func TestMutationPatchesThroughLayers(t *testing.T) {
	big := make([]byte, 8<<20)
	rand.New(rand.NewSource(1)).Read(big)
	lower := buildLayer(t, []tarEntry{
		{name: "workspace/", typ: tar.TypeDir},
		{name: "workspace/repo/", typ: tar.TypeDir, mode: 0o750, uid: 1000},
		{name: "workspace/repo/main.go", body: mainGo, mode: 0o640, uid: 1000},
		{name: "workspace/repo/old.txt", body: "stale\n"},
		{name: "workspace/repo/gone.txt", body: "gone\n"},
		{name: "workspace/repo/blob.bin", body: string(big)},
	})
	upper := buildLayer(t, []tarEntry{
		{name: "workspace/repo/", typ: tar.TypeDir, mode: 0o750, uid: 1000},
		{name: "workspace/repo/.wh.gone.txt"},
		{name: "workspace/repo/old.txt", body: "fresh\n"},
	})
	var read atomic.Int64
	g, open := memGroup([]memLayer{lower, upper}, &read)

	patch := `diff --git a/main.go b/main.go
--- a/main.go
+++ b/main.go
@@ -1,5 +1,5 @@
 package main
 
 func add(a, b int) int {
-	return a + b
+	return a - b
 }
diff --git a/old.txt b/old.txt
deleted file mode 100644
--- a/old.txt
+++ /dev/null
@@ -1 +0,0 @@
-fresh
diff --git a/new/file.txt b/new/file.txt
new file mode 100644
--- /dev/null
+++ b/new/file.txt
@@ -0,0 +1 @@
+hello
`
	blob, err := applyMutation(context.Background(), open, g, &Mutation{Patch: patch, Dir: "/workspace/repo"})
	if err != nil {
		t.Fatal(err)
	}
	files := readLayerFiles(t, blob)
	if got := files["workspace/repo/main.go"]; got != strings.Replace(mainGo, "a + b", "a - b", 1) {
		t.Errorf("patched main.go = %q", got)
	}
	if _, ok := files["workspace/repo/.wh.old.txt"]; !ok {
		t.Errorf("deleting old.txt left no whiteout: %v", files)
	}
	if files["workspace/repo/new/file.txt"] != "hello\n" {
		t.Errorf("new file = %q", files["workspace/repo/new/file.txt"])
	}
	if files["workspace/repo/"] != "-rwxr-x---" {
		t.Errorf("parent dir mode = %q, want the group's 0750", files["workspace/repo/"])
	}
	// Only TOCs and main.go/old.txt chunks were read, not the 8 MiB file.
	if n := read.Load(); n > int64(len(big))/4 {
		t.Errorf("read %d bytes of layer blobs to patch two small files (8 MiB file untouched)", n)
	}

	// The deletion in the upper layer hides gone.txt: patching it fails.
	gonePatch := "diff --git a/gone.txt b/gone.txt\n--- a/gone.txt\n+++ b/gone.txt\n@@ -1 +1 @@\n-gone\n+back\n"
	if _, err := applyMutation(context.Background(), open, g, &Mutation{Patch: gonePatch, Dir: "/workspace/repo"}); err == nil || !strings.Contains(err.Error(), "gone.txt") {
		t.Errorf("patching a whited-out file: err = %v", err)
	}
	// A hunk that does not match names the file and the hunk.
	badPatch := strings.Replace(patch, "-\treturn a + b", "-\treturn a * b", 1)
	_, err = applyMutation(context.Background(), open, g, &Mutation{Patch: badPatch, Dir: "/workspace/repo"})
	if err == nil || !strings.Contains(err.Error(), "main.go") || !strings.Contains(err.Error(), "hunk 1") {
		t.Errorf("non-applying patch: err = %v", err)
	}
}

func TestComposeBuildMergesGroups(t *testing.T) {
	mk := func(ref, kind string, env []string, workdir string, layers ...string) *Group {
		g := &Group{Ref: ref, Kind: kind, Desc: ocispec.Descriptor{Digest: digest.FromString(ref)}}
		g.Config.Config.Env = env
		g.Config.Config.WorkingDir = workdir
		g.Config.Platform = ocispec.Platform{OS: "linux", Architecture: "amd64"}
		for _, l := range layers {
			// A group's own layer annotation cannot mark it either.
			ann := map[string]string{evalgroup.LayerLabel: "/forged"}
			g.Manifest.Layers = append(g.Manifest.Layers, ocispec.Descriptor{Digest: digest.FromString(l), Size: 1, Annotations: ann})
			g.Config.RootFS.DiffIDs = append(g.Config.RootFS.DiffIDs, digest.FromString("diff-"+l))
		}
		return g
	}
	img := &Image{
		Plan: &Plan{Name: "t", Groups: []string{"b", "h"}, Process: Process{Cmd: []string{"agent"}}},
		Groups: []*Group{
			mk("r/base:1", "base", []string{"PATH=/usr/bin:/bin", "LANG=C"}, "/", "b1", "b2"),
			mk("r/harness:1", "harness", []string{"PATH=/opt/h/bin"}, "/workspace", "h1"),
		},
	}
	if err := img.build(); err != nil {
		t.Fatal(err)
	}
	if len(img.Manifest.Layers) != 3 || !reflect.DeepEqual(img.LayerGroup, []int{0, 0, 1}) {
		t.Fatalf("layers = %d, groups %v", len(img.Manifest.Layers), img.LayerGroup)
	}
	if !strings.Contains(string(img.ConfigBytes), `"PATH=/opt/h/bin:/usr/bin:/bin"`) || !strings.Contains(string(img.ConfigBytes), `"WorkingDir":"/workspace"`) {
		t.Errorf("config = %s", img.ConfigBytes)
	}
	if !strings.Contains(img.Manifest.Annotations[AnnotationPlanGroups], `"ref":"r/harness:1"`) {
		t.Errorf("provenance = %s", img.Manifest.Annotations[AnnotationPlanGroups])
	}
	if img.Desc.Digest != digest.FromBytes(img.ManifestBytes) {
		t.Error("descriptor does not match the manifest bytes")
	}
}

func TestComposeMarksEvaluatorGroup(t *testing.T) {
	mk := func(ref, kind string, layers ...string) *Group {
		g := &Group{Ref: ref, Kind: kind, Desc: ocispec.Descriptor{Digest: digest.FromString(ref)}}
		g.Config.Platform = ocispec.Platform{OS: "linux", Architecture: "amd64"}
		// A group label trying to move the marking loses.
		g.Config.Config.Labels = map[string]string{LabelEvaluatorLayers: "0"}
		for _, l := range layers {
			// A group's own layer annotation cannot mark it either.
			ann := map[string]string{evalgroup.LayerLabel: "/forged"}
			g.Manifest.Layers = append(g.Manifest.Layers, ocispec.Descriptor{Digest: digest.FromString(l), Size: 1, Annotations: ann})
			g.Config.RootFS.DiffIDs = append(g.Config.RootFS.DiffIDs, digest.FromString("diff-"+l))
		}
		return g
	}
	groups := func() []*Group {
		return []*Group{mk("r/base:1", "base", "b1", "b2"), mk("r/task:1", "task", "t1"), mk("r/eval:1", "evaluator", "e1", "e2"), mk("r/harness:1", "harness", "h1")}
	}
	for _, tc := range []struct {
		ev         *Evaluator
		wantLayers string
		wantErr    bool
	}{
		{&Evaluator{Dir: "/opt/evaluator/"}, "3-4", false},
		{&Evaluator{Group: "r/task:1", Dir: "/workspace"}, "2-2", false},
		{&Evaluator{Group: "grader", Dir: "/opt/evaluator"}, "", true},
		{nil, "", false},
	} {
		img := &Image{Plan: &Plan{Name: "t", Evaluator: tc.ev}, Groups: groups()}
		err := img.build()
		if (err != nil) != tc.wantErr {
			t.Fatalf("%+v: err %v", tc.ev, err)
		}
		if err != nil {
			continue
		}
		var cfg ocispec.Image
		if err := json.Unmarshal(img.ConfigBytes, &cfg); err != nil {
			t.Fatal(err)
		}
		// The layer annotations the snapshotter goes by mark the same
		// layers as the config label, and only those.
		var marked []string
		for i, l := range img.Manifest.Layers {
			if d, ok := l.Annotations[evalgroup.LayerLabel]; ok {
				marked = append(marked, fmt.Sprintf("%d:%s", i, d))
			}
		}
		var want []string
		if tc.ev != nil {
			var lo, hi int
			fmt.Sscanf(tc.wantLayers, "%d-%d", &lo, &hi)
			for i := lo; i <= hi; i++ {
				want = append(want, fmt.Sprintf("%d:%s", i, path.Clean(tc.ev.Dir)))
			}
		}
		if !slices.Equal(marked, want) {
			t.Errorf("%+v: layer annotations %s mark %v, want %v", tc.ev, evalgroup.LayerLabel, marked, want)
		}
		got := cfg.Config.Labels[LabelEvaluatorLayers]
		if tc.ev == nil {
			if got != "0" {
				t.Errorf("no evaluator in the plan: label %q, want the group's own", got)
			}
			continue
		}
		if got != tc.wantLayers || cfg.Config.Labels[LabelEvaluatorDir] != path.Clean(tc.ev.Dir) {
			t.Errorf("%+v: labels %v, want layers %s", tc.ev, cfg.Config.Labels, tc.wantLayers)
		}
	}
	bad := &Plan{Name: "t", Groups: []string{"a"}, Evaluator: &Evaluator{Dir: "opt/evaluator"}}
	if err := bad.Validate(); err == nil {
		t.Error("a relative evaluator dir validated")
	}
}
