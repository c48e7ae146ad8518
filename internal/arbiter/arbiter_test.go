package arbiter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/envsnap/envsnap/internal/envlet"
)

const gib = envlet.GiB

// byRequest is a node arbiter without reserve that admits by request
// (overcommit 1), so protocol tests can fill the node with admissions.
func byRequest(node envlet.Resources) *envlet.NodeArbiter {
	return envlet.NewNodeArbiter(node, 0, envlet.WithOvercommit(envlet.Overcommit{CPU: 1, Memory: 1}))
}

// startArbiter serves a NodeArbiter of the given size on a fresh socket and
// returns the socket and a stop function (also registered with Cleanup).
func startArbiter(t *testing.T, socket string, node envlet.Resources, opts ...ServeOpt) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, socket, byRequest(node), opts...) }()
	deadline := time.Now().Add(5 * time.Second)
	for {
		// The socket file exists from bind(2), before listen(2): dial.
		if c, err := net.Dial("unix", socket); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("arbiter did not listen on %s", socket)
		}
		time.Sleep(5 * time.Millisecond)
	}
	var stopped bool
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}
	t.Cleanup(stop)
	return stop
}

// serveIntercepted serves s on sock with every call passing through
// icpt (a slow or a held arbiter), until the test ends.
func serveIntercepted(t *testing.T, sock string, s *Server, icpt ttrpc.UnaryServerInterceptor) {
	t.Helper()
	srv, err := ttrpc.NewServer(ttrpc.WithUnaryServerInterceptor(icpt))
	if err != nil {
		t.Fatal(err)
	}
	s.Register(srv)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(context.Background(), l)
	t.Cleanup(func() { srv.Close() })
}

