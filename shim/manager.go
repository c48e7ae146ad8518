//go:build linux

package shim

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	cgroupsv2 "github.com/containerd/cgroups/v3/cgroup2"
	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types/runc/options"
	runcmanager "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/defaults"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/shim"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/shim/config"
)

// Grouping. One shim process serves up to group-size ([shim] in
// envlet.toml) containers of a containerd namespace: its `start`
// subcommand returns the address of a running shim with room instead of
// spawning one, the way containerd's runc shim serves a whole pod. That
// takes the process's start (binary, plugins, config, arbiter connection,
// the kernel BTF parse) off every later Create, and shares the Go
// runtime's memory and wake-ups among the group.
const (
	// AnnGroup is runc's grouping annotation; a container that sets it
	// joins that group's shim whatever group-size says.
	AnnGroup = "io.containerd.runc.v2.group"
	// annSandboxID is CRI's: a pod's containers join their sandbox's shim.
	annSandboxID = "io.kubernetes.cri.sandbox-id"
	// groupFile, in a container's bundle, names the group its shim
	// serves. Start counts these (under a lock on the namespace's bundle
	// directory) to find a group with room; containerd removes the bundle
	// when it deletes the container.
	groupFile = "envlet-group"
)

// NewManager is containerd's runc shim manager with envlet's grouping:
// Stop and Info are runc's; Start picks the container's group.
func NewManager(name string) shim.Shim {
	return manager{Shim: runcmanager.NewShimManager(name)}
}

type manager struct {
	shim.Shim
}

// Start runs in the container's bundle directory. It returns the address
// of the shim serving the container's group, spawning that shim if no
// live one listens there.
func (m manager) Start(ctx context.Context, opts *bootapi.BootstrapParams) (_ *bootapi.BootstrapResult, retErr error) {
	params := &bootapi.BootstrapResult{Version: 3, Protocol: "ttrpc"}
	id := opts.GetInstanceID()
	bundle, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	size := 1
	if cfg, err := config.Load(); err == nil {
		// A broken config is reported by the serving shim on every
		// Create; one shim per container until it is fixed.
		size = cfg.GroupSize()
	}
	socketDir := opts.GetSocketDir()
	if socketDir == "" {
		socketDir = filepath.Join(defaults.DefaultStateDir, "s")
	}
	group, err := pickGroup(bundle, id, size)
	if err != nil {
		return nil, fmt.Errorf("envlet shim group of %s: %w", id, err)
	}
	address, err := shim.CreateSocketAddress(ctx, socketDir, opts.GetContainerdGrpcAddress(), group, false)
	if err != nil {
		return nil, err
	}
	// Held until the shim listening there is started: a start of the
	// same group waits, then finds it alive.
	unlock, err := lockGroupSocket(address)
	if err != nil {
		return nil, err
	}
	defer unlock()
	socket, err := takeGroupSocket(address, id)
	if err != nil {
		return nil, err
	}
	if socket == nil {
		params.Address = address
		return params, nil
	}
	defer func() {
		if retErr != nil {
			socket.Close()
			_ = shim.RemoveSocket(address)
		}
	}()
	f, err := socket.File()
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd, err := shimCommand(ctx, id, opts.GetContainerdGrpcAddress(), bundle)
	if err != nil {
		return nil, err
	}
	cmd.Env = append(cmd.Env, groupSocketEnv+"="+address)
	cmd.ExtraFiles = []*os.File{f}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start shim: %w", err)
	}
	defer func() {
		if retErr != nil {
			_ = cmd.Process.Kill()
		}
	}()
	go func() { _ = cmd.Wait() }()
	if err := joinShimCgroup(opts, cmd.Process.Pid); err != nil {
		return nil, err
	}
	if err := shim.AdjustOOMScore(cmd.Process.Pid); err != nil {
		return nil, fmt.Errorf("adjust OOM score of shim: %w", err)
	}
	params.Address = address
	return params, nil
}

