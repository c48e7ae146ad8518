package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/pelletier/go-toml/v2"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/internal/prereq"
	shimconfig "github.com/envsnap/envsnap/shim/config"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestExampleConfigsLoad loads the shipped example configs with the very
// loaders the daemon and the shim use (unknown keys are errors there), so
// a renamed key fails here rather than on a node.
func TestExampleConfigsLoad(t *testing.T) {
	root := testenv.RepoRoot(t)
	cfg, err := daemon.LoadConfig(filepath.Join(root, "deploy/envsnap/config.toml"), true)
	if err != nil {
		t.Fatalf("daemon config: %v", err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatalf("daemon config: %v", err)
	}
	// The example documents the defaults; where it sets a path it must be
	// the default path the CLI and the other files assume.
	def := daemon.DefaultConfig()
	if cfg.Root != def.Root || cfg.Address != def.Address || cfg.HostsDir != def.HostsDir {
		t.Errorf("example root/address/hosts_dir %s %s %s differ from the defaults %s %s %s",
			cfg.Root, cfg.Address, cfg.HostsDir, def.Root, def.Address, def.HostsDir)
	}

	sc, err := shimconfig.LoadFile(filepath.Join(root, "deploy/envsnap/envlet.toml"))
	if err != nil {
		t.Fatalf("envlet config: %v", err)
	}
	ac, err := sc.ArbiterClient()
	if err != nil {
		t.Fatalf("envlet config: %v", err)
	}
	if ac.Socket != "/run/envsnap/arbiter.sock" {
		t.Errorf("arbiter socket %q, the DaemonSet and the systemd unit use /run/envsnap/arbiter.sock", ac.Socket)
	}
	ec, err := sc.Envlet()
	if err != nil {
		t.Fatalf("envlet policy: %v", err)
	}
	if err := ec.Validate(); err != nil {
		t.Errorf("envlet policy: %v", err)
	}
}

// TestFilesAgreeOnPaths: the socket containerd dials (drop-in), the socket
// the daemon listens on (config), and the one the systemd unit waits for
// must be one path; the units must start the binaries with the shipped
// config files.
func TestFilesAgreeOnPaths(t *testing.T) {
	cfg := readDaemonConfig(t, repoFile(t, "deploy/envsnap/config.toml"))
	var dropin struct {
		ProxyPlugins map[string]struct {
			Type    string            `toml:"type"`
			Address string            `toml:"address"`
			Exports map[string]string `toml:"exports"`
		} `toml:"proxy_plugins"`
	}
	if err := toml.Unmarshal(repoFile(t, "deploy/containerd/envsnap.toml"), &dropin); err != nil {
		t.Fatal(err)
	}
	p, ok := dropin.ProxyPlugins["envsnap"]
	if !ok {
		t.Fatal("drop-in has no proxy plugin envsnap")
	}
	if p.Type != "snapshot" || p.Address != cfg.Address {
		t.Errorf("proxy plugin envsnap: type %q address %q; the daemon listens on %q", p.Type, p.Address, cfg.Address)
	}
	if p.Exports["enable_remote_snapshot_annotations"] != "true" {
		t.Error("proxy plugin does not export enable_remote_snapshot_annotations: transfer-service pulls would send no layer labels")
	}
	// CRI hands kubelet the proxy plugin's root export as envsnap's image
	// and container filesystem (kubelet stats it), but only for snapshotters
	// the image service names: the envlet handler's must be one of them.
	if p.Exports["root"] != cfg.Root {
		t.Errorf("proxy plugin envsnap exports root %q; the daemon's root is %q: kubelet would stat a directory envsnap does not use", p.Exports["root"], cfg.Root)
	}
	var cri map[string]any
	if err := toml.Unmarshal(repoFile(t, "deploy/containerd/envsnap.toml"), &cri); err != nil {
		t.Fatal(err)
	}
	runtimeSnap, _ := lookup(cri, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "envlet", "snapshotter")
	imageSnap, _ := lookup(cri, "plugins", "io.containerd.cri.v1.images", "runtime_platforms", "envlet", "snapshotter")
	if runtimeSnap != "envsnap" || imageSnap != runtimeSnap {
		t.Errorf("drop-in: envlet runtime snapshotter %v, image service runtime_platforms.envlet snapshotter %v: both must be envsnap, or CRI gives envsnap no filesystem path and kubelet's stats summary fails", runtimeSnap, imageSnap)
	}

	unit := string(repoFile(t, "deploy/systemd/containerd-envsnap.service"))
	if !strings.Contains(unit, "containerd-envsnap status --address "+cfg.Address+" ") {
		t.Errorf("containerd-envsnap.service does not wait for the daemon on %s to answer", cfg.Address)
	}
	for _, want := range []string{
		"ExecStart=/usr/local/bin/containerd-envsnap serve --config /etc/envsnap/config.toml\n",
		"Before=containerd.service\n",
	} {
		if !strings.Contains(unit, want) {
			t.Errorf("containerd-envsnap.service lacks %q", want)
		}
	}
	// RequiredBy=/Requires= would take containerd down with a failing or
	// restarted snapshotter; BindsTo=/PartOf= would restart the
	// snapshotter (breaking lazy containers) with every containerd restart.
	if m := regexp.MustCompile(`(?m)^(RequiredBy|Requires|BindsTo|PartOf)=.*containerd`).FindString(unit); m != "" {
		t.Errorf("containerd-envsnap.service ties its life and containerd's together: %s", m)
	}
	// Any of these gives the service a private mount namespace, hiding the
	// layer mounts from containerd.
	privateMounts := regexp.MustCompile(`(?m)^(PrivateMounts|PrivateTmp|ProtectSystem|ProtectHome|ReadOnlyPaths|ReadWritePaths|InaccessiblePaths|TemporaryFileSystem|MountFlags|BindPaths|BindReadOnlyPaths)=`)
	if m := privateMounts.FindString(unit); m != "" {
		t.Errorf("containerd-envsnap.service sets %s: its FUSE mounts would be invisible to containerd", m)
	}
	arb := string(repoFile(t, "deploy/systemd/envsnap-arbiter.service"))
	if !strings.Contains(arb, "ExecStart=/usr/local/bin/containerd-envsnap arbiter --config /etc/envsnap/envlet.toml\n") {
		t.Error("envsnap-arbiter.service does not start the arbiter with /etc/envsnap/envlet.toml")
	}
}

// TestSystemdUnitsVerify runs systemd-analyze verify on the units: unknown
// directives, bad values and bad dependencies are reported there. The only
// complaint accepted is that the binary is not installed at /usr/local/bin
// on this machine.
func TestSystemdUnitsVerify(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		prereq.Missing(t, "systemd-analyze: %v", err)
	}
	for _, unit := range []string{"containerd-envsnap.service", "envsnap-arbiter.service"} {
		// verify wants the unit file under its own name.
		p := filepath.Join(t.TempDir(), unit)
		if err := os.WriteFile(p, repoFile(t, "deploy/systemd/"+unit), 0o644); err != nil {
			t.Fatal(err)
		}
		out, _ := exec.Command(analyze, "verify", p).CombinedOutput()
		for _, line := range strings.Split(string(out), "\n") {
			if line == "" || strings.Contains(line, "Command /usr/local/bin/containerd-envsnap is not executable") {
				continue
			}
			t.Errorf("%s: %s", unit, line)
		}
	}
}

