package fetch

import (
	"bytes"
	"context"
	"math/rand/v2"
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
			got, err := fx.layer.ReadChunk(context.Background(), c)
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
