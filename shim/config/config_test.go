package config

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/envlet"
)

func TestLoadFile(t *testing.T) {
	for _, tc := range []struct {
		name, toml string
		wantErr    string
		check      func(t *testing.T, c Config)
	}{
		{
			name: "full",
			toml: `
[policy]
initial-cpu = "250m"
initial-memory = "256Mi"
[node]
cpu = "2"
memory = "4Gi"
reserve = 0.1
[arbiter]
socket = "/tmp/x.sock"
timeout = "50ms"
fallback = "local"
`,
			check: func(t *testing.T, c Config) {
				ec, err := c.Envlet()
				if err != nil || ec.Initial != (envlet.Resources{CPU: 0.25, Memory: 256 * envlet.MiB}) {
					t.Fatalf("policy: %v %v", ec.Initial, err)
				}
				if ec.Cap != envlet.DefaultConfig().Cap {
					t.Fatalf("unset knobs must keep the defaults: cap %v", ec.Cap)
				}
				node, reserve, err := c.NodeSize()
				if err != nil || node != (envlet.Resources{CPU: 2, Memory: 4 * envlet.GiB}) || reserve != 0.1 {
					t.Fatalf("node %v reserve %v err %v", node, reserve, err)
				}
				cc, err := c.ArbiterClient()
				if err != nil || cc.Socket != "/tmp/x.sock" || cc.Timeout != 50*time.Millisecond || cc.Fallback != "local" || cc.Node != node {
					t.Fatalf("client %+v %v", cc, err)
				}
			},
		},
		{
			name: "empty means machine size and defaults",
			check: func(t *testing.T, c Config) {
				node, reserve, err := c.NodeSize()
				if err != nil || node.CPU < 1 || node.Memory < 64*envlet.MiB || reserve != envlet.DefaultReserve {
					t.Fatalf("node %v reserve %v err %v", node, reserve, err)
				}
			},
		},
		{
			name: "egress",
			toml: `
[egress]
enforce = true
allow = ["10.0.0.0/8:443/tcp", "mirror.example.com:5000/tcp, [2001:db8::1]:80/tcp"]
resolvers = ["10.96.0.10"]
deny = ["203.0.113.7", "198.51.100.0/24"]
`,
			check: func(t *testing.T, c Config) {
				n, err := c.EgressNode()
				if err != nil || !n.Enforce || len(n.Allow) != 3 || n.Allow[1].Host != "mirror.example.com" {
					t.Fatalf("egress %+v %v", n, err)
				}
				if len(n.Resolvers) != 1 || n.Resolvers[0].String() != "10.96.0.10" {
					t.Fatalf("resolvers %v", n.Resolvers)
				}
				if len(n.Deny) != 2 || n.Deny[0].String() != "203.0.113.7/32" || n.Deny[1].String() != "198.51.100.0/24" {
					t.Fatalf("deny %v", n.Deny)
				}
			},
		},
		{name: "bad egress entry", toml: "[egress]\nallow = [\"10.0.0.1:443\"]\n", wantErr: "allow"},
		{name: "bad egress resolver", toml: "[egress]\nresolvers = [\"dns.example\"]\n", wantErr: "resolvers"},
		{name: "bad egress deny", toml: "[egress]\ndeny = [\"10.0.0.0/40\"]\n", wantErr: "deny"},
		{name: "unknown key", toml: "[node]\ncpus = 2\n", wantErr: "cpus"},
		{name: "unknown knob", toml: "[policy]\ninitial-cpus = \"1\"\n", wantErr: "initial-cpus"},
		{name: "bad memory", toml: "[node]\nmemory = \"lots\"\n", wantErr: "memory"},
		{name: "bad fallback", toml: "[arbiter]\nfallback = \"open\"\n", wantErr: "fallback"},
		{name: "bad reserve", toml: "[node]\nreserve = 1.5\n", wantErr: "reserve"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "envlet.toml")
			if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
				t.Fatal(err)
			}
			c, err := LoadFile(p)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want an error about %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}

func TestLoadEnv(t *testing.T) {
	t.Setenv(EnvVar, filepath.Join(t.TempDir(), "missing.toml"))
	if _, err := Load(); err == nil {
		t.Fatal("a config file named in $ENVLET_CONFIG must exist")
	}
}

