// Package egress_test runs environments under the envlet shim with egress
// allow-lists, in network namespaces the test wires up with veth pairs:
//
//	env netns ege1 ── veth ── netns egm (the "internet": a mirror, other
//	                               hosts, a resolver, a fake metadata
//	                               service on 169.254.169.254)
//	          └────── veth ── the node (this host's namespace: listeners on
//	                               9166, 9167, 10250 of the node address)
//
// and the same for a second environment, ege2, with another list.
package egress_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/egress"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

const (
	envletRuntime = "io.containerd.envlet.v2"
	greeting      = "envsnap-egress-ok" // probe.Greeting
	mirror        = "10.232.0.1"        // in egm: the allowed mirror (8080) and other ports
	otherHost     = "10.232.0.2"        // in egm: never allowed
	resolver      = "10.232.0.53"       // in egm: the node's configured resolver
	metadata      = "169.254.169.254"   // in egm: a stand-in for the cloud metadata service
	mirror6       = "fd00:232::1"       // in egm: the mirror over IPv6
)

// nodeAddr is the node-side address of environment i's link; nodeAddr6
// its IPv6 one.
func nodeAddr(i int) string  { return fmt.Sprintf("10.233.%d.1", i) }
func nodeAddr6(i int) string { return fmt.Sprintf("fd00:233:%d::1", i) }

// nodePorts are the node's own services an environment must not reach.
var nodePorts = []int{9166, 9167, 10250}

