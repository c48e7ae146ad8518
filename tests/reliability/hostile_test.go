package reliability_test

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/layerfmt"
	"github.com/envsnap/envsnap/tests/testenv"
)

// Layout facts of the format this test edits blobs with (layerfmt/toc.go,
// layerfmt/format.go). If the format changes, resealed blobs fail to
// decode for the wrong reason and the "refused for the right reason"
// checks below fail.
const (
	tocHeaderSize = 64
	entryRecSize  = 72
	eNameOff      = 4
	eNameLen      = 8
	eSize         = 40
	eLinkOff      = 56
	eLinkLen      = 60
	frameRecSize  = 48
	footerSize    = layerfmt.FooterSize
	skippableTOC  = 0x184D2A5E
	skippableFoot = 0x184D2A5F
)

// rawLayer is a converted blob taken apart: data frames, raw TOC.
type rawLayer struct {
	data []byte // frames, up to the TOC's skippable frame
	toc  []byte // decompressed TOC
	dec  *layerfmt.TOC
}

func splitBlob(t *testing.T, blob []byte, tocDigest digest.Digest) rawLayer {
	t.Helper()
	off, size, err := layerfmt.TOCRange(blob[len(blob)-footerSize:], int64(len(blob)))
	if err != nil {
		t.Fatal(err)
	}
	enc := blob[off : off+size]
	dec, err := layerfmt.DecodeTOC(enc, tocDigest)
	if err != nil {
		t.Fatal(err)
	}
	zd, _ := zstd.NewReader(nil)
	defer zd.Close()
	raw, err := zd.DecodeAll(enc, nil)
	if err != nil {
		t.Fatal(err)
	}
	return rawLayer{data: blob[:off-8], toc: raw, dec: dec}
}

func (r rawLayer) rec(t *testing.T, path string) []byte {
	t.Helper()
	i, ok := r.dec.Lookup(strings.TrimPrefix(path, "/"))
	if !ok {
		t.Fatalf("%s not in TOC", path)
	}
	return r.toc[tocHeaderSize+i*entryRecSize:][:entryRecSize]
}

func le32(b []byte, off int) uint32 { return binary.LittleEndian.Uint32(b[off:]) }

// strs returns the string table of the raw TOC.
func (r rawLayer) strs() []byte {
	n, nc, nf, nx := le32(r.toc, 16), le32(r.toc, 20), le32(r.toc, 24), le32(r.toc, 28)
	start := tocHeaderSize + int(n)*entryRecSize + int(nc)*24 + int(nf)*frameRecSize + int(nx)*16
	return r.toc[start:]
}

// setName overwrites the base name of path with one of the same length.
func (r rawLayer) setName(t *testing.T, path, name string) {
	rec := r.rec(t, path)
	off, l := le32(rec, eNameOff), le32(rec, eNameLen)
	if int(l) != len(name) {
		t.Fatalf("name %q is not %d bytes", name, l)
	}
	copy(r.strs()[off:off+l], name)
}

func (r rawLayer) setLink(t *testing.T, path, target string) {
	rec := r.rec(t, path)
	off, l := le32(rec, eLinkOff), le32(rec, eLinkLen)
	if int(l) != len(target) {
		t.Fatalf("link target %q is not %d bytes (stored %q)", target, l, r.strs()[off:off+l])
	}
	copy(r.strs()[off:off+l], target)
}

