package hostile_test

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/egress"
	"github.com/envsnap/envsnap/internal/lsm"
)

// nodeSide is what the episode's node serves that an agent would go for.
type nodeSide struct {
	arbiterSocket string // the arbiter's quota protocol
	metricsPort   int    // the arbiter's Prometheus metrics, on 127.0.0.1
	secretDir     string // a protected directory ([guard] protected)
}

// newNodeSide prepares the protected directory and picks the metrics
// port, before the stack starts.
func newNodeSide(t *testing.T) *nodeSide {
	t.Helper()
	n := &nodeSide{secretDir: t.TempDir()}
	if err := os.WriteFile(filepath.Join(n.secretDir, "answers.txt"), []byte(answersText), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n.metricsPort = l.Addr().(*net.TCPAddr).Port
	l.Close()
	return n
}

// results parses the agent's "<what> <target> <result>" lines.
func results(t *testing.T, out string) map[string]string {
	t.Helper()
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 {
			got[f[0]+" "+f[1]] = f[2]
		}
	}
	return got
}

// nodeSockets: the agent guesses the node's sockets, at their default
// paths, at the paths this node uses, and through /proc/1/root and
// /proc/self/root, and sends the arbiter a forged request on each guess.
func nodeSockets(t *testing.T, ep *episode, n *nodeSide) {
	env := ep.env
	guesses := []string{
		env.Address, env.Address + ".ttrpc", n.arbiterSocket,
		"/run/containerd/containerd.sock", arbiter.DefaultSocket,
		"/run/containerd-envsnap/containerd-envsnap.sock", "/var/run/docker.sock",
	}
	var paths []string
	for _, g := range guesses {
		paths = append(paths, g, "/proc/1/root"+g, "/proc/self/root"+g)
	}
	arbiterGuesses := []string{n.arbiterSocket, "/proc/1/root" + n.arbiterSocket, arbiter.DefaultSocket}
	res := ep.run(t, nil, "/agent connect "+strings.Join(paths, " ")+"; /agent arbiter "+strings.Join(arbiterGuesses, " "))
	got := results(t, res.Stdout)
	for _, p := range paths {
		if r := got["connect "+p]; r != "ENOENT" {
			t.Errorf("connect %s: %q, want ENOENT (the socket is not in the container's mount namespace)", p, r)
		}
	}
	for _, p := range arbiterGuesses {
		if r := got["arbiter "+p]; r != "ENOENT" {
			t.Errorf("forged arbiter request on %s: %q, want ENOENT", p, r)
		}
	}
	if t.Failed() {
		t.Logf("agent: stdout %q stderr %q", res.Stdout, res.Stderr)
	}
}

// arbiterMetrics: the arbiter's metrics port answers on the node's
// loopback; from the container's network namespace neither its loopback
// nor the node's addresses reach it.
func arbiterMetrics(t *testing.T, ep *episode, n *nodeSide) {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", n.metricsPort))
	if err != nil {
		t.Fatalf("the arbiter's metrics from the node: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the arbiter's metrics from the node: %s", resp.Status)
	}
	targets := []string{fmt.Sprintf("127.0.0.1:%d", n.metricsPort)}
	addrs, err := egress.NodeAddresses()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if a.Addr().Is4() && !a.Addr().IsLoopback() {
			targets = append(targets, fmt.Sprintf("%s:%d", a.Addr(), n.metricsPort))
		}
	}
	res := ep.run(t, nil, "/agent tcp "+strings.Join(targets, " "))
	got := results(t, res.Stdout)
	for _, a := range targets {
		switch r := got["tcp "+a]; r {
		case "ECONNREFUSED", "ENETUNREACH":
		default:
			t.Errorf("tcp %s from the container: %q, want refused or unreachable", a, r)
		}
	}
	t.Logf("from the container: %v", got)
}

// mountedInOnPurpose: a spec that bind-mounts the arbiter's and
// containerd's sockets and a protected directory into the container, as
// a mistaken pod spec would. The BPF LSM rules refuse the connects, the
// forged request and the opens, root or not; where the kernel does not
// run them the shim says so for the environment, and the mount
// namespace was the only barrier (which this spec removed).
func mountedInOnPurpose(t *testing.T, ep *episode, n *nodeSide) {
	mounts := oci.WithMounts([]specs.Mount{
		{Destination: "/node/arbiter.sock", Type: "bind", Source: n.arbiterSocket, Options: []string{"bind"}},
		{Destination: "/node/containerd.sock", Type: "bind", Source: ep.env.Address, Options: []string{"bind"}},
		{Destination: "/node/secret", Type: "bind", Source: n.secretDir, Options: []string{"rbind", "ro"}},
	})
	script := "/agent connect /node/arbiter.sock /node/containerd.sock /proc/self/root/node/arbiter.sock; " +
		"/agent arbiter /node/arbiter.sock; /agent open /node/secret/answers.txt /node/secret; cat /node/secret/answers.txt; true"
	res := ep.run(t, nil, script, mounts)
	got := results(t, res.Stdout)
	key := ep.env.Namespace + "/" + res.ID
	attempts := []string{
		"connect /node/arbiter.sock", "connect /node/containerd.sock", "connect /proc/self/root/node/arbiter.sock",
		"arbiter /node/arbiter.sock", "open /node/secret/answers.txt", "open /node/secret",
	}
	if line := ep.env.Containerd.LogLine("lsm: no BPF LSM rules", "env="+key+" "); line != "" {
		// The fallback: say what got through, and require that it was
		// reported for this environment.
		if on, list, err := lsm.Active(); err == nil {
			t.Logf("BPF LSM unavailable (bpf active: %v, LSMs %s): %s", on, list, line)
		}
		t.Logf("without BPF LSM rules, through the mounts: %v", got)
		return
	}
	for _, a := range attempts {
		if got[a] != "EPERM" {
			t.Errorf("%s: %q, want EPERM", a, got[a])
		}
	}
	if strings.Contains(res.Stdout, "42") {
		t.Errorf("the agent read the protected answers: %q", res.Stdout)
	}
	var line string
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && line == "" {
		line = ep.env.Containerd.LogLine("lsm: denied", "env="+key+" ", "kind=connect")
		time.Sleep(100 * time.Millisecond)
	}
	if line == "" {
		t.Errorf("no LSM denial logged for %s:\n%s", key, ep.env.Containerd.LogTail(40))
	}
}