func TestEgressAllowList(t *testing.T) {
	testenv.RequireRoot(t)
	ipCmd, err := exec.LookPath("ip")
	if err != nil {
		prereq.Missing(t, "iproute2 (ip) is needed to wire network namespaces: %v", err)
	}
	dir := t.TempDir()
	probeBin := buildProbe(t, dir)
	n := newNet(t, ipCmd)

	// The internet side answers on the mirror's port and on others.
	mirrorSrv := testenv.StartProcess(t, dir, "egm-servers", nil, ipCmd, "netns", "exec", n.mirrorNS, probeBin,
		"serve", "tcp:22", "tcp:80", "tcp:443", "tcp:8080", "udp:"+resolver+":53", "udp:"+mirror+":53")
	// The node's services on the node-side address of each link.
	for i := 1; i <= 2; i++ {
		for _, p := range nodePorts {
			listenGreeting(t, net.JoinHostPort(nodeAddr(i), strconv.Itoa(p)))
			listenGreeting(t, net.JoinHostPort(nodeAddr6(i), strconv.Itoa(p)))
		}
	}

	// The arbiter's metrics port, given without a host as in the
	// DaemonSet: it must not be on the node's addresses.
	ports, err := devenv.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	metricsPort := ports[0]
	cfgPath := filepath.Join(dir, "envlet.toml")
	socket := filepath.Join(dir, "arbiter.sock")
	writeFile(t, cfgPath, fmt.Sprintf(`[policy]
arbiter-timeout = "1s"
report-period = "500ms"
[arbiter]
socket = %q
timeout = "1s"
[egress]
enforce = true
allow = ["%s:8080/tcp", "[%s]:8080/tcp"]
resolvers = [%q]
# The CRI pods below have no network but the node's (no CNI here): their
# sandboxes run, and the egress policy is what refuses their containers.
[guard]
allow-host-network = true
`, socket, mirror, mirror6, resolver))
	arb := testenv.StartProcess(t, dir, "arbiter", nil, testenv.Binary(t, "containerd-envsnap"),
		"arbiter", "--config", cfgPath, "--metrics-address", fmt.Sprintf(":%d", metricsPort))
	waitFor(t, 20*time.Second, "arbiter socket", func() bool {
		c, err := net.Dial("unix", socket)
		if err == nil {
			c.Close()
		}
		return err == nil
	}, arb.LogTail)

	targets := func(i int) []string {
		ts := []string{
			"tcp:" + mirror + ":8080", "tcp:" + mirror + ":22", "tcp:" + otherHost + ":443",
			"tcp:" + metadata + ":80",
			"udp:" + resolver + ":53", "udp:" + mirror + ":53",
			"tcp:[" + mirror6 + "]:8080", "tcp:[" + mirror6 + "]:22",
		}
		for _, p := range nodePorts {
			ts = append(ts, fmt.Sprintf("tcp:%s:%d", nodeAddr(i), p), fmt.Sprintf("tcp:[%s]:%d", nodeAddr6(i), p))
		}
		return append(ts, fmt.Sprintf("tcp:%s:%d", nodeAddr(i), metricsPort),
			"scan:"+mirror+":1-1024", "scan:"+mirror+":8000-8100", fmt.Sprintf("scan:%s:1-11000", nodeAddr(i)))
	}

	// Without a policy everything but the arbiter's loopback-only metrics
	// answers: what the environments cannot reach below is the policy's
	// doing, not the wiring's.
	for i := 1; i <= 2; i++ {
		var res results
		waitFor(t, 20*time.Second, "servers reachable before any policy", func() bool {
			out, err := exec.Command(ipCmd, "netns", "exec", n.envNS[i], probeBin, "run", "tcp:"+mirror+":8080").CombinedOutput()
			return err == nil && strings.Contains(string(out), "open ")
		}, mirrorSrv.LogTail)
		out, err := exec.Command(ipCmd, append([]string{"netns", "exec", n.envNS[i], probeBin, "run"}, targets(i)...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("probe in %s: %v\n%s", n.envNS[i], err, out)
		}
		res = parse(t, string(out))
		for _, tg := range targets(i) {
			if strings.HasPrefix(tg, "scan:") {
				continue
			}
			wantOpen := tg != fmt.Sprintf("tcp:%s:%d", nodeAddr(i), metricsPort)
			if res.open[tg] != wantOpen {
				t.Fatalf("without a policy, %s open=%v, want %v (is the wiring broken?)\n%s", tg, res.open[tg], wantOpen, out)
			}
		}
		if got := res.scan["scan:"+mirror+":1-1024"]; got != "22,80,443" {
			t.Fatalf("without a policy the scan of the mirror found %s, want 22,80,443", got)
		}
	}

	env := testenv.New(t, testenv.WithContainerdEnv("ENVLET_CONFIG="+cfgPath), testenv.WithConfig(criRuntime))
	bin, err := os.ReadFile(probeBin)
	if err != nil {
		t.Fatal(err)
	}
	img := env.Pull(t, env.PushImage(t, "egress/probe:1", []testenv.File{{Path: "/probe", Mode: 0o755, Data: bin}}).Ref, "overlayfs")

	// env 1 runs with the node's default list; env 2's annotation allows
	// more, including the node's and the metadata service's networks,
	// which stay denied anyway, and DNS to the mirror, which stays denied
	// because it is not the resolver.
	ann2 := fmt.Sprintf("%s:8080/tcp, %s:22/tcp, %s:*/udp, 169.254.0.0/16:*/tcp, 10.233.0.0/16:*/tcp, [fd00:232::/32]:*/tcp, [fd00:233::/32]:*/tcp", mirror, mirror, mirror)
	c1 := run(t, env, img, "egress-env1", netnsPath(n.envNS[1]), nil, append(targets(1), "hold:60s")...)
	c2 := run(t, env, img, "egress-env2", netnsPath(n.envNS[2]), map[string]string{egress.Annotation: ann2}, append(targets(2), "hold:60s")...)
	r1, r2 := c1.results(t), c2.results(t)

	want := func(i int, r results, open map[string]bool, scans map[string]string) {
		t.Helper()
		for _, tg := range targets(i) {
			if strings.HasPrefix(tg, "scan:") {
				continue
			}
			if r.open[tg] != open[tg] {
				t.Errorf("env %d: %s open=%v, want %v", i, tg, r.open[tg], open[tg])
			}
		}
		for s, w := range scans {
			if r.scan[s] != w {
				t.Errorf("env %d: %s found %q open, want %q", i, s, r.scan[s], w)
			}
		}
	}
	want(1, r1, map[string]bool{"tcp:" + mirror + ":8080": true, "udp:" + resolver + ":53": true, "tcp:[" + mirror6 + "]:8080": true},
		map[string]string{"scan:" + mirror + ":1-1024": "-", "scan:" + mirror + ":8000-8100": "8080", "scan:" + nodeAddr(1) + ":1-11000": "-"})
	want(2, r2, map[string]bool{"tcp:" + mirror + ":8080": true, "tcp:" + mirror + ":22": true, "udp:" + resolver + ":53": true,
		"tcp:[" + mirror6 + "]:8080": true, "tcp:[" + mirror6 + "]:22": true},
		map[string]string{"scan:" + mirror + ":1-1024": "22", "scan:" + mirror + ":8000-8100": "8080", "scan:" + nodeAddr(2) + ":1-11000": "-"})

	// Denials are counted per environment (the arbiter's metric: every
	// port its scans found closed is one rejected SYN) and logged with
	// the environment's id.
	scanned := 1024 + 101 + 11000
	for _, c := range []struct {
		*ctr
		n       int
		atLeast int
	}{{c1, 1, scanned - 1}, {c2, 2, scanned - 2}} {
		key := env.Namespace + "/" + c.id
		var v float64
		waitFor(t, 20*time.Second, fmt.Sprintf("%d egress denials in the arbiter's metrics for %s", c.atLeast, key), func() bool {
			v = metric(t, metricsPort, "envlet_status_egress_denied", key)
			return v >= float64(c.atLeast)
		}, func(int) string { return fmt.Sprintf("last value %v\n%s", v, arb.LogTail(20)) })
		t.Logf("%s: envlet_status_egress_denied %v", key, v)
		var line string
		waitFor(t, 10*time.Second, "an egress denial of a node address logged for "+key, func() bool {
			line = env.Containerd.LogLine("egress: denied", "env="+key+" ", "kind=node")
			return line != ""
		}, func(int) string { return env.Containerd.LogTail(40) })
		t.Logf("%s", line)
		// The destinations are logged too: the node's kubelet port, tried
		// before the scans filled the kernel's record.
		waitFor(t, 10*time.Second, "the node's kubelet port logged as a denied destination for "+key, func() bool {
			line = env.Containerd.LogLine("egress: denied destination", "env="+key+" ", "dst="+nodeAddr(c.n)+" ", "10250")
			return line != ""
		}, func(int) string { return env.Containerd.LogTail(40) })
		t.Logf("%s", line)
	}

	// The node's own namespace has no rules.
	self, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	if host, err := egress.OpenCounters(int(self.Fd())); err == nil {
		if got, err := host.Read(); err == nil && len(got) > 0 {
			t.Errorf("the node's namespace has an %s table: %v", egress.TableName, got)
		}
		host.Close()
	}

	// A container in the node's network namespace cannot be confined: it
	// is refused, as is one that could rewrite its rules.
	for name, opt := range map[string]oci.SpecOpts{
		"egress-hostnet":  oci.WithHostNamespace(specs.NetworkNamespace),
		"egress-netadmin": oci.WithAddedCapabilities([]string{"CAP_NET_ADMIN"}),
	} {
		if _, err := start(t, env, img, name, opt, nil, "run"); !errdefs.IsFailedPrecondition(err) {
			t.Errorf("%s: start %v, want a failed precondition", name, err)
		}
	}

	// Through CRI, as on a Kubernetes node without a CNI network (pods on
	// the host network): the pod annotation reaches the shim, and a
	// host-network pod is refused under the node's policy.
	dir2 := t.TempDir()
	crictl := func(args ...string) string { t.Helper(); return env.MustCrictl(t, args...) }
	crictl("pull", img.Name())
	ctrCfg := testenv.WriteJSON(t, dir2, "ctr.json", map[string]any{
		"metadata": map[string]any{"name": "main"},
		"image":    map[string]any{"image": img.Name()},
		"command":  []string{"/probe", "run"},
		"log_path": "main.log",
	})
	for _, tc := range []struct{ name, annotation, want string }{
		{"malformed", "10.0.0.1:443", egress.Annotation},
		{"hostnet", "", "host network"},
	} {
		ann := map[string]string{}
		if tc.annotation != "" {
			ann[egress.Annotation] = tc.annotation
		}
		pod := testenv.WriteJSON(t, dir2, tc.name+"-pod.json", map[string]any{
			"metadata":      map[string]any{"name": "egress-" + tc.name, "namespace": "default", "uid": "egress-" + tc.name, "attempt": 0},
			"log_directory": filepath.Join(dir2, tc.name),
			"annotations":   ann,
			"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
		})
		podID := crictl("runp", "--runtime", "envletov", pod)
		t.Cleanup(func() { env.Crictl(t, "stopp", podID); env.Crictl(t, "rmp", "-f", podID) })
		ctrID := crictl("create", podID, ctrCfg, pod)
		_, err := env.Crictl(t, "start", ctrID)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CRI pod %s: start %v, want a refusal naming %q", tc.name, err, tc.want)
		} else {
			t.Logf("CRI pod %s refused: %v", tc.name, err)
		}
	}
}

