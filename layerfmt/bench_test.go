package layerfmt

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
)

// manyFilesTar is a tar of n small files in directories of 100, the shape
// of a node_modules or a module cache.
func manyFilesTar(tb testing.TB, n int) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Unix(1700000000, 0)
	for i := 0; i < n; i++ {
		if i%100 == 0 {
			tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: fmt.Sprintf("pkg/mod/dir%05d/", i/100), Mode: 0o755, ModTime: mt})
		}
		data := []byte(fmt.Sprintf("package p%d\n", i))
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("pkg/mod/dir%05d/file-%07d.go", i/100, i),
			Mode: 0o644, Size: int64(len(data)), ModTime: mt, Uid: 1000, Gid: 1000}); err != nil {
			tb.Fatal(err)
		}
		tw.Write(data)
	}
	tw.Close()
	return buf.Bytes()
}

// jsonEntry is an eStargz-style JSON TOC entry, the baseline.
type jsonEntry struct {
	Name        string            `json:"name"`
	Type        string            `json:"type"`
	Size        int64             `json:"size,omitempty"`
	ModTime     string            `json:"modtime,omitempty"`
	LinkName    string            `json:"linkName,omitempty"`
	Mode        int64             `json:"mode,omitempty"`
	UID         int               `json:"uid,omitempty"`
	GID         int               `json:"gid,omitempty"`
	Offset      int64             `json:"offset,omitempty"`
	ChunkOffset int64             `json:"chunkOffset,omitempty"`
	ChunkSize   int64             `json:"chunkSize,omitempty"`
	Digest      string            `json:"digest,omitempty"`
	ChunkDigest string            `json:"chunkDigest,omitempty"`
	Xattrs      map[string][]byte `json:"xattrs,omitempty"`
}

type jsonTOC struct {
	Version int          `json:"version"`
	Entries []*jsonEntry `json:"entries"`
}

func toJSON(toc *TOC) []byte {
	var j jsonTOC
	j.Version = 1
	for i := 0; i < toc.Len(); i++ {
		e := toc.Entry(i)
		je := &jsonEntry{Name: e.Name, Type: e.Type.String(), Size: e.Size, ModTime: e.ModTime.Format(time.RFC3339),
			LinkName: e.Linkname, Mode: int64(e.Mode.Perm()), UID: e.UID, GID: e.GID}
		j.Entries = append(j.Entries, je)
		for _, c := range toc.Chunks(i) {
			je.Offset, je.ChunkOffset, je.ChunkSize, je.ChunkDigest = c.Offset, c.FileOffset, c.Size, c.Digest.String()
			je.Digest = c.Digest.String()
		}
	}
	b, _ := json.Marshal(&j)
	return b
}

