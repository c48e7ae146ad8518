// Package deploy tests what deploy/ ships: the Kubernetes manifests decode
// strictly into the Kubernetes API types and say what the node daemon needs
// (privileges, FUSE, mount propagation, probes on the metrics port); the
// files that must agree with each other (daemon config, containerd drop-in,
// ConfigMap copies, systemd units) agree; the node installer installs; and
// a real containerd loads the drop-in and exposes the snapshotter and the
// runtime handler.
package deploy

import (
	"bytes"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pelletier/go-toml/v2"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

var update = flag.Bool("update", false, "rewrite deploy/kubernetes/configmap.yaml from its source files")

const (
	namespace     = "envsnap-system"
	configMapName = "envsnap-config"
)

// configMapSources maps each ConfigMap key to the file under deploy/ it
// copies. kustomize refuses files outside the kustomization directory, so
// the copies are checked here instead of generated at apply time.
var configMapSources = []struct{ key, file string }{
	{"config.toml", "deploy/envsnap/config.toml"},
	{"envlet.toml", "deploy/envsnap/envlet.toml"},
	{"containerd-envsnap.toml", "deploy/containerd/envsnap.toml"},
	{"install-node.sh", "deploy/install-node.sh"},
}

func repoFile(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// splitDocs splits a YAML stream at its "---" lines, dropping empty
// documents.
func splitDocs(b []byte) [][]byte {
	var docs [][]byte
	var cur bytes.Buffer
	flush := func() {
		if len(bytes.TrimSpace(stripComments(cur.Bytes()))) > 0 {
			docs = append(docs, append([]byte(nil), cur.Bytes()...))
		}
		cur.Reset()
	}
	for _, line := range strings.SplitAfter(string(b), "\n") {
		if strings.TrimRight(line, "\r\n") == "---" {
			flush()
			continue
		}
		cur.WriteString(line)
	}
	flush()
	return docs
}

func stripComments(b []byte) []byte {
	var out bytes.Buffer
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			out.WriteString(line + "\n")
		}
	}
	return out.Bytes()
}

// objects is every object of the manifests, by kind.
type objects struct {
	namespaces      []corev1.Namespace
	serviceAccounts []corev1.ServiceAccount
	configMaps      []corev1.ConfigMap
	daemonSets      []appsv1.DaemonSet
	runtimeClasses  []nodev1.RuntimeClass
	clusterRoles    []rbacv1.ClusterRole
	roleBindings    []rbacv1.ClusterRoleBinding
	services        []corev1.Service
}

// decodeStrict decodes one document into its typed Kubernetes object.
// Unknown or duplicate fields are errors, so a misspelt or misplaced field
// (mountPropagation one level too high, say) fails here instead of being
// dropped silently by the API server's defaulting.
func (o *objects) decodeStrict(doc []byte) error {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &head); err != nil {
		return fmt.Errorf("read apiVersion/kind: %w", err)
	}
	var err error
	switch head.APIVersion + "/" + head.Kind {
	case "v1/Namespace":
		var v corev1.Namespace
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.namespaces = append(o.namespaces, v)
		}
	case "v1/ServiceAccount":
		var v corev1.ServiceAccount
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.serviceAccounts = append(o.serviceAccounts, v)
		}
	case "v1/ConfigMap":
		var v corev1.ConfigMap
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.configMaps = append(o.configMaps, v)
		}
	case "apps/v1/DaemonSet":
		var v appsv1.DaemonSet
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.daemonSets = append(o.daemonSets, v)
		}
	case "v1/Service":
		var v corev1.Service
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.services = append(o.services, v)
		}
	case "node.k8s.io/v1/RuntimeClass":
		var v nodev1.RuntimeClass
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.runtimeClasses = append(o.runtimeClasses, v)
		}
	case "rbac.authorization.k8s.io/v1/ClusterRole":
		var v rbacv1.ClusterRole
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.clusterRoles = append(o.clusterRoles, v)
		}
	case "rbac.authorization.k8s.io/v1/ClusterRoleBinding":
		var v rbacv1.ClusterRoleBinding
		if err = yaml.UnmarshalStrict(doc, &v); err == nil {
			o.roleBindings = append(o.roleBindings, v)
		}
	default:
		return fmt.Errorf("unexpected object %s %s", head.APIVersion, head.Kind)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", head.Kind, err)
	}
	return nil
}