// criRuntime is an envlet handler whose annotations pass as the deploy
// drop-in lets them (pod annotation io.envsnap.egress included), on the
// plain overlayfs snapshotter, so no snapshotter daemon is needed.
const criRuntime = `
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.envletov]
  runtime_type = "io.containerd.envlet.v2"
  pod_annotations = ["io.envsnap.envlet.*", "io.envsnap.shim.*", "io.envsnap.egress"]
  container_annotations = ["io.envsnap.envlet.*", "io.envsnap.shim.*"]
`

// net is the test's network: two environment namespaces, each linked to
// the internet namespace and to the node.
type netw struct {
	mirrorNS string
	envNS    map[int]string
}

func newNet(t *testing.T, ip string) *netw {
	sfx := strconv.Itoa(os.Getpid() % 100000)
	n := &netw{mirrorNS: "egm" + sfx, envNS: map[int]string{1: "ege1-" + sfx, 2: "ege2-" + sfx}}
	sh := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ip, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	in := func(ns string, args ...string) { t.Helper(); sh(append([]string{"-n", ns}, args...)...) }
	for _, ns := range []string{n.mirrorNS, n.envNS[1], n.envNS[2]} {
		sh("netns", "add", ns)
		t.Cleanup(func() { _ = exec.Command(ip, "netns", "del", ns).Run() })
		in(ns, "link", "set", "lo", "up")
	}
	for _, a := range []string{mirror, otherHost, resolver, metadata} {
		in(n.mirrorNS, "addr", "add", a+"/32", "dev", "lo")
	}
	in(n.mirrorNS, "addr", "add", mirror6+"/128", "dev", "lo")
	for i := 1; i <= 2; i++ {
		e := n.envNS[i]
		// environment <-> internet
		m, x := fmt.Sprintf("egm%d-%s", i, sfx), fmt.Sprintf("egx%d-%s", i, sfx)
		sh("link", "add", m, "netns", n.mirrorNS, "type", "veth", "peer", "name", x, "netns", e)
		in(n.mirrorNS, "addr", "add", fmt.Sprintf("10.231.%d.1/24", i), "dev", m)
		in(n.mirrorNS, "link", "set", m, "up")
		in(e, "addr", "add", fmt.Sprintf("10.231.%d.2/24", i), "dev", x)
		in(e, "link", "set", x, "up")
		in(e, "route", "add", "default", "via", fmt.Sprintf("10.231.%d.1", i))
		// IPv6 without duplicate address detection, so the addresses are
		// usable at once; neighbour discovery still runs (and must pass
		// the policy).
		in(n.mirrorNS, "addr", "add", fmt.Sprintf("fd00:231:%d::1/64", i), "dev", m, "nodad")
		in(e, "addr", "add", fmt.Sprintf("fd00:231:%d::2/64", i), "dev", x, "nodad")
		in(e, "-6", "route", "add", "default", "via", fmt.Sprintf("fd00:231:%d::1", i))
		// environment <-> node
		h, y := fmt.Sprintf("egh%d-%s", i, sfx), fmt.Sprintf("egy%d-%s", i, sfx)
		sh("link", "add", h, "type", "veth", "peer", "name", y, "netns", e)
		t.Cleanup(func() { _ = exec.Command(ip, "link", "del", h).Run() })
		sh("addr", "add", nodeAddr(i)+"/24", "dev", h)
		sh("addr", "add", nodeAddr6(i)+"/64", "dev", h, "nodad")
		sh("link", "set", h, "up")
		in(e, "addr", "add", fmt.Sprintf("10.233.%d.2/24", i), "dev", y)
		in(e, "addr", "add", fmt.Sprintf("fd00:233:%d::2/64", i), "dev", y, "nodad")
		in(e, "link", "set", y, "up")
	}
	return n
}

