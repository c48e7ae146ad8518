//go:build linux

package lazyfs

import (
	"archive/tar"
	"bytes"
	"fmt"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/internal/idleprio"
	"github.com/envsnap/envsnap/internal/prereq"
)

// TestBenchRoundTripNice measures the latency of FUSE round trips (a
// lookup of a name not in the layer, answered by this process) on a node
// whose cores are kept busy by default-priority processes, with the
// server's threads at nice 0 and at the daemon's foreground nice value
// (idleprio.RaiseForeground), blocks alternating. The client is a
// separate process at nice 0, as a container's is. Gated by
// ENVSNAP_BENCH=1.
func TestBenchRoundTripNice(t *testing.T) {
	prereq.RequireBench(t)
	requireFUSE(t)
	blob, toc := convert(t, bytes.NewReader(buildTar(t, []tarFile{
		{hdr: tar.Header{Name: "f", Typeflag: tar.TypeReg, Mode: 0o644}, data: []byte("x")},
	})))
	mnt, _ := mountLayer(t, toc, newBlobSource(bytes.NewReader(blob)))
	// Busy processes: twice as many as cores, at nice 0.
	for range 4 {
		cmd := exec.Command("/bin/sh", "-c", "while :; do :; done")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	const nice = -10
	t.Cleanup(func() { idleprio.RaiseForeground(0) })
	// The client: n lookups of distinct missing names (each one reaches
	// the server: negative entries are cached per name), the latency of
	// each in microseconds.
	client := `import os,sys,time
p=sys.argv[1]; tag=sys.argv[2]; out=[]
for i in range(2000):
    t=time.perf_counter()
    try: os.stat(p+"/missing-"+tag+"-"+str(i))
    except FileNotFoundError: pass
    out.append((time.perf_counter()-t)*1e6)
print(" ".join("%.0f"%x for x in out))`
	lat := map[int][]float64{}
	for round := range 6 {
		for _, n := range []int{0, nice} {
			if err := idleprio.RaiseForeground(n); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command("python3", "-c", client, mnt, fmt.Sprintf("%d-%d", round, n)).Output()
			if err != nil {
				t.Fatalf("client: %v", err)
			}
			for _, f := range strings.Fields(string(out)) {
				v, _ := strconv.ParseFloat(f, 64)
				lat[n] = append(lat[n], v)
			}
		}
	}
	q := func(v []float64, p float64) float64 {
		s := append([]float64(nil), v...)
		sort.Float64s(s)
		return s[int(p*float64(len(s)-1))]
	}
	for _, n := range []int{0, nice} {
		v := lat[n]
		var sum float64
		for _, x := range v {
			sum += x
		}
		t.Logf("server at nice %3d: %d lookups, latency median %.0f us, p90 %.0f us, p99 %.0f us, mean %.0f us",
			n, len(v), q(v, 0.5), q(v, 0.9), q(v, 0.99), sum/float64(len(v)))
	}
}
