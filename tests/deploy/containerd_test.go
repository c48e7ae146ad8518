package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/pelletier/go-toml/v2"

	"github.com/envsnap/envsnap/tests/testenv"
)

// lookup walks nested TOML tables.
func lookup(m map[string]any, keys ...string) (any, bool) {
	var cur any = m
	for _, k := range keys {
		t, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = t[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}

func strs(v any) []string {
	l, _ := v.([]any)
	out := make([]string, 0, len(l))
	for _, e := range l {
		out = append(out, fmt.Sprint(e))
	}
	return out
}

// dumpConfig returns the configuration containerd itself computes from
// mainConfig and everything it imports (`containerd config dump`: the
// same loader, migrations and merge as the daemon).
func dumpConfig(t *testing.T, mainConfig string) map[string]any {
	t.Helper()
	p := filepath.Join(t.TempDir(), "config.toml")
	if err := os.WriteFile(p, []byte(mainConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(testenv.Tool(t, "containerd"), "--config", p, "config", "dump")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("containerd config dump: %v\n%s", err, stderr.String())
	}
	var m map[string]any
	if err := toml.Unmarshal(out, &m); err != nil {
		t.Fatalf("parse config dump: %v\n%s", err, out)
	}
	return m
}

// TestDropInMerge pins down how containerd merges the drop-in into the
// main configs nodes really have, with containerd's own loader:
//   - tables merge key by key: the node's runtimes and their options stay;
//   - arrays are replaced: the node's unpack_config list is dropped;
//   - booleans set in the drop-in win over the main config (true -> false);
//   - a version 2 main config is migrated on its own before the merge, so
//     the drop-in's version 3 does not skip the main config's migration.
func TestDropInMerge(t *testing.T) {
	dropin := filepath.Join(testenv.RepoRoot(t), "deploy/containerd/envsnap.toml")
	confd := t.TempDir()
	if err := os.WriteFile(filepath.Join(confd, "envsnap.toml"), repoFile(t, "deploy/containerd/envsnap.toml"), 0o644); err != nil {
		t.Fatal(err)
	}
	glob := filepath.Join(confd, "*.toml")
	for _, tc := range []struct {
		name       string
		main       string
		wantRunc   bool // main config's runc runtime with SystemdCgroup survives
		wantEnvlet bool
	}{
		{
			name:       "imports glob, otherwise empty",
			main:       fmt.Sprintf("version = 3\nimports = [%q]\n", glob),
			wantEnvlet: true,
		},
		{
			name: "version 3 node config",
			main: fmt.Sprintf(`version = 3
imports = [%q]
[plugins."io.containerd.transfer.v1.local"]
  [[plugins."io.containerd.transfer.v1.local".unpack_config]]
    platform = "linux/amd64"
    snapshotter = "erofs"
[plugins."io.containerd.cri.v1.images"]
  disable_snapshot_annotations = true
[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
      SystemdCgroup = true
`, dropin),
			wantRunc:   true,
			wantEnvlet: true,
		},
		{
			name: "version 2 node config (containerd 1.x style CRI section)",
			main: fmt.Sprintf(`version = 2
imports = [%q]
[plugins."io.containerd.grpc.v1.cri".containerd]
  disable_snapshot_annotations = true
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = true
`, dropin),
			wantRunc:   true,
			wantEnvlet: true,
		},
		{
			// Negative control: without the imports line nothing of the
			// drop-in arrives (and this test would notice a broken parser).
			name: "no imports",
			main: "version = 3\n",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := dumpConfig(t, tc.main)

			proxyType, _ := lookup(m, "proxy_plugins", "envsnap", "type")
			exports, _ := lookup(m, "proxy_plugins", "envsnap", "exports", "enable_remote_snapshot_annotations")
			rtType, _ := lookup(m, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "envlet", "runtime_type")
			snap, _ := lookup(m, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "envlet", "snapshotter")
			podAnn, _ := lookup(m, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "envlet", "pod_annotations")
			disable, _ := lookup(m, "plugins", "io.containerd.cri.v1.images", "disable_snapshot_annotations")
			unpack, _ := lookup(m, "plugins", "io.containerd.transfer.v1.local", "unpack_config")
			var unpackSnapshotters []string
			list, _ := unpack.([]any)
			for _, u := range list {
				um, _ := u.(map[string]any)
				s, _ := lookup(um, "snapshotter")
				unpackSnapshotters = append(unpackSnapshotters, fmt.Sprint(s))
			}

			if !tc.wantEnvlet {
				if proxyType != nil || rtType != nil {
					t.Errorf("drop-in applied without an imports line: proxy %v runtime %v", proxyType, rtType)
				}
				if disable != true {
					t.Errorf("disable_snapshot_annotations = %v without the drop-in, want containerd's Linux default true", disable)
				}
				return
			}
			if proxyType != "snapshot" || exports != "true" {
				t.Errorf("proxy plugin envsnap: type %v, enable_remote_snapshot_annotations %v", proxyType, exports)
			}
			if rtType != "io.containerd.envlet.v2" || snap != "envsnap" {
				t.Errorf("CRI runtime envlet: runtime_type %v snapshotter %v", rtType, snap)
			}
			if !slices.Contains(strs(podAnn), "io.envsnap.envlet.*") {
				t.Errorf("CRI runtime envlet pod_annotations %v do not pass envlet annotations", podAnn)
			}
			if disable != false {
				t.Errorf("disable_snapshot_annotations = %v, want false (drop-in wins over the main config)", disable)
			}
			if !slices.Equal(unpackSnapshotters, []string{"overlayfs", "envsnap"}) {
				t.Errorf("unpack_config snapshotters = %v, want the drop-in's list [overlayfs envsnap] replacing the main config's", unpackSnapshotters)
			}
			sc, _ := lookup(m, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "runc", "options", "SystemdCgroup")
			if tc.wantRunc && sc != true {
				t.Errorf("main config's runc SystemdCgroup = %v after the merge, want true", sc)
			}
		})
	}
}

// TestDropInLoadsInContainerd starts a real containerd whose main config
// only imports the shipped drop-in, and asks it what it loaded: the proxy
// snapshotter plugin (through the introspection API) and the CRI runtime
// handler (through crictl info, what kubelet sees).
func TestDropInLoadsInContainerd(t *testing.T) {
	testenv.RequireRoot(t)
	// Unix socket paths are limited to 108 bytes: keep the directory short.
	dir, err := os.MkdirTemp("", "envsnap-deploy-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if m := testenv.MountsBelow(dir); len(m) > 0 {
			t.Errorf("mounts left below %s: %v", dir, m)
		}
		os.RemoveAll(dir)
	})
	address := filepath.Join(dir, "containerd.sock")
	main := fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
imports = [%[3]q]
[grpc]
  address = %[4]q
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins."io.containerd.nri.v1.nri"]
    disable = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%[5]q]
    conf_dir = %[5]q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"),
		filepath.Join(testenv.RepoRoot(t), "deploy/containerd/envsnap.toml"), address, filepath.Join(dir, "cni"))
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(main), 0o600); err != nil {
		t.Fatal(err)
	}
	proc := testenv.StartProcess(t, dir, "containerd", nil, testenv.Tool(t, "containerd"), "--config", cfgPath)

	var c *client.Client
	deadline := time.Now().Add(30 * time.Second)
	for {
		if exited, err := proc.Exited(); exited {
			t.Fatalf("containerd exited: %v\n%s", err, proc.LogTail(40))
		}
		if _, err := os.Stat(address); err == nil {
			if c, err = client.New(address, client.WithTimeout(5*time.Second)); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd did not serve on %s\n%s", address, proc.LogTail(40))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	resp, err := c.IntrospectionService().Plugins(ctx, `type=="io.containerd.snapshotter.v1",id=="envsnap"`)
	if err != nil {
		t.Fatalf("introspection: %v", err)
	}
	if len(resp.Plugins) != 1 {
		t.Fatalf("snapshotter plugin envsnap: %d plugins registered, want 1\n%s", len(resp.Plugins), proc.LogTail(40))
	}
	p := resp.Plugins[0]
	if p.InitErr != nil {
		t.Errorf("envsnap plugin failed to initialize: %v", p.InitErr)
	}
	if p.Exports["enable_remote_snapshot_annotations"] != "true" {
		t.Errorf("envsnap plugin exports %v: no enable_remote_snapshot_annotations", p.Exports)
	}
	if p.Exports["address"] != "/run/containerd-envsnap/containerd-envsnap.sock" {
		t.Errorf("envsnap plugin address %q", p.Exports["address"])
	}
	for _, id := range []string{`type=="io.containerd.grpc.v1",id=="cri"`, `type=="io.containerd.transfer.v1",id=="local"`} {
		r, err := c.IntrospectionService().Plugins(ctx, id)
		if err != nil || len(r.Plugins) != 1 || r.Plugins[0].InitErr != nil {
			t.Errorf("plugin %s did not load: %v %+v", id, err, r)
		}
	}

	out, err := exec.CommandContext(ctx, testenv.Tool(t, "crictl"),
		"--runtime-endpoint", "unix://"+address, "--image-endpoint", "unix://"+address, "info").Output()
	if err != nil {
		t.Fatalf("crictl info: %v", err)
	}
	var info struct {
		Config struct {
			Containerd struct {
				Runtimes map[string]struct {
					RuntimeType    string   `json:"runtimeType"`
					Snapshotter    string   `json:"snapshotter"`
					PodAnnotations []string `json:"PodAnnotations"`
					Options        any      `json:"options"`
				} `json:"runtimes"`
			} `json:"containerd"`
		} `json:"config"`
		RuntimeHandlers []struct {
			Name string `json:"name"`
		} `json:"runtimeHandlers"`
	}
	if err := json.Unmarshal(out, &info); err != nil {
		t.Fatalf("crictl info: %v\n%s", err, out)
	}
	rt, ok := info.Config.Containerd.Runtimes["envlet"]
	if !ok {
		t.Fatalf("CRI has no runtime envlet: %s", out)
	}
	if rt.RuntimeType != "io.containerd.envlet.v2" || rt.Snapshotter != "envsnap" || rt.Options != nil {
		t.Errorf("CRI runtime envlet = %+v", rt)
	}
	if !slices.Contains(rt.PodAnnotations, "io.envsnap.envlet.*") {
		t.Errorf("CRI runtime envlet pod annotations %v", rt.PodAnnotations)
	}
	if !slices.ContainsFunc(info.RuntimeHandlers, func(h struct {
		Name string `json:"name"`
	}) bool {
		return h.Name == "envlet"
	}) {
		t.Errorf("CRI runtime handlers %v do not include envlet (what kubelet matches a RuntimeClass against)", info.RuntimeHandlers)
	}
}