type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
	Images     []struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
	} `json:"images"`
}

func readKustomization(t *testing.T) kustomization {
	t.Helper()
	var k kustomization
	if err := yaml.UnmarshalStrict(repoFile(t, "deploy/kubernetes/kustomization.yaml"), &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	return k
}

// loadManifests decodes every resource the kustomization lists.
func loadManifests(t *testing.T) *objects {
	t.Helper()
	k := readKustomization(t)
	o := &objects{}
	for _, r := range k.Resources {
		docs := splitDocs(repoFile(t, path.Join("deploy/kubernetes", r)))
		if len(docs) == 0 {
			t.Errorf("%s: no objects", r)
		}
		for i, d := range docs {
			if err := o.decodeStrict(d); err != nil {
				t.Errorf("%s document %d: %v", r, i, err)
			}
		}
	}
	return o
}

// TestKustomizationListsEveryManifest: a manifest missing from
// kustomization.yaml is never applied; a listed one that is missing breaks
// `kubectl apply -k`.
func TestKustomizationListsEveryManifest(t *testing.T) {
	k := readKustomization(t)
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("kustomization.yaml is %s %s", k.APIVersion, k.Kind)
	}
	files, err := filepath.Glob(filepath.Join(testenv.RepoRoot(t), "deploy/kubernetes/*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, f := range files {
		if b := filepath.Base(f); b != "kustomization.yaml" {
			want = append(want, b)
		}
	}
	got := slices.Sorted(slices.Values(k.Resources))
	if !slices.Equal(got, want) {
		t.Errorf("kustomization resources = %v, manifests in deploy/kubernetes = %v", got, want)
	}
}

// TestManifestsDecodeStrict decodes every object and checks the references
// between them that the API server would only catch at apply time, or
// never: volume names, probe port names, ConfigMap keys, the namespace and
// service account.
func TestManifestsDecodeStrict(t *testing.T) {
	o := loadManifests(t)
	if len(o.namespaces) != 1 || o.namespaces[0].Name != namespace {
		t.Fatalf("want one Namespace %s, got %d", namespace, len(o.namespaces))
	}
	if got := o.namespaces[0].Labels["pod-security.kubernetes.io/enforce"]; got != "privileged" {
		t.Errorf("namespace pod-security enforce = %q: a privileged DaemonSet is rejected under baseline/restricted", got)
	}
	if len(o.daemonSets) != 1 || len(o.configMaps) != 1 || len(o.serviceAccounts) != 1 || len(o.runtimeClasses) != 1 {
		t.Fatalf("want one DaemonSet, ConfigMap, ServiceAccount and RuntimeClass; got %d, %d, %d, %d",
			len(o.daemonSets), len(o.configMaps), len(o.serviceAccounts), len(o.runtimeClasses))
	}
	ds, cm, sa := o.daemonSets[0], o.configMaps[0], o.serviceAccounts[0]
	for _, m := range []struct {
		kind, ns string
	}{{"DaemonSet", ds.Namespace}, {"ConfigMap", cm.Namespace}, {"ServiceAccount", sa.Namespace}} {
		if m.ns != namespace {
			t.Errorf("%s namespace = %q, want %q", m.kind, m.ns, namespace)
		}
	}
	if o.runtimeClasses[0].Namespace != "" {
		t.Errorf("RuntimeClass is cluster-scoped but has namespace %q", o.runtimeClasses[0].Namespace)
	}
	spec := ds.Spec.Template.Spec
	if spec.ServiceAccountName != sa.Name {
		t.Errorf("DaemonSet service account %q, ServiceAccount is %q", spec.ServiceAccountName, sa.Name)
	}
	sel := ds.Spec.Selector.MatchLabels
	for k, v := range sel {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("selector %s=%s does not match the pod template labels %v", k, v, ds.Spec.Template.Labels)
		}
	}
	if len(sel) == 0 {
		t.Error("DaemonSet has an empty selector")
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		if _, dup := volumes[v.Name]; dup {
			t.Errorf("volume %s defined twice", v.Name)
		}
		volumes[v.Name] = v
		if v.ConfigMap != nil && v.ConfigMap.Name != cm.Name {
			t.Errorf("volume %s uses ConfigMap %q, the manifests define %q", v.Name, v.ConfigMap.Name, cm.Name)
		}
	}
	used := map[string]bool{}
	all := append(append([]corev1.Container(nil), spec.InitContainers...), spec.Containers...)
	for _, c := range all {
		ports := map[string]bool{}
		for _, p := range c.Ports {
			ports[p.Name] = true
		}
		for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
			if p != nil && p.HTTPGet != nil && p.HTTPGet.Port.StrVal != "" && !ports[p.HTTPGet.Port.StrVal] {
				t.Errorf("container %s: probe port %q is not one of its ports", c.Name, p.HTTPGet.Port.StrVal)
			}
		}
		for _, m := range c.VolumeMounts {
			v, ok := volumes[m.Name]
			if !ok {
				t.Errorf("container %s mounts undefined volume %s", c.Name, m.Name)
				continue
			}
			used[m.Name] = true
			if v.ConfigMap != nil && m.SubPath != "" {
				if _, ok := cm.Data[m.SubPath]; !ok {
					t.Errorf("container %s mounts ConfigMap key %q, which %s does not have", c.Name, m.SubPath, cm.Name)
				}
			}
		}
		if strings.HasPrefix(c.Image, metricsProxyImage+":") {
			continue // a third-party image, pinned by tag
		}
		if c.Image == "" || !strings.HasPrefix(c.Image, "ghcr.io/envsnap/envsnap:") {
			t.Errorf("container %s image %q: kustomization.yaml's images entry would not retag it", c.Name, c.Image)
		}
	}
	for name := range volumes {
		if !used[name] {
			t.Errorf("volume %s is never mounted", name)
		}
	}
}

