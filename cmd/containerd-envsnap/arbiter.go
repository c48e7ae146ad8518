//go:build linux

package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/containerd/log"
	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/internal/envlet"
	"github.com/envsnap/envsnap/shim/config"
)

var arbiterCommand = &cli.Command{
	Name:  "arbiter",
	Usage: "serve the node quota arbiter for envlet shims",
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "config", Usage: "envlet config file (node size, arbiter socket); default $ENVLET_CONFIG or " + config.DefaultPath},
		&cli.StringFlag{Name: "socket", Usage: "arbiter socket (default from the config, else " + arbiter.DefaultSocket + ")"},
		&cli.StringFlag{Name: "node-cpu", Usage: "node CPU capacity in cores (default from the config, else online CPUs)"},
		&cli.StringFlag{Name: "node-memory", Usage: "node memory capacity, e.g. 16Gi (default from the config, else MemTotal)"},
		&cli.Float64Flag{Name: "reserve", Value: -1, Usage: "share of the node kept for admissions (default from the config, else 0.15)"},
		&cli.StringFlag{Name: "metrics-address", Usage: "serve Prometheus metrics on host:port at /metrics (a port alone listens on 127.0.0.1)"},
		&cli.StringFlag{Name: "ledger", Usage: "file the leases are persisted to and restored from at start (default from the config, else arbiter-ledger.json next to the socket; \"none\": memory only)"},
	},
	Action: runArbiter,
}

func init() { commands = append(commands, arbiterCommand) }

func runArbiter(ctx context.Context, c *cli.Command) error {
	var cfg config.Config
	var err error
	if p := c.String("config"); p != "" {
		cfg, err = config.LoadFile(p)
	} else {
		cfg, err = config.Load()
	}
	if err != nil {
		return err
	}
	// Flags given explicitly win over the file.
	if v := c.String("node-cpu"); v != "" {
		cfg.Node.CPU = v
	}
	if v := c.String("node-memory"); v != "" {
		cfg.Node.Memory = v
	}
	if r := c.Float64("reserve"); r >= 0 {
		cfg.Node.Reserve = &r
	}
	if v := c.String("socket"); v != "" {
		cfg.Arbiter.Socket = v
	}
	if v := c.String("ledger"); v != "" {
		cfg.Arbiter.Ledger = v
	}
	node, reserve, err := cfg.NodeSize()
	if err != nil {
		return err
	}
	socket := cfg.Arbiter.Socket
	if socket == "" {
		socket = arbiter.DefaultSocket
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	log.G(ctx).WithField("node", node.String()).WithField("reserve", reserve).Info("arbiter: node capacity")
	var opts []arbiter.ServeOpt
	if p := cfg.LedgerPath(); p != "" {
		opts = append(opts, arbiter.WithLedger(p))
	}
	if a := c.String("metrics-address"); a != "" {
		opts = append(opts, arbiter.WithMetricsAddress(a))
	}
	nodeOpts, err := cfg.NodeOpts()
	if err != nil {
		return err
	}
	if err := arbiter.Serve(ctx, socket, envlet.NewNodeArbiter(node, reserve, nodeOpts...), opts...); err != nil {
		return fmt.Errorf("arbiter: %w", err)
	}
	return nil
}