func socketPath(t *testing.T) string {
	// Unix socket paths are short; t.TempDir() can exceed 108 bytes.
	dir, err := os.MkdirTemp("", "arb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "a.sock")
}

func TestAdmitGrowReportRelease(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	startArbiter(t, sock, envlet.Resources{CPU: 4, Memory: 4 * gib})
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })

	base := envlet.Resources{CPU: 1, Memory: 1 * gib}
	if err := c.Admit(ctx, "a", base); err != nil {
		t.Fatalf("admit a: %v", err)
	}
	if err := c.Admit(ctx, "b", base); err != nil {
		t.Fatalf("admit b: %v", err)
	}
	// The node has 4 GiB: a third and fourth 1 GiB env fit, a fifth not.
	for _, id := range []string{"c", "d"} {
		if err := c.Admit(ctx, id, base); err != nil {
			t.Fatalf("admit %s: %v", id, err)
		}
	}
	if err := c.Admit(ctx, "e", base); !errdefs.IsResourceExhausted(err) {
		t.Fatalf("admit e on a full node: got %v, want ErrResourceExhausted", err)
	}
	if !c.Connected() {
		t.Fatal("a rejected admission must not count as an outage")
	}
	for _, id := range []string{"c", "d"} {
		if err := c.Release(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	got, err := c.Grow(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib})
	if err != nil {
		t.Fatal(err)
	}
	// 4 GiB node, b holds 1 GiB: a can reach at most 3 GiB.
	if got.CPU != 2 || got.Memory != 3*gib {
		t.Fatalf("grow a: got %v", got)
	}
	lim, err := c.Report(ctx, "a", got, envlet.Resources{CPU: 0.1, Memory: 100 << 20})
	if err != nil || lim != got {
		t.Fatalf("report a: got %v, %v; want %v", lim, err, got)
	}
	envs, err := c.List(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(envs) != 2 || envs[0].Env != "a" || envs[0].Current.Memory != 3*gib || envs[0].Used.Memory != 100<<20 {
		t.Fatalf("list: %+v", envs)
	}
	if err := c.Release(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	envs, err = c.List(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	var ended bool
	for _, e := range envs {
		if e.Env == "a" && !e.Ended.IsZero() && e.Reason == "exited" {
			ended = true
		}
	}
	if !ended {
		t.Fatalf("released env a not listed as ended: %+v", envs)
	}
}

// TestReregisterAfterRestart: a restarted arbiter knows nothing; the client
// must restore its environments (with their grants) before they can be
// crowded out by newcomers.
func TestReregisterAfterRestart(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	stop := startArbiter(t, sock, node)
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	if err := c.Admit(ctx, "a", envlet.Resources{CPU: 1, Memory: gib}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Grow(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib}); err != nil {
		t.Fatal(err)
	}
	stop()
	startArbiter(t, sock, node)

	// The client, or the first call after the restart, reconnects and
	// re-registers a with its 3 GiB grant.
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := c.Report(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib}, envlet.Resources{CPU: 2, Memory: 2900 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if c.Connected() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("client never reconnected")
		}
		time.Sleep(50 * time.Millisecond)
	}
	other := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { other.Close() })
	envs, err := other.List(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(envs) != 1 || envs[0].Env != "a" || envs[0].Current.Memory != 3*gib {
		t.Fatalf("after restart: %+v, want a re-registered with 3 GiB", envs)
	}
	// The outage is counted once, however many calls it failed, and the
	// shim's next report tells the arbiter (metrics).
	if gaps, failed := c.Gaps(); gaps != 1 {
		t.Fatalf("client counted %d gaps, %d failed calls; want 1 gap", gaps, failed)
	}
	if _, err := c.Report(ctx, "a", envlet.Resources{CPU: 2, Memory: 3 * gib}, envlet.Resources{CPU: 2, Memory: 2900 << 20}); err != nil {
		t.Fatal(err)
	}
	if envs, err = other.List(ctx, false); err != nil || len(envs) != 1 || envs[0].Gaps == nil || envs[0].Gaps.Gaps != 1 {
		t.Fatalf("listing after the report: %+v (%v), want 1 gap recorded", envs, err)
	}
	// a's grant is real again: a newcomer cannot grow into it.
	if err := other.Admit(ctx, "b", envlet.Resources{CPU: 0.5, Memory: gib / 2}); err != nil {
		t.Fatal(err)
	}
	if got, err := other.Grow(ctx, "b", envlet.Resources{Memory: 4 * gib}); err != nil || got.Memory != gib {
		t.Fatalf("b grew to %v (%v) next to re-registered a's 3 GiB on a 4 GiB node, want 1 GiB", got, err)
	}
}

func TestFallback(t *testing.T) {
	ctx := context.Background()
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	base := envlet.Resources{CPU: 1, Memory: gib}
	for _, tc := range []struct {
		policy   string
		wantGrow bool
	}{
		{FallbackDegraded, false},
		{FallbackLocal, true},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			c := NewClient(ClientConfig{Socket: socketPath(t), Node: node, Fallback: tc.policy})
			t.Cleanup(func() { c.Close() })
			// No arbiter listens: admission is decided locally against
			// the configured node size.
			for _, id := range []string{"a", "b", "c", "d"} {
				if err := c.Admit(ctx, id, base); err != nil {
					t.Fatalf("admit %s without arbiter: %v", id, err)
				}
			}
			// Degraded admits by request: this shim cannot see the
			// others' use. Local sees the whole node and admits by use.
			err := c.Admit(ctx, "e", base)
			if tc.policy == FallbackDegraded && !errdefs.IsResourceExhausted(err) {
				t.Fatalf("degraded fallback admitted beyond the node: %v", err)
			}
			if tc.policy == FallbackLocal && err != nil {
				t.Fatalf("local fallback refused an idle node: %v", err)
			}
			if err := c.Release(ctx, "d"); err != nil {
				t.Fatal(err)
			}
			got, err := c.Grow(ctx, "a", envlet.Resources{CPU: 2, Memory: 2 * gib})
			if tc.wantGrow {
				if err != nil || got.Memory != 2*gib {
					t.Fatalf("local grow: %v, %v", got, err)
				}
				return
			}
			if !errdefs.IsUnavailable(err) {
				t.Fatalf("degraded grow: got %v, %v; want ErrUnavailable for the controller's policy", got, err)
			}
		})
	}
}

