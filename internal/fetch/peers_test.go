package fetch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/internal/chunkcache"
	"github.com/envsnap/envsnap/internal/peer"
	"github.com/envsnap/envsnap/internal/peer/peertest"
	"github.com/envsnap/envsnap/layerfmt"
)

// A cluster of nodes in one process: each node has its own chunk cache,
// Flights, Layer and a real peer server on a loopback port; one fake
// registry serves the blob and logs every range it sends.

type peerNode struct {
	addr    string
	cache   *chunkcache.Cache
	flights *Flights
	layer   *Layer
	client  *peer.Client
	metrics *peer.Metrics
	stop    context.CancelFunc
	done    chan struct{}
}

type peerCluster struct {
	reg   *fakeRegistry
	toc   *layerfmt.TOC
	blob  []byte
	nodes []*peerNode
	want  map[string][]byte
}

const peerFiles = 4

// peerLayerFiles makes a layer of several 4 MiB stripes (peer.StripeSize),
// so that ownership spreads over the nodes.
func peerLayerFiles() []testFile {
	r := rand.New(rand.NewPCG(7, 8))
	var fs []testFile
	for i := range peerFiles {
		fs = append(fs, testFile{fmt.Sprintf("f%d.bin", i), randBytes(r, 5<<19+i*4099)})
	}
	// A copy of the first file at the end, in another stripe: its frames
	// repeat earlier ones, which an owner fetches as the earlier spans.
	return append(fs, testFile{"dup.bin", fs[0].data})
}

func newPeerCluster(t *testing.T, n int, peers bool, sources func(i int, s peer.Source) peer.Source, extra ...LayerOption) *peerCluster {
	t.Helper()
	return newPeerClusterViews(t, n, peers, sources, nil, extra...)
}

// newPeerClusterViews is newPeerCluster where node i knows the members as
// view(i, members) lists them (nil: as they are).
func newPeerClusterViews(t *testing.T, n int, peers bool, sources func(i int, s peer.Source) peer.Source, view func(i int, members []string) []string, extra ...LayerOption) *peerCluster {
	t.Helper()
	tokFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokFile, []byte("0123456789abcdef-test-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tok, err := peer.NewToken(tokFile)
	if err != nil {
		t.Fatal(err)
	}
	files := peerLayerFiles()
	reg := newFakeRegistry(t)
	blob, toc := testLayer(t, 256<<10, files...)
	desc := reg.addBlob(blob)
	pc := &peerCluster{reg: reg, toc: toc, blob: blob, want: map[string][]byte{}}
	for _, f := range files {
		pc.want[f.name] = f.data
	}
	var (
		listeners []net.Listener
		members   []string
	)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		listeners = append(listeners, l)
		members = append(members, l.Addr().String())
	}
	for i := range n {
		cache, err := chunkcache.Open(t.TempDir(), 1<<30)
		if err != nil {
			t.Fatal(err)
		}
		br, err := NewBlobReader(hostsFor(nil, reg), testRef, desc, fastRetry)
		if err != nil {
			t.Fatal(err)
		}
		nd := &peerNode{addr: members[i], cache: cache, flights: NewFlights(), metrics: peer.NewMetrics(), done: make(chan struct{})}
		opts := append([]LayerOption{WithFlights(nd.flights), WithFill(false)}, extra...)
		if peers {
			known := members
			if view != nil {
				known = view(i, members)
			}
			nd.client, err = peer.NewClient(peer.Static(known), peer.Auth{Token: tok}, peer.Options{
				Self: members[i], BadFor: time.Minute,
				// These tests count registry bytes; on this shared
				// machine an owner can take longer than the default
				// hedge delay to show life, and a hedge sends a
				// stripe twice. Hedging has its own tests in
				// internal/peer. The timeout is the default: it counts
				// time without progress, and an owner fetching from
				// the registry reports progress, however long the
				// fetch takes under the race detector.
				HedgeAfter: 2 * time.Second,
			}, nd.metrics)
			if err != nil {
				t.Fatal(err)
			}
			opts = append(opts, WithPeers(nd.client))
		}
		nd.layer = NewLayer(br, toc, cache, opts...)
		var src peer.Source = nd.flights
		if sources != nil {
			src = sources(i, src)
		}
		srv, err := peer.NewServer(src, peer.Auth{Token: tok}, nd.metrics)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		nd.stop = cancel
		go func() {
			defer close(nd.done)
			srv.Serve(ctx, listeners[i])
		}()
		t.Cleanup(func() {
			cancel()
			<-nd.done
			nd.layer.Close()
		})
		pc.nodes = append(pc.nodes, nd)
	}
	return pc
}

