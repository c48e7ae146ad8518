package groups_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/internal/plan"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestBenchComposition prints composition throughput (registry and local
// mode) and what one harness update costs across N tasks with groups,
// against rebuilding one full image per task, measured in the same run.
// Run with ENVSNAP_BENCH=1 (make bench).
func TestBenchComposition(t *testing.T) {
	prereq.RequireBench(t)
	const N, R, H = 200, 5, 2
	env := testenv.New(t, testenv.WithEnvsnap())
	ctx := env.Context()
	f := publishGroups(t, env)
	reg := env.Registry.Host
	pub := &group.Publisher{Hosts: env.Hosts()}

	taskDirs := make([]string, R)
	var tasks []string
	for r := 0; r < R; r++ {
		taskDirs[r] = writeTree(t, filepath.Join(f.dir, fmt.Sprintf("repo%d", r)), map[string]string{
			"calc.sh": calcSh, "test.sh": calcTestSh, "README": fmt.Sprintf("repository %d\n", r),
		})
		ref := fmt.Sprintf("%s/envsnap/task/repo%d:1", reg, r)
		epoch := time.Unix(0, 0)
		if _, err := pub.Publish(ctx, ref, []group.TarSource{group.DirSource(taskDirs[r], group.DirOptions{Prefix: "/workspace/calc", ModTime: &epoch})}, group.Meta{Kind: "task"}); err != nil {
			t.Fatal(err)
		}
		tasks = append(tasks, ref)
	}
	// A harness of realistic weight: 32 MiB of incompressible "runtime".
	harnessDir := func(version string) string {
		d := filepath.Join(f.dir, "harness-"+version)
		writeTree(t, d, map[string]string{"bin/agent": "#!/bin/sh\necho agent " + version + "\n"})
		blob := make([]byte, 32<<20)
		testenv.RandomFile("", int64(len(blob)), int64(len(version))).Reader().Read(blob)
		os.WriteFile(filepath.Join(d, "lib.bin"), blob, 0o644)
		return d
	}
	publishHarness := func(h int, version string) (*group.Result, string) {
		dir := harnessDir(version)
		epoch := time.Unix(0, 0)
		ref := fmt.Sprintf("%s/envsnap/harness/agent%d:latest", reg, h)
		res, err := pub.Publish(ctx, ref, []group.TarSource{group.DirSource(dir, group.DirOptions{Prefix: "/opt/harness", ModTime: &epoch})},
			group.Meta{Kind: "harness", Env: []string{"PATH=/opt/harness/bin"}})
		if err != nil {
			t.Fatal(err)
		}
		return res, dir
	}
	var harnesses []string
	for h := 0; h < H; h++ {
		publishHarness(h, fmt.Sprintf("1.%d", h))
		harnesses = append(harnesses, fmt.Sprintf("%s/envsnap/harness/agent%d:latest", reg, h))
	}
	plans := make([]*plan.Plan, N)
	for i := range plans {
		plans[i] = &plan.Plan{Name: fmt.Sprintf("task-%03d", i), Groups: []string{f.base, tasks[i%R], harnesses[i%H], f.eval}}
	}

	registryMode := func() (time.Duration, int64) {
		c := &plan.Composer{Hosts: env.Hosts()}
		start := time.Now()
		var sent atomic.Int64
		g, gctx := errgroup.WithContext(ctx)
		g.SetLimit(8) // the CLI's default --concurrency
		for _, p := range plans {
			g.Go(func() error {
				img, err := c.Compose(gctx, p)
				if err != nil {
					return err
				}
				st, err := c.Push(gctx, img, fmt.Sprintf("%s/envsnap/env/%s:1", reg, p.Name))
				sent.Add(st.UploadedBytes)
				return err
			})
		}
		if err := g.Wait(); err != nil {
			t.Fatal(err)
		}
		return time.Since(start), sent.Load()
	}
	regTime, regBytes := registryMode()

	localStart := time.Now()
	lc := &plan.Composer{Hosts: env.Hosts()}
	for _, p := range plans {
		img, err := lc.Compose(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		if err := plan.WriteLocal(ctx, env.Client, img, "envsnap.local/"+p.Name, "envsnap"); err != nil {
			t.Fatal(err)
		}
	}
	localTime := time.Since(localStart)

	// Harness update with groups: one publish, then recompose every plan
	// using that harness (all plans, for simplicity: the rest are no-ops
	// in bytes).
	env.Registry.ResetCounters()
	updStart := time.Now()
	res, newHarness := publishHarness(0, "2.0")
	recompose, recBytes := registryMode()
	groupsUpdate := time.Since(updStart)
	groupsBytes := res.UploadedBytes + recBytes

	// The static way: every task of harness 0 is one full image built from
	// the same content (flattened, gzip as `docker build` + push would),
	// rebuilt and pushed after the harness update.
	bb, _ := testenv.BusyboxFiles()
	evalFiles := readTree(t, filepath.Join(f.dir, "evaluator"), "/opt/evaluator")
	harnessFiles := readTree(t, newHarness, "/opt/harness")
	env.Registry.ResetCounters()
	staticStart := time.Now()
	var staticBytes int64
	for i := 0; i < N; i += H { // the tasks that use harness 0
		files := append(append(append(append([]testenv.File{}, bb...), readTree(t, taskDirs[i%R], "/workspace/calc")...), harnessFiles...), evalFiles...)
		n, err := pushFlatImage(ctx, env, fmt.Sprintf("%s/static/%s:2", reg, plans[i].Name), files)
		if err != nil {
			t.Fatal(err)
		}
		staticBytes += n
	}
	staticTime := time.Since(staticStart)

	t.Logf("\ncomposition of %d plans (%d groups):\n"+
		"  registry mode: %6.1f plans/s (%s, %d bytes uploaded: configs+manifests)\n"+
		"  local mode:    %6.1f plans/s (%s, no registry write)\n"+
		"harness update across %d tasks:\n"+
		"  groups: %s, %d bytes uploaded (publish %d + recompose %d in %s)\n"+
		"  static: %s, %d bytes uploaded (%d full images rebuilt)\n"+
		"  ratio groups/static: time %.3fx, bytes %.3fx",
		N, R+H+2, float64(N)/regTime.Seconds(), regTime.Round(time.Millisecond), regBytes,
		float64(N)/localTime.Seconds(), localTime.Round(time.Millisecond),
		N/H, groupsUpdate.Round(time.Millisecond), groupsBytes, res.UploadedBytes, recBytes, recompose.Round(time.Millisecond),
		staticTime.Round(time.Millisecond), staticBytes, N/H,
		groupsUpdate.Seconds()/staticTime.Seconds(), float64(groupsBytes)/float64(staticBytes))
}

func readTree(t *testing.T, dir, prefix string) []testenv.File {
	t.Helper()
	var out []testenv.File
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		out = append(out, testenv.File{Path: filepath.Join(prefix, rel), Data: b, Mode: fi.Mode().Perm()})
		return nil
	})
	return out
}

// pushFlatImage builds a one-layer gzip image of files and pushes it,
// returning the bytes uploaded.
func pushFlatImage(ctx context.Context, env *testenv.Env, ref string, files []testenv.File) (int64, error) {
	tb, err := testenv.LayerTar(files)
	if err != nil {
		return 0, err
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tb)
	zw.Close()
	layer := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: digest.FromBytes(gz.Bytes()), Size: int64(gz.Len())}
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH}, RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(tb)}}})
	cfgDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: digest.FromBytes(cfg), Size: int64(len(cfg))}
	mb, _ := json.Marshal(ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, Config: cfgDesc, Layers: []ocispec.Descriptor{layer}})
	mDesc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(mb), Size: int64(len(mb))}
	pusher, err := env.Resolver().Pusher(ctx, ref)
	if err != nil {
		return 0, err
	}
	var sent int64
	for _, b := range []struct {
		d ocispec.Descriptor
		b []byte
	}{{layer, gz.Bytes()}, {cfgDesc, cfg}, {mDesc, mb}} {
		ok, err := group.PushBytes(ctx, pusher, b.d, b.b)
		if err != nil {
			return sent, err
		}
		if ok {
			sent += b.d.Size
		}
	}
	return sent, nil
}
