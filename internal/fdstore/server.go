//go:build linux

package fdstore

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// Defaults, all in one place.
const (
	// checkInterval is how often the keeper looks for entries whose mount
	// is gone (unmounted by an operator or a teardown, not by the daemon).
	checkInterval = 2 * time.Second
	// idleExit is how long a keeper that holds nothing waits for a client
	// before exiting (covers a daemon that started it and died at once).
	idleExit = 30 * time.Second
)

// Server is the keeper.
type Server struct {
	path string

	mu      sync.Mutex
	entries map[string]Entry
	clients int
	idle    time.Time // since when it holds nothing and has no client
}

// Serve listens on the unix socket path (mode 0600) and keeps descriptors
// until ctx ends or it has nothing to keep and nobody to keep it for.
// Descriptors still held when it returns are closed (which ends their FUSE
// connections), so it should only be stopped on purpose.
func Serve(ctx context.Context, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("fdstore: create socket dir: %w", err)
	}
	// A live keeper answers; a stale socket file does not.
	if c, err := Dial(path); err == nil {
		c.Close()
		return fmt.Errorf("fdstore: a keeper already serves %s", path)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("fdstore: remove stale socket: %w", err)
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("fdstore: listen on %s: %w", path, err)
	}
	l.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return fmt.Errorf("fdstore: restrict socket: %w", err)
	}
	s := &Server{path: path, entries: map[string]Entry{}, idle: time.Now()}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	go s.watch(ctx, cancel)
	log.G(ctx).WithField("socket", path).Info("fdstore: keeping descriptors")
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			break
		}
		s.mu.Lock()
		s.clients++
		s.mu.Unlock()
		go s.serveConn(ctx, c)
	}
	s.mu.Lock()
	for k, e := range s.entries {
		unix.Close(e.FD)
		delete(s.entries, k)
	}
	s.mu.Unlock()
	return nil
}

// watch drops entries whose mount is gone and ends the keeper when it is
// idle.
func (s *Server) watch(ctx context.Context, stop context.CancelFunc) {
	t := time.NewTicker(checkInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		mounts, err := readMountinfo()
		if err != nil {
			log.G(ctx).WithError(err).Warn("fdstore: read mountinfo")
			continue
		}
		s.mu.Lock()
		for k, e := range s.entries {
			if e.Mountpoint == "" || mounts[e.Mountpoint+" "+e.Dev] {
				continue
			}
			log.G(ctx).WithField("key", k).WithField("mountpoint", e.Mountpoint).Info("fdstore: mount is gone; dropping its descriptor")
			unix.Close(e.FD)
			delete(s.entries, k)
		}
		s.touchLocked()
		idleFor := time.Duration(0)
		if !s.idle.IsZero() {
			idleFor = time.Since(s.idle)
		}
		s.mu.Unlock()
		// The socket was removed (its directory torn down): nobody can
		// reach us any more.
		if _, err := os.Stat(s.path); err != nil {
			log.G(ctx).WithField("socket", s.path).Info("fdstore: socket removed; exiting")
			stop()
			return
		}
		if idleFor >= idleExit {
			log.G(ctx).Info("fdstore: nothing to keep; exiting")
			stop()
			return
		}
	}
}

// touchLocked records when the keeper became idle.
func (s *Server) touchLocked() {
	switch {
	case len(s.entries) > 0 || s.clients > 0:
		s.idle = time.Time{}
	case s.idle.IsZero():
		s.idle = time.Now()
	}
}

func (s *Server) serveConn(ctx context.Context, c *net.UnixConn) {
	defer func() {
		c.Close()
		s.mu.Lock()
		s.clients--
		s.touchLocked()
		empty := len(s.entries) == 0 && s.clients == 0
		s.mu.Unlock()
		if empty {
			// The daemon stopped cleanly and unmounted everything:
			// nothing to wait for. (The watcher notices within one
			// interval; this only makes it prompt.)
			s.mu.Lock()
			s.idle = time.Now().Add(-idleExit)
			s.mu.Unlock()
		}
	}()
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			return
		}
		fds, ferr := parseRights(oob[:oobn])
		var req request
		if err := json.Unmarshal(buf[:n], &req); err != nil || ferr != nil {
			closeAll(fds)
			s.send(c, reply{Err: fmt.Sprintf("bad request: %v %v", err, ferr)}, -1)
			return
		}
		switch req.Op {
		case "put":
			if len(fds) != 1 {
				closeAll(fds)
				s.send(c, reply{Err: fmt.Sprintf("put carries %d descriptors, want 1", len(fds))}, -1)
				continue
			}
			e := req.Entry
			e.FD = fds[0]
			s.mu.Lock()
			if old, ok := s.entries[e.Key]; ok {
				unix.Close(old.FD)
			}
			s.entries[e.Key] = e
			s.mu.Unlock()
			log.G(ctx).WithField("key", e.Key).Debug("fdstore: stored")
			s.send(c, reply{}, -1)
		case "delete":
			closeAll(fds)
			s.mu.Lock()
			if old, ok := s.entries[req.Entry.Key]; ok {
				unix.Close(old.FD)
				delete(s.entries, req.Entry.Key)
			}
			s.mu.Unlock()
			s.send(c, reply{}, -1)
		case "list":
			closeAll(fds)
			s.mu.Lock()
			list := make([]Entry, 0, len(s.entries))
			for _, e := range s.entries {
				list = append(list, e)
			}
			// Send while holding the lock: a descriptor must not be
			// closed by a concurrent delete mid-send.
			if !s.send(c, reply{Count: len(list)}, -1) {
				s.mu.Unlock()
				return
			}
			for i := range list {
				if !s.send(c, reply{Entry: &list[i]}, list[i].FD) {
					break
				}
			}
			s.mu.Unlock()
		default:
			closeAll(fds)
			s.send(c, reply{Err: "unknown op " + req.Op}, -1)
		}
	}
}

func (s *Server) send(c *net.UnixConn, r reply, fd int) bool {
	b, err := json.Marshal(r)
	if err != nil {
		return false
	}
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	return err == nil
}

func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for _, m := range msgs {
		f, err := unix.ParseUnixRights(&m)
		if err != nil {
			closeAll(fds)
			return nil, err
		}
		fds = append(fds, f...)
	}
	for _, fd := range fds {
		unix.CloseOnExec(fd)
	}
	return fds, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// readMountinfo returns "mountpoint major:minor" for every mount.
func readMountinfo() (map[string]bool, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		// id parent major:minor root mountpoint ...
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		out[unescape(fields[4])+" "+fields[2]] = true
	}
	return out, sc.Err()
}

// unescape undoes mountinfo's octal escapes (\040 for space etc.).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// MountDev returns the "major:minor" of the mount at mountpoint as
// mountinfo shows it, without touching the filesystem (a FUSE mount whose
// server is gone would hang a stat).
func MountDev(mountpoint string) (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	dev := ""
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 5 && unescape(fields[4]) == mountpoint {
			dev = fields[2] // the last one is the visible one
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if dev == "" {
		return "", fmt.Errorf("fdstore: nothing mounted at %s: %w", mountpoint, os.ErrNotExist)
	}
	return dev, nil
}
