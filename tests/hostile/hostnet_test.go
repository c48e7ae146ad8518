package hostile_test

import (
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/envsnap/envsnap/tests/testenv"
)

// TestHostNetwork: under the defaults the envlet runtime refuses a
// container on the node's network namespace (`ctr run --net-host`) and a
// hostNetwork CRI pod (at its sandbox), with an error naming the option
// that allows it; on the node's network a container reads what listens on
// the node's loopback, such as the arbiter's metrics (every environment's
// name and usage), which is why loopback is no boundary. A node that sets
// [guard] allow-host-network runs both.
func TestHostNetwork(t *testing.T) {
	const option = "allow-host-network = true under [guard]"
	for _, allow := range []bool{false, true} {
		t.Run(fmt.Sprintf("allow-host-network=%v", allow), func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			port := l.Addr().(*net.TCPAddr).Port
			l.Close()
			// The CRI envlet handler unpacks into envsnap.
			env := testenv.New(t, testenv.WithEnvsnap(), testenv.WithEnvlet(testenv.EnvletConfig{
				ArbiterMetrics: fmt.Sprintf("127.0.0.1:%d", port), AllowHostNetwork: allow,
			}))
			ref := env.PushImage(t, "hostile/hostnet:1", nil).Ref
			mustCtr(t, env, "images", "pull", "--hosts-dir", env.HostsDir, ref)
			// Prints how many of the arbiter's metric lines it read.
			probe := fmt.Sprintf("wget -q -O - http://127.0.0.1:%d/metrics | grep -c '^envlet_'; echo PROBED", port)

			out, err := ctrIn(t, env, "run", "--rm", "--net-host", "--runtime", envletRuntime, ref, "hostnet", "sh", "-c", probe)
			t.Cleanup(func() { _, _ = ctrIn(t, env, "containers", "delete", "hostnet") })
			if allow {
				if n, ran := metricLines(out); err != nil || !ran || n == 0 {
					t.Errorf("ctr run --net-host where the node allows it read %d metric lines: %v\n%s", n, err, out)
				}
			} else {
				if _, ran := metricLines(out); err == nil || ran {
					t.Errorf("ctr run --net-host ran under the defaults: %v\n%s", err, out)
				}
				if !strings.Contains(out, option) || !strings.Contains(out, "host network") {
					t.Errorf("refusal does not say host network and name %q:\n%s", option, out)
				}
				if err != nil {
					t.Logf("refused: %s", strings.TrimSpace(out))
				}
			}

			// In a namespace of its own, the node's loopback is out of reach.
			out = mustCtr(t, env, "run", "--rm", "--runtime", envletRuntime, ref, "ownnet", "sh", "-c", probe)
			if n, ran := metricLines(out); !ran || n != 0 {
				t.Errorf("container with its own network namespace read %d metric lines:\n%s", n, out)
			}

			dir := t.TempDir()
			pod := testenv.WriteJSON(t, dir, "pod.json", map[string]any{
				"metadata":      map[string]any{"name": "hostnet", "namespace": "default", "uid": "hostnet-uid", "attempt": 0},
				"log_directory": filepath.Join(dir, "logs"),
				"linux":         map[string]any{"security_context": map[string]any{"namespace_options": map[string]any{"network": 2}}},
			})
			podID, err := env.Crictl(t, "runp", "--runtime", "envlet", pod)
			if err == nil {
				t.Cleanup(func() { env.Crictl(t, "stopp", podID); env.Crictl(t, "rmp", "-f", podID) })
			}
			switch {
			case allow && err != nil:
				t.Errorf("hostNetwork pod where the node allows it: %v", err)
			case !allow && err == nil:
				t.Errorf("hostNetwork pod ran under the defaults")
			case !allow && !strings.Contains(err.Error(), option):
				t.Errorf("hostNetwork pod refusal does not name %q: %v", option, err)
			}
		})
	}
}

// metricLines finds the probe's output in ctr's (which carries ctr's own
// warnings and wget's errors): the count printed just before PROBED.
func metricLines(out string) (n int, ran bool) {
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		if l == "PROBED" && i > 0 {
			if _, err := fmt.Sscan(lines[i-1], &n); err == nil {
				return n, true
			}
		}
	}
	return 0, false
}