func netnsPath(name string) string { return "/var/run/netns/" + name }

func buildProbe(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "probe")
	cmd := exec.Command("go", "build", "-o", out, "./probe")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build probe: %v\n%s", err, b)
	}
	return out
}

// listenGreeting serves the probe greeting on addr for the test's life.
func listenGreeting(t *testing.T, addr string) {
	t.Helper()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("listen on %s: %v", addr, err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			fmt.Fprintln(c, greeting)
			c.Close()
		}
	}()
}

func writeFile(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, timeout time.Duration, what string, ok func() bool, tail func(int) string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s\n%s", what, tail(30))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// results is a probe's output: which targets answered, what each scan
// found open.
type results struct {
	open map[string]bool
	scan map[string]string
}

func parse(t *testing.T, out string) results {
	t.Helper()
	r := results{open: map[string]bool{}, scan: map[string]string{}}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 2 && f[0] == "open":
			r.open[f[1]] = true
		case len(f) >= 2 && f[0] == "denied":
			r.open[strings.TrimSuffix(f[1], ":")] = false
		case len(f) == 4 && f[0] == "scan":
			r.scan["scan:"+f[1]] = f[3]
		}
	}
	return r
}

// ctr is a running probe container.
type ctr struct {
	id  string
	out *syncBuffer
}

