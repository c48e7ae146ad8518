// Package peers runs the peer tier end to end: several "nodes" on one
// machine, each a network namespace with its own containerd and envsnap
// daemon (state roots and sockets apart), the namespaces joined by a
// bridge, reading lazily from one registry.
package peers

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/envsnap/envsnap/bench/netshape"
	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/peer"
	"github.com/envsnap/envsnap/internal/peer/peertest"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

type node struct {
	env  *testenv.Env
	peer string // host:port of its peer server, on its namespace's address
}

// peerPort is where every node's peer server listens: each node has a
// network namespace of its own, so all use the daemon's default port.
const peerPort = "9168"

var clusters atomic.Int64

// startNodes starts n nodes whose daemons are peers of each other, each
// node's containerd and envsnap daemon in a network namespace of its own,
// the namespaces joined by a bridge. All read from node 0's registry,
// served on the bridge's address in the root namespace, which runs behind
// regNet when given. via, when set, gives the address the other nodes
// reach node j at (a proxy in front of its peer server, listening on the
// bridge's address).
func startNodes(t *testing.T, n int, regNet devenv.RegistryNetwork, via func(br *netshape.Bridge, j int, addr string) string) []*node {
	t.Helper()
	testenv.RequireRoot(t)
	br, err := netshape.NewBridge(context.Background(), fmt.Sprintf("%speers-%d-%d", netshape.NamePrefix, os.Getpid(), clusters.Add(1)), n)
	if err != nil {
		prereq.Missing(t, "network namespaces on a bridge (ip netns, veth, bridge): %v", err)
	}
	// Registered before the nodes, so it runs after their daemons stop.
	t.Cleanup(func() {
		if err := br.Close(context.Background()); err != nil {
			t.Error(err)
		}
	})
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("e2e-peer-token-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var members []string
	for _, bn := range br.Nodes {
		members = append(members, net.JoinHostPort(bn.Addr.String(), peerPort))
	}
	var nodes []*node
	for i := range n {
		quoted := make([]string, n)
		for j, m := range members {
			if via != nil && j != i {
				m = via(br, j, m)
			}
			quoted[j] = strconv.Quote(m)
		}
		// No advertise: the daemon finds itself in the list by its
		// namespace's address, as a DaemonSet pod does.
		// No background fill: the test counts what reads cost. The hedge
		// waits longer than the default: on this shared 2-core machine an
		// owner running 4 daemons' worth of work may take longer than
		// 200 ms to accept, and each hedge sends a stripe twice.
		cfg := fmt.Sprintf(`fill = false
native_lowers = false
[peers]
enabled = true
listen = ":%s"
members = [%s]
token_file = %q
hedge_after = "2s"
bad_for = "1m"
`, peerPort, strings.Join(quoted, ", "), token)
		p := filepath.Join(dir, fmt.Sprintf("node%d.toml", i))
		if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
			t.Fatal(err)
		}
		opts := []testenv.Option{testenv.WithEnvsnap("--config", p), devenv.WithNetNS(br.Nodes[i].Path())}
		if i == 0 {
			opts = append(opts, devenv.WithRegistryListenIP(br.HostAddr.String()))
			if regNet != nil {
				opts = append(opts, devenv.WithRegistryNetwork(regNet))
			}
		}
		env := testenv.New(t, opts...)
		nodes = append(nodes, &node{env: env, peer: members[i]})
	}
	for _, nd := range nodes[1:] {
		testenv.WriteHostsDir(t, nd.env.HostsDir, nodes[0].env.Registry.Host)
	}
	t.Logf("%d nodes in network namespaces on bridge %s (%s): peers %s; registry at %s", n, br.Name, br.Prefix, strings.Join(members, " "), nodes[0].env.Registry.Host)
	return nodes
}

// metric sums the samples of a metric on a node's status socket.
func (nd *node) metric(t *testing.T, name string) float64 { return nd.metricWith(t, name, "") }

// metricWith sums the samples of a metric whose labels contain label.
func (nd *node) metricWith(t *testing.T, name, label string) float64 {
	t.Helper()
	sock := daemon.StatusSocket(nd.env.SnapshotterSocket)
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Get("http://envsnap/metrics")
	if err != nil {
		t.Fatalf("metrics of %s: %v", nd.peer, err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) || (len(line) > len(name) && line[len(name)] != ' ' && line[len(name)] != '{') || !strings.Contains(line, label) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			t.Fatalf("metric line %q", line)
		}
		sum += v
	}
	return sum
}

func digestOf(f testenv.File) string {
	h := sha256.New()
	io.Copy(h, f.Reader())
	return hex.EncodeToString(h.Sum(nil))
}