func findContainer(t *testing.T, cs []corev1.Container, name string) corev1.Container {
	t.Helper()
	for _, c := range cs {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return corev1.Container{}
}

func findMount(c corev1.Container, mountPath string) (corev1.VolumeMount, bool) {
	for _, m := range c.VolumeMounts {
		if m.MountPath == mountPath {
			return m, true
		}
	}
	return corev1.VolumeMount{}, false
}

func volumeByName(spec corev1.PodSpec, name string) corev1.Volume {
	for _, v := range spec.Volumes {
		if v.Name == name {
			return v
		}
	}
	return corev1.Volume{}
}

// daemonConfig is the part of deploy/envsnap/config.toml the manifests
// must agree with.
type daemonConfig struct {
	Root         string `toml:"root"`
	Address      string `toml:"address"`
	HostsDir     string `toml:"hosts_dir"`
	DockerConfig string `toml:"docker_config"`
}

func readDaemonConfig(t *testing.T, b []byte) daemonConfig {
	t.Helper()
	var c daemonConfig
	if err := toml.Unmarshal(b, &c); err != nil {
		t.Fatalf("config.toml: %v", err)
	}
	return c
}

// TestDaemonSetEssentials checks what the snapshotter cannot work without
// on a node, against the daemon's own config file.
func TestDaemonSetEssentials(t *testing.T) {
	o := loadManifests(t)
	if t.Failed() || len(o.daemonSets) != 1 || len(o.configMaps) != 1 {
		t.FailNow()
	}
	ds := o.daemonSets[0]
	spec := ds.Spec.Template.Spec
	cfg := readDaemonConfig(t, []byte(o.configMaps[0].Data["config.toml"]))
	sn := findContainer(t, spec.Containers, "snapshotter")

	if sc := sn.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Error("snapshotter is not privileged: FUSE and overlay mounts with host propagation need it")
	}
	// The keeper must outlive the pod: the snapshotter launches it in the
	// host's mount namespace (PID 1's, hence hostPID) as a systemd unit,
	// from the binary the installer puts on the host.
	keeper := ""
	if i := slices.Index(sn.Args, "--keeper-command"); i >= 0 && i+1 < len(sn.Args) {
		keeper = sn.Args[i+1]
	}
	if !strings.HasPrefix(keeper, "nsenter --target 1 --mount -- systemd-run ") || !strings.HasSuffix(keeper, " /usr/local/bin/containerd-envsnap") {
		t.Errorf("snapshotter --keeper-command %q: want the keeper launched on the host (nsenter --target 1 --mount -- systemd-run ... /usr/local/bin/containerd-envsnap)", keeper)
	}
	if !spec.HostPID {
		t.Error("hostPID is not set: nsenter --target 1 would enter the pod's own namespaces, and the keeper would die with the pod")
	}
	if ds.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Errorf("update strategy %q: a rolling restart of the snapshotter breaks running lazy containers", ds.Spec.UpdateStrategy.Type)
	}
	if !slices.ContainsFunc(spec.Tolerations, func(tl corev1.Toleration) bool {
		return tl.Operator == corev1.TolerationOpExists && tl.Key == "" && tl.Effect == ""
	}) {
		t.Error("no catch-all toleration: tainted nodes would get no snapshotter")
	}

	// hostPath checks: the mount in the container, the hostPath behind it.
	type hostMount struct {
		mountPath, hostPath string
		hostType            corev1.HostPathType
		propagation         corev1.MountPropagationMode // "" = none required
		readOnly            bool
	}
	for _, want := range []hostMount{
		{"/dev/fuse", "/dev/fuse", corev1.HostPathCharDev, "", false},
		// containerd mounts overlays over the FUSE mounts below root: they
		// must propagate back to the host.
		{cfg.Root, cfg.Root, corev1.HostPathDirectoryOrCreate, corev1.MountPropagationBidirectional, false},
		{filepath.Dir(cfg.Address), filepath.Dir(cfg.Address), corev1.HostPathDirectoryOrCreate, "", false},
		{cfg.HostsDir, cfg.HostsDir, corev1.HostPathDirectoryOrCreate, "", true},
		{filepath.Dir(cfg.DockerConfig), filepath.Dir(cfg.DockerConfig), corev1.HostPathDirectoryOrCreate, "", true},
	} {
		m, ok := findMount(sn, want.mountPath)
		if !ok {
			t.Errorf("snapshotter does not mount %s", want.mountPath)
			continue
		}
		v := volumeByName(spec, m.Name)
		if v.HostPath == nil || v.HostPath.Path != want.hostPath {
			t.Errorf("%s: volume %s is not hostPath %s: %+v", want.mountPath, m.Name, want.hostPath, v.VolumeSource)
			continue
		}
		if v.HostPath.Type == nil || *v.HostPath.Type != want.hostType {
			t.Errorf("%s: hostPath type %v, want %s", want.mountPath, v.HostPath.Type, want.hostType)
		}
		if want.propagation != "" && (m.MountPropagation == nil || *m.MountPropagation != want.propagation) {
			t.Errorf("%s: mount propagation %v, want %s", want.mountPath, m.MountPropagation, want.propagation)
		}
		if m.ReadOnly != want.readOnly {
			t.Errorf("%s: readOnly = %v, want %v", want.mountPath, m.ReadOnly, want.readOnly)
		}
	}

	// The daemon must read the config the checks above were made against.
	if !slices.Equal(sn.Args[:3], []string{"serve", "--config", "/etc/envsnap/config.toml"}) {
		t.Errorf("snapshotter args %v: want serve --config /etc/envsnap/config.toml", sn.Args)
	}
	if m, ok := findMount(sn, "/etc/envsnap/config.toml"); !ok || m.SubPath != "config.toml" {
		t.Errorf("config.toml is not mounted from the ConfigMap at /etc/envsnap/config.toml: %+v", m)
	}

	// Status and health are served only on the root-only unix socket (the
	// pod's addresses are the node's): the probes run the status client
	// against the daemon's configured socket, and the metrics address, if
	// any, is loopback.
	if slices.Contains(sn.Args, "--metrics-address") {
		t.Errorf("snapshotter args %v: the metrics address belongs in config.toml (loopback)", sn.Args)
	}
	var snCfg struct {
		Address        string `toml:"address"`
		MetricsAddress string `toml:"metrics_address"`
	}
	if err := toml.Unmarshal([]byte(o.configMaps[0].Data["config.toml"]), &snCfg); err != nil {
		t.Fatal(err)
	}
	if host, _, err := net.SplitHostPort(snCfg.MetricsAddress); snCfg.MetricsAddress != "" && (err != nil || (host != "" && !net.ParseIP(host).IsLoopback())) {
		t.Errorf("metrics_address %q is not loopback: under host networking every container reaching the node could read it", snCfg.MetricsAddress)
	}
	// The one port on the node's addresses is the peer tier's, which
	// serves nothing without a token or a client certificate (the daemon
	// refuses to enable peers without one; TestPeersService).
	if len(sn.Ports) != 1 || sn.Ports[0].Name != "peer" {
		t.Errorf("snapshotter declares ports %v; it serves only the authenticated peer port on the pod's (the node's) addresses", sn.Ports)
	}
	want := []string{"/usr/local/bin/containerd-envsnap", "status", "--address", snCfg.Address}
	for name, p := range map[string]*corev1.Probe{"readiness": sn.ReadinessProbe, "liveness": sn.LivenessProbe} {
		if p == nil || p.Exec == nil || !slices.Equal(p.Exec.Command, want) {
			t.Errorf("%s probe %+v, want exec %v", name, p, want)
		}
	}
	if sn.Resources.Requests.Cpu().IsZero() || sn.Resources.Requests.Memory().IsZero() {
		t.Error("snapshotter has no CPU/memory requests")
	}
	if !sn.Resources.Limits.Cpu().IsZero() {
		t.Error("snapshotter has a CPU limit: throttling the FUSE server stalls every lazy read")
	}

	// The arbiter's socket directory is the host's, where the shims look.
	var envlet struct {
		Arbiter struct {
			Socket string `toml:"socket"`
		} `toml:"arbiter"`
	}
	if err := toml.Unmarshal([]byte(o.configMaps[0].Data["envlet.toml"]), &envlet); err != nil {
		t.Fatal(err)
	}
	arb := findContainer(t, spec.Containers, "arbiter")
	m, ok := findMount(arb, filepath.Dir(envlet.Arbiter.Socket))
	if v := volumeByName(spec, m.Name); !ok || v.HostPath == nil || v.HostPath.Path != filepath.Dir(envlet.Arbiter.Socket) {
		t.Errorf("arbiter does not share %s with the host", filepath.Dir(envlet.Arbiter.Socket))
	}

	// The installer writes into the host's directories it mounts.
	inst := findContainer(t, spec.InitContainers, "install")
	for _, dir := range []string{"/usr/local/bin", "/etc/containerd", "/etc/envsnap"} {
		m, ok := findMount(inst, "/host"+dir)
		if v := volumeByName(spec, m.Name); !ok || m.ReadOnly || v.HostPath == nil || v.HostPath.Path != dir {
			t.Errorf("installer does not mount the host's %s writable at /host%s", dir, dir)
		}
	}
	if !slices.Contains(inst.Command, "/config/install-node.sh") {
		t.Errorf("installer command %v does not run /config/install-node.sh", inst.Command)
	}
}