// groupSocketEnv names, in a serving shim's environment, the address of
// the socket Start made for it: the shim removes it when it leaves
// (Service.linger), so that the next start of its group makes a new one.
const groupSocketEnv = "ENVLET_GROUP_SOCKET"

// lockGroupSocket takes an exclusive lock on a file beside the socket at
// address. Start holds it while it finds, replaces or creates a group's
// socket and starts the shim, a leaving shim while it removes its
// socket: two starts of one group would otherwise both take the socket a
// shim left behind for stale, and one would remove the other's new
// socket or fail to bind.
func lockGroupSocket(address string) (unlock func(), err error) {
	path := strings.TrimPrefix(address, "unix://") + ".lock"
	// The socket directory does not exist before a node's first shim
	// (shim.NewSocket makes it, with the same mode).
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("shim socket directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open shim socket lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil // closing unlocks
}

// takeGroupSocket returns a new listening socket at address for the
// shim of container id to serve on, or nil when a live shim already
// listens there; then it records id as joined to that shim, which must
// not leave before id's Create reaches it (Service.unlist). The caller
// holds the group's lock.
func takeGroupSocket(address, id string) (*net.UnixListener, error) {
	socket, err := groupSocket(address)
	if err != nil {
		return nil, err
	}
	if socket == nil {
		return nil, recordJoin(address, id)
	}
	// Joins recorded for a shim that died are not the new shim's.
	if err := os.Remove(joinsPath(address)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		socket.Close()
		return nil, fmt.Errorf("remove the joins of a dead shim: %w", err)
	}
	return socket, nil
}

// joinsPath is the file beside a group's socket listing, one per line,
// the containers whose start returned the live shim there: containerd
// connects and sends their Create only after the start exits, and a
// shim leaving in between would lose them.
func joinsPath(address string) string {
	return strings.TrimPrefix(address, "unix://") + ".joins"
}

// recordJoin adds id to the joins of the shim at address. The caller
// holds the group's lock.
func recordJoin(address, id string) error {
	f, err := os.OpenFile(joinsPath(address), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("record join of %s: %w", id, err)
	}
	if _, err := f.WriteString(id + "\n"); err != nil {
		f.Close()
		return fmt.Errorf("record join of %s: %w", id, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("record join of %s: %w", id, err)
	}
	return nil
}

// pendingJoins returns the containers joined to the shim at address
// whose Create it has not seen, and when the last join was recorded.
// The caller holds the group's lock.
func pendingJoins(address string, created map[string]bool) (pending []string, last time.Time, err error) {
	f, err := os.Open(joinsPath(address))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, time.Time{}, nil
	}
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read joins: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read joins: %w", err)
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if id := sc.Text(); id != "" && !created[id] {
			pending = append(pending, id)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, time.Time{}, fmt.Errorf("read joins: %w", err)
	}
	return pending, st.ModTime(), nil
}

// groupSocket returns a new listening socket at address, or nil when a
// live shim already listens there. A socket nobody answers on is one a
// shim left behind when it died: it is replaced. The caller holds the
// group's lock (lockGroupSocket).
func groupSocket(address string) (*net.UnixListener, error) {
	socket, err := shim.NewSocket(address)
	if err == nil {
		return socket, nil
	}
	if !shim.SocketEaddrinuse(err) {
		return nil, fmt.Errorf("create shim socket: %w", err)
	}
	if shim.CanConnect(address) {
		return nil, nil
	}
	if err := shim.RemoveSocket(address); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("remove stale shim socket: %w", err)
	}
	if socket, err = shim.NewSocket(address); err != nil {
		return nil, fmt.Errorf("create shim socket after removing a stale one: %w", err)
	}
	return socket, nil
}

