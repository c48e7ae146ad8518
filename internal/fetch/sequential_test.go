package fetch

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// TestSequentialReadAhead: a reader going through a large file chunk by
// chunk meets the registry in a few growing windows fetched ahead of it,
// not once per read-ahead; a reader jumping around the file issues no
// window at all (same requests as with windows off).
func TestSequentialReadAhead(t *testing.T) {
	r := rand.New(rand.NewPCG(81, 82))
	big := testFile{"big.bin", randBytes(r, 3<<20)}
	read := func(t *testing.T, seq int64, order func(n int) []int) int {
		checkGoroutines(t)
		fx := newLayerFixture(t, nil, []testFile{big}, WithFill(false), WithReadAhead(128<<10), WithSequentialReadAhead(seq), WithFrameCache(0))
		fx.reg.setLatency(20 * time.Millisecond)
		cs := fx.chunksOf(t, "big.bin")
		for _, k := range order(len(cs)) {
			c := cs[k]
			got, err := readChunk(fx.layer, c)
			if err != nil || !bytes.Equal(got, big.data[c.FileOffset:c.FileOffset+c.Size]) {
				t.Fatalf("chunk %d: %v", k, err)
			}
		}
		// Windows in flight when the reader stops still count.
		fx.layer.Close()
		return fx.reg.requests()
	}
	inOrder := func(n int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = i
		}
		return out
	}
	// Every 8th chunk: 512 KiB apart, more than read-ahead and the
	// largest hole bridged.
	strided := func(n int) []int {
		var out []int
		for i := 0; i < n; i += 8 {
			out = append(out, i)
		}
		return out
	}
	plain, windows := read(t, 0, inOrder), read(t, 1<<20, inOrder)
	t.Logf("sequential read of %d MiB: %d requests without windows, %d with", len(big.data)>>20, plain, windows)
	if windows*2 > plain {
		t.Errorf("sequential reader: %d requests with windows, %d without; want at most half", windows, plain)
	}
	if p, w := read(t, 0, strided), read(t, 1<<20, strided); w != p {
		t.Errorf("strided reader: %d requests with windows, %d without; want the same", w, p)
	}
}

// TestDecodeAhead: once a reader goes from one chunk of a file to the
// next, the file's next chunks are fetched and decoded into the frame
// cache before it asks for them; a reader jumping around the file, or a
// layer with decoding ahead off, decodes nothing it did not ask for.
func TestDecodeAhead(t *testing.T) {
	r := rand.New(rand.NewPCG(83, 84))
	big := testFile{"big.bin", randBytes(r, 1<<20)}
	read := func(t *testing.T, fx *layerFixture, ks ...int) {
		t.Helper()
		cs := fx.chunksOf(t, "big.bin")
		for _, k := range ks {
			c := cs[k]
			got, err := readChunk(fx.layer, c)
			if err != nil || !bytes.Equal(got, big.data[c.FileOffset:c.FileOffset+c.Size]) {
				t.Fatalf("chunk %d: %v", k, err)
			}
		}
		fx.layer.settle()
	}
	decoded := func(t *testing.T, fx *layerFixture) []int {
		var ks []int
		for k, c := range fx.chunksOf(t, "big.bin") {
			if _, ok := fx.layer.frames.get(c.Digest); ok {
				ks = append(ks, k)
			}
		}
		return ks
	}
	newFixture := func(t *testing.T, opts ...LayerOption) *layerFixture {
		checkGoroutines(t)
		fx := newLayerFixture(t, nil, []testFile{big}, append([]LayerOption{WithFill(false), WithReadAhead(0)}, opts...)...)
		t.Cleanup(func() { fx.layer.Close() })
		return fx
	}

	t.Run("sequential", func(t *testing.T) {
		fx := newFixture(t)
		read(t, fx, 0)
		if got := decoded(t, fx); !slices.Equal(got, []int{0}) {
			t.Fatalf("after a first read: decoded %v, want [0]", got)
		}
		read(t, fx, 1)
		if got := decoded(t, fx); !slices.Equal(got, []int{0, 1, 2, 3}) {
			t.Fatalf("after reading 0 then 1: decoded %v, want [0 1 2 3]", got)
		}
		n := fx.reg.requests()
		read(t, fx, 2)
		if got := fx.reg.requests() - n; got != 1 {
			t.Errorf("reading chunk 2, decoded ahead: %d requests, want 1 (chunk 4 ahead)", got)
		}
		if got := decoded(t, fx); !slices.Equal(got, []int{0, 1, 2, 3, 4}) {
			t.Errorf("after reading 2: decoded %v, want [0 1 2 3 4]", got)
		}
	})
	t.Run("jumps", func(t *testing.T) {
		fx := newFixture(t)
		read(t, fx, 0, 5, 10, 3)
		if got := decoded(t, fx); !slices.Equal(got, []int{0, 3, 5, 10}) {
			t.Errorf("decoded %v, want only the chunks read", got)
		}
	})
	t.Run("off", func(t *testing.T) {
		fx := newFixture(t, WithDecodeAhead(0))
		read(t, fx, 0, 1, 2)
		if got := decoded(t, fx); !slices.Equal(got, []int{0, 1, 2}) {
			t.Errorf("decoded %v, want only the chunks read", got)
		}
	})
}