// metricsProxyImage is the authenticating proxy in front of the loopback
// metrics endpoints.
const metricsProxyImage = "quay.io/brancz/kube-rbac-proxy"

// TestMetricsOnlyBehindTheProxy: under host networking the pod's
// addresses are the node's, reachable from every container on it. The
// daemons' metrics listen on loopback, each is published only through a
// kube-rbac-proxy sidecar whose upstream is that loopback address, the
// proxy's service account may review tokens, and only the proxies mount a
// token.
func TestMetricsOnlyBehindTheProxy(t *testing.T) {
	o := loadManifests(t)
	if t.Failed() || len(o.daemonSets) != 1 || len(o.configMaps) != 1 {
		t.FailNow()
	}
	spec := o.daemonSets[0].Spec.Template.Spec
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("the pod mounts the service account token into every container")
	}
	var snCfg struct {
		MetricsAddress string `toml:"metrics_address"`
	}
	if err := toml.Unmarshal([]byte(o.configMaps[0].Data["config.toml"]), &snCfg); err != nil {
		t.Fatal(err)
	}
	arb := findContainer(t, spec.Containers, "arbiter")
	i := slices.Index(arb.Args, "--metrics-address")
	if i < 0 || i+1 >= len(arb.Args) {
		t.Fatalf("arbiter args %v: no --metrics-address", arb.Args)
	}
	arbAddr := arb.Args[i+1]
	if host, _, err := net.SplitHostPort(arbAddr); err != nil || !net.ParseIP(host).IsLoopback() {
		t.Errorf("arbiter --metrics-address %q is not loopback", arbAddr)
	}
	if len(arb.Ports) != 0 {
		t.Errorf("arbiter declares ports %v; it serves nothing on the node's addresses", arb.Ports)
	}
	for _, p := range []*corev1.Probe{arb.ReadinessProbe, arb.LivenessProbe} {
		if p == nil || p.Exec == nil {
			t.Errorf("arbiter probe %+v: want an exec probe over the unix socket", p)
		}
	}
	upstreams := map[string]string{}
	for _, c := range spec.Containers {
		_, tokenMounted := findMount(c, "/var/run/secrets/kubernetes.io/serviceaccount")
		if !strings.HasPrefix(c.Image, metricsProxyImage+":") {
			if tokenMounted {
				t.Errorf("container %s mounts a service account token", c.Name)
			}
			continue
		}
		if !tokenMounted {
			t.Errorf("proxy %s has no token to review scrapers' tokens with", c.Name)
		}
		var up, listen string
		for _, a := range c.Args {
			if v, ok := strings.CutPrefix(a, "--upstream="); ok {
				up = v
			}
			if v, ok := strings.CutPrefix(a, "--secure-listen-address="); ok {
				listen = v
			}
		}
		if listen == "" || !slices.Contains(c.Args, "--allow-paths=/metrics") {
			t.Errorf("proxy %s args %v: want --secure-listen-address and --allow-paths=/metrics", c.Name, c.Args)
		}
		upstreams[up] = c.Name
	}
	for _, addr := range []string{snCfg.MetricsAddress, arbAddr} {
		if _, ok := upstreams["http://"+addr+"/"]; !ok {
			t.Errorf("no metrics proxy forwards to %s (proxies: %v)", addr, upstreams)
		}
	}
	// The proxies' service account may create token and access reviews.
	var bound bool
	for _, b := range o.roleBindings {
		for _, s := range b.Subjects {
			if s.Kind != "ServiceAccount" || s.Name != spec.ServiceAccountName || s.Namespace != namespace {
				continue
			}
			for _, r := range o.clusterRoles {
				if r.Name != b.RoleRef.Name {
					continue
				}
				var tr, sar bool
				for _, rule := range r.Rules {
					tr = tr || slices.Contains(rule.Resources, "tokenreviews") && slices.Contains(rule.Verbs, "create")
					sar = sar || slices.Contains(rule.Resources, "subjectaccessreviews") && slices.Contains(rule.Verbs, "create")
				}
				bound = bound || tr && sar
			}
		}
	}
	if !bound {
		t.Errorf("service account %s is not bound to a role that creates tokenreviews and subjectaccessreviews", spec.ServiceAccountName)
	}
}