// readAll reads every chunk of every file through node i and checks every
// byte.
func (pc *peerCluster) readAll(t *testing.T, i int, files []string) error {
	for _, name := range files {
		idx, ok := pc.toc.Lookup(name)
		if !ok {
			return fmt.Errorf("%s not in TOC", name)
		}
		for _, c := range pc.toc.Chunks(idx) {
			got, err := readChunk(pc.nodes[i].layer, c)
			if err != nil {
				return fmt.Errorf("node %d read %s at %d: %w", i, name, c.FileOffset, err)
			}
			if !bytes.Equal(got, pc.want[name][c.FileOffset:c.FileOffset+c.Size]) {
				return fmt.Errorf("node %d read %s at %d: wrong bytes", i, name, c.FileOffset)
			}
		}
	}
	return nil
}

// registryBytes sums the ranges the registry sent.
func (pc *peerCluster) registryBytes(t *testing.T) int64 {
	var n int64
	for _, r := range pc.reg.rangeLog() {
		a, b, ok := strings.Cut(strings.TrimPrefix(r, "bytes="), "-")
		first, err1 := strconv.ParseInt(a, 10, 64)
		last, err2 := strconv.ParseInt(b, 10, 64)
		if !ok || err1 != nil || err2 != nil {
			t.Fatalf("registry range %q", r)
		}
		n += last - first + 1
	}
	return n
}

// frameBytes is the compressed size of every frame of files, by place in
// the blob: what the union of all reads needs from the registry. (A frame
// repeated at two places is fetched at whichever a reader asks for
// first, so by digest the union would depend on the order of reads.)
func (pc *peerCluster) frameBytes(files []string) int64 {
	seen := map[int64]bool{}
	var n int64
	for _, name := range files {
		idx, _ := pc.toc.Lookup(name)
		for _, c := range pc.toc.Chunks(idx) {
			if !seen[c.Offset] {
				seen[c.Offset] = true
				n += c.CompressedSize
			}
		}
	}
	return n
}

func allFiles() []string {
	var out []string
	for i := range peerFiles {
		out = append(out, fmt.Sprintf("f%d.bin", i))
	}
	return out
}

