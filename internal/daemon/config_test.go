package daemon

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/fetch"
)

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name    string
		toml    string
		want    func(Config) bool
		wantErr bool
	}{
		{"empty file keeps defaults", "", func(c Config) bool { return reflect.DeepEqual(c, DefaultConfig()) && c.HintSources == nil }, false},
		{"hint sources", `hint_sources = ["registry.example", "other.example/envsnap/"]`, func(c Config) bool {
			return reflect.DeepEqual(c.HintSources, []string{"registry.example", "other.example/envsnap/"})
		}, false},
		// Empty is not unset: it allows no source at all.
		{"no hint sources", `hint_sources = []`, func(c Config) bool { return c.HintSources != nil && len(c.HintSources) == 0 }, false},
		{"all fields", `
root = "/srv/envsnap"
address = "/run/x.sock"
hosts_dir = "/etc/hosts.d"
docker_config = "/root/.docker"
metrics_address = "127.0.0.1:9111"
cache_dir = "/cache"
cache_size = "512MiB"
fill = false
read_timeout = "5s"
log_level = "debug"
`, func(c Config) bool {
			return c.Root == "/srv/envsnap" && c.Address == "/run/x.sock" && c.HostsDir == "/etc/hosts.d" &&
				c.DockerConfig == "/root/.docker" && c.MetricsAddress == "127.0.0.1:9111" && c.CacheDir == "/cache" &&
				c.CacheSize == 512<<20 && !c.Fill && time.Duration(c.ReadTimeout) == 5*time.Second && c.LogLevel == "debug"
		}, false},
		{"writable cap", "writable_disk_limit = \"20GiB\"\nwritable_inode_limit = 2000000", func(c Config) bool {
			return c.WritableCap().Bytes == 20<<30 && c.WritableCap().Inodes == 2000000
		}, false},
		{"writable cap by default", `log_level = "info"`, func(c Config) bool {
			return c.WritableCap().Bytes == 20<<30 && c.WritableDiskReserve == 10
		}, false},
		{"writable reserve", "writable_disk_reserve = 5", func(c Config) bool { return c.WritableDiskReserve == 5 }, false},
		{"unknown field", `cache_sise = "1GiB"`, nil, true},
		{"bad size", `cache_size = "lots"`, nil, true},
		{"bad duration", `read_timeout = "soon"`, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name+".toml")
			if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
				t.Fatal(err)
			}
			c, err := LoadConfig(p, true)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tc.wantErr)
			}
			// A misspelt key is named, with its line.
			if tc.name == "unknown field" && !strings.Contains(err.Error(), `"cache_sise" (line 1)`) {
				t.Fatalf("err = %v, want it to name cache_sise", err)
			}
			if err == nil && !tc.want(c) {
				t.Fatalf("config %+v", c)
			}
		})
	}
	if _, err := LoadConfig(filepath.Join(dir, "missing.toml"), false); err != nil {
		t.Errorf("missing default config: %v", err)
	}
	if _, err := LoadConfig(filepath.Join(dir, "missing.toml"), true); err == nil {
		t.Error("missing explicit config accepted")
	}
}

func TestWritableCapValidated(t *testing.T) {
	for _, tc := range []struct {
		bytes  Size
		inodes int64
		ok     bool
	}{{0, 0, true}, {20 << 30, 0, true}, {1 << 20, 0, false}, {20 << 30, -1, false}} {
		c := DefaultConfig()
		c.WritableDiskLimit, c.WritableInodeLimit = tc.bytes, tc.inodes
		if err := c.Validate(); (err == nil) != tc.ok {
			t.Errorf("writable_disk_limit %d, writable_inode_limit %d: %v", tc.bytes, tc.inodes, err)
		}
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		bad  bool
	}{
		{"1048576", 1 << 20, false},
		{"20GiB", 20 << 30, false},
		{"1.5GB", 1500000000, false},
		{"64M", 64 << 20, false},
		{"7B", 7, false},
		{"-1", 0, true},
		{"GiB", 0, true},
		{"12 apples", 0, true},
	} {
		got, err := ParseSize(tc.in)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v", tc.in, got, err)
		}
	}
	if s := Size(20 << 30).String(); s != "20GiB" {
		t.Errorf("Size.String = %q", s)
	}
	if n, _ := ParseSize(DefaultCacheSize.String()); n != int64(DefaultCacheSize) {
		t.Errorf("default cache size does not round-trip")
	}
}