// TestRuntimeClass: the handler must be the CRI runtime name the drop-in
// defines, bound to our shim and snapshotter.
// TestPeersService: the headless Service lists the snapshotter pods on
// the port the daemon's peer server listens on (as the example config
// sets it), and the token Secret is mounted where the example config
// reads it.
func TestPeersService(t *testing.T) {
	o := loadManifests(t)
	if len(o.services) != 1 {
		t.Fatalf("want one Service, got %d", len(o.services))
	}
	svc, ds := o.services[0], o.daemonSets[0]
	if svc.Namespace != namespace || svc.Spec.ClusterIP != corev1.ClusterIPNone || !svc.Spec.PublishNotReadyAddresses {
		t.Errorf("Service %s/%s: want headless, in %s, listing pods not yet ready", svc.Namespace, svc.Name, namespace)
	}
	for k, v := range svc.Spec.Selector {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("Service selector %s=%s does not match the snapshotter pods", k, v)
		}
	}
	var container *corev1.Container
	for i, c := range ds.Spec.Template.Spec.Containers {
		if c.Name == "snapshotter" {
			container = &ds.Spec.Template.Spec.Containers[i]
		}
	}
	if container == nil {
		t.Fatal("no snapshotter container")
	}
	var port int32
	for _, p := range container.Ports {
		if p.Name == "peer" {
			port = p.ContainerPort
		}
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].TargetPort.StrVal != "peer" || svc.Spec.Ports[0].Port != port || port == 0 {
		t.Errorf("Service ports %+v, snapshotter peer port %d", svc.Spec.Ports, port)
	}
	if want := fmt.Sprintf(":%d", port); daemon.DefaultPeerListen != want {
		t.Errorf("daemon listens for peers on %s by default, the manifests use %s", daemon.DefaultPeerListen, want)
	}
	text := string(repoFile(t, "deploy/envsnap/config.toml"))
	m := regexp.MustCompile(`(?m)^# token_file = "(.*)"$`).FindStringSubmatch(text)
	if m == nil {
		t.Fatal("config.toml shows no token_file")
	}
	mounted := false
	for _, vm := range container.VolumeMounts {
		if vm.Name == "peer-token" && filepath.Dir(m[1]) == vm.MountPath && vm.SubPath == "" {
			mounted = true
		}
	}
	if !mounted {
		t.Errorf("token_file %s is not in the peer-token Secret's mount", m[1])
	}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == "peer-token" && (v.Secret == nil || v.Secret.SecretName != "envsnap-peer-token" || v.Secret.Optional == nil || !*v.Secret.Optional) {
			t.Errorf("volume peer-token: want the optional Secret envsnap-peer-token, got %+v", v.VolumeSource)
		}
	}
}

