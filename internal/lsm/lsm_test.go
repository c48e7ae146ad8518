//go:build linux

package lsm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/prereq"
)

// helperEnv makes the test binary the probe run inside the confined
// cgroup: it tries each "open:PATH" or "connect:PATH" argument and prints
// "PATH result" per attempt.
const helperEnv = "ENVSNAP_LSM_PROBE"

func TestProbeHelper(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		prereq.Skip(t, prereq.HelperProcess, "")
	}
	for _, a := range strings.Split(os.Getenv(helperEnv+"_ARGS"), ",") {
		what, path, _ := strings.Cut(a, ":")
		var err error
		switch what {
		case "open":
			var f *os.File
			if f, err = os.Open(path); err == nil {
				f.Close()
			}
		case "connect":
			var c net.Conn
			if c, err = net.Dial("unix", path); err == nil {
				c.Close()
			}
		}
		fmt.Printf("%s %s %s\n", what, path, result(err))
	}
	os.Exit(0)
}

func result(err error) string {
	var errno syscall.Errno
	switch {
	case err == nil:
		return "ok"
	case errors.As(err, &errno):
		return unix.ErrnoName(errno)
	}
	return err.Error()
}

// probe runs the helper with attempts in cgroup dir (or in the test's own
// cgroup when dir is "") and returns its lines by attempt.
func probe(t *testing.T, dir string, attempts []string) map[string]string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestProbeHelper$")
	cmd.Env = append(os.Environ(), helperEnv+"=1", helperEnv+"_ARGS="+strings.Join(attempts, ","))
	if dir != "" {
		cg, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer cg.Close()
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("probe: %v\n%s", err, out)
	}
	got := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(l)
		if len(f) == 3 {
			got[f[0]+":"+f[1]] = f[2]
		}
	}
	return got
}

