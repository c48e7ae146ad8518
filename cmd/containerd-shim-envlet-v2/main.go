//go:build linux

// Command containerd-shim-envlet-v2 is the envsnap runtime v2 shim: runc's
// task service wrapped with a per-container elastic quota controller
// (envlet), one process serving a group of containers. See docs/shim.md.
package main

import (
	"context"

	"github.com/containerd/containerd/v2/pkg/shim"

	// Also registers our "task" ttrpc plugin in place of runc's.
	envletshim "github.com/envsnap/envsnap/shim"
)

func main() {
	shim.RunShim(context.Background(), envletshim.NewManager("io.containerd.envlet.v2"))
}