func TestRuntimeClass(t *testing.T) {
	o := loadManifests(t)
	if len(o.runtimeClasses) != 1 {
		t.FailNow()
	}
	rc := o.runtimeClasses[0]
	if rc.Name != "envlet" || rc.Handler != "envlet" {
		t.Errorf("RuntimeClass %s handler %s, want envlet/envlet", rc.Name, rc.Handler)
	}
	var dropin struct {
		Plugins struct {
			Runtime struct {
				Containerd struct {
					Runtimes map[string]map[string]any `toml:"runtimes"`
				} `toml:"containerd"`
			} `toml:"io.containerd.cri.v1.runtime"`
		} `toml:"plugins"`
	}
	if err := toml.Unmarshal(repoFile(t, "deploy/containerd/envsnap.toml"), &dropin); err != nil {
		t.Fatal(err)
	}
	rt, ok := dropin.Plugins.Runtime.Containerd.Runtimes[rc.Handler]
	if !ok {
		t.Fatalf("drop-in defines no CRI runtime %q", rc.Handler)
	}
	if rt["runtime_type"] != "io.containerd.envlet.v2" || rt["snapshotter"] != "envsnap" {
		t.Errorf("CRI runtime %s = %v", rc.Handler, rt)
	}
	if _, ok := rt["options"]; ok {
		t.Error("CRI runtime envlet has an options table: CRI would send runtimeoptions the runc task service rejects")
	}
}