func heapAfterGC() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkTOCDecode decodes the TOC of a 100,000-file layer and, side by
// side, an eStargz-style JSON TOC of the same entries.
func BenchmarkTOCDecode(b *testing.B) {
	in := manyFilesTar(b, 100_000)
	var out bytes.Buffer
	res, err := Convert(context.Background(), &out, bytes.NewReader(in))
	if err != nil {
		b.Fatal(err)
	}
	blob := out.Bytes()
	enc := blob[len(blob)-FooterSize-int(res.TOCSize) : len(blob)-FooterSize]
	toc, err := DecodeTOC(enc, res.TOCDigest)
	if err != nil {
		b.Fatal(err)
	}
	js := toJSON(toc)

	// Retained memory of a decoded TOC, each way (average of a few kept
	// copies, so that GC noise does not dominate).
	const copies = 4
	// A TOC holds exactly its decompressed bytes (all its slices share one
	// buffer).
	ourHeap := int64(tocHeaderSize + len(toc.entries) + len(toc.chunks) + len(toc.frames) + len(toc.xattrs) + len(toc.strs))
	base := heapAfterGC()
	var jkeep [copies]jsonTOC
	for k := range jkeep {
		if err := json.Unmarshal(js, &jkeep[k]); err != nil {
			b.Fatal(err)
		}
	}
	jsonHeap := (int64(heapAfterGC()) - int64(base)) / copies
	runtime.KeepAlive(&jkeep)
	jkeep = [copies]jsonTOC{}

	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	start := time.Now()
	n := 0
	for b.Loop() {
		if _, err := DecodeTOC(enc, res.TOCDigest); err != nil {
			b.Fatal(err)
		}
		n++
	}
	ours := time.Since(start) / time.Duration(n)
	runtime.ReadMemStats(&ms1)
	ourAlloc := (ms1.TotalAlloc - ms0.TotalAlloc) / uint64(n)

	runtime.ReadMemStats(&ms0)
	start = time.Now()
	jn := max(1, n/4)
	for range jn {
		var j jsonTOC
		if err := json.Unmarshal(js, &j); err != nil {
			b.Fatal(err)
		}
	}
	jsonTime := time.Since(start) / time.Duration(jn)
	runtime.ReadMemStats(&ms1)
	jsonAlloc := (ms1.TotalAlloc - ms0.TotalAlloc) / uint64(jn)

	runtime.KeepAlive(in)
	runtime.KeepAlive(blob)
	b.ReportMetric(float64(toc.Len()), "entries")
	b.ReportMetric(float64(res.TOCSize), "toc-bytes")
	b.ReportMetric(float64(len(js)), "json-bytes")
	b.ReportMetric(float64(ourAlloc), "alloc-B/decode")
	b.ReportMetric(float64(ourHeap), "retained-B")
	b.ReportMetric(float64(jsonTime)/float64(ours), "json/ours-time")
	b.ReportMetric(float64(jsonAlloc)/float64(ourAlloc), "json/ours-alloc")
	b.ReportMetric(float64(jsonHeap)/float64(max(ourHeap, 1)), "json/ours-retained")

	// Lookups by path: binary search per component, no map.
	names := make([]string, 1000)
	for k := range names {
		names[k] = toc.Name(1 + k*toc.Len()/1000%(toc.Len()-1))
	}
	start = time.Now()
	for k := 0; k < 100_000; k++ {
		if _, ok := toc.Lookup(names[k%len(names)]); !ok {
			b.Fatal("lookup failed")
		}
	}
	b.ReportMetric(float64(time.Since(start).Nanoseconds())/100_000, "ns/lookup")
}

func zstdStreamSize(in []byte, level int) int {
	var buf bytes.Buffer
	zw, _ := zstd.NewWriter(&buf, zstd.WithEncoderLevel(zstd.EncoderLevelFromZstd(level)), zstd.WithEncoderConcurrency(1))
	zw.Write(in)
	zw.Close()
	return buf.Len()
}

// BenchmarkConvertSize converts GOROOT with several chunk sizes and reports
// the blob size against one zstd stream of the same tar at the same level
// and against tar+gzip (default level). Run with -benchtime=1x.
func BenchmarkConvertSize(b *testing.B) {
	in := goRootTar(b)
	plain := zstdStreamSize(in, DefaultCompressionLevel)
	var gz bytes.Buffer
	gw := gzip.NewWriter(&gz)
	gw.Write(in)
	gw.Close()
	for _, cs := range []int{256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20} {
		b.Run(fmt.Sprintf("chunk=%dKiB", cs>>10), func(b *testing.B) {
			var res *WriteResult
			for b.Loop() {
				var err error
				if res, err = Convert(context.Background(), io.Discard, bytes.NewReader(in), WithChunkSize(cs)); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(res.Size), "blob-bytes")
			b.ReportMetric(100*(float64(res.Size)/float64(plain)-1), "%-over-zstd")
			b.ReportMetric(100*(float64(res.Size)/float64(gz.Len())-1), "%-over-gzip")
		})
	}
}