// TestTimeout: an arbiter that accepts but never answers costs one timeout,
// then the client decides locally without waiting on every call.
func TestTimeout(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	c := NewClient(ClientConfig{Socket: sock, Timeout: 50 * time.Millisecond, Node: envlet.Resources{CPU: 2, Memory: gib}})
	t.Cleanup(func() { c.Close() })
	err = c.Admit(ctx, "a", envlet.Resources{CPU: 1, Memory: 512 << 20})
	if err != nil {
		t.Fatalf("admit against a mute arbiter should fall back locally: %v", err)
	}
	if c.Connected() {
		t.Fatal("still connected to a mute arbiter")
	}
	_, err = c.Grow(ctx, "a", envlet.Resources{CPU: 2})
	if !errdefs.IsUnavailable(err) {
		t.Fatalf("grow against a mute arbiter: %v", err)
	}
}

// pointSource is a StatusSource whose timeline the test appends to.
type pointSource struct{ pts []envlet.TimelinePoint }

func (p *pointSource) Status() envlet.Status { return envlet.Status{} }

func (p *pointSource) TimelineSince(seq uint64) ([]envlet.TimelinePoint, uint64) {
	return p.pts[min(seq, uint64(len(p.pts))):], uint64(len(p.pts))
}

// Each report carries the timeline points since the last one, each once.
func TestReportsSendNewPoints(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	startArbiter(t, sock, envlet.Resources{CPU: 4, Memory: 4 * gib})
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	if err := c.Admit(ctx, "a", envlet.Resources{CPU: 1, Memory: gib}); err != nil {
		t.Fatal(err)
	}
	src := &pointSource{}
	c.Track("a", src)
	t0 := time.Unix(1000, 0)
	for round, n := range []int{3, 0, 2} {
		for range n {
			src.pts = append(src.pts, envlet.TimelinePoint{T: t0.Add(time.Duration(len(src.pts)) * time.Second)})
		}
		if _, err := c.Report(ctx, "a", envlet.Resources{CPU: 1, Memory: gib}, envlet.Resources{}); err != nil {
			t.Fatal(err)
		}
		got, err := c.Timeline(ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(src.pts) {
			t.Fatalf("round %d: the arbiter holds %d points, want %d", round, len(got), len(src.pts))
		}
		for i, b := range got {
			var p envlet.TimelinePoint
			if err := json.Unmarshal(b, &p); err != nil || !p.T.Equal(src.pts[i].T) {
				t.Fatalf("round %d: point %d at %v (%v), want %v", round, i, p.T, err, src.pts[i].T)
			}
		}
	}
}

// A client whose arbiter restarts re-registers its environments without
// waiting for a call of theirs (idle ones call only every 15 s): the
// restored leases are confirmed within the ledger's grace, and the lost
// connection counts as a gap.
func TestRedialWithoutCalls(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	ledger := DefaultLedgerPath(sock)
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	stop := startArbiter(t, sock, node, WithLedger(ledger))
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	if err := c.Admit(ctx, "a", envlet.Resources{CPU: 1, Memory: gib}); err != nil {
		t.Fatal(err)
	}
	stop()
	startArbiter(t, sock, node, WithLedger(ledger))
	// Connected only once every environment is registered again (the
	// client holds its lock from the dial to the last registration).
	deadline := time.Now().Add(5 * time.Second)
	for !c.Connected() {
		if time.Now().After(deadline) {
			t.Fatal("client did not reconnect within 5 s of the restart")
		}
		time.Sleep(50 * time.Millisecond)
	}
	other := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { other.Close() })
	if envs, err := other.List(ctx, false); err != nil || len(envs) != 1 || envs[0].Env != "a" {
		t.Fatalf("after the restart: %+v (%v), want a", envs, err)
	}
	if gaps, failed := c.Gaps(); gaps != 1 || failed != 0 {
		t.Fatalf("client counted %d gaps, %d failed calls; want 1 gap, no call failed", gaps, failed)
	}
}