// tomlKeys lists the toml keys of a config struct, descending into nested
// structs (maps are free-form and skipped).
func tomlKeys(t reflect.Type) []string {
	var keys []string
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("toml"), ",")
		if name == "" || name == "-" {
			continue
		}
		ft := f.Type
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch ft.Kind() {
		case reflect.Struct:
			keys = append(keys, tomlKeys(ft)...)
		case reflect.Map:
		default:
			keys = append(keys, name)
		}
	}
	return keys
}

// documented reports whether key is set or shown commented out.
func documented(text, key string) bool {
	return regexp.MustCompile(`(?m)^#? ?` + regexp.QuoteMeta(key) + ` = `).MatchString(text)
}

// TestExampleConfigsDocumentEveryKey: the example files are the reference
// for operators, so every key the loaders accept and every envlet policy
// knob appears in them, and the policy values shown (set or commented out)
// are the built-in defaults.
func TestExampleConfigsDocumentEveryKey(t *testing.T) {
	daemonText := string(repoFile(t, "deploy/envsnap/config.toml"))
	for _, k := range tomlKeys(reflect.TypeFor[daemon.Config]()) {
		if !documented(daemonText, k) {
			t.Errorf("deploy/envsnap/config.toml does not show key %s", k)
		}
	}
	envletText := string(repoFile(t, "deploy/envsnap/envlet.toml"))
	for _, k := range tomlKeys(reflect.TypeFor[shimconfig.Config]()) {
		if !documented(envletText, k) {
			t.Errorf("deploy/envsnap/envlet.toml does not show key %s", k)
		}
	}
	for _, k := range envlet.AnnotationKeys() {
		knob := strings.TrimPrefix(k, envlet.AnnotationPrefix)
		if !documented(envletText, knob) {
			t.Errorf("deploy/envsnap/envlet.toml [policy] does not show knob %s", knob)
		}
	}

	// Uncomment everything and load it: the values shown must be the
	// defaults, or the comments mislead.
	uncommented := regexp.MustCompile(`(?m)^# ([a-z0-9_-]+ = )`).ReplaceAllString(envletText, "$1")
	p := filepath.Join(t.TempDir(), "envlet.toml")
	if err := os.WriteFile(p, []byte(uncommented), 0o644); err != nil {
		t.Fatal(err)
	}
	sc, err := shimconfig.LoadFile(p)
	if err != nil {
		t.Fatalf("envlet.toml with every line uncommented: %v", err)
	}
	got, err := sc.Envlet()
	if err != nil {
		t.Fatal(err)
	}
	if want := envlet.DefaultConfig(); !reflect.DeepEqual(got, want) {
		t.Errorf("envlet.toml shows a policy other than the defaults:\n got %+v\nwant %+v", got, want)
	}
}