// seal builds a blob from data frames and a raw TOC, with a footer whose
// TOC offset is shifted by footerShift (0 for a valid one).
func seal(t *testing.T, data, raw []byte, footerShift uint64) ([]byte, digest.Digest) {
	t.Helper()
	ze, err := zstd.NewWriter(nil)
	if err != nil {
		t.Fatal(err)
	}
	enc := ze.EncodeAll(raw, nil)
	ze.Close()
	var b bytes.Buffer
	b.Write(data)
	binary.Write(&b, binary.LittleEndian, uint32(skippableTOC))
	binary.Write(&b, binary.LittleEndian, uint32(len(enc)))
	tocOff := uint64(b.Len())
	b.Write(enc)
	sum := sha256.Sum256(enc)
	p := make([]byte, 72)
	copy(p[0:8], "ESNAPFT1")
	binary.LittleEndian.PutUint32(p[8:], 1) // format version
	binary.LittleEndian.PutUint64(p[16:], tocOff+footerShift)
	binary.LittleEndian.PutUint64(p[24:], uint64(len(enc)))
	copy(p[32:64], sum[:])
	binary.LittleEndian.PutUint32(p[64:], crc32.Checksum(p[:64], crc32.MakeTable(crc32.Castagnoli)))
	binary.Write(&b, binary.LittleEndian, uint32(skippableFoot))
	binary.Write(&b, binary.LittleEndian, uint32(72))
	b.Write(p)
	return b.Bytes(), digest.FromBytes(enc)
}

