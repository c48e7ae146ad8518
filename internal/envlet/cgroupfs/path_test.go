package cgroupfs

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// ownCgroupV2 is this process's unified-hierarchy cgroup, which runc's
// relative paths hang off.
func ownCgroupV2(t *testing.T) string {
	t.Helper()
	f, err := os.Open("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return p
		}
	}
	t.Fatal("no 0:: line in /proc/self/cgroup")
	return ""
}

func TestResolveV2(t *testing.T) {
	parent := filepath.Dir(ownCgroupV2(t))
	for _, tc := range []struct {
		name, in, want, err string
	}{
		{name: "kubeadm burstable pod", in: "kubepods-burstable-pod0b5e.slice:cri-containerd:4f2a",
			want: "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b5e.slice/cri-containerd-4f2a.scope"},
		{name: "guaranteed pod", in: "kubepods-pod1.slice:cri-containerd:c1",
			want: "/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope"},
		{name: "top-level slice", in: "system.slice:ctr:p1", want: "/sys/fs/cgroup/system.slice/ctr-p1.scope"},
		{name: "empty slice is system.slice", in: ":ctr:p1", want: "/sys/fs/cgroup/system.slice/ctr-p1.scope"},
		{name: "root slice", in: "-.slice:ctr:p1", want: "/sys/fs/cgroup/ctr-p1.scope"},
		{name: "name is a slice", in: "kubepods.slice:cri-containerd:pod2.slice", want: "/sys/fs/cgroup/kubepods.slice/pod2.slice"},
		{name: "double dash", in: "a--b.slice:x:y", err: "invalid slice name"},
		{name: "not a slice", in: "kubepods:cri-containerd:c1", err: "invalid slice name"},
		{name: "empty name", in: "system.slice:ctr:", err: "slice:prefix:name"},
		{name: "absolute", in: "/kubepods/burstable/pod1/c1", want: "/sys/fs/cgroup/kubepods/burstable/pod1/c1"},
		{name: "absolute with dots", in: "/default/../../etc", want: "/sys/fs/cgroup/etc"},
		{name: "absolute with colons is cgroupfs", in: "/a:b:c", want: "/sys/fs/cgroup/a:b:c"},
		{name: "relative", in: "default/c1", want: filepath.Join("/sys/fs/cgroup", parent, "default/c1")},
		{name: "relative cannot climb", in: "../../x", want: filepath.Join("/sys/fs/cgroup", parent, "x")},
		{name: "empty", in: "", err: "empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ResolveV2(tc.in)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("ResolveV2(%q) = %q, %v; want error containing %q", tc.in, got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ResolveV2(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
			}
		})
	}
}

func TestResolveV1(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{in: "kubepods-besteffort-pod7.slice:cri-containerd:c9", want: "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod7.slice/cri-containerd-c9.scope"},
		{in: ":ctr:p1", want: "/system.slice/ctr-p1.scope"},
		{in: "/default/p1", want: "/default/p1"},
		{in: "x-.slice:a:b", err: "invalid slice name"},
		{in: "", err: "empty"},
	} {
		got, err := ResolveV1(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ResolveV1(%q) = %q, %v; want error containing %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ResolveV1(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}
