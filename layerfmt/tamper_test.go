package layerfmt

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"sort"
	"testing"
)

func typedErr(err error) bool {
	for _, e := range []error{ErrNotLayer, ErrBadFooter, ErrBadTOC, ErrDigestMismatch, ErrTruncated} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// readAll reads every regular file of the layer in blob through a Reader;
// it returns the contents, or the first error.
func readAll(blob []byte, expect bool, tocDigest string) (map[string][]byte, error) {
	var exp = ""
	if expect {
		exp = tocDigest
	}
	r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), digestFromString(exp))
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	t := r.TOC()
	for i := 0; i < t.Len(); i++ {
		if t.Type(i) != TypeReg {
			continue
		}
		b := make([]byte, t.Size(i))
		if _, err := r.ReadFileAt(i, b, 0); err != nil && !(errors.Is(err, io.EOF) && len(b) == 0) {
			return nil, err
		}
		out[t.Name(i)] = b
	}
	return out, nil
}

// TestTamper flips bytes across the chunk frames, the TOC and the footer:
// every flip must give a typed error, never different bytes.
func TestTamper(t *testing.T) {
	blob, res := convert(t, synthTar(t), WithChunkSize(64<<10))
	want, err := readAll(blob, true, res.TOCDigest.String())
	if err != nil {
		t.Fatal(err)
	}
	r, _ := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	toc := r.TOC()
	// Chunk frames: every byte some chunk's digest covers.
	type span struct{ lo, hi int64 }
	var frames []span
	seen := map[int64]bool{}
	for i := 0; i < toc.Len(); i++ {
		for _, c := range toc.Chunks(i) {
			if !seen[c.Offset] {
				seen[c.Offset] = true
				frames = append(frames, span{c.Offset, c.Offset + c.CompressedSize})
			}
		}
	}
	sort.Slice(frames, func(a, b int) bool { return frames[a].lo < frames[b].lo })
	var chunkPos []int64
	for k, f := range frames {
		// first, middle and last byte of a sample of frames
		if k%3 == 0 || f.hi-f.lo > 1000 {
			chunkPos = append(chunkPos, f.lo, (f.lo+f.hi)/2, f.hi-1)
		}
	}
	size := int64(len(blob))
	tocOff := size - FooterSize - res.TOCSize
	regions := map[string][]int64{"chunks": chunkPos}
	for k := int64(0); k < 60; k++ {
		regions["toc"] = append(regions["toc"], tocOff-skippableHeaderSize+k*(res.TOCSize+skippableHeaderSize-1)/59)
	}
	for p := size - FooterSize; p < size; p++ {
		regions["footer"] = append(regions["footer"], p)
	}
	for name, positions := range regions {
		t.Run(name, func(t *testing.T) {
			for _, p := range positions {
				for _, expect := range []bool{true, false} {
					bad := bytes.Clone(blob)
					bad[p] ^= 0x5a
					got, err := readAll(bad, expect, res.TOCDigest.String())
					if err != nil {
						if !typedErr(err) {
							t.Errorf("flip at %d (expect=%v): untyped error %v", p, expect, err)
						}
						continue
					}
					// Accepted: then the flip must not have changed any byte served.
					if !equalContents(got, want) {
						t.Fatalf("flip at %d (expect=%v): wrong bytes served", p, expect)
					}
					if name != "toc" || expect {
						t.Errorf("flip at %d in %s (expect=%v) went unnoticed", p, name, expect)
					}
				}
			}
		})
	}
	// Truncation.
	for _, cut := range []int64{1, FooterSize, FooterSize + res.TOCSize/2, size / 2} {
		if _, err := readAll(blob[:size-cut], true, res.TOCDigest.String()); !typedErr(err) {
			t.Errorf("truncated by %d: %v", cut, err)
		}
		// A reader that believes the old size sees a short blob.
		if _, err := NewReader(bytes.NewReader(blob[:size-cut]), size, res.TOCDigest); !errors.Is(err, ErrTruncated) {
			t.Errorf("short reader by %d: %v", cut, err)
		}
	}
	if _, err := NewReader(bytes.NewReader(blob), size, digestFromString("sha256:"+fmt.Sprintf("%064x", 1))); !errors.Is(err, ErrDigestMismatch) {
		t.Errorf("wrong expected TOC digest: %v", err)
	}
	if _, err := NewReader(bytes.NewReader([]byte("not a layer at all, just some text long enough to hold a footer.................")), 84, ""); !errors.Is(err, ErrNotLayer) {
		t.Errorf("plain bytes: %v", err)
	}
}

func equalContents(a, b map[string][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if !bytes.Equal(v, b[k]) {
			return false
		}
	}
	return true
}

var _ fs.FS = (*Reader)(nil)

// countingReaderAt counts ReadAt calls.
type countingReaderAt struct {
	r     *bytes.Reader
	calls int
}

func (c *countingReaderAt) ReadAt(p []byte, off int64) (int, error) {
	c.calls++
	return c.r.ReadAt(p, off)
}

func TestMetadataReads(t *testing.T) {
	for _, tc := range []struct {
		name      string
		in        []byte
		wantCalls int
	}{
		{"small TOC", smallTar(t), 1},
		{"large TOC", manyFilesTar(t, 30000), 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			blob, res := convert(t, tc.in)
			c := &countingReaderAt{r: bytes.NewReader(blob)}
			if _, err := NewReader(c, int64(len(blob)), res.TOCDigest); err != nil || c.calls != tc.wantCalls {
				t.Errorf("NewReader: %v after %d ReadAt calls, want %d", err, c.calls, tc.wantCalls)
			}
			// With the size annotation, one exact read suffices.
			n := TailSize(res.TOCSize)
			if _, err := DecodeTail(blob[int64(len(blob))-n:], int64(len(blob)), res.TOCDigest); err != nil {
				t.Errorf("DecodeTail: %v", err)
			}
			if _, err := DecodeTail(blob[int64(len(blob))-n+1:], int64(len(blob)), res.TOCDigest); !errors.Is(err, ErrTruncated) {
				t.Errorf("DecodeTail of a short tail: %v", err)
			}
		})
	}
}