// readAll runs a container of ref on nd that hashes files, and checks the
// hashes.
func (nd *node) readAll(t *testing.T, ref string, files []testenv.File) error {
	img, err := nd.env.Env.Pull(nd.env.Context(), ref, "envsnap")
	if err != nil {
		return fmt.Errorf("node %s pull %s: %w", nd.peer, ref, err)
	}
	args := []string{"sha256sum"}
	for _, f := range files {
		args = append(args, f.Path)
	}
	res, err := nd.env.Run(nd.env.Context(), img, testenv.RunOptions{Snapshotter: "envsnap", Args: args, Timeout: 3 * time.Minute})
	if err != nil {
		return fmt.Errorf("node %s run %s: %w", nd.peer, ref, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("node %s: sha256sum exited %d: %s", nd.peer, res.ExitCode, res.Stderr)
	}
	for _, f := range files {
		if want := digestOf(f) + "  " + f.Path; !strings.Contains(res.Stdout, want) {
			return fmt.Errorf("node %s: %s read wrong (want %q in %q)", nd.peer, f.Path, want, res.Stdout)
		}
	}
	return nil
}

// 16 environments from two images sharing a base group, 4 per node on 4
// nodes, all at once: the registry sends about the union of what they
// read, not four times it, and every byte is right. Then a request
// without the token is refused by every node.
func TestPeersSixteenEnvironments(t *testing.T) {
	testenv.RequireRoot(t)
	// The registry behind a 1 Gbit/s link with a 20 ms round trip, the
	// link the project is measured on.
	link, err := netshape.NewLink(context.Background(), netshape.WithLinkRate(1e9), netshape.WithName(fmt.Sprintf("envsnap-peers-%d", os.Getpid())))
	if err != nil {
		prereq.Missing(t, "shaped link (ip netns, veth, tc): %v", err)
	}
	t.Cleanup(func() { link.Close(context.Background()) })
	regNet := netshape.NewRegistryNet(context.Background(), link, 20*time.Millisecond)
	nodes := startNodes(t, 4, regNet, nil)
	t.Logf("registry link: %s (htb shaped: %v)", regNet.Describe(), link.Shaped)
	reg := nodes[0].env
	var base []testenv.File
	for i := range 3 {
		base = append(base, testenv.RandomFile(fmt.Sprintf("/base/lib%d.so", i), 3<<20+int64(i)*4097, int64(10+i)))
	}
	taskA := []testenv.File{testenv.RandomFile("/task/a.bin", 3<<20, 21)}
	taskB := []testenv.File{testenv.RandomFile("/task/b.bin", 3<<20, 22)}
	imgA := reg.PushImageLayers(t, "peers/env-a:1", [][]testenv.File{base, taskA}, testenv.WithLazyLayers())
	imgB := reg.PushImageLayers(t, "peers/env-b:1", [][]testenv.File{base, taskB}, testenv.WithLazyLayers())
	images := []struct {
		ref   string
		files []testenv.File
	}{{imgA.Ref, append(append([]testenv.File(nil), base...), taskA...)}, {imgB.Ref, append(append([]testenv.File(nil), base...), taskB...)}}

	// Every node pulls (mounts) both first, as nodes starting an
	// iteration's environments do: owners serve layers they have open.
	for _, nd := range nodes {
		for _, im := range images {
			if _, err := nd.env.Env.Pull(nd.env.Context(), im.ref, "envsnap"); err != nil {
				t.Fatal(err)
			}
		}
	}
	reg.Registry.ResetCounters()

	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i, nd := range nodes {
		wg.Go(func() {
			for k := range 4 {
				im := images[(i+k)%2]
				if err := nd.readAll(t, im.ref, im.files); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}

	registry := float64(reg.Registry.BlobBytesServed())
	var needed, union, fetched, served, hedges float64
	for _, nd := range nodes {
		n := nd.metric(t, "envsnap_fetch_registry_bytes_total") + nd.metric(t, "envsnap_peer_fetched_bytes_total")
		needed += n
		union = max(union, n)
		fetched += nd.metric(t, "envsnap_peer_fetched_bytes_total")
		served += nd.metric(t, "envsnap_peer_served_bytes_total")
		hedges += nd.metric(t, "envsnap_peer_hedges_total")
	}
	// Every node read everything, so what one node needed (from the
	// registry and from peers) is the union of what they read; what all
	// needed in all is what the registry would send without peers.
	t.Logf("registry sent %.0f bytes; union of reads %.0f; all nodes needed %.0f (%.2fx, the registry's bytes without peers); from peers %.0f, served %.0f, %.0f hedges",
		registry, union, needed, needed/union, fetched, served, hedges)
	t.Logf("registry bytes / union: %.2f", registry/union)
	if registry > 1.1*union {
		t.Errorf("registry sent %.2fx the union of reads, want <= 1.1x", registry/union)
	}
	if needed < 3.5*union || fetched == 0 || fetched != served {
		t.Errorf("nodes needed %.2fx the union, fetched %.0f from peers, peers served %.0f", needed/union, fetched, served)
	}

	// The status command reports the tier.
	out, err := nodes[1].env.EnvsnapCLI("status", "--address", nodes[1].env.SnapshotterSocket)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "peers: 4 members, 0 bad now; fetched ") {
		t.Errorf("status has no peers line:\n%s", out)
	}

	// No credentials, nothing served.
	for _, nd := range nodes {
		resp, err := http.Post("http://"+nd.peer+"/v1/frames", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || len(b) != 0 {
			t.Errorf("node %s answered a request without credentials with %d and %d bytes", nd.peer, resp.StatusCode, len(b))
		}
	}
}

// The owner of hot stripes is killed (SIGKILL) while other nodes read
// them: every read succeeds. Restarted, it serves again.
func TestPeersOwnerKilledMidRead(t *testing.T) {
	nodes := startNodes(t, 3, nil, nil)
	reg := nodes[0].env
	var files []testenv.File
	for i := range 4 {
		files = append(files, testenv.RandomFile(fmt.Sprintf("/hot/f%d", i), 3<<20, int64(30+i)))
	}
	img := reg.PushImageLayers(t, "peers/hot:1", [][]testenv.File{files}, testenv.WithLazyLayers())
	for _, nd := range nodes {
		if _, err := nd.env.Env.Pull(nd.env.Context(), img.Ref, "envsnap"); err != nil {
			t.Fatal(err)
		}
	}
	// The owner of the layer's first stripe dies; the other two read.
	var members []string
	for _, nd := range nodes {
		members = append(members, nd.peer)
	}
	owner := peer.Owner(peer.StripeKey(img.Layers[len(img.Layers)-1].Digest, 0), members)
	var victim *node
	var readers []*node
	for _, nd := range nodes {
		if nd.peer == owner {
			victim = nd
		} else {
			readers = append(readers, nd)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, nd := range readers {
		wg.Go(func() {
			if err := nd.readAll(t, img.Ref, files); err != nil {
				errs <- err
			}
		})
	}
	// Kill it once it has served something: mid-read for its peers.
	deadline := time.Now().Add(2 * time.Minute)
	var served float64
	for served == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		served = victim.metric(t, "envsnap_peer_served_bytes_total")
	}
	victim.env.Envsnap.Kill()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	marks := readers[0].metric(t, "envsnap_peer_bad_marks_total") + readers[1].metric(t, "envsnap_peer_bad_marks_total")
	t.Logf("victim served %.0f bytes before the kill; bad marks after it: %.0f", served, marks)
	if marks == 0 {
		t.Errorf("no reader noticed the dead owner: the kill came after the reads")
	}

	// Restarted, it takes over its mounts and answers peers again.
	victim.env.StartEnvsnap(t)
	resp, err := http.Post("http://"+victim.peer+"/v1/frames", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatalf("restarted node does not serve peers: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("restarted node answered %d", resp.StatusCode)
	}
}

// Every node reaches the others through a proxy that corrupts what they
// send: the requesters detect it, mark the peers bad, and read from the
// registry; every byte is right, and nothing wrong was cached (a second
// environment reads the same files right again).
func TestPeersCorruptingPeerBypassed(t *testing.T) {
	proxies := map[int]string{}
	nodes := startNodes(t, 3, nil, func(br *netshape.Bridge, j int, addr string) string {
		if _, ok := proxies[j]; !ok {
			proxies[j] = peertest.CorruptingProxy(t, br.HostAddr.String(), addr)
		}
		return proxies[j]
	})
	reg := nodes[0].env
	var files []testenv.File
	for i := range 4 {
		files = append(files, testenv.RandomFile(fmt.Sprintf("/c/f%d", i), 3<<20, int64(40+i)))
	}
	img := reg.PushImageLayers(t, "peers/corrupt:1", [][]testenv.File{files}, testenv.WithLazyLayers())
	for _, nd := range nodes {
		if _, err := nd.env.Env.Pull(nd.env.Context(), img.Ref, "envsnap"); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(nodes))
	for _, nd := range nodes {
		wg.Go(func() {
			for range 2 {
				if err := nd.readAll(t, img.Ref, files); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	var corrupt, marks, fetched float64
	for _, nd := range nodes {
		corrupt += nd.metricWith(t, "envsnap_peer_request_outcomes_total", `outcome="corrupt"`)
		marks += nd.metric(t, "envsnap_peer_bad_marks_total")
		fetched += nd.metric(t, "envsnap_peer_fetched_bytes_total")
	}
	t.Logf("corrupt answers %.0f, bad marks %.0f, bytes accepted from peers %.0f", corrupt, marks, fetched)
	if corrupt == 0 || marks == 0 || fetched != 0 {
		t.Errorf("corrupt answers %.0f, bad marks %.0f, bytes accepted from peers %.0f: want corruption detected and nothing accepted", corrupt, marks, fetched)
	}
}