func TestNumericFields(t *testing.T) {
	st := envlet.Status{Env: "x", CPUGrows: 3, OOMs: 2, Throttled: 0.5, Idle: true, Limit: envlet.Resources{CPU: 2}}
	b, _ := json.Marshal(st)
	got := map[string]float64{}
	for _, f := range NumericFields(b) {
		got[f.Name] = f.Value
	}
	for name, want := range map[string]float64{"cpu_grows": 3, "ooms": 2, "throttled": 0.5, "idle": 1, "limit_cpu": 2} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}
	for name := range got {
		if strings.ContainsAny(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZ-.") {
			t.Errorf("metric-unsafe name %q", name)
		}
	}
	if NumericFields([]byte("not json")) != nil {
		t.Error("invalid JSON must yield nothing")
	}
}

func TestMetrics(t *testing.T) {
	ctx := context.Background()
	s := NewServer(byRequest(envlet.Resources{CPU: 4, Memory: 4 * gib}))
	if _, err := s.admit(ctx, &AdmitRequest{Env: "a", Base: Resources{CPU: 1, Memory: gib}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.admit(ctx, &AdmitRequest{Env: "big", Base: Resources{CPU: 1, Memory: 8 * gib}}); err == nil {
		t.Fatal("admitted beyond the node")
	}
	status, _ := json.Marshal(envlet.Status{Env: "a", Throttled: 0.25, CPUGrows: 3, OOMs: 1, EgressDenied: 5})
	if _, err := s.report(ctx, &ReportRequest{Env: "a", Current: Resources{CPU: 2, Memory: gib},
		Used: Resources{CPU: 1.5, Memory: 512 << 20}, Status: status}); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			key := mf.GetName()
			for _, l := range m.GetLabel() {
				key += "," + l.GetName() + "=" + l.GetValue()
			}
			got[key] = v
		}
	}
	for key, want := range map[string]float64{
		"envlet_quota_cpu_cores,env=a":                2,
		"envlet_usage_memory_bytes,env=a":             512 << 20,
		"envlet_status_throttled,env=a":               0.25,
		"envlet_status_cpu_grows,env=a":               3,
		"envlet_status_ooms,env=a":                    1,
		"envlet_status_egress_denied,env=a":           5,
		"envlet_arbiter_envs":                         1,
		"envlet_arbiter_denials_total,kind=admission": 1,
	} {
		if v, ok := got[key]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", key, v, ok, want)
		}
	}
}

// A metrics port given without a host listens on loopback only, and
// serves /metrics alone: on a host-network pod every other address of the
// node is reachable from its containers.
func TestMetricsLocalOnly(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	startArbiter(t, socketPath(t), envlet.Resources{CPU: 1, Memory: gib}, WithMetricsAddress(fmt.Sprintf(":%d", port)))
	get := func(url string) int {
		var resp *http.Response
		for i := 0; i < 100; i++ { // the metrics listener starts with Serve
			if resp, err = http.Get(url); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port)); code != http.StatusOK {
		t.Errorf("/metrics: %d", code)
	}
	if code := get(fmt.Sprintf("http://127.0.0.1:%d/status", port)); code != http.StatusNotFound {
		t.Errorf("/status: %d, want 404", code)
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	tried := 0
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.IsLoopback() || ipn.IP.IsLinkLocalUnicast() {
			continue
		}
		tried++
		if c, err := net.DialTimeout("tcp", net.JoinHostPort(ipn.IP.String(), fmt.Sprint(port)), time.Second); err == nil {
			c.Close()
			t.Errorf("metrics reachable on the node address %s", ipn.IP)
		}
	}
	if tried == 0 {
		t.Log("no non-loopback address on this host: only the loopback side was checked")
	}
	if got := MetricsListenAddress("0.0.0.0:9167"); got != "0.0.0.0:9167" {
		t.Errorf("an explicit host was replaced: %s", got)
	}
}

// The quota protocol is for root only.
func TestSocketRootOnly(t *testing.T) {
	sock := socketPath(t)
	startArbiter(t, sock, envlet.Resources{CPU: 1, Memory: gib})
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if perm := fi.Mode().Perm(); perm != 0o600 {
		t.Errorf("arbiter socket mode %v, want 0600", perm)
	}
}