// TestExampleConfigHasDropIn: config.toml.example (a whole containerd
// config) and deploy/containerd/envsnap.toml (the drop-in) both claim to be
// complete, so every setting of the drop-in must be in the example with the
// same value; the example may only add main-config settings. containerd
// must load the example as it is.
func TestExampleConfigHasDropIn(t *testing.T) {
	var dropin, example map[string]any
	if err := toml.Unmarshal(repoFile(t, "deploy/containerd/envsnap.toml"), &dropin); err != nil {
		t.Fatal(err)
	}
	exampleText := repoFile(t, "config.toml.example")
	if err := toml.Unmarshal(exampleText, &example); err != nil {
		t.Fatal(err)
	}
	var walk func(path string, want, got any)
	walk = func(path string, want, got any) {
		if wm, ok := want.(map[string]any); ok {
			gm, ok := got.(map[string]any)
			if !ok {
				t.Errorf("config.toml.example: %s is %T, the drop-in has a table", path, got)
				return
			}
			for k, v := range wm {
				walk(path+"."+k, v, gm[k])
			}
			return
		}
		if !reflect.DeepEqual(want, got) {
			t.Errorf("config.toml.example: %s = %v, the drop-in has %v", path, got, want)
		}
	}
	walk("", dropin, example)

	dumped := dumpConfig(t, string(exampleText))
	if v, _ := lookup(dumped, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "envlet", "snapshotter"); v != "envsnap" {
		t.Errorf("containerd config dump of the example: envlet runtime snapshotter %v", v)
	}
}