func (c *ctr) results(t *testing.T) results {
	t.Helper()
	waitFor(t, 3*time.Minute, c.id+"'s probe", func() bool { return strings.Contains(c.out.String(), "done\n") },
		func(int) string { return c.out.String() })
	return parse(t, c.out.String())
}

func run(t *testing.T, env *testenv.Env, img client.Image, id, netns string, ann map[string]string, args ...string) *ctr {
	t.Helper()
	c, err := start(t, env, img, id, oci.WithLinuxNamespace(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: netns}), ann, append([]string{"run"}, args...)...)
	if err != nil {
		t.Fatalf("start %s: %v", id, err)
	}
	return c
}

func start(t *testing.T, env *testenv.Env, img client.Image, id string, opt oci.SpecOpts, ann map[string]string, args ...string) (*ctr, error) {
	t.Helper()
	ctx := env.Context()
	c, err := env.Client.NewContainer(ctx, id,
		client.WithSnapshotter("overlayfs"),
		client.WithNewSnapshot(id+"-snap", img),
		client.WithRuntime(envletRuntime, nil),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs(append([]string{"/probe"}, args...)...),
			oci.WithAnnotations(ann), opt),
	)
	if err != nil {
		t.Fatalf("create container %s: %v", id, err)
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(env.Context(), 30*time.Second)
		defer cancel()
		_ = c.Delete(dctx, client.WithSnapshotCleanup)
	})
	out := &syncBuffer{}
	task, err := c.NewTask(ctx, cio.NewCreator(cio.WithStreams(nil, out, out)))
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() {
		dctx, cancel := context.WithTimeout(env.Context(), 30*time.Second)
		defer cancel()
		_, _ = task.Delete(dctx, client.WithProcessKill)
	})
	if err := task.Start(ctx); err != nil {
		return nil, err
	}
	return &ctr{id: id, out: out}, nil
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// metric reads one series of the arbiter's metrics, labelled env=key.
func metric(t *testing.T, port int, name, key string) float64 {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	prefix := fmt.Sprintf("%s{env=%q} ", name, key)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, prefix); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}