// TestHostileLayers publishes layers whose TOC or data lie, each sealed
// with a correct TOC digest (so the trust chain holds and only the content
// is hostile). A hostile TOC or footer is refused: the snapshotter falls
// back to containerd's normal unpack of the layer (whose tar stream is
// the honest one), and the container sees the honest files. A data frame
// that decompresses to far more than it declares fails the read with EIO.
// The daemon survives all of it within a fixed memory bound, and nothing
// appears outside the rootfs.
func TestHostileLayers(t *testing.T) {
	env := testenv.New(t, testenv.WithEnvsnap("--fill=false", "--read-timeout", "5s"))
	hostMarker := filepath.Join(t.TempDir(), "host-secret")
	if err := os.WriteFile(hostMarker, []byte("host secret\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	honest := []testenv.File{
		testenv.RandomFile("/data/aa", 8<<10, 1),
		testenv.RandomFile("/data/dupA", 8<<10, 2),
		testenv.RandomFile("/data/dupB", 8<<10, 3),
		testenv.RandomFile("/data/ZetcZpasswd", 8<<10, 4),
		testenv.RandomFile("/data/big", 8<<10, 5),
		testenv.RandomFile("/data/hl-target-abcd", 4<<10, 6),
	}
	bb, err := testenv.BusyboxFiles()
	if err != nil {
		t.Fatal(err)
	}
	layerBlob := func(files []testenv.File) ([]byte, *layerfmt.WriteResult) {
		tb, err := testenv.LayerTar(files)
		if err != nil {
			t.Fatal(err)
		}
		return convertTar(t, env, tb)
	}
	bbBlob, bbRes := layerBlob(bb)
	// Each case gets a distinct data layer (distinct diffID, so distinct
	// chainID): otherwise containerd would reuse the snapshot an earlier
	// case unpacked and never ask the daemon.
	honestLayer := func(t *testing.T, i int) ([]byte, *layerfmt.WriteResult, digest.Digest) {
		files := append(append([]testenv.File(nil), honest...), testenv.RandomFile(fmt.Sprintf("/data/case-%d", i), 100, int64(i)))
		blob, res := convertTar(t, env, dataTar(t, files, hostMarker))
		return blob, res, digest.Digest(res.Annotations()[layerfmt.AnnotationTOCDigest])
	}

	type tamper func(t *testing.T, r rawLayer) ([]byte, digest.Digest)
	cases := []struct {
		name   string
		tamper tamper
		lazy   bool   // the TOC is fine; the data is hostile
		reason string // in the logged refusal
	}{
		{"dot-dot name", func(t *testing.T, r rawLayer) ([]byte, digest.Digest) {
			r.setName(t, "/data/aa", "..")
			return seal(t, r.data, r.toc, 0)
		}, false, `..`},
		{"absolute name", func(t *testing.T, r rawLayer) ([]byte, digest.Digest) {
			r.setName(t, "/data/ZetcZpasswd", "/etc/passwd")
			return seal(t, r.data, r.toc, 0)
		}, false, `/etc/passwd`},
		{"duplicate path", func(t *testing.T, r rawLayer) ([]byte, digest.Digest) {
			r.setName(t, "/data/dupB", "dupA")
			return seal(t, r.data, r.toc, 0)
		}, false, "duplicated"},
		{"hard link escape", func(t *testing.T, r rawLayer) ([]byte, digest.Digest) {
			r.setLink(t, "/data/hl", "../../../../etc/shd")
			return seal(t, r.data, r.toc, 0)
		}, false, "bad hard-link target"},
		{"absurd size", func(t *testing.T, r rawLayer) ([]byte, digest.Digest) {
			binary.LittleEndian.PutUint64(r.rec(t, "/data/big")[eSize:], 1<<60)
			return seal(t, r.data, r.toc, 0)
		}, false, "chunks cover"},
		{"footer outside the blob", func(t *testing.T, r rawLayer) ([]byte, digest.Digest) {
			return seal(t, r.data, r.toc, 1<<40)
		}, false, "does not end at the footer"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			blob, res, tocDigest := honestLayer(t, i)
			raw := splitBlob(t, blob, tocDigest)
			raw.toc = append([]byte(nil), raw.toc...)
			raw.dec, _ = layerfmt.DecodeTOC(blob[len(raw.data)+8:len(blob)-footerSize], "")
			bad, badTOC := tc.tamper(t, raw)
			badRes := *res
			badRes.Digest, badRes.Size = digest.FromBytes(bad), int64(len(bad))
			badRes.TOCDigest = badTOC
			img := pushBlobs(t, env, fmt.Sprintf("rel/hostile-%d:1", i), [][]byte{bbBlob, bad}, []*layerfmt.WriteResult{bbRes, &badRes})
			image := env.Pull(t, img.Ref, "envsnap")
			lazy := false
			for _, l := range envsnapStatus(t, env).Layers {
				if l.Digest == badRes.Digest && l.Mounted {
					lazy = true
				}
			}
			if lazy != tc.lazy {
				t.Fatalf("hostile layer served lazily: %v, want %v\n%s", lazy, tc.lazy, env.Envsnap.LogTail(20))
			}
			if line := env.Envsnap.LogLine("cannot serve layer lazily", badRes.Digest.String()); !strings.Contains(line, tc.reason) {
				t.Errorf("no reason logged for refusing %s:\n%s", badRes.Digest, env.Envsnap.LogTail(15))
			} else {
				t.Logf("refused: %s", line[strings.LastIndex(line, badRes.Digest.String()+": ")+len(badRes.Digest.String())+2:])
			}
			// The fallback unpacked the honest tar stream.
			args := []string{"/bin/sh", "-c", "sha256sum /data/aa /data/dupA /data/dupB /data/big; cat /data/esc; ls /etc/passwd /etc/shd 2>&1; true"}
			out := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: args})
			for _, f := range honest[:5] {
				if f.Path == "/data/ZetcZpasswd" {
					continue
				}
				if !strings.Contains(out.Stdout, f.Digest().Encoded()) {
					t.Errorf("%s not the honest file: %q %q", f.Path, out.Stdout, out.Stderr)
				}
			}
			if strings.Contains(out.Stdout, "host secret") {
				t.Errorf("symlink escaped the rootfs: %q", out.Stdout)
			}
		})
		if exited, err := env.Envsnap.Exited(); exited {
			t.Fatalf("daemon exited on %s: %v", tc.name, err)
		}
	}

	t.Run("zstd bomb frame", func(t *testing.T) {
		// The last data frame is replaced by one that inflates to 1 GiB
		// of zeros; the TOC still declares the honest small size and
		// carries the bomb's digest, so only the decompression limit
		// stands between the daemon and 1 GiB of memory.
		blob, res, tocDigest := honestLayer(t, len(cases))
		raw := splitBlob(t, blob, tocDigest)
		raw.toc = append([]byte(nil), raw.toc...)
		nf := int(le32(raw.toc, 24))
		n, nc := int(le32(raw.toc, 16)), int(le32(raw.toc, 20))
		frames := raw.toc[tocHeaderSize+n*entryRecSize+nc*24:]
		last := frames[(nf-1)*frameRecSize:][:frameRecSize]
		off := binary.LittleEndian.Uint64(last[0:])
		var bomb bytes.Buffer
		zw, err := zstd.NewWriter(&bomb, zstd.WithEncoderLevel(zstd.SpeedFastest))
		if err != nil {
			t.Fatal(err)
		}
		zeros := make([]byte, 1<<20)
		for range 1024 {
			zw.Write(zeros)
		}
		zw.Close()
		binary.LittleEndian.PutUint32(last[8:], uint32(bomb.Len()))
		sum := sha256.Sum256(bomb.Bytes())
		copy(last[16:48], sum[:])
		binary.LittleEndian.PutUint64(raw.toc[56:], off+uint64(bomb.Len())) // data end
		data := append(append([]byte(nil), raw.data[:off]...), bomb.Bytes()...)
		bad, badTOC := seal(t, data, raw.toc, 0)
		badRes := *res
		badRes.Digest, badRes.Size, badRes.TOCDigest = digest.FromBytes(bad), int64(len(bad)), badTOC
		img := pushBlobs(t, env, "rel/hostile-bomb:1", [][]byte{bbBlob, bad}, []*layerfmt.WriteResult{bbRes, &badRes})
		image := env.Pull(t, img.Ref, "envsnap")
		// Read every file: those in the bomb frame fail, none is wrong.
		var args []string
		for _, f := range honest[:6] {
			args = append(args, f.Path)
		}
		out := env.RunContainer(t, image, testenv.RunOptions{Snapshotter: "envsnap", Args: append([]string{"sha256sum"}, args...)})
		if !strings.Contains(out.Stderr, "Input/output error") {
			t.Errorf("bomb frame read without EIO: exit %d stdout %q stderr %q", out.ExitCode, out.Stdout, out.Stderr)
		}
		if line := env.Envsnap.LogLine("level=error"); line != "" {
			t.Logf("daemon: %s", line)
		}
		for _, line := range strings.Split(strings.TrimSpace(out.Stdout), "\n") {
			sum, p, _ := strings.Cut(line, "  ")
			for _, f := range honest {
				if f.Path == p && sum != f.Digest().Encoded() {
					t.Errorf("WRONG BYTES for %s: %s", p, sum)
				}
			}
		}
	})

	hwm := vmHWM(t, env.Envsnap.PID())
	t.Logf("daemon peak RSS (VmHWM) after the hostile layers: %d MiB", hwm>>20)
	if hwm > 300<<20 {
		t.Errorf("daemon peak RSS %d MiB: a hostile layer made it allocate", hwm>>20)
	}
	if exited, err := env.Envsnap.Exited(); exited {
		t.Fatalf("daemon exited: %v", err)
	}
}

