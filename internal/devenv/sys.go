package devenv

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

func hasFilesystem(name string) bool {
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[len(f)-1] == name {
			return true
		}
	}
	return false
}

var (
	rootOnce sync.Once
	rootDir  string
	rootErr  error
)

// RepoRoot is the module root (the directory holding go.mod).
func RepoRoot() (string, error) {
	rootOnce.Do(func() {
		out, err := exec.Command("go", "env", "GOMOD").Output()
		gomod := strings.TrimSpace(string(out))
		if err != nil || gomod == "" || gomod == os.DevNull {
			rootErr = fmt.Errorf("cannot find the envsnap module root (go env GOMOD: %v)", err)
			return
		}
		rootDir = filepath.Dir(gomod)
	})
	return rootDir, rootErr
}

// BinDir is where `make build` puts our binaries ($ENVSNAP_BIN or bin/).
func BinDir() (string, error) {
	if d := os.Getenv("ENVSNAP_BIN"); d != "" {
		return d, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, "bin"), nil
}

// ToolsDir is where `make deps` puts containerd, runc, registry and crictl
// ($ENVSNAP_TOOLS or binDir/tools).
func ToolsDir(binDir string) string {
	if d := os.Getenv("ENVSNAP_TOOLS"); d != "" {
		return d
	}
	return filepath.Join(binDir, "tools")
}

// Tool returns the path of a tool installed by `make deps`.
func Tool(name string) (string, error) {
	bin, err := BinDir()
	if err != nil {
		return "", err
	}
	p := filepath.Join(ToolsDir(bin), name)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not installed at %s: run `make deps`", name, p)
	}
	return p, nil
}

// Binary returns the path of one of our binaries built by `make build`.
func Binary(name string) (string, error) {
	bin, err := BinDir()
	if err != nil {
		return "", err
	}
	p := filepath.Join(bin, name)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not built at %s: run `make build`", name, p)
	}
	return p, nil
}

// RemoveLeftovers stops the processes that name dir on their command line,
// detaches every mount below it and removes it, returning the mounts it
// found: what an Env's Close does once its daemons are stopped, for a
// stack whose Env is gone (a test binary that was killed).
func RemoveLeftovers(logf func(string, ...any), dir string) (leaked []string) {
	killNaming(logf, dir)
	leaked = unmountBelow(dir)
	if err := os.RemoveAll(dir); err != nil {
		logf("teardown: remove %s: %v", dir, err)
	}
	return leaked
}

// killNaming kills the processes whose command line names dir: the shims
// that serve the containerd below it outlive containerd by design, and the
// daemon's descriptor keeper outlives the daemon, so a test that failed
// mid-way would leak them. Killed by PID.
func killNaming(logf func(string, ...any), dir string) {
	entries, _ := os.ReadDir("/proc")
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil {
			continue
		}
		// dir+"/": a sibling whose name starts with dir's is another stack.
		if args := "\x00" + string(cmdline); strings.Contains(args, dir+"/") || strings.Contains(args, "\x00"+dir+"\x00") {
			logf("teardown: killing leftover pid %d (%s)", pid, strings.ReplaceAll(strings.TrimRight(string(cmdline), "\x00"), "\x00", " "))
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// mountsBelow lists mountpoints at or below dir, deepest first.
func mountsBelow(dir string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// MountsBelow returns the mountpoints currently at or below dir.
func MountsBelow(dir string) []string { return mountsBelow(dir) }

func unescapeMount(s string) string {
	// mountinfo escapes space, tab, newline and backslash as \ooo.
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// unmountBelow detaches every mount below dir and returns what it found.
func unmountBelow(dir string) []string {
	var found []string
	for attempt := 0; attempt < 5; attempt++ {
		mps := mountsBelow(dir)
		if len(mps) == 0 {
			break
		}
		for _, mp := range mps {
			if attempt == 0 {
				found = append(found, mp)
			}
			_ = syscall.Unmount(mp, syscall.MNT_DETACH)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return found
}

// removeCgroups removes the cgroups runc created under the namespace name
// in every v1 hierarchy and in the unified one.
func removeCgroups(logf func(string, ...any), namespace string) {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	roots = append(roots, "/sys/fs/cgroup")
	for _, root := range roots {
		dir := filepath.Join(root, namespace)
		if _, err := os.Stat(dir); err != nil {
			continue
		}
		// Children first: rmdir only works on empty cgroups.
		var dirs []string
		_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, d := range dirs {
			// Tasks of a killed container can take a moment to leave
			// their cgroup; rmdir fails with EBUSY until they have.
			var err error
			for attempt := 0; attempt < 25; attempt++ {
				if err = syscall.Rmdir(d); err != syscall.EBUSY {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if err != nil && err != syscall.ENOENT {
				logf("teardown: rmdir cgroup %s: %v", d, err)
			}
		}
	}
}

// removeEmptyCgroups removes name in every hierarchy if it is empty.
func removeEmptyCgroups(name string) {
	roots, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, root := range append(roots, "/sys/fs/cgroup") {
		_ = syscall.Rmdir(filepath.Join(root, name))
	}
}
