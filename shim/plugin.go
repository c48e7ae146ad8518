//go:build linux

// Package shim is the envlet task service: containerd's runc task service
// with an elastic quota controller (package envlet) around every container
// it runs. Importing it registers the shim's "task" ttrpc plugin in place
// of runc's (cmd/containerd-shim-envlet-v2 must not also import runc's
// task/plugin: registering "task" twice panics).
//
// Life of a container: Create admits it with the node arbiter (rejection
// fails Create with errdefs.ErrResourceExhausted) and, when an egress
// policy applies, installs it in the container's network namespace once
// runc has created it, before it runs (package egress), and attaches the
// BPF LSM rules that keep its processes from the node's sockets and
// protected paths (package lsm); Start starts its
// controller on the container's cgroup, Update moves the controller's
// bounds, exit and Delete stop the controller and release the grant. A
// controller that gives up (memory denied while OOMing) fails the task
// loudly: an /envlet/env/failed event, the Kubernetes termination message,
// /tasks/oom, and SIGKILL (exit status 137). Sandbox (pause) containers
// run as plain runc containers.
package shim

import (
	"context"
	"fmt"
	"os"
	"time"

	runctask "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/log"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/ksm"
	"github.com/envsnap/envsnap/internal/lsm"
	"github.com/envsnap/envsnap/shim/config"
)

// GroupLinger is how long a shared shim outlives its last container
// (Options.Linger).
const GroupLinger = 5 * time.Second

// started is when this shim process began running Go code: its log line
// on becoming ready says what a fresh shim adds to its first Create.
var started = time.Now()

func init() {
	// The same registration as runc's task/plugin, with our service.
	registry.Register(&plugin.Registration{
		Type:     plugins.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugins.EventPlugin, plugins.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (any, error) {
			// containerd's shim library logs through the log pipe's own
			// descriptor, of which stderr is a copy. Through stderr, the
			// log follows the pipe a shared shim moves it to when the
			// container it was started for is deleted
			// (Service.handOverLog, attachLog); through the first
			// descriptor, every line after that delete was lost.
			// stderr shares that descriptor's non-blocking mode, in
			// which a full pipe fails a write (EAGAIN, the line
			// dropped) where the library's file waited: blocking, it
			// waits too.
			_ = unix.SetNonblock(int(os.Stderr.Fd()), false)
			log.G(ic.Context).Logger.SetOutput(os.Stderr)
			pp, err := ic.GetByID(plugins.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			ss, err := ic.GetByID(plugins.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			publisher := pp.(shim.Publisher)
			tap := &OOMTap{Publisher: publisher}
			inner, err := runctask.NewTaskService(ic.Context, tap, ss.(shutdown.Service))
			if err != nil {
				return nil, err
			}
			cfg, err := config.Load()
			if err != nil {
				// A broken node config must not run pods with a policy
				// nobody asked for, nor silently: every Create fails with
				// the reason until the file is fixed (new pods, new shims).
				log.G(ic.Context).WithError(err).Error("envlet: config")
				return New(ic.Context, inner, publisher, Options{ConfigErr: err}), nil
			}
			if cfg.Shim.MemoryMerge && !cfg.Disabled {
				mergeMemory(ic.Context)
			}
			policy, err := cfg.Envlet()
			if err != nil {
				return nil, fmt.Errorf("envlet policy: %w", err)
			}
			node, _, err := cfg.NodeSize()
			if err != nil {
				return nil, fmt.Errorf("envlet node size: %w", err)
			}
			guard, err := cfg.GuardLimits()
			if err != nil {
				return nil, fmt.Errorf("envlet guard: %w", err)
			}
			if guard.LSM && !cfg.Disabled {
				go lsm.Warm()
			}
			cc, err := cfg.ArbiterClient()
			if err != nil {
				return nil, fmt.Errorf("envlet arbiter: %w", err)
			}
			eg, err := cfg.EgressNode()
			if err != nil {
				return nil, fmt.Errorf("envlet egress: %w", err)
			}
			// The node's sockets, wherever this node keeps them.
			arbSocket := cc.Socket
			if arbSocket == "" {
				arbSocket = arbiter.DefaultSocket
			}
			guard.Protected = append(append(guard.Protected, NodeSockets(os.Getenv)...), arbSocket)
			defer func() {
				log.G(ic.Context).WithField("init", time.Since(started).Round(100*time.Microsecond)).Info("envlet: shim ready")
			}()
			arb := arbiter.NewClient(cc)
			ss.(shutdown.Service).RegisterCallback(func(context.Context) error { return arb.Close() })
			var linger time.Duration
			if cfg.GroupSize() > 1 {
				linger = GroupLinger
			}
			svc := New(ic.Context, inner, publisher, Options{
				Linger:   linger,
				Socket:   os.Getenv(groupSocketEnv),
				Disabled: cfg.Disabled,
				Policy:   policy,
				Node:     node,
				Arbiter:  arb,
				Egress:   &eg,
				Guard:    guard,
			})
			tap.Notify(svc)
			return svc, nil
		},
	})
}

// mergeMemory marks the shim's memory, and so every container process it
// starts, mergeable ([shim] memory-merge). Merging saves memory, it is
// not needed to run anything: a kernel without it or a node without ksmd
// running starts containers unmerged, with the reason in the log.
func mergeMemory(ctx context.Context) {
	if err := ksm.MergeSelf(); err != nil {
		log.G(ctx).WithError(err).Warn("envlet: [shim] memory-merge: containers start unmerged")
		return
	}
	if n, err := ksm.ReadNode(); err != nil || n.Run != 1 {
		log.G(ctx).WithError(err).WithField("run", n.Run).Warn("envlet: [shim] memory-merge: containers are marked mergeable, but the node's ksmd is not merging (/sys/kernel/mm/ksm/run is not 1)")
	}
}