// TestGuard confines a cgroup and probes from inside it and from outside:
// a protected socket reached by its path, a hard link and
// /proc/self/root; a file under a protected directory; and what is not
// protected. Where the bpf LSM is not active (the VM guest), New must say
// so instead of loading programs that would never run.
func TestGuard(t *testing.T) {
	prereq.RequireRoot(t)
	root, err := cgroup2Mount()
	if err != nil {
		prereq.Missing(t, "%v", err)
	}
	rel := fmt.Sprintf("envsnap-lsm-test-%d", os.Getpid())
	if err := os.Mkdir(filepath.Join(root, rel), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filepath.Join(root, rel)) })
	// A nested cgroup: the rules hold below the environment's cgroup too.
	if err := os.Mkdir(filepath.Join(root, rel, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filepath.Join(root, rel, "sub")) })
	cg, err := OpenCgroup(root, rel)
	if err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	if err := os.MkdirAll(filepath.Join(secret, "deep", "er"), 0o755); err != nil {
		t.Fatal(err)
	}
	answers := filepath.Join(secret, "deep", "er", "answers.txt")
	public := filepath.Join(dir, "public.txt")
	for _, f := range []string{answers, public} {
		if err := os.WriteFile(f, []byte("42\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	listen := func(name string) string {
		p := filepath.Join(dir, name)
		l, err := net.Listen("unix", p)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		return p
	}
	node := listen("node.sock")
	other := listen("other.sock")
	link := filepath.Join(dir, "link.sock")
	if err := os.Link(node, link); err != nil {
		t.Fatal(err)
	}

	ps, missing, err := Resolve([]string{node, secret, filepath.Join(dir, "absent")})
	if err != nil || len(ps) != 2 || len(missing) != 1 {
		t.Fatalf("Resolve: %v, %d resolved, missing %v", err, len(ps), missing)
	}
	on, list, err := Active()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(Cgroup{ID: 1, Dir: root}, ps); err == nil || errors.Is(err, ErrUnavailable) {
		t.Fatalf("New on the root cgroup: %v, want a refusal", err)
	}
	g, err := New(cg, ps)
	if !on && !errors.Is(err, ErrUnavailable) {
		t.Fatalf("bpf LSM not active (%s), New: %v, want ErrUnavailable", list, err)
	}
	if errors.Is(err, ErrUnavailable) && os.Getenv("ENVSNAP_LSM_REQUIRED") == "1" {
		t.Fatalf("ENVSNAP_LSM_REQUIRED=1 (the VM guest, whose kernel runs them): %v", err)
	}
	if errors.Is(err, ErrUnavailable) {
		// The fallback: nothing of ours stays loaded.
		if n := ourPrograms(t); n != 0 {
			t.Errorf("%d envsnap BPF programs loaded after a refused New", n)
		}
		t.Logf("active LSMs %s: New: %v", list, err)
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Close() })

	attempts := []string{
		"connect:" + node, "connect:" + link, "connect:/proc/self/root" + node, "connect:" + other,
		"open:" + answers, "open:/proc/self/root" + answers, "open:" + secret, "open:" + public,
	}
	want := map[string]string{
		"connect:" + node: "EPERM", "connect:" + link: "EPERM", "connect:/proc/self/root" + node: "EPERM", "connect:" + other: "ok",
		"open:" + answers: "EPERM", "open:/proc/self/root" + answers: "EPERM", "open:" + secret: "EPERM", "open:" + public: "ok",
	}
	for _, where := range []string{rel, rel + "/sub"} {
		got := probe(t, filepath.Join(root, where), attempts)
		for _, a := range attempts {
			if got[a] != want[a] {
				t.Errorf("in %s: %s: %s, want %s", where, a, got[a], want[a])
			}
		}
	}
	// Outside the cgroup nothing changes.
	for a, res := range probe(t, "", attempts) {
		if res != "ok" {
			t.Errorf("outside the cgroup: %s: %s, want ok", a, res)
		}
	}
	d, err := g.Denials()
	if err != nil {
		t.Fatal(err)
	}
	if c := d[node]; c[Connect] != 6 || c[Open] != 0 {
		t.Errorf("denials of %s: %v, want 6 connects", node, c)
	}
	if c := d[secret]; c[Open] != 6 || c[Connect] != 0 {
		t.Errorf("denials of %s: %v, want 6 opens", secret, c)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	// Detached: the same cgroup is free again.
	if got := probe(t, filepath.Join(root, rel), attempts[:1]); got[attempts[0]] != "ok" {
		t.Errorf("after Close: %v", got)
	}
}

// ourPrograms counts this package's programs loaded in the kernel (by
// anyone: other tests may run alongside).
func ourPrograms(t *testing.T) int {
	n := 0
	var id ebpf.ProgramID
	for {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // gone meanwhile
		}
		if info, err := p.Info(); err == nil && strings.HasPrefix(info.Name, "envsnap_") {
			n++
		}
		p.Close()
	}
}

func TestMemberOffset(t *testing.T) {
	// struct file of Linux 6.12 and later: f_path inside an anonymous union.
	ptr := &btf.Pointer{Target: &btf.Void{}}
	path := &btf.Struct{Name: "path", Size: 16, Members: []btf.Member{{Name: "mnt", Type: ptr}, {Name: "dentry", Type: ptr, Offset: 64}}}
	union := &btf.Union{Size: 16, Members: []btf.Member{{Name: "f_path", Type: path}, {Name: "__f_path", Type: path}}}
	file := &btf.Struct{Name: "file", Size: 80, Members: []btf.Member{{Name: "f_inode", Type: ptr, Offset: 256}, {Type: union, Offset: 512}}}
	for _, tc := range []struct {
		path string
		want uint32
		err  bool
	}{
		{"f_inode", 32, false}, {"f_path.dentry", 72, false}, {"f_path.mnt", 64, false}, {"f_path.inode", 0, true}, {"f_mode", 0, true},
	} {
		got, err := memberOffset(file, strings.Split(tc.path, "."))
		if (err != nil) != tc.err || got != tc.want && !tc.err {
			t.Errorf("%s: %d, %v; want %d (error %v)", tc.path, got, err, tc.want, tc.err)
		}
	}
}