// TestConfigMapMatchesSources: the ConfigMap carries byte-identical copies
// of the files under deploy/. With -update it rewrites configmap.yaml.
func TestConfigMapMatchesSources(t *testing.T) {
	if *update {
		writeConfigMap(t)
	}
	o := loadManifests(t)
	if len(o.configMaps) != 1 {
		t.FailNow()
	}
	cm := o.configMaps[0]
	if cm.Name != configMapName {
		t.Errorf("ConfigMap name %q, want %q", cm.Name, configMapName)
	}
	for _, s := range configMapSources {
		got, ok := cm.Data[s.key]
		if !ok {
			t.Errorf("ConfigMap has no key %s (copy of %s)", s.key, s.file)
			continue
		}
		if want := string(repoFile(t, s.file)); got != want {
			t.Errorf("ConfigMap key %s differs from %s: run go test ./tests/deploy -run TestConfigMapMatchesSources -update", s.key, s.file)
		}
	}
	if len(cm.Data) != len(configMapSources) {
		t.Errorf("ConfigMap has %d keys, want %d", len(cm.Data), len(configMapSources))
	}
}

func writeConfigMap(t *testing.T) {
	t.Helper()
	var b strings.Builder
	b.WriteString("# GENERATED from the files under deploy/ named below by\n")
	b.WriteString("#   go test ./tests/deploy -run TestConfigMapMatchesSources -update\n")
	b.WriteString("# Edit those files, not this one.\n")
	b.WriteString("apiVersion: v1\nkind: ConfigMap\nmetadata:\n")
	fmt.Fprintf(&b, "  name: %s\n  namespace: %s\n", configMapName, namespace)
	b.WriteString("  labels:\n    app.kubernetes.io/part-of: envsnap\ndata:\n")
	for _, s := range configMapSources {
		content := string(repoFile(t, s.file))
		if !strings.HasSuffix(content, "\n") || strings.HasSuffix(content, "\n\n") {
			t.Fatalf("%s must end in exactly one newline to survive a YAML literal block", s.file)
		}
		fmt.Fprintf(&b, "  # %s\n  %s: |\n", s.file, s.key)
		for _, line := range strings.SplitAfter(strings.TrimSuffix(content, "\n"), "\n") {
			if strings.TrimSpace(line) == "" {
				b.WriteString("\n")
				continue
			}
			b.WriteString("    " + line)
		}
		b.WriteString("\n")
	}
	p := filepath.Join(testenv.RepoRoot(t), "deploy/kubernetes/configmap.yaml")
	if err := os.WriteFile(p, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestKustomizeBuild renders the kustomization with the pinned kustomize
// (what `kubectl apply -k` embeds; kubectl itself is not a Debian package,
// so make deps builds kustomize into bin/tools) and decodes the result strictly: the image override applies
// and nothing is lost or added on the way.
func TestKustomizeBuild(t *testing.T) {
	kustomize, err := exec.LookPath("kustomize")
	if err != nil {
		prereq.Missing(t, "kustomize (make deps builds it into bin/tools): %v", err)
	}
	cmd := exec.Command(kustomize, "build", filepath.Join(testenv.RepoRoot(t), "deploy/kubernetes"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kustomize build: %v\n%s", err, stderr.String())
	}
	o := &objects{}
	for i, d := range splitDocs(out) {
		if err := o.decodeStrict(d); err != nil {
			t.Errorf("rendered document %d: %v", i, err)
		}
	}
	if len(o.clusterRoles) != 2 || len(o.roleBindings) != 1 {
		t.Errorf("rendered %d ClusterRoles and %d ClusterRoleBindings, want 2 and 1 (rbac.yaml)", len(o.clusterRoles), len(o.roleBindings))
	}
	if len(o.namespaces)+len(o.serviceAccounts)+len(o.configMaps)+len(o.daemonSets)+len(o.runtimeClasses) != 5 {
		t.Errorf("rendered %d/%d/%d/%d/%d objects, want one of each", len(o.namespaces), len(o.serviceAccounts), len(o.configMaps), len(o.daemonSets), len(o.runtimeClasses))
	}
	k := readKustomization(t)
	if len(o.daemonSets) == 1 && len(k.Images) == 1 {
		want := k.Images[0].Name + ":" + k.Images[0].NewTag
		spec := o.daemonSets[0].Spec.Template.Spec
		for _, c := range append(spec.InitContainers, spec.Containers...) {
			if c.Image != want && !strings.HasPrefix(c.Image, metricsProxyImage+":") {
				t.Errorf("rendered container %s image %q, want %q", c.Name, c.Image, want)
			}
		}
	}
	if len(o.configMaps) == 1 {
		for _, s := range configMapSources {
			if o.configMaps[0].Data[s.key] != string(repoFile(t, s.file)) {
				t.Errorf("rendered ConfigMap key %s differs from %s", s.key, s.file)
			}
		}
	}
}
