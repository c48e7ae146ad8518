//go:build linux

// Command containerd-shim-envlet-v2 is the envsnap runtime v2 shim: runc's
// task service wrapped with a per-container elastic quota controller
// (envlet). See docs/shim.md.
package main

import (
	"context"

	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/pkg/shim"

	// Registers our "task" ttrpc plugin in place of runc's.
	_ "github.com/envsnap/envsnap/shim"
)

func main() {
	shim.RunShim(context.Background(), manager.NewShimManager("io.containerd.envlet.v2"))
}