// TestKernelTypesDropped: loads share one decoded BTF while it is kept;
// once its timer fires it is let go, and the next load gets a new one.
// The timer is fired by hand: a wall-clock btfKeep would make the test
// depend on how promptly a loaded host runs it.
func TestKernelTypesDropped(t *testing.T) {
	keep := btfKeep
	btfKeep = time.Hour
	t.Cleanup(func() { btfKeep = keep })

	a := kernelTypes()
	if b := kernelTypes(); b != a {
		t.Fatal("a second load got a cache of its own")
	}
	kernelBTF.Lock()
	kernelBTF.drop.Reset(time.Millisecond)
	kernelBTF.Unlock()
	deadline := time.Now().Add(5 * time.Second)
	for {
		kernelBTF.Lock()
		dropped := kernelBTF.cache == nil
		kernelBTF.Unlock()
		if dropped {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the cache was still held 5 s after its timer was due")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if c := kernelTypes(); c == a {
		t.Fatal("after the drop, a load got the dropped cache back")
	}
}

// guardedCgroup makes cgroup i of this test process below the cgroup2
// root, removed at the end of the test.
func guardedCgroup(t testing.TB, root string, i int) Cgroup {
	t.Helper()
	rel := fmt.Sprintf("envsnap-lsm-many-%d-%d", os.Getpid(), i)
	if err := os.Mkdir(filepath.Join(root, rel), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filepath.Join(root, rel)) })
	cg, err := OpenCgroup(root, rel)
	if err != nil {
		t.Fatal(err)
	}
	return cg
}

// TestGuardsPerHook attaches guards, each for a cgroup of its own, until
// the kernel refuses one: it must refuse with ErrHookFull (it attaches at
// most 38 programs to one LSM hook), leave nothing of the refused guard
// loaded, and every guard before it must have attached. Where the bpf LSM
// does not run our programs, New must say ErrUnavailable.
func TestGuardsPerHook(t *testing.T) {
	prereq.RequireRoot(t)
	root, err := cgroup2Mount()
	if err != nil {
		prereq.Missing(t, "%v", err)
	}
	var guards []*Guard
	t.Cleanup(func() {
		for _, g := range guards {
			g.Close()
		}
	})
	for i := range 64 {
		g, err := New(guardedCgroup(t, root, i), nil)
		if i == 0 && errors.Is(err, ErrUnavailable) {
			if os.Getenv("ENVSNAP_LSM_REQUIRED") == "1" {
				t.Fatalf("ENVSNAP_LSM_REQUIRED=1: %v", err)
			}
			t.Logf("no BPF LSM programs here: %v", err)
			return
		}
		if err != nil {
			if !errors.Is(err, ErrHookFull) {
				t.Fatalf("guard %d: %v, want ErrHookFull or success", i+1, err)
			}
			if n := ourPrograms(t); n != 2*i {
				t.Errorf("%d envsnap programs loaded after the refused guard %d, want the %d of the guards before it", n, i+1, 2*i)
			}
			t.Logf("%d guards attached; guard %d refused: %v", i, i+1, err)
			return
		}
		guards = append(guards, g)
	}
	t.Fatalf("64 guards attached: the kernel's limit per hook is not what ErrHookFull says")
}

