// Package evalgroup is what the snapshotter and the envlet shim share
// about a plan's evaluator-only group (docs/plans.md, "Evaluator-only
// groups"): the snapshot label that marks the group's layers, and the
// record of the layers the snapshotter held back from a container's root
// file system, which the shim mounts for the evaluator.
//
// Invariant: the mounts the snapshotter gives out for a container's
// writable snapshot never contain a marked layer; the record, beside the
// snapshot's upper directory, names them. The record is outside the
// upper directory, so nothing in the container can write it.
package evalgroup

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// LayerLabel marks a layer of an evaluator-only group; its value is the
// directory of the image that holds the group's files. Compose sets it as
// an annotation on each of the group's layers; containerd's unpacker
// passes annotations with this prefix to the snapshotter's Prepare and
// Commit for every client, so the committed snapshot of the layer carries
// it.
const LayerLabel = "containerd.io/snapshot/envsnap.evaluator-dir"

// recordName is the record's file name, in the directory of the
// snapshot's upper directory (containerd's overlay snapshotter keeps a
// snapshot's "fs" and "work" there).
const recordName = "envsnap-evaluator.json"

// Record names the evaluator layers held back from one container
// snapshot.
type Record struct {
	// Dir is where the group's files appear in the container.
	Dir string `json:"dir"`
	// Lowers are the layers' directories, topmost first (overlay's
	// lowerdir order).
	Lowers []string `json:"lowers"`
}

// CheckDir cleans d and checks it is an absolute directory below /.
func CheckDir(d string) (string, error) {
	c := filepath.Clean(d)
	if !filepath.IsAbs(c) || c == "/" {
		return "", fmt.Errorf("evaluator directory %q: want an absolute directory below /", d)
	}
	return c, nil
}

func recordPath(upper string) string {
	return filepath.Join(filepath.Dir(filepath.Clean(upper)), recordName)
}

// Write stores r for the snapshot whose upper directory is upper,
// replacing any earlier record whole.
func Write(upper string, r Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	p := recordPath(upper)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write evaluator record: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write evaluator record: %w", err)
	}
	return nil
}

// Read returns the record of the snapshot whose upper directory is upper;
// ok is false when there is none (no evaluator layer was held back).
func Read(upper string) (r Record, ok bool, err error) {
	b, err := os.ReadFile(recordPath(upper))
	if errors.Is(err, os.ErrNotExist) {
		return Record{}, false, nil
	}
	if err != nil {
		return Record{}, false, fmt.Errorf("read evaluator record: %w", err)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return Record{}, false, fmt.Errorf("decode evaluator record %s: %w", recordPath(upper), err)
	}
	if r.Dir, err = CheckDir(r.Dir); err != nil {
		return Record{}, false, fmt.Errorf("evaluator record %s: %w", recordPath(upper), err)
	}
	if len(r.Lowers) == 0 {
		return Record{}, false, fmt.Errorf("evaluator record %s names no layer", recordPath(upper))
	}
	return r, true, nil
}
