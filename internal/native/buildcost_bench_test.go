//go:build linux

package native

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"

	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/layerfmt"
)

// TestBenchBuildCost measures the CPU a native copy costs per GiB of
// files, for each group of the benchmark workload, every frame in the
// node cache as a finished fill leaves it, and splits it into what
// building the copy while the layer fills would not pay again and what
// it would: reading and re-verifying the compressed frames from the node
// cache (a build from the fill's own bytes skips it), decoding them, and
// creating and writing the files (paid either way). The page cache's
// writeback of the files runs in kernel threads, not counted. Gated by
// ENVSNAP_BENCH=1; needs the workload (ENVSNAP_BENCH_CACHE, default
// .cache/bench).
func TestBenchBuildCost(t *testing.T) {
	prereq.RequireBench(t)
	requireRoot(t)
	cache := os.Getenv("ENVSNAP_BENCH_CACHE")
	if cache == "" {
		cache = filepath.Join("..", "..", ".cache", "bench")
	}
	work := filepath.Join(cache, "workload", "small")
	// One thread does the work: its own CPU time is what is measured.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	thread := func() float64 { return cpuTime(syscall.RUSAGE_THREAD).Seconds() }
	var total struct{ files, get, decode, build float64 }
	for _, name := range []string{"base.tar", "task-uuid.tar", "harness.tar"} {
		_, toc, c := workloadLayer(t, filepath.Join(work, name))
		var files int64
		for i := range toc.Len() {
			if toc.Type(i) == layerfmt.TypeReg {
				files += toc.Size(i)
			}
		}
		// Read and verify every frame from the node cache, then decode
		// each, as the build does.
		frames := make([][]byte, toc.NumFrames())
		t0 := thread()
		for k := range toc.NumFrames() {
			b, ok := c.Get(toc.Frame(k).Digest)
			if !ok {
				t.Fatalf("%s: frame %d not in the cache", name, k)
			}
			frames[k] = b
		}
		t1 := thread()
		var dst []byte
		for k := range toc.NumFrames() {
			f := toc.Frame(k)
			ch := layerfmt.Chunk{Offset: f.Offset, CompressedSize: f.CompressedSize, Size: f.Size, Digest: f.Digest, FrameSize: f.Size, FrameIndex: k}
			out, err := layerfmt.DecodeVerifiedFrame(ch, frames[k], dst)
			if err != nil {
				t.Fatalf("%s: decode frame %d: %v", name, k, err)
			}
			dst = out
		}
		t2 := thread()
		frames = nil
		dir := filepath.Join(t.TempDir(), "tree")
		t3 := thread()
		if err := BuildTree(context.Background(), dir, toc, c); err != nil {
			t.Fatalf("native copy of %s: %v", name, err)
		}
		t4 := thread()
		gib := float64(files) / (1 << 30)
		get, decode, build := t1-t0, t2-t1, t4-t3
		t.Logf("%-14s %4.0f MiB of files in %5d entries, %4d frames: build %.2fs CPU (%.1f s/GiB), of which reading and verifying cached frames %.2fs (%.1f s/GiB), decoding %.2fs (%.1f s/GiB), files %.2fs (%.1f s/GiB)",
			name, float64(files)/(1<<20), toc.Len(), toc.NumFrames(), build, build/gib, get, get/gib, decode, decode/gib, build-get-decode, (build-get-decode)/gib)
		total.files += gib
		total.get += get
		total.decode += decode
		total.build += build
		os.RemoveAll(dir)
	}
	t.Logf("all groups, %.2f GiB of files: build %.1f CPU-s/GiB: reading and verifying cached frames %.1f, decoding %.1f, creating and writing files %.1f",
		total.files, total.build/total.files, total.get/total.files, total.decode/total.files, (total.build-total.get-total.decode)/total.files)
}