// TestOpenCostOfGuards measures what attached guards cost every other
// process on the node: each environment's guard adds two node-wide
// programs, and every open on the node runs its open program, which
// returns after one helper call for a process outside the environment.
// It times open+close of one file from this test's process, outside
// every guarded cgroup, with no guard and with ENVSNAP_LSM_GUARDS
// (default 32; the kernel holds at most 38) guards attached, in three
// rounds, and logs the ratios and their median. A benchmark
// (ENVSNAP_BENCH=1): it asserts no time. It needs the bpf LSM active
// (the VM guest).
func TestOpenCostOfGuards(t *testing.T) {
	prereq.RequireBench(t)
	prereq.RequireRoot(t)
	on, list, err := Active()
	if err != nil {
		t.Fatal(err)
	}
	if !on {
		prereq.Missing(t, "the bpf LSM is not active (active LSMs: %s)", list)
	}
	n := 32
	if v := os.Getenv("ENVSNAP_LSM_GUARDS"); v != "" {
		if _, err := fmt.Sscan(v, &n); err != nil {
			t.Fatal(err)
		}
	}
	root, err := cgroup2Mount()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	ps, _, err := Resolve([]string{filepath.Join(dir, "protected")})
	if err != nil {
		t.Fatal(err)
	}
	opens := func() float64 {
		r := testing.Benchmark(func(b *testing.B) {
			for range b.N {
				f, err := os.Open(file)
				if err != nil {
					b.Fatal(err)
				}
				f.Close()
			}
		})
		return float64(r.T.Nanoseconds()) / float64(r.N)
	}
	// Rounds alternate without and with the guards: a host shared with
	// other work (a TCG guest above all) drifts between measurements.
	const rounds = 3
	var ratios, perProg []float64
	for r := range rounds {
		none := opens()
		var guards []*Guard
		for i := range n {
			g, err := New(guardedCgroup(t, root, r*n+i), ps)
			if errors.Is(err, ErrUnavailable) && os.Getenv("ENVSNAP_LSM_REQUIRED") != "1" {
				prereq.Missing(t, "%v", err)
			}
			if err != nil {
				t.Fatal(err)
			}
			guards = append(guards, g)
		}
		guarded := opens()
		for _, g := range guards {
			g.Close()
		}
		ratios = append(ratios, guarded/none)
		perProg = append(perProg, (guarded-none)/float64(n))
		t.Logf("round %d: open+close of a file outside every guarded cgroup: %.0f ns with no guard, %.0f ns with %d guards (%d programs) attached: %.2fx",
			r+1, none, guarded, n, 2*n, guarded/none)
	}
	slices.Sort(ratios)
	slices.Sort(perProg)
	t.Logf("median of %d rounds: %.2fx, %.0f ns per attached open program", rounds, ratios[rounds/2], perProg[rounds/2])
}

// BenchmarkNewBTF loads a guard's programs side by side with the shared
// BTF cache (what New does) and with a fresh cache per load (what loading
// each program with ebpf.NewProgram did), then logs the heap the shared
// cache holds and what is left once it is dropped. Where the kernel
// refuses the programs (EPERM) the refusal comes after the attach target
// was looked up in the BTF, which is the cost measured; run it with
// -benchtime 20x or so: each fresh load decodes the whole BTF.
func BenchmarkNewBTF(b *testing.B) {
	prereq.RequireRoot(b)
	root, err := cgroup2Mount()
	if err != nil {
		prereq.Missing(b, "%v", err)
	}
	cg := guardedCgroup(b, root, 0)
	load := func(b *testing.B, types func() *btf.Cache) {
		for range b.N {
			g, err := newGuard(cg, nil, types())
			if err != nil && !errors.Is(err, ErrUnavailable) {
				b.Fatal(err)
			}
			if g != nil {
				g.Close()
			}
		}
	}
	b.Run("shared", func(b *testing.B) { load(b, kernelTypes) })
	b.Run("fresh", func(b *testing.B) { load(b, btf.NewCache) })

	heap := func() float64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		return float64(m.HeapInuse) / (1 << 20)
	}
	held := heap()
	kernelBTF.Lock()
	if kernelBTF.drop != nil {
		kernelBTF.drop.Reset(time.Millisecond)
	}
	kernelBTF.Unlock()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		kernelBTF.Lock()
		dropped := kernelBTF.cache == nil
		kernelBTF.Unlock()
		if dropped {
			break
		}
	}
	b.Logf("heap in use: %.1f MiB with the shared BTF held, %.1f MiB once dropped", held, heap())
}
