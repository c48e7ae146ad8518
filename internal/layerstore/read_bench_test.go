//go:build linux

package layerstore

import (
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// BenchmarkCachedRead reads a 64 MiB file through a lazy mount whose
// chunks are all in the node cache, dropping the mount's page cache before
// each read: the daemon-side cost of a cached sequential read (profile it
// with -cpuprofile; the FUSE server runs in this process).
func BenchmarkCachedRead(b *testing.B) {
	if os.Getuid() != 0 {
		prereq.Missing(b, "mounts FUSE: needs root")
	}
	const size = 64 << 20
	data := make([]byte, size)
	rand.New(rand.NewSource(1)).Read(data)
	r := newFakeRegistryB(b)
	desc, _ := r.addLazyLayer(b, tarOfB(b, "big.bin", data))
	labels := r.addManifest(b, "bench/app:1", desc)[0]
	s := newStoreB(b)
	reg := prometheus.NewRegistry()
	s.cfg.Registerer = reg
	mp := b.TempDir()
	if err := s.Mount(b.Context(), mp, labels); err != nil {
		b.Fatal(err)
	}
	unmountAtCleanup(b, s, mp)
	p := filepath.Join(mp, "big.bin")
	read := func() {
		f, err := os.Open(p)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		h := digest.Canonical.Digester()
		if _, err := io.CopyBuffer(h.Hash(), struct{ io.Reader }{f}, make([]byte, 1<<20)); err != nil {
			b.Fatal(err)
		}
		if h.Digest() != digest.FromBytes(data) {
			b.Fatal("content mismatch")
		}
	}
	read() // fetch everything into the cache
	b.SetBytes(size)
	b.ResetTimer()
	for b.Loop() {
		read()
	}
	b.StopTimer()
	// FUSE read requests per MiB read: the kernel's request size decides
	// how many round trips through the daemon a sequential read costs.
	mfs, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "envsnap_lazyfs_ops_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetValue() == "read" {
					b.ReportMetric(m.GetCounter().GetValue()/float64((b.N+1)*(size>>20)), "fuse-reads/MiB")
				}
			}
		}
	}
}