// readEverywhere has every node read files at the same time.
func (pc *peerCluster) readEverywhere(t *testing.T, files []string) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(pc.nodes))
	for i := range pc.nodes {
		wg.Go(func() {
			// Each node reads in its own order, as different workloads
			// would, so that nodes miss the same stripes at different
			// moments and owners serve others' first requests.
			fs := append([]string(nil), files...)
			rand.New(rand.NewPCG(uint64(i), 1)).Shuffle(len(fs), func(a, b int) { fs[a], fs[b] = fs[b], fs[a] })
			errs[i] = pc.readAll(t, i, fs)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// Four nodes read the same layer at once: with peers the registry sends
// about the union of what they read; without, about four times it.
func TestPeersFetchOncePerCluster(t *testing.T) {
	files := allFiles()
	ratio := map[bool]float64{}
	var repeated, ranges []string
	for _, peers := range []bool{false, true} {
		pc := newPeerCluster(t, 4, peers, nil)
		pc.readEverywhere(t, files)
		union := pc.frameBytes(files)
		ratio[peers] = float64(pc.registryBytes(t)) / float64(union)
		if peers {
			ranges = pc.reg.rangeLog()
			seen := map[string]int{}
			for _, r := range pc.reg.rangeLog() {
				if seen[r]++; seen[r] == 2 {
					repeated = append(repeated, r)
				}
			}
		}
		if peers {
			var fetched, served, hedges int64
			outcomes := map[string]int64{}
			// An owner counts what it served after its last write, which
			// can be after the requester has read the bytes and returned:
			// give the handlers a moment to finish.
			for wait := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				fetched, served, hedges = 0, 0, 0
				clear(outcomes)
				for _, nd := range pc.nodes {
					s := nd.metrics.Stats(4)
					fetched += s.FetchedBytes
					served += s.ServedBytes
					hedges += s.Hedges
					for o, n := range s.Outcomes {
						outcomes[o] += n
					}
				}
				if fetched == served || time.Now().After(wait) {
					break
				}
			}
			t.Logf("peers: %d bytes fetched from peers, %d served, %d hedges, outcomes %v", fetched, served, hedges, outcomes)
			if fetched == 0 || fetched != served {
				t.Errorf("fetched %d bytes from peers, peers served %d: want equal and > 0", fetched, served)
			}
		}
	}
	t.Logf("registry bytes / union of reads: %.2f without peers, %.2f with", ratio[false], ratio[true])
	if ratio[true] > 1.1 {
		t.Errorf("with peers the registry sent %.2fx the union of reads, want <= 1.1x; ranges sent more than once: %v; all ranges: %v", ratio[true], repeated, ranges)
	}
	if ratio[false] < 3.5 {
		t.Errorf("without peers the registry sent %.2fx the union, want ~4x (the test would not show what peers save)", ratio[false])
	}
}

// ownerAndOther returns the node owning the layer's first stripe and
// another node.
func (pc *peerCluster) ownerAndOther() (owner, other int) {
	var members []string
	for _, nd := range pc.nodes {
		members = append(members, nd.addr)
	}
	o := peer.Owner(peer.StripeKey(pc.nodes[0].layer.blob.Descriptor().Digest, 0), members)
	for i, nd := range pc.nodes {
		if nd.addr == o {
			return i, (i + 1) % len(pc.nodes)
		}
	}
	panic("owner not a member")
}

// An owner that dies in the middle of the reads costs no read: its
// stripes go to the registry (and then to the next member).
func TestPeersOwnerDiesMidRead(t *testing.T) {
	pc := newPeerCluster(t, 3, true, nil)
	files := allFiles()
	owner, reader := pc.ownerAndOther()
	// The owner goes away after serving its first request: the reader
	// is in the middle of the first stripe.
	pc.reg.setLatency(10 * time.Millisecond)
	f0, _ := pc.toc.Lookup(files[0])
	first := pc.toc.Chunks(f0)[0]
	if _, err := readChunk(pc.nodes[reader].layer, first); err != nil {
		t.Fatal(err)
	}
	if s := pc.nodes[reader].metrics.Stats(3); s.Outcomes["hit"] != 1 {
		t.Fatalf("first read not served by the owner: %+v", s)
	}
	pc.nodes[owner].stop()
	<-pc.nodes[owner].done
	if err := pc.readAll(t, reader, files); err != nil {
		t.Fatal(err)
	}
	if bad := pc.nodes[reader].client.BadPeers(); len(bad) != 1 || bad[0] != pc.nodes[owner].addr {
		t.Errorf("bad peers %v, want the dead owner %s", bad, pc.nodes[owner].addr)
	}
}

// switchable serves frames with one byte flipped while corrupt says so.
type switchable struct {
	peer.Source
	corrupt func() bool
}

func (c *switchable) Frames(ctx context.Context, layer digest.Digest, frames []peer.Frame) (func() ([][]byte, error), error) {
	get, err := c.Source.Frames(ctx, layer, frames)
	if err != nil || !c.corrupt() {
		return get, err
	}
	return func() ([][]byte, error) {
		data, err := get()
		if err != nil {
			return nil, err
		}
		for i, b := range data {
			b = append([]byte(nil), b...)
			b[len(b)/2] ^= 0xff
			data[i] = b
		}
		return data, nil
	}, nil
}

// A peer sending wrong bytes is caught by the requester, marked bad, and
// the registry serves the read.
func TestPeersCorruptPeerBypassed(t *testing.T) {
	var corrupt int
	pc := newPeerCluster(t, 3, true, func(i int, s peer.Source) peer.Source {
		return &switchable{Source: s, corrupt: func() bool { return i == corrupt }}
	})
	owner, reader := pc.ownerAndOther()
	corrupt = owner
	if err := pc.readAll(t, reader, allFiles()); err != nil {
		t.Fatal(err)
	}
	s := pc.nodes[reader].metrics.Stats(3)
	if s.Outcomes["corrupt"] == 0 || s.BadMarks == 0 {
		t.Errorf("corrupting peer not detected: %+v", s)
	}
	if bad := pc.nodes[reader].client.BadPeers(); len(bad) != 1 || bad[0] != pc.nodes[owner].addr {
		t.Errorf("bad peers %v, want [%s]", bad, pc.nodes[owner].addr)
	}
	// The corrupt bytes never reached the cache either.
	if err := pc.readAll(t, reader, allFiles()); err != nil {
		t.Fatal(err)
	}
}

// An owner asked for the same stripe by several nodes at once fetches it
// from the registry once.
func TestPeersOwnerSingleFlight(t *testing.T) {
	pc := newPeerCluster(t, 4, true, nil)
	pc.reg.setLatency(30 * time.Millisecond)
	// The last file (a copy of the first, whose frames the registry sends
	// once, as the first file's): no read-ahead past it, so the registry
	// should send its frames and nothing else, once.
	files := []string{"dup.bin"}
	var wg sync.WaitGroup
	for i := range pc.nodes {
		wg.Go(func() {
			if err := pc.readAll(t, i, files); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if got, union := pc.registryBytes(t), pc.frameBytes(files); float64(got) > 1.1*float64(union) {
		t.Errorf("registry sent %d bytes for %d bytes of frames read by 4 nodes at once", got, union)
		for i, nd := range pc.nodes {
			t.Logf("node %d: %+v", i, nd.metrics.Stats(4))
		}
		t.Logf("ranges: %v", pc.reg.rangeLog())
	}
}

// Background fill goes through the owners too: two nodes filling the same
// layer one after the other fetch it from the registry once.
func TestPeersFill(t *testing.T) {
	pc := newPeerCluster(t, 2, true, nil, WithFill(true), WithFillYield(false))
	for _, nd := range pc.nodes {
		nd.layer.StartFill(context.Background())
		waitFilled(t, nd.layer)
	}
	all := pc.frameBytes(allFiles())
	got := pc.registryBytes(t)
	// Which node owns which stripe depends on their (random) ports; the
	// peers served something either way.
	fetched := pc.nodes[0].metrics.Stats(2).FetchedBytes + pc.nodes[1].metrics.Stats(2).FetchedBytes
	t.Logf("registry sent %d bytes for %d bytes of frames; %d bytes came from peers", got, all, fetched)
	if float64(got) > 1.1*float64(all) || fetched == 0 {
		t.Errorf("two fills cost the registry %d bytes for %d bytes of frames (%d from peers)", got, all, fetched)
	}
	if err := pc.readAll(t, 1, allFiles()); err != nil {
		t.Fatal(err)
	}
}

// A peer asking for two frames far apart in the layer (here the last of
// one file and a frame that repeats the layer's first, which the owner
// fetches at its first place) costs the registry those frames, not the
// bytes between them. Seen in CI as 1.90x the union of reads, when a
// requester's read-ahead ran into dup.bin.
func TestPeersServeFarFrames(t *testing.T) {
	pc := newPeerCluster(t, 1, false, nil)
	last := pc.toc.Chunks(mustLookup(t, pc.toc, fmt.Sprintf("f%d.bin", peerFiles-1)))
	dup := pc.toc.Chunks(mustLookup(t, pc.toc, "dup.bin"))
	var frames []peer.Frame
	for _, c := range []layerfmt.Chunk{last[len(last)-1], dup[0]} {
		frames = append(frames, peer.Frame{Offset: c.Offset, Size: c.CompressedSize, Digest: c.Digest})
	}
	get, err := pc.nodes[0].flights.Frames(context.Background(), pc.nodes[0].layer.blob.Descriptor().Digest, frames)
	if err != nil {
		t.Fatal(err)
	}
	data, err := get()
	if err != nil {
		t.Fatal(err)
	}
	for i, fr := range frames {
		if fr.Digest.Algorithm().FromBytes(data[i]) != fr.Digest {
			t.Errorf("frame %d: wrong bytes", i)
		}
	}
	first := pc.toc.Chunks(mustLookup(t, pc.toc, "f0.bin"))[0]
	want := last[len(last)-1].CompressedSize + first.CompressedSize
	if got := pc.registryBytes(t); got != want {
		t.Errorf("registry sent %d bytes (%v) for two frames of %d bytes", got, pc.reg.rangeLog(), want)
	}
}

func mustLookup(t *testing.T, toc *layerfmt.TOC, name string) int {
	t.Helper()
	idx, ok := toc.Lookup(name)
	if !ok {
		t.Fatalf("%s not in TOC", name)
	}
	return idx
}

// Every node reaches the others through a proxy that corrupts what they
// send, as in tests/peers: each node marks the others bad and fails over
// to the next owner by rendezvous, which its own view of the members
// (itself by its address, the others by their proxies) picks differently
// from the others' views. Node A's failover can go to node B while B's
// own read of the frame fails over to A: an owner answering a peer must
// not wait for its own peer-bound read, or the two report progress to
// each other until the read timeout and the reads fail
// (TestPeersCorruptingPeerBypassed failed so, under load).
func TestPeersFailoverCycle(t *testing.T) {
	for round := range 3 {
		var proxies []string
		pc := newPeerClusterViews(t, 3, true, nil, func(i int, members []string) []string {
			if proxies == nil {
				for _, m := range members {
					proxies = append(proxies, peertest.CorruptingProxy(t, "127.0.0.1", m))
				}
			}
			view := []string{members[i]}
			for j, p := range proxies {
				if j != i {
					view = append(view, p)
				}
			}
			return view
		}, WithReadTimeout(10*time.Second))
		files := allFiles()
		var wg sync.WaitGroup
		errs := make([]error, len(pc.nodes))
		for i := range pc.nodes {
			wg.Go(func() { errs[i] = pc.readAll(t, i, files) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
	}
}