func TestGuardLimits(t *testing.T) {
	for _, tc := range []struct {
		toml    string
		want    GuardLimits
		wantErr string
	}{
		{"", GuardLimits{Seccomp: true, Pids: DefaultPids, PidsGrace: DefaultPidsGrace, Output: DefaultOutput, Disk: DefaultDisk, Inodes: DefaultInodes, LSM: true, Protected: DefaultProtected}, ""},
		{"[guard]\nseccomp = \"none\"\npids = 0\noutput = \"0\"\npids-grace = \"5s\"\ndisk = \"0\"\ninodes = 0\nlsm = \"off\"\n", GuardLimits{Pids: 0, PidsGrace: 5 * time.Second, Protected: DefaultProtected}, ""},
		{"[guard]\npids = 128\noutput = \"64Mi\"\ndisk = \"1Gi\"\ninodes = 1000\nprotected = [\"/srv/answers\"]\n", GuardLimits{Seccomp: true, Pids: 128, PidsGrace: DefaultPidsGrace, Output: 64 * envlet.MiB, Disk: envlet.GiB, Inodes: 1000, LSM: true, Protected: append(slices.Clone(DefaultProtected), "/srv/answers")}, ""},
		{"[guard]\nlsm = \"maybe\"\n", GuardLimits{}, "lsm"},
		{"[guard]\nprotected = [\"srv\"]\n", GuardLimits{}, "absolute"},
		{"[guard]\ndisk = \"much\"\n", GuardLimits{}, "disk"},
		{"[guard]\ninodes = -5\n", GuardLimits{}, "inodes"},
		{"[guard]\nseccomp = \"strict\"\n", GuardLimits{}, "seccomp"},
		{"[guard]\npids = -1\n", GuardLimits{}, "pids"},
		{"[guard]\noutput = \"lots\"\n", GuardLimits{}, "output"},
		{"[guard]\npids-grace = \"soon\"\n", GuardLimits{}, "pids-grace"},
	} {
		p := filepath.Join(t.TempDir(), "envlet.toml")
		if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
			t.Fatal(err)
		}
		c, err := LoadFile(p)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%q: err %v, want one about %s", tc.toml, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", tc.toml, err)
		}
		if g, err := c.GuardLimits(); err != nil || !reflect.DeepEqual(g, tc.want) {
			t.Errorf("%q: %+v %v, want %+v", tc.toml, g, err, tc.want)
		}
	}
}

func TestGroupSize(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		toml string
		want int // 0: an error
	}{{"", DefaultGroupSize}, {"[shim]\ngroup-size = 4\n", 4}, {"[shim]\ngroup-size = 1\n", 1}, {"[shim]\ngroup-size = 0\n", 0}} {
		p := filepath.Join(dir, "envlet.toml")
		if err := os.WriteFile(p, []byte(c.toml), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadFile(p)
		switch {
		case c.want == 0 && err == nil:
			t.Errorf("%q: loaded, want an error", c.toml)
		case c.want != 0 && (err != nil || cfg.GroupSize() != c.want):
			t.Errorf("%q: group size %d, %v; want %d", c.toml, cfg.GroupSize(), err, c.want)
		}
	}
}

// NodeOpts bounds memory by what the machine has only when the node's
// memory is left to the machine: a node "of" 1 TiB grows an environment
// past what this machine holds when [node] memory says so, not when the
// size came from the machine (here handed to the arbiter as 1 TiB).
func TestNodeOptsMachineMemory(t *testing.T) {
	total, _, err := envlet.ReadMeminfo()
	if err != nil {
		t.Fatal(err)
	}
	node := envlet.Resources{CPU: 2, Memory: 1 << 40}
	for _, tc := range []struct {
		memory  string
		bounded bool
	}{{"", true}, {"1Ti", false}} {
		var c Config
		c.Node.Memory = tc.memory
		opts, err := c.NodeOpts()
		if err != nil {
			t.Fatal(err)
		}
		a := envlet.NewNodeArbiter(node, envlet.DefaultReserve, opts...)
		if err := a.Admit(context.Background(), "e", envlet.Resources{CPU: 1, Memory: 1 << 30}); err != nil {
			t.Fatal(err)
		}
		got, err := a.Grow(context.Background(), "e", envlet.Resources{CPU: 1, Memory: node.Memory})
		if err != nil {
			t.Fatal(err)
		}
		if bounded := got.Memory < total; bounded != tc.bounded {
			t.Errorf("[node] memory %q: grant %s on a machine of %s; want bounded by the machine %v", tc.memory, envlet.FormatBytes(got.Memory), envlet.FormatBytes(total), tc.bounded)
		}
	}
}