func convertTar(t *testing.T, env *testenv.Env, tb []byte) ([]byte, *layerfmt.WriteResult) {
	t.Helper()
	var blob bytes.Buffer
	res, err := layerfmt.Convert(env.Context(), &blob, bytes.NewReader(tb))
	if err != nil {
		t.Fatal(err)
	}
	return blob.Bytes(), res
}

// dataTar is the honest data layer: files, a hard link /data/hl to
// /data/hl-target-abcd, and a symlink /data/esc pointing far above the
// root at a host file.
func dataTar(t *testing.T, files []testenv.File, hostFile string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := func(h *tar.Header) {
		h.ModTime = time.Unix(1e9, 0)
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
	}
	hdr(&tar.Header{Typeflag: tar.TypeDir, Name: "data/", Mode: 0o755})
	for _, f := range files {
		b, err := io.ReadAll(f.Reader())
		if err != nil {
			t.Fatal(err)
		}
		hdr(&tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(f.Path, "/"), Mode: 0o644, Size: int64(len(b))})
		tw.Write(b)
	}
	hdr(&tar.Header{Typeflag: tar.TypeLink, Name: "data/hl", Linkname: "data/hl-target-abcd"})
	hdr(&tar.Header{Typeflag: tar.TypeSymlink, Name: "data/esc", Linkname: "/../../../.." + hostFile})
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// vmHWM returns a process's peak resident set size in bytes.
func vmHWM(t testing.TB, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb int64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}
