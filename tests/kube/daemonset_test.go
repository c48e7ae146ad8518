//go:build kube

package kube_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/internal/devenv"
	"github.com/envsnap/envsnap/tests/testenv"
)

// TestKubernetesDaemonSet installs envsnap on a node that has none of it,
// as docs/kubernetes.md tells a user to: the DaemonSet's image built from
// deploy/image/Dockerfile (hack/envsnap-image.sh) and imported on the node,
// `kubectl apply -k` of deploy/kubernetes (testdata/daemonset: less the
// metrics proxies, whose image this machine kind cannot pull), containerd
// restarted once the installer has written its drop-in, the node labelled.
// A lazy envlet pod then runs, and its reads of a lazily served file go on
// while the snapshotter's pod is deleted and the DaemonSet replaces it
// (the descriptor keeper on the host holds the FUSE connections).
func TestKubernetesDaemonSet(t *testing.T) {
	root := testenv.RepoRoot(t)
	imageDir := runScript(t, root, "envsnap-image.sh")
	image, err := os.ReadFile(filepath.Join(imageDir, "image"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("DaemonSet image %s built from deploy/image/Dockerfile", strings.TrimSpace(string(image)))
	n := bringUp(t, root, "daemonset", map[string]string{"envsnap-image.tar": filepath.Join(imageDir, "envsnap.tar")})
	c, g, share, reg, images := n.c, n.g, n.share, n.reg, n.images
	const ns = "envsnap-system"
	dsPod := func() (name, uid string) {
		out, _ := c.kubectl("-n", ns, "get", "pod", "-l", "app.kubernetes.io/name=containerd-envsnap",
			"-o", `jsonpath={range .items[*]}{.metadata.name} {.metadata.uid} {.metadata.deletionTimestamp}{"\n"}{end}`)
		for _, line := range strings.Split(out, "\n") {
			if f := strings.Fields(line); len(f) == 2 { // not being deleted
				return f[0], f[1]
			}
		}
		return "", ""
	}
	dsReady := func(t *testing.T, what string) {
		t.Helper()
		if err := c.waitFor(podBound, func() bool {
			out, err := c.kubectl("-n", ns, "get", "daemonset", "containerd-envsnap", "-o", "jsonpath={.status.numberReady}/{.status.desiredNumberScheduled}")
			return err == nil && out == "1/1"
		}); err != nil {
			name, _ := dsPod()
			out, _ := c.kubectl("-n", ns, "describe", "pod", name)
			g.ask(t, share, "journal-daemonset")
			t.Fatalf("%s: the DaemonSet's pod not Ready within %s:\n%s", what, podBound, out)
		}
	}

	// --- kubectl apply -k: the installer (init container) puts the shim,
	// the keeper's binary, envlet.toml and the containerd drop-in on the
	// node ---
	applied := time.Now()
	c.mustKubectl(t, "apply", "-k", filepath.Join("testdata", "daemonset"))
	if err := c.waitFor(podBound, func() bool {
		name, _ := dsPod()
		if name == "" {
			return false
		}
		out, err := c.kubectl("-n", ns, "get", "pod", name, "-o", "jsonpath={.status.initContainerStatuses[0].state.terminated.exitCode}")
		return err == nil && out == "0"
	}); err != nil {
		name, _ := dsPod()
		out, _ := c.kubectl("-n", ns, "describe", "pod", name)
		t.Fatalf("the DaemonSet's installer did not complete within %s:\n%s", podBound, out)
	}
	first, firstUID := dsPod()
	t.Logf("installer of %s completed %s after kubectl apply -k", first, time.Since(applied).Round(time.Second))

	// --- the pod Ready (docs/kubernetes.md, step 1), then the operator's
	// steps the installer prints: restart containerd (the pod's running
	// containers live through it), label the node ---
	dsReady(t, "after the install")
	t.Logf("DaemonSet Ready %s after kubectl apply -k", time.Since(applied).Round(time.Second))
	g.ask(t, share, "restart-containerd")
	c.mustKubectl(t, "label", "node", nodeName, "envsnap.io/envlet=ready", "--overwrite")
	dsReady(t, "after containerd's restart")

	// --- a lazy envlet pod: it reads nothing of its 64 MiB file until told,
	// then reads it 1 MiB every 0.5 s (a first pass of 32 s, each slice
	// going to the snapshotter), then again from the page cache until told
	// to stop, and
	// reports its reads, its errors and the file's sha256 ---
	big := devenv.RandomFile("/data/big.bin", bigSize, 11)
	slices := bigSize >> 20
	reader := fmt.Sprintf(`cat /msg >/dev/termination-log
until [ -e /share/read ]; do sleep 0.2; done
n=0; e=0
while [ $n -lt %[1]d ] || ! [ -e /share/done ]; do
  dd if=/data/big.bin of=/dev/null bs=1M skip=$((n %% %[1]d)) count=1 2>/dev/null || e=$((e+1))
  n=$((n+1)); echo "$n $e" >/share/reader.progress
  if [ $n -lt %[1]d ]; then sleep 0.5; else sleep 0.2; fi
done
sum=$(sha256sum /data/big.bin | cut -d' ' -f1) || e=$((e+1))
echo "reads=$n errors=$e sha256=$sum" >/dev/termination-log
[ $e -eq 0 ]`, slices)
	c.applyPod(t, "reader", images[0], reader, "",
		"  volumes:\n  - name: share\n    hostPath: {path: /mnt/host, type: Directory}\n",
		"    volumeMounts:\n    - {name: share, mountPath: /share}\n")
	c.waitPodRunning(t, "reader")
	status := n.guestFile(t, "status-lazy")
	t.Logf("pod reader running; registry served %d blob bytes; the snapshotter serves:\n%s", reg.BlobBytesServed(), status)
	lazy := false
	for _, line := range strings.Split(status, "\n") {
		if f := strings.Fields(line); len(f) >= 4 && strings.HasSuffix(line, "kube/env0:1") && f[3] == "yes" {
			lazy = true
		}
	}
	if !lazy {
		t.Errorf("containerd-envsnap status lists no mounted layer of %s: the pod's image was not served lazily by the DaemonSet's snapshotter", images[0])
	}

	before := n.guestFile(t, "logs-before")
	// The daemons lived through containerd's restart (a restart of the
	// snapshotter would have been a restart of every lazy mount's server).
	restarts := c.mustKubectl(t, "-n", ns, "get", "pod", first, "-o",
		`jsonpath={range .status.containerStatuses[*]}{.name}={.restartCount} {.lastState.terminated.reason} {.lastState.terminated.exitCode};{end}`)
	t.Logf("pod %s before its deletion: restarts %s", first, restarts)
	for _, f := range strings.Split(restarts, ";") {
		if name, rest, ok := strings.Cut(strings.TrimSpace(f), "="); ok && !strings.HasPrefix(rest, "0") {
			statuses, _ := c.kubectl("-n", ns, "get", "pod", first, "-o", "jsonpath={.status.containerStatuses}")
			t.Errorf("container %s of the DaemonSet's pod restarted (%s): not through containerd's restart; statuses %s\nthe node:\n%s",
				name, rest, statuses, before)
		}
	}
	// --- the snapshotter's pod deleted while the reader reads (the
	// DaemonSet's OnDelete update: a new pod of the new template) ---
	writeFile(t, filepath.Join(share, "read"), "")
	deleted := time.Now()
	c.mustKubectl(t, "-n", ns, "delete", "pod", first, "--wait=false")
	var second, secondUID string
	if err := c.waitFor(podBound, func() bool {
		second, secondUID = dsPod()
		return secondUID != "" && secondUID != firstUID
	}); err != nil {
		t.Fatalf("the DaemonSet did not replace its deleted pod %s within %s", first, podBound)
	}
	dsReady(t, "after the deletion")
	readsAtReady := readerProgress(t, share)
	t.Logf("pod %s deleted, %s Ready %s later; the reader had made %d reads (%d errors) by then",
		first, second, time.Since(deleted).Round(time.Second), readsAtReady[0], readsAtReady[1])
	// The reader's first pass ends after the new pod is Ready, so some of
	// its first reads of each slice go to the new daemon.
	if err := c.waitFor(2*time.Minute, func() bool { return readerProgress(t, share)[0] >= slices }); err != nil {
		t.Errorf("the reader did not finish its first pass within 2m of the new snapshotter's readiness (progress %v)", readerProgress(t, share))
	}
	writeFile(t, filepath.Join(share, "done"), "")
	term, phase := c.waitTerminated(t, "reader")
	if term.ExitCode != 0 || t.Failed() {
		t.Logf("the node before the deletion:\n%s\nafter the replacement:\n%s", before, n.guestFile(t, "logs-after"))
	}
	t.Logf("pod reader: phase %s, exit %d (%s), message %q", phase, term.ExitCode, term.Reason, term.Message)
	want := fmt.Sprintf("errors=0 sha256=%s", big.Digest().Encoded())
	if term.ExitCode != 0 || !strings.Contains(term.Message, want) {
		t.Errorf("pod reader: exit %d, message %q; want exit 0 and %q: its reads of a lazy layer failed or returned wrong bytes across the snapshotter's replacement",
			term.ExitCode, term.Message, want)
	}
	if readsAtReady[0] >= slices {
		t.Logf("note: the reader's first pass ended before the new snapshotter was Ready (%d reads): the reads went to the old daemon or waited for the new one", readsAtReady[0])
	}

	// --- the new snapshotter serves new pods lazily ---
	term, phase = c.runPod(t, "episode", images[1], "cat /msg >/dev/termination-log; exit 3", "")
	t.Logf("pod episode after the replacement: phase %s, exit %d (%s), message %q", phase, term.ExitCode, term.Reason, term.Message)
	if term.ExitCode != 3 || strings.TrimSpace(term.Message) != "envlet-kube-1" {
		t.Errorf("pod episode: exit %d, message %q; want exit 3 and envlet-kube-1", term.ExitCode, term.Message)
	}
	t.Logf("after the replacement the snapshotter serves:\n%s", n.guestFile(t, "status-after"))
}

// guestFile asks the guest for what the event name stands for
// (testdata/node.sh: "status-*" is `containerd-envsnap status` as the
// DaemonSet's probes run it, "logs-*" the snapshotter pod's log and the
// keeper's unit) and returns what it wrote.
func (n *node) guestFile(t *testing.T, name string) string {
	t.Helper()
	n.g.ask(t, n.share, name)
	b, err := os.ReadFile(filepath.Join(n.share, name+".out"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// readerProgress is the reader pod's count of reads and of failed reads
// (it writes them to the share after each read).
func readerProgress(t *testing.T, share string) [2]int {
	t.Helper()
	var p [2]int
	b, err := os.ReadFile(filepath.Join(share, "reader.progress"))
	if err != nil {
		return p
	}
	f := strings.Fields(string(b))
	if len(f) == 2 {
		p[0], _ = strconv.Atoi(f[0])
		p[1], _ = strconv.Atoi(f[1])
	}
	return p
}

// waitPodRunning waits for pod name's container to be running.
func (c *cluster) waitPodRunning(t *testing.T, name string) {
	t.Helper()
	if err := c.waitFor(podBound, func() bool {
		out, err := c.kubectl("get", "pod", name, "-o", "jsonpath={.status.containerStatuses[0].state.running}")
		return err == nil && out != ""
	}); err != nil {
		out, _ := c.kubectl("describe", "pod", name)
		t.Fatalf("pod %s not running within %s:\n%s", name, podBound, out)
	}
}