// pickGroup returns the group of the container id whose bundle is
// bundle, and records it there. The annotations decide first (runc's
// group, then the pod's sandbox's group); otherwise the lowest numbered
// group of the namespace holding fewer than size containers, counting
// the bundles that name it, under an exclusive lock on the namespace's
// bundle directory so that containers started together count each other.
// size 1 gives every container its own shim.
func pickGroup(bundle, id string, size int) (string, error) {
	ann, err := bundleAnnotations(bundle)
	if err != nil {
		return "", err
	}
	if g := ann[AnnGroup]; g != "" {
		return g, nil
	}
	if size <= 1 {
		return id, nil
	}
	nsDir := filepath.Dir(bundle)
	d, err := os.Open(nsDir)
	if err != nil {
		return "", err
	}
	defer d.Close()
	if err := unix.Flock(int(d.Fd()), unix.LOCK_EX); err != nil {
		return "", fmt.Errorf("lock %s: %w", nsDir, err)
	}
	defer unix.Flock(int(d.Fd()), unix.LOCK_UN) //nolint:errcheck // closing unlocks too
	group := ""
	if sb := ann[annSandboxID]; sb != "" && sb != id {
		if b, err := os.ReadFile(filepath.Join(nsDir, filepath.Base(sb), groupFile)); err == nil {
			group = string(b)
		}
	}
	if group == "" {
		members := map[string]int{}
		files, err := filepath.Glob(filepath.Join(nsDir, "*", groupFile))
		if err != nil {
			return "", err
		}
		for _, f := range files {
			if b, err := os.ReadFile(f); err == nil {
				members[string(b)]++
			}
		}
		for i := 0; ; i++ {
			g := "envlet-" + strconv.Itoa(i)
			if members[g] < size {
				group = g
				break
			}
		}
	}
	if err := os.WriteFile(filepath.Join(bundle, groupFile), []byte(group), 0o600); err != nil {
		return "", fmt.Errorf("record shim group: %w", err)
	}
	return group, nil
}

// bundleAnnotations reads only the annotations of the bundle's spec.
func bundleAnnotations(bundle string) (map[string]string, error) {
	f, err := os.Open(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var s struct {
		Annotations map[string]string `json:"annotations"`
	}
	if err := json.NewDecoder(f).Decode(&s); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("read spec annotations: %w", err)
	}
	return s.Annotations, nil
}

// shimCommand is the serving shim's command line, as runc's manager
// builds it: the first container's id names the process (and its log is
// that container's), the socket is passed as fd 3.
func shimCommand(ctx context.Context, id, containerdAddress, dir string) (*exec.Cmd, error) {
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "-namespace", ns, "-id", id, "-address", containerdAddress)
	cmd.Dir = dir
	// runc's manager sets 4 too. One was tried once (48 rollouts, 3
	// shims): the shims' CPU until the last ready fell from 6.1 to 4.3
	// CPU-s; the episodes' work after ready took 57.9 s (median) against
	// 20-23 s in the runs before, but later runs with 4 took 41-63 s
	// too, so that run does not say whether one P costs the episodes.
	cmd.Env = append(os.Environ(), "GOMAXPROCS=4")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd, nil
}

// joinShimCgroup moves the shim into the runtime's shim cgroup
// (runc options' ShimCgroup), as runc's manager does.
func joinShimCgroup(opts *bootapi.BootstrapParams, pid int) error {
	var runcOpts options.Options
	found, err := opts.FindExtension(&runcOpts)
	if err != nil {
		return fmt.Errorf("read runc options: %w", err)
	}
	if !found || runcOpts.GetShimCgroup() == "" {
		return nil
	}
	path := runcOpts.GetShimCgroup()
	if cgroups.Mode() == cgroups.Unified {
		cg, err := cgroupsv2.Load(path)
		if err != nil {
			return fmt.Errorf("load shim cgroup %s: %w", path, err)
		}
		return cg.AddProc(uint64(pid))
	}
	cg, err := cgroup1.Load(cgroup1.StaticPath(path))
	if err != nil {
		return fmt.Errorf("load shim cgroup %s: %w", path, err)
	}
	return cg.AddProc(uint64(pid))
}