func TestServeRefusesLiveSocket(t *testing.T) {
	sock := socketPath(t)
	startArbiter(t, sock, envlet.Resources{CPU: 1, Memory: gib})
	err := Serve(context.Background(), sock, envlet.NewNodeArbiter(envlet.Resources{CPU: 1, Memory: gib}, 0))
	if !errdefs.IsAlreadyExists(err) {
		t.Fatalf("second arbiter on a live socket: %v", err)
	}
	// The first one still serves.
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	if _, err := c.List(context.Background(), false); err != nil {
		t.Fatal(err)
	}
}

func TestTimelineByContainerID(t *testing.T) {
	ctx := context.Background()
	s := NewServer(envlet.NewNodeArbiter(envlet.Resources{CPU: 4, Memory: 4 * gib}, 0))
	for _, env := range []string{"default/abc", "k8s.io/xyz"} {
		if _, err := s.admit(ctx, &AdmitRequest{Env: env, Base: Resources{CPU: 1, Memory: gib}}); err != nil {
			t.Fatal(err)
		}
		pt, _ := json.Marshal(envlet.TimelinePoint{Wake: env})
		if _, err := s.report(ctx, &ReportRequest{Env: env, Timeline: []json.RawMessage{pt}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.release(ctx, &ReleaseRequest{Env: "k8s.io/xyz"}); err != nil {
		t.Fatal(err)
	}
	for q, want := range map[string]string{"default/abc": "default/abc", "abc": "default/abc", "xyz": "k8s.io/xyz"} {
		resp, err := s.timelineOf(ctx, &TimelineRequest{Env: q})
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		var p envlet.TimelinePoint
		if len(resp.Points) != 1 || json.Unmarshal(resp.Points[0], &p) != nil || p.Wake != want {
			t.Errorf("timeline of %s: %s", q, resp.Points)
		}
	}
	if _, err := s.timelineOf(ctx, &TimelineRequest{Env: "bc"}); !errdefs.IsNotFound(err) {
		t.Errorf("a partial id matched: %v", err)
	}
}

// A busy node answers slowly, not never: an arbiter that takes 300 ms per
// call (its share of 2 cores next to 12 busy environments) keeps every
// shim connected with the default deadline. The former 100 ms deadline
// dropped it at the first call and decided locally.
func TestClientWaitsForBusyArbiter(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	s := NewServer(byRequest(envlet.Resources{CPU: 4, Memory: 4 * gib}))
	serveIntercepted(t, sock, s, func(ctx context.Context, u ttrpc.Unmarshaler, _ *ttrpc.UnaryServerInfo, m ttrpc.Method) (any, error) {
		time.Sleep(300 * time.Millisecond)
		return m(ctx, u)
	})

	c := NewClient(ClientConfig{Socket: sock})
	t.Cleanup(func() { c.Close() })
	base := envlet.Resources{CPU: 1, Memory: gib}
	if err := c.Admit(ctx, "a", base); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Grow(ctx, "a", envlet.Resources{Memory: 2 * gib}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if _, err := c.Report(ctx, "a", envlet.Resources{CPU: 1, Memory: 2 * gib}, envlet.Resources{CPU: 0.1, Memory: gib}); err != nil {
			t.Fatal(err)
		}
	}
	if gaps, failed := c.Gaps(); gaps != 0 || failed != 0 || !c.Connected() {
		t.Fatalf("slow arbiter: %d gaps, %d failed calls, connected %v; want none", gaps, failed, c.Connected())
	}
	if g := s.arb.Leases()["a"].Grant.Memory; g != 2*gib {
		t.Fatalf("grant at the arbiter %d, want the 2 GiB grown", g)
	}
}

// The calls of a shim's controllers are in flight together: one that the
// arbiter is slow to answer does not hold another environment's report
// behind it. The client used to make one call at a time under its lock,
// so controllers sampling on the same instants queued, and the last ones
// passed their deadline with the arbiter answering (arbiter gaps in the
// 48-rollout batch).
func TestCallsDoNotQueue(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	s := NewServer(byRequest(envlet.Resources{CPU: 4, Memory: 4 * gib}))
	held, release := make(chan struct{}), make(chan struct{})
	serveIntercepted(t, sock, s, func(ctx context.Context, u ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, m ttrpc.Method) (any, error) {
		if strings.HasSuffix(info.FullMethod, "/"+methodGrow) {
			close(held)
			<-release
		}
		return m(ctx, u)
	})

	c := NewClient(ClientConfig{Socket: sock, Timeout: 10 * time.Second})
	t.Cleanup(func() { c.Close() })
	base := envlet.Resources{CPU: 1, Memory: gib}
	for _, env := range []string{"slow", "a"} {
		if err := c.Admit(ctx, env, base); err != nil {
			t.Fatal(err)
		}
	}
	grown := make(chan error, 1)
	go func() {
		_, err := c.Grow(ctx, "slow", envlet.Resources{CPU: 2, Memory: gib})
		grown <- err
	}()
	<-held
	reported := make(chan error, 1)
	go func() {
		_, err := c.Report(ctx, "a", base, envlet.Resources{CPU: 0.1, Memory: gib / 2})
		reported <- err
	}()
	select {
	case err := <-reported:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		close(release)
		t.Fatal("a's report waited for slow's grow to be answered")
	}
	select {
	case err := <-grown:
		t.Fatalf("grow answered (%v) while the arbiter held it", err)
	default:
	}
	close(release)
	if err := <-grown; err != nil {
		t.Fatal(err)
	}
	if gaps, failed := c.Gaps(); gaps != 0 || failed != 0 || !c.Connected() {
		t.Fatalf("%d gaps, %d failed calls, connected %v; want none", gaps, failed, c.Connected())
	}
}

// endedReason returns the reason env is listed as ended with, "" if it is
// not listed as ended.
func endedReason(t *testing.T, c *Client, env string) string {
	t.Helper()
	envs, err := c.List(context.Background(), true)
	if err != nil {
		t.Fatal(err)
	}
	reason := ""
	for _, e := range envs {
		if e.Env == env && !e.Ended.IsZero() {
			reason = e.Reason
		}
	}
	return reason
}

// A controller's report cut short by its own environment stopping is not
// an arbiter outage: the release that follows reaches the arbiter with
// its reason. It used to drop the connection, so the release went to the
// local fallback and the arbiter listed the environment as running until
// its stale limit (tests/hostile's envs listing, on a loaded CI node).
func TestCancelledCallKeepsConnection(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	startArbiter(t, sock, envlet.Resources{CPU: 4, Memory: 4 * gib})
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	base := envlet.Resources{CPU: 1, Memory: gib}
	if err := c.Admit(ctx, "a", base); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := c.Report(cctx, "a", base, envlet.Resources{CPU: 0.1}); !errors.Is(err, context.Canceled) {
		t.Fatalf("report with a cancelled context: %v, want context.Canceled", err)
	}
	if gaps, failed := c.Gaps(); gaps != 0 || failed != 0 || !c.Connected() {
		t.Fatalf("after a cancelled call: %d gaps, %d failed calls, connected %v; want none and connected", gaps, failed, c.Connected())
	}
	if err := c.ReleaseReason(ctx, "a", envlet.ReasonPidsExhausted); err != nil {
		t.Fatal(err)
	}
	if got := endedReason(t, c, "a"); got != envlet.ReasonPidsExhausted {
		t.Fatalf("a listed as ended with %q, want %s", got, envlet.ReasonPidsExhausted)
	}
}

// Releases made while the arbiter is away reach it when it is back: the
// grant is returned then (not at the restored lease's grace), and an
// environment admitted and ended entirely by the fallback is listed as
// ended too, each with its reason.
func TestReleaseWhileArbiterAway(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	node := envlet.Resources{CPU: 4, Memory: 4 * gib}
	ledger := DefaultLedgerPath(sock)
	stop := startArbiter(t, sock, node, WithLedger(ledger))
	c := NewClient(ClientConfig{Socket: sock, Timeout: 200 * time.Millisecond, Node: node})
	t.Cleanup(func() { c.Close() })
	base := envlet.Resources{CPU: 1, Memory: gib}
	for _, env := range []string{"a", "b"} {
		if err := c.Admit(ctx, env, base); err != nil {
			t.Fatal(err)
		}
	}
	stop()
	// ttrpc's graceful shutdown may still serve a call on a connection it
	// is closing; the arbiter is away once the client saw it close.
	for deadline := time.Now().Add(5 * time.Second); c.Connected(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the client still holds its connection 5 s after the arbiter stopped")
		}
	}
	if err := c.ReleaseReason(ctx, "a", envlet.ReasonDiskCapExceeded); err != nil {
		t.Fatalf("release with the arbiter away: %v", err)
	}
	if err := c.Admit(ctx, "c", base); err != nil {
		t.Fatalf("admit by the fallback: %v", err)
	}
	if err := c.ReleaseReason(ctx, "c", envlet.ReasonOutputCapExceeded); err != nil {
		t.Fatal(err)
	}
	startArbiter(t, sock, node, WithLedger(ledger))
	// Nothing calls: the client's redial delivers (a second apart).
	deadline := time.Now().Add(5 * time.Second)
	for {
		other := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
		a, cr := endedReason(t, other, "a"), endedReason(t, other, "c")
		envs, err := other.List(ctx, false)
		other.Close()
		if err != nil {
			t.Fatal(err)
		}
		if a == envlet.ReasonDiskCapExceeded && cr == envlet.ReasonOutputCapExceeded && len(envs) == 1 && envs[0].Env == "b" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the arbiter came back: a ended %q, c ended %q, live %+v; want a %s, c %s, only b live",
				a, cr, envs, envlet.ReasonDiskCapExceeded, envlet.ReasonOutputCapExceeded)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// The start queue over the wire: ranks in admission order, a start that
// ends moves the next one up, and a restarted arbiter queues a start
// again once its shim has re-registered.
func TestStartRank(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	stop := startArbiter(t, sock, envlet.Resources{CPU: 4, Memory: 4 * gib})
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	base := envlet.Resources{CPU: 1, Memory: gib}
	for _, id := range []string{"a", "b"} {
		if err := c.Admit(ctx, id, base); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Millisecond) // distinct admission times
	}
	rank := func(id string, done bool) int {
		t.Helper()
		r, err := c.StartRank(ctx, id, done)
		if err != nil {
			t.Fatalf("start rank %s: %v", id, err)
		}
		return r
	}
	if a, b := rank("a", false), rank("b", false); a != 0 || b != 1 {
		t.Fatalf("ranks a %d, b %d; want 0, 1", a, b)
	}
	rank("a", true)
	if b := rank("b", false); b != 0 {
		t.Fatalf("rank of b after a's start ended: %d, want 0", b)
	}
	stop()
	startArbiter(t, sock, envlet.Resources{CPU: 4, Memory: 4 * gib})
	if b := rank("b", false); b != 0 {
		t.Fatalf("rank of b from a restarted arbiter: %d, want 0", b)
	}
	if _, err := c.StartRank(ctx, "nobody", false); !errdefs.IsNotFound(err) {
		t.Fatalf("rank of an environment the client does not know: %v, want NotFound", err)
	}
}

// An arbiter older than the start queue answers Unimplemented: an answer,
// not an outage, so the client keeps its connection and the node's view.
func TestStartRankOldArbiter(t *testing.T) {
	ctx := context.Background()
	sock := socketPath(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	old := NewServer(byRequest(envlet.Resources{CPU: 4, Memory: 4 * gib}))
	methods := map[string]ttrpc.Method{methodAdmit: handler(old.admit), methodReport: handler(old.report), methodRelease: handler(old.release)}
	srv.RegisterService(ServiceName, &ttrpc.ServiceDesc{Methods: methods})
	go srv.Serve(ctx, l)
	t.Cleanup(func() { srv.Close() })
	c := NewClient(ClientConfig{Socket: sock, Timeout: time.Second})
	t.Cleanup(func() { c.Close() })
	if err := c.Admit(ctx, "a", envlet.Resources{CPU: 1, Memory: gib}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartRank(ctx, "a", false); !errdefs.IsNotImplemented(err) {
		t.Fatalf("start rank from an arbiter without a start queue: %v, want NotImplemented", err)
	}
	if !c.Connected() {
		t.Fatal("an Unimplemented answer dropped the connection")
	}
}