// BenchmarkRandomRead reads 4 KiB at random offsets of random GOROOT files
// from a local blob, decoding every chunk afresh (no cache), and reports
// the cost against finding the same bytes in one zstd stream, which means
// decompressing from the start (on average half the stream).
func BenchmarkRandomRead(b *testing.B) {
	in := goRootTar(b)
	var out bytes.Buffer
	res, err := Convert(context.Background(), &out, bytes.NewReader(in))
	if err != nil {
		b.Fatal(err)
	}
	blob := out.Bytes()
	r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	if err != nil {
		b.Fatal(err)
	}
	toc := r.TOC()
	var files []int
	for i := 0; i < toc.Len(); i++ {
		if toc.Type(i) == TypeReg && toc.Size(i) > 0 {
			files = append(files, i)
		}
	}
	rng := rand.New(rand.NewPCG(7, 8))
	p := make([]byte, 4096)
	var compressed, decompressed int64
	start := time.Now()
	for b.Loop() {
		i := files[rng.IntN(len(files))]
		off := rng.Int64N(toc.Size(i))
		for pos := off; pos < min(off+4096, toc.Size(i)); {
			c := toc.Chunk(i, toc.ChunkAt(i, pos))
			data, err := r.ReadChunk(c, nil)
			if err != nil {
				b.Fatal(err)
			}
			compressed += c.CompressedSize
			decompressed += c.FrameSize
			pos += int64(copy(p, data[pos-c.FileOffset:]))
		}
	}
	per := time.Since(start) / time.Duration(b.N)
	b.ReportMetric(float64(compressed)/float64(b.N), "compressed-B/read")
	b.ReportMetric(float64(decompressed)/float64(b.N), "decompressed-B/read")

	var zs bytes.Buffer
	zw, _ := zstd.NewWriter(&zs, zstd.WithEncoderConcurrency(1))
	zw.Write(in)
	zw.Close()
	dec, _ := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1))
	t0 := time.Now()
	dec.Reset(bytes.NewReader(zs.Bytes()))
	io.Copy(io.Discard, dec)
	half := time.Since(t0) / 2
	dec.Close()
	b.ReportMetric(float64(half)/float64(per), "stream/ours-time")
}

// BenchmarkConvert reports conversion throughput of GOROOT against
// compressing the same tar as one zstd stream at the same level.
func BenchmarkConvert(b *testing.B) {
	in := goRootTar(b)
	b.SetBytes(int64(len(in)))
	start := time.Now()
	for b.Loop() {
		if _, err := Convert(context.Background(), io.Discard, bytes.NewReader(in)); err != nil {
			b.Fatal(err)
		}
	}
	ours := time.Since(start) / time.Duration(b.N)
	t0 := time.Now()
	zstdStreamSize(in, DefaultCompressionLevel)
	b.ReportMetric(float64(ours)/float64(time.Since(t0)), "ours/zstd-time")
}

// BenchmarkDecodeFrame: decompressing one default-size frame of
// executable-like bytes (the cold read path's CPU per frame), with the
// output buffer DecodeVerifiedFrame allocates.
func BenchmarkDecodeFrame(b *testing.B) {
	data := make([]byte, DefaultChunkSize)
	r := rand.New(rand.NewPCG(3, 4))
	for off := 0; off < len(data); off += 4096 {
		blk := data[off:min(off+4096, len(data))]
		if r.IntN(2) == 0 {
			for i := range blk {
				blk[i] = byte(r.Uint32()) & 0x0f
			}
		} else {
			for i := range blk {
				blk[i] = byte(r.Uint32())
			}
		}
	}
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "bin", Mode: 0o755, Size: int64(len(data))}); err != nil {
		b.Fatal(err)
	}
	tw.Write(data)
	tw.Close()
	var blob bytes.Buffer
	res, err := Convert(context.Background(), &blob, &tb)
	if err != nil {
		b.Fatal(err)
	}
	rd, err := NewReader(bytes.NewReader(blob.Bytes()), int64(blob.Len()), res.TOCDigest)
	if err != nil {
		b.Fatal(err)
	}
	toc := rd.TOC()
	i, ok := toc.Lookup("bin")
	if !ok {
		b.Fatal("bin not in the TOC")
	}
	c := toc.Chunk(i, 0)
	compressed := blob.Bytes()[c.Offset : c.Offset+c.CompressedSize]
	b.SetBytes(c.FrameSize)
	for b.Loop() {
		if _, err := DecodeVerifiedFrame(c, compressed, nil); err != nil {
			b.Fatal(err)
		}
	}
}
