//go:build linux

package fdstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// replyTimeout bounds each exchange with the keeper. A keeper answers in
// microseconds; one that does not (stopped, wedged) must not hold a
// daemon's start-up or its mounts forever.
const replyTimeout = 10 * time.Second

// Client talks to a keeper. It is safe for concurrent use.
type Client struct {
	mu      sync.Mutex
	conn    *net.UnixConn
	timeout time.Duration // replyTimeout; shorter in tests
}

// Dial connects to the keeper at path.
func Dial(path string) (*Client, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("fdstore: connect to %s: %w", path, err)
	}
	return &Client{conn: c, timeout: replyTimeout}, nil
}

// Start connects to the keeper at path, starting one first if none
// answers: bin with args, in a session of its own (so the signals and
// process-group kills aimed at the caller do not reach it), with stderr
// going to the caller's stderr.
//
// bin may also be a launcher that hands the keeper to a service manager
// and exits (systemd-run starting it as a unit of its own, so it outlives
// the caller's cgroup, e.g. a Kubernetes pod): a launcher exiting with
// status 0 is not a failure, and Start waits for the socket as for a
// keeper it runs itself. Start gives up when ctx is done or the keeper
// does not answer within 10 s; a keeper it started keeps running then
// (it exits by itself once it holds nothing and no daemon is connected).
func Start(ctx context.Context, path, bin string, args ...string) (*Client, error) {
	if c, err := Dial(path); err == nil {
		return c, nil
	}
	cmd := exec.Command(bin, args...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("fdstore: start keeper: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := Dial(path)
		if err == nil {
			return c, nil
		}
		select {
		case werr := <-exited:
			if werr == nil {
				// A launcher: the keeper runs elsewhere.
				exited = nil
				break
			}
			// Another daemon's keeper may have won the race for the
			// socket; try it once more before giving up.
			if c, err := Dial(path); err == nil {
				return c, nil
			}
			return nil, fmt.Errorf("fdstore: keeper exited: %v", werr)
		case <-ctx.Done():
			return nil, fmt.Errorf("fdstore: wait for the keeper at %s: %w", path, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("fdstore: keeper did not answer within 10s: %w", err)
		}
	}
}

// Close disconnects. The keeper keeps what it holds.
func (c *Client) Close() error { return c.conn.Close() }

// Put stores a duplicate of e.FD under e.Key, replacing an entry with the
// same key. The caller keeps e.FD.
func (c *Client) Put(e Entry) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.send(request{Op: "put", Entry: e}, e.FD); err != nil {
		return err
	}
	_, err := c.recv()
	return err
}

// Delete drops the entry key (closing the keeper's descriptor).
func (c *Client) Delete(key string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.send(request{Op: "delete", Entry: Entry{Key: key}}, -1); err != nil {
		return err
	}
	_, err := c.recv()
	return err
}

// List returns every entry with a new descriptor each, owned by the caller.
func (c *Client) List() ([]Entry, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.send(request{Op: "list"}, -1); err != nil {
		return nil, err
	}
	r, err := c.recv()
	if err != nil {
		return nil, err
	}
	out := make([]Entry, 0, r.Count)
	for range r.Count {
		r, err := c.recv()
		if err == nil && (r.Entry == nil || r.Entry.FD < 0) {
			err = protoErr("list entry without a descriptor")
		}
		if err != nil {
			for _, e := range out {
				unix.Close(e.FD)
			}
			return nil, err
		}
		out = append(out, *r.Entry)
	}
	return out, nil
}

func (c *Client) send(r request, fd int) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	c.conn.SetWriteDeadline(time.Now().Add(c.timeout))
	if _, _, err := c.conn.WriteMsgUnix(b, oob, nil); err != nil {
		return c.fail(fmt.Errorf("fdstore: send %s: %w", r.Op, err))
	}
	return nil
}

// fail closes the connection after a failed exchange: a reply that comes
// late would otherwise be taken for the answer to the next request.
func (c *Client) fail(err error) error {
	c.conn.Close()
	return err
}

// recv reads one reply; a descriptor attached to it ends up in Entry.FD.
func (c *Client) recv() (reply, error) {
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(4*4))
	c.conn.SetReadDeadline(time.Now().Add(c.timeout))
	n, oobn, _, _, err := c.conn.ReadMsgUnix(buf, oob)
	if err != nil {
		return reply{}, c.fail(fmt.Errorf("fdstore: receive: %w", err))
	}
	if n == 0 {
		return reply{}, fmt.Errorf("fdstore: keeper closed the connection: %w", net.ErrClosed)
	}
	fds, err := parseRights(oob[:oobn])
	if err != nil {
		return reply{}, fmt.Errorf("fdstore: receive descriptors: %w", err)
	}
	var r reply
	if err := json.Unmarshal(buf[:n], &r); err != nil {
		closeAll(fds)
		return reply{}, protoErr("decode reply: %v", err)
	}
	if r.Err != "" {
		closeAll(fds)
		return reply{}, errors.New("fdstore: " + r.Err)
	}
	if r.Entry != nil {
		r.Entry.FD = -1
		if len(fds) > 0 {
			r.Entry.FD = fds[0]
			closeAll(fds[1:])
		}
	} else {
		closeAll(fds)
	}
	return r, nil
}