// TestDeployedConfigLoads keeps the shipped example config in step with
// the Config struct (unknown keys are errors).
func TestDeployedConfigLoads(t *testing.T) {
	c, err := LoadConfig("../../deploy/envsnap/config.toml", true)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestMetricsAddressDefaultsToLoopback: a metrics address without a host
// listens on loopback, not on every interface.
func TestMetricsAddressDefaultsToLoopback(t *testing.T) {
	for in, want := range map[string]string{
		"":             "",
		":9166":        "127.0.0.1:9166",
		"0.0.0.0:9166": "0.0.0.0:9166",
		"[::1]:9166":   "[::1]:9166",
	} {
		c := DefaultConfig()
		c.MetricsAddress = in
		if err := c.Validate(); err != nil || c.MetricsAddress != want {
			t.Errorf("metrics_address %q: got %q, %v; want %q", in, c.MetricsAddress, err, want)
		}
	}
	c := DefaultConfig()
	c.MetricsAddress = "9166"
	if err := c.Validate(); err == nil {
		t.Error("metrics_address without a port accepted")
	}
}

func TestPeerConfig(t *testing.T) {
	for _, tc := range []struct {
		name    string
		toml    string
		wantErr bool
	}{
		{"off needs nothing", "[peers]\nenabled = false\n", false},
		{"static with token", "[peers]\nenabled = true\nmembers = [\"10.0.0.1:9168\", \"10.0.0.2:9168\"]\ntoken_file = \"/t\"\n", false},
		{"dns with tls", "[peers]\nenabled = true\ndns = \"peers.ns.svc\"\ntls_cert = \"/c\"\ntls_key = \"/k\"\ntls_ca = \"/ca\"\n", false},
		{"no authentication", "[peers]\nenabled = true\nmembers = [\"10.0.0.1:9168\"]\n", true},
		{"half tls", "[peers]\nenabled = true\nmembers = [\"10.0.0.1:9168\"]\ntls_cert = \"/c\"\n", true},
		{"no member source", "[peers]\nenabled = true\ntoken_file = \"/t\"\n", true},
		{"two member sources", "[peers]\nenabled = true\ntoken_file = \"/t\"\ndns = \"a\"\nmembers_file = \"/m\"\n", true},
		{"bad member", "[peers]\nenabled = true\ntoken_file = \"/t\"\nmembers = [\"10.0.0.1\"]\n", true},
		{"negative hedge", "[peers]\nenabled = true\ntoken_file = \"/t\"\ndns = \"a\"\nhedge_after = \"-1s\"\n", true},
		{"timeout shorter than owners' progress reports", "[peers]\nenabled = true\ntoken_file = \"/t\"\ndns = \"a\"\ntimeout = \"500ms\"\n", true},
		{"timeout of a second", "[peers]\nenabled = true\ntoken_file = \"/t\"\ndns = \"a\"\ntimeout = \"1s\"\n", false},
		{"unknown key", "[peers]\nenable = true\n", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "c.toml")
			if err := os.WriteFile(p, []byte(tc.toml), 0o600); err != nil {
				t.Fatal(err)
			}
			c, err := LoadConfig(p, true)
			if err == nil {
				err = c.Validate()
			}
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tc.wantErr)
			}
			// A misspelt key is named, with its line.
			if tc.name == "unknown field" && !strings.Contains(err.Error(), `"cache_sise" (line 1)`) {
				t.Fatalf("err = %v, want it to name cache_sise", err)
			}
			if err == nil && c.Peers.Enabled && (c.Peers.Listen != DefaultPeerListen || c.Peers.Refresh != DefaultPeerRefresh) {
				t.Errorf("defaults not filled: %+v", c.Peers)
			}
		})
	}
}

