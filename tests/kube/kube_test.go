//go:build kube

// Package kube_test runs envsnap on a one-node Kubernetes cluster: the
// control plane (etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler) on this host, built from the Go module proxy by
// hack/kube.sh, and the node (containerd, kubelet, and envsnap either from
// its shipped systemd units and containerd drop-ins or from the DaemonSet,
// daemonset_test.go) in the qemu guest of tests/vm (systemd, cgroup v2). The guest reaches the API server and the registry through
// qemu's user-mode network, where the host's loopback is 10.0.2.2: no
// address is added to the host, all traffic stays on its loopback.
//
// Every process is started by this test and stopped by PID; the guest is
// powered off through the share (testdata/node.sh waits for "stop").
package kube_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/plugins/content/local"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/internal/prereq"
	"github.com/envsnap/envsnap/tests/testenv"
)

const (
	// gateway is the host's loopback as the guest sees it (qemu's
	// user-mode network).
	gateway = "10.0.2.2"
	// nodeName is the guest's hostname (hack/vm-image.sh).
	nodeName = "vmtest"
	// bootBound bounds the guest's boot up to kubelet's start; readyBound
	// kubelet's registration and the node's Ready condition. Both under
	// TCG emulation on a loaded 2-core host, many times an idle KVM's.
	bootBound   = 10 * time.Minute
	readyBound  = 10 * time.Minute
	podBound    = 10 * time.Minute
	guestMemMiB = 4096
	// bigSize is the lazy image's unread file: a pull that downloads it is
	// not lazy.
	bigSize = 64 << 20
)

func require(t *testing.T, ok bool, format string, args ...any) {
	t.Helper()
	if !ok {
		prereq.Missing(t, format, args...)
	}
}

// cluster is the control plane on this host.
type cluster struct {
	dir        string
	bin        string
	kubeconfig string
	apiPort    int
	// deadline ends every wait early enough for the cleanup (the guest's
	// power-off, the control plane's stop) to run before go test's
	// -timeout, which would leave them running.
	deadline time.Time
}

