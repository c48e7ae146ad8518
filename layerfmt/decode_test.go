package layerfmt

import (
	"bytes"
	"errors"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestDecodeVerifiedFrame: DecodeVerifiedFrame skips only the digest check
// (its caller has done it) and keeps every other check of DecodeFrame.
func TestDecodeVerifiedFrame(t *testing.T) {
	blob, res := convert(t, synthTar(t), WithChunkSize(64<<10))
	r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	if err != nil {
		t.Fatal(err)
	}
	toc := r.TOC()
	var c Chunk
	for i := 0; i < toc.Len() && c.Size == 0; i++ {
		if toc.NumChunks(i) > 0 {
			c = toc.Chunk(i, 0)
		}
	}
	if c.Size == 0 {
		t.Fatal("no chunk in the synthetic layer")
	}
	compressed := blob[c.Offset : c.Offset+c.CompressedSize]
	want, err := DecodeFrame(c, compressed, nil)
	if err != nil {
		t.Fatal(err)
	}

	otherDigest := c
	otherDigest.Digest = digest.FromString("something else")
	wrongSize := c
	wrongSize.FrameSize++
	wrongSize.Size = min(wrongSize.Size, wrongSize.FrameSize-wrongSize.FrameOffset)
	for _, tc := range []struct {
		name         string
		c            Chunk
		in           []byte
		wantErr      error // of DecodeVerifiedFrame
		wantFrameErr error // of DecodeFrame
	}{
		{name: "good frame", c: c, in: compressed},
		{name: "digest not checked", c: otherDigest, in: compressed, wantFrameErr: ErrDigestMismatch},
		{name: "truncated", c: c, in: compressed[:len(compressed)-1], wantErr: ErrTruncated, wantFrameErr: ErrTruncated},
		{name: "frame size differs from header", c: wrongSize, in: compressed, wantErr: ErrBadTOC, wantFrameErr: ErrBadTOC},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeVerifiedFrame(tc.c, tc.in, nil)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil && err != nil) {
				t.Fatalf("DecodeVerifiedFrame: err %v, want %v", err, tc.wantErr)
			}
			if tc.wantErr == nil && !bytes.Equal(got, want) {
				t.Fatal("DecodeVerifiedFrame returned other bytes than DecodeFrame")
			}
			_, err = DecodeFrame(tc.c, tc.in, nil)
			if !errors.Is(err, tc.wantFrameErr) || (tc.wantFrameErr == nil && err != nil) {
				t.Fatalf("DecodeFrame: err %v, want %v", err, tc.wantFrameErr)
			}
		})
	}
}

// FuzzDecodeVerifiedFrame: arbitrary bytes and sizes never panic, and a
// frame is returned only with exactly the size the chunk declares.
func FuzzDecodeVerifiedFrame(f *testing.F) {
	blob, res := convert(f, synthTar(f), WithChunkSize(64<<10))
	r, err := NewReader(bytes.NewReader(blob), int64(len(blob)), res.TOCDigest)
	if err != nil {
		f.Fatal(err)
	}
	if toc := r.TOC(); toc.Len() > 0 {
		for i := 0; i < toc.Len(); i++ {
			if toc.NumChunks(i) > 0 {
				c := toc.Chunk(i, 0)
				f.Add(blob[c.Offset:c.Offset+c.CompressedSize], c.FrameSize, c.FrameOffset, c.Size)
				break
			}
		}
	}
	f.Add([]byte{0x28, 0xb5, 0x2f, 0xfd}, int64(10), int64(0), int64(10))
	f.Fuzz(func(t *testing.T, in []byte, frameSize, frameOff, size int64) {
		c := Chunk{CompressedSize: int64(len(in)), FrameSize: frameSize, FrameOffset: frameOff, Size: size, Digest: digest.FromBytes(in)}
		out, err := DecodeVerifiedFrame(c, in, nil)
		if err == nil && int64(len(out)) != frameSize {
			t.Fatalf("decoded %d bytes, chunk declares %d", len(out), frameSize)
		}
	})
}