// TestFillPolicyConfig: [fill_policy] sets the durations it names, keeps
// the measured defaults for the others, and refuses negative ones.
func TestFillPolicyConfig(t *testing.T) {
	def := fetch.DefaultFillPolicy()
	if got := DefaultConfig().FillPolicy.Policy(); got != def {
		t.Fatalf("default config's fill policy %+v, want fetch.DefaultFillPolicy %+v", got, def)
	}
	c := loadValid(t, "[fill_policy]\nquiet = \"50ms\"\nstartup = \"0s\"\nfree_cpu = 0.5\nsmall_layer = \"8MiB\"\n")
	want := def
	want.Quiet, want.Startup, want.SmallLayer = 50*time.Millisecond, 0, 8<<20
	if got := c.FillPolicy.Policy(); got != want {
		t.Errorf("fill policy %+v, want %+v", got, want)
	}
	// free_cpu still loads (configurations of earlier daemons) and is
	// reported as ignored.
	if !c.FillPolicy.FreeCPUIgnored() || DefaultConfig().FillPolicy.FreeCPUIgnored() {
		t.Errorf("free_cpu ignored: %v with it set, %v by default", c.FillPolicy.FreeCPUIgnored(), DefaultConfig().FillPolicy.FreeCPUIgnored())
	}
	bad := c
	bad.FillPolicy.MaxPause = Duration(-time.Second)
	if err := bad.Validate(); err == nil {
		t.Error("negative fill_policy.max_pause accepted")
	}
	bad = c
	bad.FillPolicy.SmallLayer = -1
	if err := bad.Validate(); err == nil {
		t.Error("negative fill_policy.small_layer accepted")
	}
}

// TestPrefetchPolicyConfig: [prefetch_policy] likewise.
func TestPrefetchPolicyConfig(t *testing.T) {
	def := fetch.DefaultPrefetchPolicy()
	if got := DefaultConfig().PrefetchPolicy.Policy(); got != def {
		t.Fatalf("default config's prefetch policy %+v, want fetch.DefaultPrefetchPolicy %+v", got, def)
	}
	c := loadValid(t, "[prefetch_policy]\nbatch = \"8MiB\"\ninflight = 12\nlead = \"0s\"\n")
	want := def
	want.Batch, want.Inflight, want.Lead = 8<<20, 12, 0
	if got := c.PrefetchPolicy.Policy(); got != want {
		t.Errorf("prefetch policy %+v, want %+v", got, want)
	}
	c.PrefetchPolicy.Inflight = 0
	if err := c.Validate(); err == nil {
		t.Error("prefetch_policy.inflight 0 accepted")
	}
}

// loadValid loads the configuration text over the defaults and validates it.
func loadValid(t *testing.T, text string) Config {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.toml")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := LoadConfig(p, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestServeNiceConfig: serve_nice defaults to DefaultServeNice, 0 leaves
// the threads alone, and a value outside nice's range is refused.
func TestServeNiceConfig(t *testing.T) {
	if got := DefaultConfig().ServeNice; got != DefaultServeNice {
		t.Errorf("default serve_nice %d, want %d", got, DefaultServeNice)
	}
	if c := loadValid(t, "serve_nice = 0\n"); c.ServeNice != 0 {
		t.Errorf("serve_nice = 0 loaded as %d", c.ServeNice)
	}
	for _, n := range []int{-21, 20} {
		c := DefaultConfig()
		c.ServeNice = n
		if err := c.Validate(); err == nil {
			t.Errorf("serve_nice %d accepted", n)
		}
	}
}
