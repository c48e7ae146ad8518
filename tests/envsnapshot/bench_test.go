package envsnapshot_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/diff"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/envsnapshot"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

// benchEpisode changes about 48 MiB: 24 MiB of incompressible build
// output, 2,000 small source-like files (~16 MiB of text), a deleted
// directory of the image and edits.
const benchEpisode = `set -e
mkdir -p /srv/build /srv/src
head -c 25165824 /opt/tool/runtime.bin > /srv/build/out.bin
i=0
while [ $i -lt 2000 ]; do
  d=/srv/src/pkg$((i % 40))
  mkdir -p $d
  seq $i $((i + 1200)) > $d/file$i.go
  i=$((i + 1))
done
rm -rf /srv/cache
echo edited >> /etc/app.conf
`

// TestBenchSnapshot measures, side by side in one run on the same
// container contents: envsnap's snapshot (freeze, wall time and its
// phases, bytes uploaded) against a commit and push the way nerdctl does it (pause,
// containerd's diff service with gzip, resume, push) of a container on
// overlayfs; then the time for 8 forks of the snapshot to be running on
// the parent's node, against 8 cold starts of the original image on an
// empty node. Run with ENVSNAP_BENCH=1 (make bench).
func TestBenchSnapshot(t *testing.T) {
	prereq.RequireBench(t)
	const rounds = 5
	t.Logf("load average at the start: %s", loadavg())
	r := newRig(t)
	e := r.env
	ctx := e.Context()
	files := append(baseFiles(), testenv.RandomFile("/opt/tool/runtime.bin", 96<<20, 11))
	lazy := e.PushImage(t, "envsnap-bench/env:1", files, testenv.WithLazyLayers())
	gz := e.PushImage(t, "envsnap-bench/env-gzip:1", files)
	lazyImg := e.Pull(t, lazy.Ref, "envsnap")
	gzImg := e.Pull(t, gz.Ref, "overlayfs")
	r.start(t, lazyImg, "bench-envsnap", benchEpisode)
	ovlTask := r.startOn(t, gzImg, "bench-overlayfs", "overlayfs", benchEpisode)

	var snapWall, commitWall, snapFreeze, snapCopy, commitFreeze []time.Duration
	var snapPre, snapEncode, snapPush []time.Duration
	var fileWall, fileEncode, filePush []time.Duration
	var snapCPU, commitCPU []time.Duration // every process of the rig
	var snapBytes, commitBytes int64
	var snapRef string
	for i := range rounds {
		// A repository per round: the same diff pushed again to the same
		// repository would find its blobs there and send nothing.
		snapRef = fmt.Sprintf("%s/envsnap-bench/snap-%d:1", e.Registry.Host, i)
		cpu := e.CPUSeconds()
		res, err := envsnapshot.Take(ctx, e.Client, "bench-envsnap", snapRef, envsnapshot.Options{Hosts: e.Hosts()})
		if err != nil {
			t.Fatal(err)
		}
		used, split := cpuSince(e.CPUSeconds(), cpu)
		snapCPU = append(snapCPU, used)
		t.Logf("envsnap round %d: CPU %s (%s)", i, used, split)
		snapWall, snapFreeze, snapBytes = append(snapWall, res.Duration), append(snapFreeze, res.Frozen), res.UploadedBytes
		snapCopy = append(snapCopy, res.Copy)
		snapPre, snapEncode, snapPush = append(snapPre, res.Precopy), append(snapEncode, res.Encode), append(snapPush, res.Push)
		t.Logf("envsnap round %d: pre-copy %s, frozen %s by %s (reading %s: %d files read frozen, %d from the pre-copy), encode %s (encoded early: %v), push %s, wall %s, diff %d data bytes -> %d-byte layer, uploaded %d",
			i, res.Precopy, res.Frozen, res.Freezer, res.Copy, res.FilesCopied, res.FilesReused, res.Encode, res.EncodedEarly, res.Push, res.Duration, res.Diff.DataBytes, res.Layer.Size, res.UploadedBytes)

		// The same snapshot without streaming: the layer is written to a
		// file, then pushed.
		ref := fmt.Sprintf("%s/envsnap-bench/snap-file-%d:1", e.Registry.Host, i)
		res, err = envsnapshot.Take(ctx, e.Client, "bench-envsnap", ref, envsnapshot.Options{Hosts: e.Hosts(), UploadChunk: -1})
		if err != nil {
			t.Fatal(err)
		}
		fileWall, fileEncode, filePush = append(fileWall, res.Duration), append(fileEncode, res.Encode), append(filePush, res.Push)
		t.Logf("envsnap without streaming round %d: pre-copy %s, frozen %s, encode %s, push %s, wall %s, uploaded %d",
			i, res.Precopy, res.Frozen, res.Encode, res.Push, res.Duration, res.UploadedBytes)

		cpu = e.CPUSeconds()
		wall, frozen, sent := commitAndPush(t, e, ovlTask, "bench-overlayfs", fmt.Sprintf("%s/envsnap-bench/commit-%d:1", e.Registry.Host, i))
		used, split = cpuSince(e.CPUSeconds(), cpu)
		commitCPU = append(commitCPU, used)
		t.Logf("commit round %d: CPU %s (%s)", i, used, split)
		commitWall, commitFreeze, commitBytes = append(commitWall, wall), append(commitFreeze, frozen), sent
		t.Logf("commit round %d: paused %s, wall %s, uploaded %d (envsnap / commit this round: %.2fx)", i, frozen, wall, sent, ratio(snapWall[i], wall))
	}
	t.Logf("load average after the snapshot rounds: %s", loadavg())
	var perRound []time.Duration
	for i := range snapWall {
		// A ratio scaled to a duration, so median applies.
		perRound = append(perRound, time.Duration(ratio(snapWall[i], commitWall[i])*1e6))
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.0f ms", float64(d.Microseconds())/1000) }
	t.Logf("| snapshot of a ~48 MiB episode (median of %d) | envsnap `env snapshot` | overlayfs commit + push (gzip) | ratio |", rounds)
	t.Logf("| freeze | %s (copy %s) | %s (paused for the whole diff) | %.3fx |", ms(median(snapFreeze)), ms(median(snapCopy)), ms(median(commitFreeze)), ratio(median(snapFreeze), median(commitFreeze)))
	t.Logf("| wall time | %s | %s | %.2fx (median of the per-round ratios %.2fx) |", ms(median(snapWall)), ms(median(commitWall)), ratio(median(snapWall), median(commitWall)), float64(median(perRound))/1e6)
	t.Logf("| wall time, layer written to a file then pushed (no streaming) | %s (encode %s, push %s) | | %.2fx |", ms(median(fileWall)), ms(median(fileEncode)), ms(median(filePush)), ratio(median(fileWall), median(commitWall)))
	t.Logf("| bytes uploaded | %d | %d | %.2fx |", snapBytes, commitBytes, float64(snapBytes)/float64(commitBytes))
	// On a small node the snapshot's work (encode, digests, the registry
	// taking the layer) shares the cores with itself: its CPU divided by
	// the cores is the wall time it could reach with perfect overlap.
	cores := runtime.NumCPU()
	floor := median(snapCPU) / time.Duration(cores)
	t.Logf("| CPU, every process of the node's rig (this one, containerd, the registry, envsnap) | %s | %s | %.2fx |", ms(median(snapCPU)), ms(median(commitCPU)), ratio(median(snapCPU), median(commitCPU)))
	t.Logf("| shortest wall time that CPU allows on %d cores (CPU / cores), against the commit's wall | %s | %s | %.2fx |", cores, ms(floor), ms(median(commitWall)), ratio(floor, median(commitWall)))
	var snapOther []time.Duration
	for i := range snapWall {
		snapOther = append(snapOther, snapWall[i]-snapPre[i]-snapFreeze[i]-snapEncode[i]-snapPush[i])
	}
	t.Logf("| where the time goes | pre-copy %s, frozen %s, encode (uploading as it goes, base layers linked meanwhile) %s, push (last chunk, config, manifest) %s, other (container look-ups, task status) %s | paused (diff + gzip) %s, the rest (config, manifest, push) %s | |",
		ms(median(snapPre)), ms(median(snapFreeze)), ms(median(snapEncode)), ms(median(snapPush)), ms(median(snapOther)), ms(median(commitFreeze)), ms(median(commitWall)-median(commitFreeze)))

	forks := forkTimes(t, ctx, e, snapRef, "bench-fork", 8)
	node2 := testenv.New(t, testenv.WithEnvsnap())
	testenv.WriteHostsDir(t, node2.HostsDir, e.Registry.Host)
	cold := forkTimes(t, node2.Context(), node2, lazy.Ref, "bench-cold", 8)
	t.Logf("| 8 environments ready (task running), p50 / max | forks of the snapshot, parent's node | original image, empty node (cold) | ratio of p50 |")
	t.Logf("| ready | %s / %s | %s / %s | %.2fx |", ms(median(forks)), ms(maxDur(forks)), ms(median(cold)), ms(maxDur(cold)), ratio(median(forks), median(cold)))
}

// cpuSince is the CPU used between two CPUSeconds samples by the
// processes in both: the sum, and each process's share for the log.
func cpuSince(now, before map[string]float64) (time.Duration, string) {
	var sum float64
	var parts []string
	for name, t := range now {
		if b, ok := before[name]; ok {
			sum += t - b
			parts = append(parts, fmt.Sprintf("%s %.0f ms", name, (t-b)*1000))
		}
	}
	sort.Strings(parts)
	return time.Duration(sum * float64(time.Second)), strings.Join(parts, ", ")
}

// forkTimes starts n environments from ref on e with env fork's Go API and
// returns each one's time until its task ran (the shared pull included).
func forkTimes(t *testing.T, ctx context.Context, e *testenv.Env, ref, prefix string, n int) []time.Duration {
	t.Helper()
	pull, forks, err := envsnapshot.Fork(ctx, e.Client, ref, n, envsnapshot.ForkOptions{Hosts: e.Hosts(), IDPrefix: prefix, Args: []string{"sleep", "100000"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: pull (lazy) %s, then %d containers created and started at once", prefix, pull, n)
	var out []time.Duration
	for _, f := range forks {
		if f.Err != nil {
			t.Fatal(f.Err)
		}
		out = append(out, f.Ready)
	}
	return out
}

// commitAndPush does what `nerdctl commit` then `nerdctl push` do with a
// running container on overlayfs: pause it, diff its snapshot against its
// parent with containerd's diff service (gzip), resume it, write a config
// and manifest with the new layer, push (base layers are mounted across
// repositories, not sent). It returns the wall time, how long the
// container was paused and the blob bytes uploaded.
func commitAndPush(t *testing.T, e *testenv.Env, task client.Task, id, ref string) (wall, paused time.Duration, sent int64) {
	t.Helper()
	start := time.Now()
	ctx, done, err := e.Client.WithLease(e.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer done(context.WithoutCancel(ctx))
	c, err := e.Client.LoadContainer(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sn := e.Client.SnapshotService(info.Snapshotter)
	sinfo, err := sn.Stat(ctx, info.SnapshotKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	p0 := time.Now()
	lowerKey := fmt.Sprintf("%s-commit-lower-%d", id, time.Now().UnixNano())
	lower, err := sn.View(ctx, lowerKey, sinfo.Parent)
	if err != nil {
		t.Fatal(err)
	}
	upper, err := sn.Mounts(ctx, info.SnapshotKey)
	if err != nil {
		t.Fatal(err)
	}
	layer, err := e.Client.DiffService().Compare(ctx, lower, upper, diff.WithMediaType(ocispec.MediaTypeImageLayerGzip))
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	paused = time.Since(p0)
	_ = sn.Remove(ctx, lowerKey)

	cs := e.Client.ContentStore()
	linfo, err := cs.Info(ctx, layer.Digest)
	if err != nil {
		t.Fatal(err)
	}
	img, err := e.Client.GetImage(ctx, info.Image)
	if err != nil {
		t.Fatal(err)
	}
	m, err := images.Manifest(ctx, cs, img.Target(), platforms.Default())
	if err != nil {
		t.Fatal(err)
	}
	cb, err := content.ReadBlob(ctx, cs, m.Config)
	if err != nil {
		t.Fatal(err)
	}
	var cfg ocispec.Image
	if err := json.Unmarshal(cb, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, digest.Digest(linfo.Labels["containerd.io/uncompressed"]))
	cfg.History = nil
	cfgDesc := writeJSON(t, ctx, cs, ocispec.MediaTypeImageConfig, cfg, nil)
	m.Config, m.Layers = cfgDesc, append(m.Layers, layer)
	m.Versioned, m.MediaType = specs.Versioned{SchemaVersion: 2}, ocispec.MediaTypeImageManifest
	gc := map[string]string{"containerd.io/gc.ref.content.config": cfgDesc.Digest.String()}
	sizes := map[string]int64{cfgDesc.Digest.String(): cfgDesc.Size}
	for i, l := range m.Layers {
		gc[fmt.Sprintf("containerd.io/gc.ref.content.l.%d", i)] = l.Digest.String()
		sizes[l.Digest.String()] = l.Size
	}
	mDesc := writeJSON(t, ctx, cs, ocispec.MediaTypeImageManifest, m, gc)

	before := len(e.Registry.UploadedDigests())
	if err := e.Client.Push(ctx, ref, mDesc, client.WithResolver(e.Resolver())); err != nil {
		t.Fatal(err)
	}
	for _, d := range e.Registry.UploadedDigests()[before:] {
		sent += sizes[d]
	}
	return time.Since(start), paused, sent + mDesc.Size
}

func writeJSON(t *testing.T, ctx context.Context, cs content.Store, mediaType string, v any, labels map[string]string) ocispec.Descriptor {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	desc := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
	if err := content.WriteBlob(ctx, cs, desc.Digest.String(), bytes.NewReader(b), desc, content.WithLabels(labels)); err != nil {
		t.Fatal(err)
	}
	return desc
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[(len(s)-1)/2]
}

func maxDur(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

func ratio(a, b time.Duration) float64 { return float64(a) / float64(b) }

// loadavg is the 1, 5 and 15 minute load averages: the machine may be
// shared, and the ratios are only comparable with the load they ran at.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