func TestKubernetesNode(t *testing.T) {
	root := testenv.RepoRoot(t)
	n := bringUp(t, root, "systemd", nil)
	c, g, share, reg, images := n.c, n.g, n.share, n.reg, n.images

	// --- RuntimeClass as shipped; the node carries the label it selects
	// (the DaemonSet's installer's promise: containerd knows the handler) ---
	c.mustKubectl(t, "apply", "-f", filepath.Join(root, "deploy", "kubernetes", "runtimeclass.yaml"))
	c.mustKubectl(t, "label", "node", nodeName, "envsnap.io/envlet=ready", "--overwrite")

	// --- a pod as a user writes it: runtimeClassName envlet, the image
	// pulled lazily (kubelet names the handler in the pull), an episode
	// that reports through its termination message and exit code ---
	reg.ResetCounters()
	term, phase := c.runPod(t, "episode", images[0], "cat /msg >/dev/termination-log; exit 3", "")
	served := reg.BlobBytesServed()
	t.Logf("pod episode: phase %s, exit %d (%s), message %q; registry served %d blob bytes",
		phase, term.ExitCode, term.Reason, term.Message, served)
	if term.ExitCode != 3 || phase != "Failed" || strings.TrimSpace(term.Message) != "envlet-kube-0" {
		t.Errorf("pod episode: exit %d, phase %s, message %q; want the episode's exit 3, phase Failed and the lazy image's /msg (envlet-kube-0)",
			term.ExitCode, phase, term.Message)
	}
	if served >= bigSize/2 {
		t.Errorf("the registry served %d blob bytes for a pod that never read the %d-byte file: the pull was not lazy", served, bigSize)
	}

	// --- requests are not a ceiling: a pod without limits that requests
	// 64 MiB reads 256 MiB into one buffer (dd's obs) and succeeds, its
	// cgroup's memory.peak past envlet's initial 128 MiB; with a 192 MiB
	// limit the same pod stops there: the limit is envlet's cap
	// (docs/shim.md). The kernel OOM-kills the pod's dd at the cap (on v2
	// memory.high and memory.max are both the cap there); the shim finds
	// the kill after the exit and writes envlet's MEM_CAP_EXCEEDED into
	// the termination message ---
	// The reads fill dd's 256 MiB output buffer 1 MiB per read(2), as a
	// program's own page faults fill its heap: the steps test the caps,
	// not how fast envlet grows under one huge system call (the kernel's
	// memory.high throttling applies on the way back to user space).
	const burst = 256 << 20
	ddRead := fmt.Sprintf("dd if=/dev/zero of=/dev/null ibs=1M obs=%d count=%d 2>/dev/null", burst, burst>>20)
	ddBurst := ddRead + " && cat /sys/fs/cgroup/memory.peak >/dev/termination-log"
	term, phase = c.runPod(t, "burst", images[0], ddBurst, "requests: {memory: 64Mi}")
	t.Logf("pod burst (requests 64Mi, no limits): phase %s, exit %d (%s), memory.peak %q", phase, term.ExitCode, term.Reason, term.Message)
	peak, _ := strconv.ParseInt(strings.TrimSpace(term.Message), 10, 64)
	if term.ExitCode != 0 || phase != "Succeeded" || peak < burst {
		t.Errorf("pod burst: exit %d, phase %s, memory.peak %q; want it to succeed with a peak of at least %d bytes", term.ExitCode, phase, term.Message, burst)
	}
	term, phase = c.runPod(t, "capped", images[0], ddBurst, "requests: {memory: 64Mi}\n      limits: {memory: 192Mi}")
	t.Logf("pod capped (limits 192Mi): phase %s, exit %d (%s), message %q", phase, term.ExitCode, term.Reason, term.Message)
	if term.ExitCode != 137 || phase != "Failed" {
		t.Errorf("pod capped: exit %d, phase %s, message %q; want it killed at its 192Mi limit (exit 137, phase Failed)", term.ExitCode, phase, term.Message)
	}
	switch {
	case strings.Contains(term.Message, "MEM_CAP_EXCEEDED"):
	case term.Reason != "OOMKilled" && term.Message == "":
		// The kill nobody saw: runc's task service published no
		// TaskOOM (CRI's "Error", not "OOMKilled") and the shim found
		// no OOM kill in the cgroup's counters (gone with the scope,
		// systemd driver). 1 of 2 runs of the full suite, once; the
		// lowered pod below shows it more often (docs/kubernetes.md).
		t.Logf("pod capped: killed at its limit with no OOM report from runc nor from the cgroup: no reason (the silent kill docs/kubernetes.md describes)")
	default:
		t.Errorf("pod capped: termination message %q (reason %s), want envlet's MEM_CAP_EXCEEDED (the kernel kills at the cap; the shim says so after the exit)", term.Message, term.Reason)
	}

	// --- in-place resize: kubelet's resize of a running pod's memory
	// limit reaches the shim as a task Update, and envlet's cap moves with
	// it. The pod holds a 192Mi limit and waits (polling a file on the
	// node's share, which the test writes once kubelet reports the resize
	// actuated), then reads 256 MiB into one buffer: that succeeds only if
	// the cap went up to the new 512Mi ---
	// The pod writes what it sees before the burst first, so a killed pod
	// still says it: with the systemd cgroup driver, the update makes
	// systemd rewrite the scope's cgroup (memory.high back to max,
	// memory.max to the creation-time 192Mi) and runc writes kubelet's
	// memory.oom.group=1; envlet puts its own values back.
	resizeCmd := "cg=/sys/fs/cgroup; " +
		"seen=\"high=$(cat $cg/memory.high) max=$(cat $cg/memory.max) oom.group=$(cat $cg/memory.oom.group)\"; echo \"$seen\" >/dev/termination-log; " +
		ddRead + " && " +
		"echo \"$seen peak=$(cat $cg/memory.peak) max.after=$(cat $cg/memory.max)\" >/dev/termination-log"
	term, phase = c.resizeWaiting(t, share, "resize", images[0], resizeCmd, "192Mi", "512Mi")
	t.Logf("pod resize (limits 192Mi -> 512Mi while running): phase %s, exit %d (%s), cgroup %q", phase, term.ExitCode, term.Reason, term.Message)
	seen := map[string]string{}
	for _, f := range strings.Fields(term.Message) {
		if k, v, ok := strings.Cut(f, "="); ok {
			seen[k] = v
		}
	}
	if seen["high"] == "" || seen["high"] == "max" || seen["oom.group"] != "0" {
		t.Errorf("pod resize: after the update the container's cgroup had %q; want envlet's memory.high (not max) and memory.oom.group 0", term.Message)
	}
	if peak, _ := strconv.ParseInt(seen["peak"], 10, 64); term.ExitCode != 0 || phase != "Succeeded" || peak < burst {
		t.Errorf("pod resize: exit %d, phase %s, message %q; want it to succeed past its old 192Mi limit after the resize to 512Mi, memory.peak at least %d",
			term.ExitCode, phase, term.Message, burst)
	}
	// --- the other way: a running pod created with a 512Mi limit, lowered
	// in place to 192Mi while it waits. It then reads what its cgroup
	// holds (envlet's limits, within the new cap) and does the same 256
	// MiB read, which succeeded under 512Mi above: it is killed at the
	// lowered limit. Its reason is logged, not asserted: in 2 of 3 runs
	// here the kernel's kill (at the pod's 192Mi slice) came with no
	// TaskOOM from runc's task service and after systemd had removed the
	// container's cgroup, so the shim had nothing to count (the pod ends
	// "Error", exit 137, no message); the capped pod above asserts the
	// reason at a cap whenever containerd saw the kill ---
	lowerCmd := "cg=/sys/fs/cgroup; echo \"high=$(cat $cg/memory.high) max=$(cat $cg/memory.max)\" >/dev/termination-log; " + ddRead + "; s=$?; echo \"dd exited $s\" >>/dev/termination-log; exit $s"
	term, phase = c.resizeWaiting(t, share, "lower", images[0], lowerCmd, "512Mi", "192Mi")
	t.Logf("pod lower (limits 512Mi -> 192Mi while running): phase %s, exit %d (%s), message %q", phase, term.ExitCode, term.Reason, term.Message)
	seen = map[string]string{}
	for _, f := range strings.Fields(term.Message) {
		if k, v, ok := strings.Cut(f, "="); ok {
			seen[k] = v
		}
	}
	const lowered = 192 << 20
	high, errHigh := strconv.ParseInt(seen["high"], 10, 64)
	maxv, errMax := strconv.ParseInt(seen["max"], 10, 64)
	switch {
	case strings.Contains(term.Message, "dd exited 0"):
		t.Errorf("pod lower: the 256 MiB read succeeded after the limit was lowered to 192Mi (message %q)", term.Message)
	case strings.Contains(term.Message, "envlet:"):
		// The shim's reason replaced what the pod wrote.
		if !strings.Contains(term.Message, "MEM_CAP_EXCEEDED") || !strings.Contains(term.Message, "cap 192.0Mi") {
			t.Errorf("pod lower: message %q; want envlet's MEM_CAP_EXCEEDED at cap 192.0Mi", term.Message)
		}
	case errHigh != nil || errMax != nil || high > lowered || maxv > lowered:
		t.Errorf("pod lower: after the lowering the container's cgroup had %q; want envlet's memory.high and memory.max within the new 192Mi", term.Message)
	}
	if term.ExitCode == 0 || phase != "Failed" {
		t.Errorf("pod lower: exit %d, phase %s; want it killed at the lowered 192Mi limit", term.ExitCode, phase)
	}
	if t.Failed() {
		g.ask(t, share, "journal-resize")
	}

	// --- node exhaustion: a pod without limits asks for more memory than
	// envlet may grant on the node (435 MiB); envlet freezes and kills it,
	// and the reason reaches the pod's status through kubelet's
	// termination message file, so kubectl describe shows it ---
	term, phase = c.runPod(t, "hog", images[0], "dd if=/dev/zero bs=629145600 count=1 2>/dev/null | exec sleep 100000", "")
	describe := c.mustKubectl(t, "describe", "pod", "hog")
	t.Logf("pod hog: phase %s, exit %d (%s), message %q", phase, term.ExitCode, term.Reason, term.Message)
	if !strings.Contains(describe, "MEM_NODE_EXHAUSTED") {
		t.Errorf("kubectl describe pod hog does not name envlet's reason MEM_NODE_EXHAUSTED:\n%s", describe)
	}

	// --- without RuntimeClassInImageCriApi kubelet pulls without the
	// handler: CRI downloads the whole image into overlayfs and unpacks
	// it again into envsnap at container creation; the pod still runs
	// (docs/kubernetes.md, "Which pulls are lazy on Kubernetes") ---
	g.ask(t, share, "kubelet-no-gate")
	c.waitNodeReady(t)
	reg.ResetCounters()
	term, phase = c.runPod(t, "episode-no-gate", images[1], "cat /msg >/dev/termination-log; exit 4", "")
	served = reg.BlobBytesServed()
	t.Logf("pod episode-no-gate: phase %s, exit %d (%s), message %q; registry served %d blob bytes",
		phase, term.ExitCode, term.Reason, term.Message, served)
	if term.ExitCode != 4 || phase != "Failed" || strings.TrimSpace(term.Message) != "envlet-kube-1" {
		t.Errorf("pod episode-no-gate: exit %d, phase %s, message %q; want exit 4, phase Failed, message envlet-kube-1",
			term.ExitCode, phase, term.Message)
	}
	if served < bigSize {
		t.Errorf("without the gate the registry served %d blob bytes, less than the %d-byte file: the docs say the pull is full", served, bigSize)
	}

	// --- node memory pressure with the shipped budgets: envlet's node is
	// the whole machine less its 15% reserve (no [node] memory, the
	// default cap), kubelet evicts at memory.available < 100Mi (its
	// default). A pod without limits reads 3.5 GiB into one buffer on the
	// 4 GiB guest: envlet stops granting at its reserve and fails the pod
	// with its reason before kubelet sees pressure, so kubelet evicts
	// nothing (docs/kubernetes.md, "Node memory pressure"). If neither
	// acts, dd finishes and the pod says so ---
	g.ask(t, share, "envlet-node-default")
	term, phase = c.runPod(t, "fill", images[0], "dd if=/dev/zero of=/dev/null bs=3758096384 count=1 iflag=fullblock 2>/dev/null; echo \"dd exited $? (nothing stopped it): memory.peak $(cat /sys/fs/cgroup/memory.peak) memory.max $(cat /sys/fs/cgroup/memory.max) memory.swap.peak $(cat /sys/fs/cgroup/memory.swap.peak)\" >/dev/termination-log; exit 9", "")
	reason, _ := c.kubectl("get", "pod", "fill", "-o", "jsonpath={.status.reason}")
	evictions, _ := c.kubectl("get", "events", "-A", "--field-selector", "reason=Evicted", "-o", "name")
	pressure, _ := c.kubectl("get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="MemoryPressure")].status} {.status.conditions[?(@.type=="MemoryPressure")].lastTransitionTime}`)
	t.Logf("pod fill (3.5 GiB, envlet's whole-node budget): phase %s (%s), exit %d (%s), message %q; Evicted events %q; node MemoryPressure %s",
		phase, reason, term.ExitCode, term.Reason, term.Message, evictions, pressure)
	if !strings.Contains(term.Message, "MEM_NODE_EXHAUSTED") || reason == "Evicted" || strings.TrimSpace(evictions) != "" {
		t.Errorf("pod fill: phase %s (%s), message %q, Evicted events %q: want envlet's MEM_NODE_EXHAUSTED and no eviction by kubelet",
			phase, reason, term.Message, evictions)
	}

	// --- kubelet first: its eviction threshold raised to
	// memory.available < 2Gi, above what envlet keeps free (its 15%
	// reserve, 0.59 GiB here). Two pods hold memory within envlet's grants:
	// "elder" 800 MiB with no request, then "younger" 1200 MiB within its
	// 1300Mi request; together they take the node below kubelet's
	// threshold and nowhere near envlet's reserve. kubelet evicts by its
	// own order (pods above their requests first, then priority, then
	// usage above requests): the elder, where envlet's victim policy
	// (lowest priority, then youngest) would have picked the younger.
	// envlet fails neither: nothing it grants is short. kubelet sees the
	// node only through its stats summary, which needs CRI to name
	// envsnap's filesystem (the drop-in's runtime_platforms.envlet and
	// root export); without them it failed and kubelet evicted nothing ---
	g.ask(t, share, "kubelet-evict-early")
	c.waitNodeReady(t)
	hold := func(mib int) string {
		return fmt.Sprintf("dd if=/dev/zero ibs=1M obs=%dM count=%d 2>/dev/null | exec sleep 100000", mib, mib)
	}
	holding := func(mib int) string {
		return fmt.Sprintf("    readinessProbe:\n      exec: {command: [\"/bin/sh\", \"-c\", \"test $(cat /sys/fs/cgroup/memory.current) -gt %d\"]}\n      periodSeconds: 2\n", mib<<20)
	}
	c.applyPod(t, "elder", images[0], hold(800), "", "", holding(800))
	c.waitPodReady(t, "elder")
	c.applyPod(t, "younger", images[0], hold(1200), "requests: {memory: 1300Mi}", "", holding(1200))
	var evicted []string
	evictedAt := time.Now()
	if err := c.waitFor(3*time.Minute, func() bool {
		evicted = evicted[:0]
		for _, name := range []string{"elder", "younger"} {
			if r, _ := c.kubectl("get", "pod", name, "-o", "jsonpath={.status.reason}"); r == "Evicted" {
				evicted = append(evicted, name)
			}
		}
		return len(evicted) > 0
	}); err != nil {
		g.ask(t, share, "journal-evict")
		t.Errorf("kubelet evicted neither pod within 3m with memory.available < 2Gi")
	}
	waited := time.Since(evictedAt).Round(time.Second)
	pressure, _ = c.kubectl("get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="MemoryPressure")].status}`)
	var states []string
	for _, name := range []string{"elder", "younger"} {
		msg, _ := c.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase} {.status.message} {.status.containerStatuses[0].state.terminated.message}")
		states = append(states, name+": "+strings.TrimSpace(msg))
		if strings.Contains(msg, "envlet:") {
			t.Errorf("pod %s carries an envlet failure (%q) while kubelet's threshold is the one crossed", name, msg)
		}
	}
	t.Logf("kubelet at memory.available < 2Gi: evicted %v within %s of the younger pod's creation; node MemoryPressure %s; %s", evicted, waited, pressure, strings.Join(states, "; "))
	if len(evicted) != 1 || evicted[0] != "elder" {
		t.Errorf("evicted %v, want kubelet's pick by its order, the elder (above its request) alone", evicted)
	}

}

// node is the one-node cluster a test brings up: the control plane on this
// host, the guest, its share, and the registry with the lazy images.
type node struct {
	c      *cluster
	g      *guest
	share  string
	reg    *devenv.Registry
	images []string
}

// bringUp builds (cached) the guest image and the Kubernetes binaries,
// starts the control plane and the registry, boots the guest with envsnap
// installed the way install names (testdata/node.sh: "systemd" or
// "daemonset") and waits for the node to be Ready. extra files are put in
// the share (name to path on this host) before the guest boots.
func bringUp(t *testing.T, root, install string, extra map[string]string) *node {
	t.Helper()
	require(t, os.Geteuid() == 0, "needs root (builds the guest image, runs qemu)")
	qemu, err := exec.LookPath("qemu-system-x86_64")
	require(t, err == nil, "qemu-system-x86_64 not installed (hack/vm-image.sh installs it)")
	require(t, freeMemMiB() > guestMemMiB+2048, "less than %d MiB available for the guest and the control plane", guestMemMiB+2048)

	start := time.Now()
	img := runScript(t, root, "vm-image.sh")
	kbin := runScript(t, root, "kube.sh")
	t.Logf("guest image %s, Kubernetes binaries %s ready in %s", img, kbin, time.Since(start).Round(time.Second))

	dir := t.TempDir()
	c := startControlPlane(t, dir, kbin)
	t.Logf("control plane up in %s", time.Since(start).Round(time.Second))

	share, reg, images := stage(t, root, dir, kbin, c)
	writeFile(t, filepath.Join(share, "node.env"), fmt.Sprintf("API_SERVER=%s:%d\nREGISTRY=%s\nINSTALL=%s\n",
		gateway, c.apiPort, guestRegistry(reg), install))
	for name, src := range extra {
		// A hard link where the share and the source are on one file
		// system (the image is tens of MiB), a copy otherwise.
		if err := os.Link(src, filepath.Join(share, name)); err != nil {
			copyFile(t, src, filepath.Join(share, name))
		}
	}

	g := bootGuest(t, qemu, img, share)
	t.Cleanup(func() { g.stop(t, share) })
	select {
	case <-g.ready:
		t.Logf("guest started kubelet %s after boot", time.Since(g.booted).Round(time.Second))
	case <-g.exited:
		t.Fatalf("the guest stopped before kubelet started; console %s", g.console)
	case <-time.After(bootBound):
		t.Fatalf("the guest did not start kubelet within %s; console %s", bootBound, g.console)
	}

	// --- the node registers and becomes Ready ---
	readyAt := time.Now()
	c.waitNodeReady(t)
	t.Logf("node %s Ready %s after kubelet started", nodeName, time.Since(readyAt).Round(time.Second))
	return &node{c: c, g: g, share: share, reg: reg, images: images}
}

// ask has the guest do what the event name stands for (testdata/node.sh
// acts on a file of that name in the share) and waits for it to say so.
func (g *guest) ask(t *testing.T, share, name string) {
	t.Helper()
	writeFile(t, filepath.Join(share, name), "")
	select {
	case ev := <-g.events:
		if ev != name {
			t.Fatalf("guest event %q, want %s", ev, name)
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("the guest did not act on %s within 2m", name)
	}
}

// terminated is a container's terminated state in a pod's status.
type terminated struct {
	ExitCode int    `json:"exitCode"`
	Message  string `json:"message"`
	Reason   string `json:"reason"`
}

// runPod creates a pod as a user writes it (runtimeClassName envlet,
// restartPolicy Never, no service account token: the guest has no mount
// helpers for it to matter) running command in image, waits for its
// container to terminate and returns that state and the pod's phase.
// resources is the container's resources block (YAML, indented as its
// lines follow "resources:"), or empty for none.
func (c *cluster) runPod(t *testing.T, name, image, command, resources string) (terminated, string) {
	t.Helper()
	c.applyPod(t, name, image, command, resources, "", "")
	return c.waitTerminated(t, name)
}

// applyPod creates the pod runPod describes; podSpec and container are
// added to the pod's spec and its container's (YAML at their
// indentation), or empty.
func (c *cluster) applyPod(t *testing.T, name, image, command, resources, podSpec, container string) {
	t.Helper()
	if resources != "" {
		resources = "\n    resources:\n      " + resources
	}
	if container != "" {
		resources += "\n" + strings.TrimSuffix(container, "\n")
	}
	file := filepath.Join(c.dir, name+".yaml")
	writeFile(t, file, fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: default
spec:
  runtimeClassName: envlet
  restartPolicy: Never
  automountServiceAccountToken: false
%s  containers:
  - name: env
    image: %s
    imagePullPolicy: IfNotPresent
    command: ["/bin/sh", "-c", %q]%s
`, name, podSpec, image, command, resources))
	c.mustKubectl(t, "apply", "-f", file)
}

// resizeWaiting runs pod name with a memory request of 64Mi and limit
// from; the pod waits for a file of its name on the node's share, then
// runs command. Its limit is resized in place to to while it waits, then
// it is let go; it returns how the container ended.
func (c *cluster) resizeWaiting(t *testing.T, share, name, image, command, from, to string) (terminated, string) {
	t.Helper()
	c.applyPod(t, name, image, fmt.Sprintf("until [ -e /share/%s ]; do sleep 0.2; done; %s", name, command),
		"requests: {memory: 64Mi}\n      limits: {memory: "+from+"}",
		"  volumes:\n  - name: share\n    hostPath: {path: /mnt/host, type: Directory}\n",
		"    volumeMounts:\n    - {name: share, mountPath: /share, readOnly: true}\n")
	c.resizeMemory(t, name, "64Mi", to)
	writeFile(t, filepath.Join(share, name), "")
	return c.waitTerminated(t, name)
}

// resizeMemory resizes the memory of pod name's running container in
// place (the pod's resize subresource, as `kubectl patch --subresource
// resize` does) and waits for kubelet to report the new limit actuated.
func (c *cluster) resizeMemory(t *testing.T, name, request, limit string) {
	t.Helper()
	c.waitPodRunning(t, name)
	c.mustKubectl(t, "patch", "pod", name, "--subresource", "resize", "--type", "merge", "-p",
		fmt.Sprintf(`{"spec":{"containers":[{"name":"env","resources":{"requests":{"memory":%q},"limits":{"memory":%q}}}]}}`, request, limit))
	if err := c.waitFor(2*time.Minute, func() bool {
		out, err := c.kubectl("get", "pod", name, "-o", "jsonpath={.status.containerStatuses[0].resources.limits.memory}")
		return err == nil && out == limit
	}); err != nil {
		out, _ := c.kubectl("get", "pod", name, "-o", "yaml")
		t.Fatalf("kubelet did not report pod %s's memory limit %s within 2m:\n%s", name, limit, out)
	}
}

// waitTerminated waits for the container of pod name to terminate and
// returns its state and the pod's phase.
func (c *cluster) waitTerminated(t *testing.T, name string) (terminated, string) {
	t.Helper()
	var term terminated
	if err := c.waitFor(podBound, func() bool {
		out, err := c.kubectl("get", "pod", name, "-o", "jsonpath={.status.containerStatuses[0].state.terminated}")
		return err == nil && out != "" && json.Unmarshal([]byte(out), &term) == nil
	}); err != nil {
		out, _ := c.kubectl("describe", "pod", name)
		t.Fatalf("pod %s did not terminate within %s:\n%s", name, podBound, out)
	}
	// The phase follows the container's state in a later status update.
	var phase string
	c.waitFor(time.Minute, func() bool {
		phase, _ = c.kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}")
		return phase == "Succeeded" || phase == "Failed"
	})
	return term, phase
}

// waitNodeReady waits for the node's Ready condition.
// waitPodReady waits for pod name's Ready condition (its readiness probe).
func (c *cluster) waitPodReady(t *testing.T, name string) {
	t.Helper()
	if err := c.waitFor(podBound, func() bool {
		out, err := c.kubectl("get", "pod", name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && out == "True"
	}); err != nil {
		out, _ := c.kubectl("describe", "pod", name)
		t.Fatalf("pod %s not Ready within %s:\n%s", name, podBound, out)
	}
}

func (c *cluster) waitNodeReady(t *testing.T) {
	t.Helper()
	if err := c.waitFor(readyBound, func() bool {
		out, err := c.kubectl("get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		return err == nil && out == "True"
	}); err != nil {
		out, _ := c.kubectl("describe", "node", nodeName)
		t.Fatalf("node %s not Ready within %s:\n%s", nodeName, readyBound, out)
	}
}

// runScript runs hack/NAME (cached builds: no-ops when up to date) and
// returns the directory it prints on its last line.
func runScript(t *testing.T, root, name string) string {
	t.Helper()
	cmd := exec.Command(filepath.Join(root, "hack", name))
	var stdout strings.Builder
	cmd.Stdout = &stdout
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		t.Log(sc.Text())
	}
	if err := cmd.Wait(); err != nil {
		require(t, false, "hack/%s: %v", name, err)
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	return lines[len(lines)-1]
}

// startControlPlane starts etcd, kube-apiserver, kube-controller-manager
// and kube-scheduler on this host's loopback and waits for the API server
// to be ready.
func startControlPlane(t *testing.T, dir, kbin string) *cluster {
	t.Helper()
	pkiDir := filepath.Join(dir, "pki")
	if err := os.MkdirAll(pkiDir, 0o700); err != nil {
		t.Fatal(err)
	}
	p := newPKI(t, pkiDir)
	// The API server is reached as 127.0.0.1 from this host and as the
	// gateway from the guest; 10.96.0.1 is its Service address.
	p.issue(t, "apiserver", "kube-apiserver", nil,
		[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(gateway), net.ParseIP("10.96.0.1")},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"})
	p.issue(t, "admin", "kubernetes-admin", []string{"system:masters"}, nil, nil)
	p.issue(t, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil, nil)
	p.issue(t, "controller-manager", "system:kube-controller-manager", nil, nil, nil)
	p.issue(t, "scheduler", "system:kube-scheduler", nil, nil, nil)
	p.issue(t, "kubelet", "system:node:"+nodeName, []string{"system:nodes"}, nil, nil)
	p.serviceAccountKey(t)

	ports, err := devenv.FreePorts(5)
	if err != nil {
		t.Fatal(err)
	}
	etcdClient, etcdPeer, apiPort, controllerPort, schedulerPort := ports[0], ports[1], ports[2], ports[3], ports[4]
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)
	testenv.StartProcess(t, dir, "etcd", nil, filepath.Join(kbin, "etcd"),
		"--name", "default", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "default="+peerURL, "--log-level", "warn")

	c := &cluster{dir: dir, bin: kbin, apiPort: apiPort, kubeconfig: filepath.Join(dir, "admin.conf")}
	if d, ok := t.Deadline(); ok {
		c.deadline = d.Add(-5 * time.Minute)
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", c.apiPort)
	testenv.StartProcess(t, dir, "kube-apiserver", nil, filepath.Join(kbin, "kube-apiserver"),
		"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(c.apiPort),
		// The address the Service "kubernetes" names: the guest's way to
		// this host's loopback. Nothing on this host carries it.
		"--advertise-address", gateway,
		"--cert-dir", filepath.Join(dir, "apiserver-certs"),
		"--tls-cert-file", p.path("apiserver.crt"), "--tls-private-key-file", p.path("apiserver.key"),
		"--client-ca-file", p.path("ca.crt"),
		"--kubelet-client-certificate", p.path("apiserver-kubelet-client.crt"),
		"--kubelet-client-key", p.path("apiserver-kubelet-client.key"),
		"--service-account-key-file", p.path("sa.pub"),
		"--service-account-signing-key-file", p.path("sa.key"),
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-cluster-ip-range", "10.96.0.0/24",
		"--authorization-mode", "Node,RBAC",
		"--allow-privileged=true")
	for _, name := range []string{"admin", "controller-manager", "scheduler"} {
		p.kubeconfig(t, filepath.Join(dir, name+".conf"), server, pkiDir, name)
	}
	if err := c.waitFor(3*time.Minute, func() bool {
		out, err := c.kubectl("get", "--raw", "/readyz")
		return err == nil && out == "ok"
	}); err != nil {
		t.Fatalf("kube-apiserver not ready within 3m")
	}
	testenv.StartProcess(t, dir, "kube-controller-manager", nil, filepath.Join(kbin, "kube-controller-manager"),
		"--kubeconfig", filepath.Join(dir, "controller-manager.conf"),
		"--authentication-kubeconfig", filepath.Join(dir, "controller-manager.conf"),
		"--authorization-kubeconfig", filepath.Join(dir, "controller-manager.conf"),
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(controllerPort),
		"--leader-elect=false", "--use-service-account-credentials",
		"--service-account-private-key-file", p.path("sa.key"),
		"--root-ca-file", p.path("ca.crt"),
		"--cluster-signing-cert-file", p.path("ca.crt"), "--cluster-signing-key-file", p.path("ca.key"))
	testenv.StartProcess(t, dir, "kube-scheduler", nil, filepath.Join(kbin, "kube-scheduler"),
		"--kubeconfig", filepath.Join(dir, "scheduler.conf"),
		"--authentication-kubeconfig", filepath.Join(dir, "scheduler.conf"),
		"--authorization-kubeconfig", filepath.Join(dir, "scheduler.conf"),
		"--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(schedulerPort),
		"--leader-elect=false")
	return c
}

func (c *cluster) kubectl(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(c.bin, "kubectl"), append([]string{"--kubeconfig", c.kubeconfig, "--request-timeout", "60s"}, args...)...)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (c *cluster) mustKubectl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := c.kubectl(args...)
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// waitFor polls ok every 2 s until it holds or bound passes (or the
// test's deadline comes near).
func (c *cluster) waitFor(bound time.Duration, ok func() bool) error {
	deadline := time.Now().Add(bound)
	if !c.deadline.IsZero() && c.deadline.Before(deadline) {
		deadline = c.deadline
	}
	for !ok() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", bound)
		}
		time.Sleep(2 * time.Second)
	}
	return nil
}

// stage fills the directory the guest mounts: the node's binaries and CNI
// plugins, deploy/, envlet.toml, kubelet's credentials and config, and the
// node script. It starts the registry on this host's loopback with the
// pause image and two lazy images, and returns the share, the registry
// and the lazy images' references as the guest names them.
func stage(t *testing.T, root, dir, kbin string, c *cluster) (string, *devenv.Registry, []string) {
	t.Helper()
	share := filepath.Join(dir, "share")
	for _, d := range []string{"bin", "cni", "kube"} {
		if err := os.MkdirAll(filepath.Join(share, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"containerd-envsnap", "containerd-shim-envlet-v2"} {
		copyFile(t, testenv.Binary(t, name), filepath.Join(share, "bin", name))
	}
	for _, name := range []string{"containerd", "ctr", "containerd-shim-runc-v2", "runc", "crictl"} {
		copyFile(t, testenv.Tool(t, name), filepath.Join(share, "bin", name))
	}
	copyFile(t, filepath.Join(kbin, "kubelet"), filepath.Join(share, "bin", "kubelet"))
	for _, name := range []string{"bridge", "host-local", "loopback"} {
		copyFile(t, filepath.Join(kbin, "cni", name), filepath.Join(share, "cni", name))
	}
	if err := os.CopyFS(filepath.Join(share, "deploy"), os.DirFS(filepath.Join(root, "deploy"))); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join("testdata", "node.sh"), filepath.Join(share, "guest.sh"))
	// envlet's node budget well below the guest's 4 GiB, as tests/vm sets
	// it: 512 MiB with a 15% reserve, 435 MiB to grant, so one pod can
	// exhaust it while kubelet sees plenty. Arbiter calls get 5 s (TCG on
	// a loaded host). The pods of this cluster are on its CNI bridge, not
	// the host network.
	writeFile(t, filepath.Join(share, "envlet.toml"), `[policy]
initial-cpu = "0.5"
initial-memory = "128Mi"
cap-cpu = "2"
cap-memory = "2Gi"
arbiter-timeout = "5s"
[node]
cpu = "2"
memory = "512Mi"
reserve = 0.15
[arbiter]
socket = "/run/envsnap/arbiter.sock"
timeout = "5s"
`)
	kube := filepath.Join(share, "kube")
	for _, name := range []string{"ca.crt", "kubelet.crt", "kubelet.key"} {
		copyFile(t, filepath.Join(dir, "pki", name), filepath.Join(kube, name))
	}
	p := &pki{}
	p.kubeconfig(t, filepath.Join(kube, "kubelet.conf"), fmt.Sprintf("https://%s:%d", gateway, c.apiPort), "/etc/kubernetes/pki", "kubelet")
	// kubelet's configuration: the systemd driver (cgroup v2 under
	// systemd), the guest's swap tolerated, eviction thresholds a 4 GiB
	// test disk and memory meet, and RuntimeClassInImageCriApi, which
	// makes kubelet name the runtime handler in its pulls, so CRI pulls an
	// envlet pod's image into envsnap (docs/kubernetes.md, "Which pulls are
	// lazy on Kubernetes").
	writeFile(t, filepath.Join(kube, "kubelet.yaml"), `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: /etc/kubernetes/pki/ca.crt}
authorization: {mode: Webhook}
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
clusterDomain: cluster.local
featureGates:
  RuntimeClassInImageCriApi: true
`)

	ctx := context.Background()
	reg := testenv.StartRegistry(t, filepath.Join(dir, "registry"))
	cs, err := local.NewStore(filepath.Join(dir, "content"))
	if err != nil {
		t.Fatal(err)
	}
	hosts := filepath.Join(dir, "hosts")
	testenv.WriteHostsDir(t, hosts, reg.Host)
	env := &devenv.Env{Registry: reg, ContentStore: cs, HostsDir: hosts}
	if _, err := env.PushImage(ctx, "kube/pause:1", nil,
		devenv.WithEntrypoint("/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done")); err != nil {
		t.Fatal(err)
	}
	// Two images, different in every layer: each pod's pull starts from
	// nothing.
	var images []string
	for i := range 2 {
		name := fmt.Sprintf("kube/env%d:1", i)
		if _, err := env.PushImage(ctx, name, []devenv.File{
			{Path: "/msg", Data: []byte(fmt.Sprintf("envlet-kube-%d\n", i))},
			devenv.RandomFile("/data/big.bin", bigSize, int64(11+i)),
		}, devenv.WithLazyLayers()); err != nil {
			t.Fatal(err)
		}
		images = append(images, guestRegistry(reg)+"/"+name)
	}
	return share, reg, images
}

// guestRegistry is the registry's address as the guest reaches it.
func guestRegistry(reg *devenv.Registry) string {
	_, port, _ := net.SplitHostPort(reg.Host)
	return net.JoinHostPort(gateway, port)
}

type guest struct {
	cmd     *exec.Cmd
	console string
	booted  time.Time
	ready   chan struct{}
	exited  chan struct{}
	// events receives the names of the guest's "KUBETEST: EVENT name"
	// lines.
	events chan string
}

// bootGuest boots the guest with qemu's user-mode network: the guest
// reaches this host's loopback at the gateway. Nothing is forwarded into
// the guest: the test reads what it needs from the API server (pod status
// and termination messages), never from kubelet's port (logs, exec).
func bootGuest(t *testing.T, qemu, img, share string) *guest {
	t.Helper()
	g := &guest{console: filepath.Join(t.TempDir(), "console.log"), ready: make(chan struct{}), exited: make(chan struct{}), events: make(chan string, 8)}
	nic := "user,id=n0"
	// thread=single: both vCPUs on one host thread. With one each, the
	// guest kernel can panic while it patches the BPF LSM hook envlet's
	// guard attaches to (tests/vm's runGuest says more). Here once, a pod
	// stood at ContainerCreating for 10 minutes after "Container created",
	// and the guest printed neither its journals nor DONE when the test
	// asked for them: it was gone.
	g.cmd = exec.Command(qemu,
		"-accel", "tcg,thread=single", "-smp", "2", "-m", fmt.Sprint(guestMemMiB),
		"-nographic", "-no-reboot", "-snapshot",
		"-netdev", nic, "-device", "virtio-net-pci,netdev=n0",
		"-kernel", filepath.Join(img, "vmlinuz"), "-initrd", filepath.Join(img, "initrd.img"),
		"-drive", "file="+filepath.Join(img, "root.img")+",format=raw,if=virtio",
		"-virtfs", "local,path="+share+",mount_tag=host,security_model=none,id=host",
		"-append", "console=ttyS0 root=/dev/vda rw quiet panic=-1 systemd.show_status=false")
	out, err := g.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	g.cmd.Stderr = g.cmd.Stdout
	console, err := os.Create(g.console)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.cmd.Start(); err != nil {
		t.Fatalf("start qemu: %v", err)
	}
	g.booted = time.Now()
	go func() {
		defer close(g.exited)
		defer console.Close()
		var once bool
		sc := bufio.NewScanner(io.TeeReader(out, console))
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := strings.TrimRight(sc.Text(), "\r")
			i := strings.Index(line, "KUBETEST: ")
			if i < 0 {
				continue
			}
			msg := line[i+len("KUBETEST: "):]
			if msg == "READY" && !once {
				once = true
				close(g.ready)
			}
			if name, ok := strings.CutPrefix(msg, "EVENT "); ok {
				g.events <- name
			}
			t.Log("guest: " + msg)
		}
		g.cmd.Wait()
	}()
	return g
}

// stop asks the guest to power off (and to print its journals first when
// the test failed), then kills qemu by PID if it does not.
func (g *guest) stop(t *testing.T, share string) {
	if t.Failed() {
		writeFile(t, filepath.Join(share, "dump"), "")
	}
	writeFile(t, filepath.Join(share, "stop"), "")
	select {
	case <-g.exited:
	case <-time.After(3 * time.Minute):
		t.Logf("the guest did not power off within 3m; killing qemu (PID %d)", g.cmd.Process.Pid)
		g.cmd.Process.Kill()
		<-g.exited
	}
	t.Logf("guest console log: %s", g.console)
	if t.Failed() {
		// The console goes with the test's temporary directory: keep the
		// part that says why a guest ended early (a kernel panic).
		if tail, err := exec.Command("tail", "-n", "60", g.console).Output(); err == nil {
			t.Logf("guest console tail:\n%s", tail)
		}
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

func writeFile(t *testing.T, p, s string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// freeMemMiB is MemAvailable from /proc/meminfo.
func freeMemMiB() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var kb int64
		if n, _ := fmt.Sscanf(sc.Text(), "MemAvailable: %d kB", &kb); n == 1 {
			return kb / 1024
		}
	}
	return 0
}
