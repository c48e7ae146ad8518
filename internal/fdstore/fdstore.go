//go:build linux

// Package fdstore keeps open file descriptors alive across restarts of the
// process that made them. Its server (the "keeper") is a small separate
// process; the daemon hands it a duplicate of each FUSE connection's
// /dev/fuse descriptor with SCM_RIGHTS, and a restarted daemon gets them
// back. The kernel keeps a FUSE connection alive while any descriptor of it
// is open, so a daemon killed with SIGKILL leaves its mounts waiting (not
// broken) until its successor serves them again.
//
// Protocol: one SOCK_SEQPACKET connection per client; each message is a
// JSON request or reply, descriptors travel as SCM_RIGHTS on the message
// that names them.
//
// Lifetime: the keeper drops an entry when told to, or when the mount it
// was registered for (mountpoint and device number, from mountinfo) is
// gone; it exits once it holds nothing and no client is connected, so a
// clean daemon stop leaves no process behind.
package fdstore

import (
	"encoding/json"
	"errors"
	"fmt"
)

// Entry is one stored descriptor.
type Entry struct {
	// Key names the entry (the daemon uses the mountpoint).
	Key string `json:"key"`
	// Mountpoint and Dev ("major:minor" as in mountinfo) tie the entry to
	// a mount: the keeper drops the entry once that mount is gone. Both
	// empty means the entry lives until deleted.
	Mountpoint string `json:"mountpoint,omitempty"`
	Dev        string `json:"dev,omitempty"`
	// Meta is opaque to the keeper.
	Meta json.RawMessage `json:"meta,omitempty"`
	// FD is the descriptor: in Put, the caller's (the keeper stores a
	// duplicate, the caller keeps its own); in List, a new descriptor
	// owned by the caller.
	FD int `json:"-"`
}

type request struct {
	Op    string `json:"op"` // put, delete, list
	Entry Entry  `json:"entry,omitempty"`
}

type reply struct {
	Err   string `json:"err,omitempty"`
	Count int    `json:"count,omitempty"` // list: entries that follow, one message each
	Entry *Entry `json:"entry,omitempty"`
}

// maxMessage bounds one message; entries carry a few hundred bytes.
const maxMessage = 64 << 10

var errProtocol = errors.New("fdstore: protocol error")

func protoErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errProtocol, fmt.Sprintf(format, args...))
}
