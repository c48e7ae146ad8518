package devenv

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
)

// Process is a daemon started by the env. It is always stopped by PID,
// never by name, so parallel runs and the developer's own daemons are safe.
type Process struct {
	Name    string
	LogPath string
	cmd     *exec.Cmd
	done    chan struct{}
	err     error
}

// StartProcess starts bin with args, logging stdout and stderr to
// dir/name.log. The caller stops it (Env.StartProcess registers that).
func StartProcess(dir, name string, env []string, bin string, args ...string) (*Process, error) {
	return StartCommand(dir, name, env, exec.Command(bin, args...))
}

// StartCommand is StartProcess for a prepared command (e.g. one that runs
// inside a network namespace).
func StartCommand(dir, name string, env []string, cmd *exec.Cmd) (*Process, error) {
	bin := cmd.Path
	logPath := filepath.Join(dir, name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open log for %s: %w", name, err)
	}
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Env = append(os.Environ(), env...)
	// A process group of its own, so a terminal ^C aimed at the parent does
	// not race its orderly shutdown.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	p := &Process{Name: name, LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// PID returns the process ID.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Exited reports whether the process has exited, and its wait error.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Stop sends SIGTERM and escalates to SIGKILL after grace. It is idempotent.
func (p *Process) Stop(grace time.Duration) {
	if exited, _ := p.Exited(); exited {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// Kill sends SIGKILL and waits for the exit, for crash tests.
func (p *Process) Kill() {
	if exited, _ := p.Exited(); exited {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
}

// LogTail returns the last n lines of the process log.
func (p *Process) LogTail(n int) string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return fmt.Sprintf("(read log: %v)", err)
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// LogContains reports whether the process log contains s.
func (p *Process) LogContains(s string) bool {
	b, err := os.ReadFile(p.LogPath)
	return err == nil && strings.Contains(string(b), s)
}

// LogSize is the length of the process log now (0 when it cannot be
// read): the offset from which a later CountLogLines counts.
func (p *Process) LogSize() int64 {
	st, err := os.Stat(p.LogPath)
	if err != nil {
		return 0
	}
	return st.Size()
}

// CountLogLines counts the lines of the process log written after
// offset from (a LogSize) that contain s.
func (p *Process) CountLogLines(from int64, s string) (int, error) {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return 0, err
	}
	if from > int64(len(b)) {
		return 0, fmt.Errorf("log %s is shorter (%d bytes) than offset %d", p.LogPath, len(b), from)
	}
	n := 0
	for _, line := range strings.Split(string(b[from:]), "\n") {
		if strings.Contains(line, s) {
			n++
		}
	}
	return n, nil
}

// LogLine returns the last line of the process log that contains every
// one of parts, or "" when none does (or the log cannot be read).
func (p *Process) LogLine(parts ...string) string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return ""
	}
	found := ""
	for _, line := range strings.Split(string(b), "\n") {
		all := true
		for _, s := range parts {
			all = all && strings.Contains(line, s)
		}
		if all {
			found = line
		}
	}
	return found
}

// waitFor polls cond every 50ms until it returns nil or timeout passes.
func waitFor(timeout time.Duration, what string, cond func() error) error {
	deadline := time.Now().Add(timeout)
	var err error
	for {
		if err = cond(); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s: %w", timeout, what, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CPUSeconds reports the CPU time (user and system, in seconds) used so
// far by each daemon of the env that is still running, by name, and by
// the calling process as "self" (which runs the env's in-process parts:
// the registry's link proxy, the clients). Benchmarks difference two
// calls to say where the CPU of a scenario went, whichever process did
// the work. A process that cannot be read is left out: the numbers
// explain results, they are not results.
func (e *Env) CPUSeconds() map[string]float64 {
	out := map[string]float64{}
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return out
	}
	add := func(name string, pid int) {
		p, err := fs.Proc(pid)
		if err != nil {
			return
		}
		if st, err := p.Stat(); err == nil {
			out[name] += st.CPUTime()
		}
	}
	for _, p := range e.Processes() {
		if exited, _ := p.Exited(); !exited { // a restarted daemon's old PID
			add(p.Name, p.PID())
		}
	}
	add("self", os.Getpid())
	return out
}
