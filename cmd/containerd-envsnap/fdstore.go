//go:build linux

package main

import (
	"context"
	"os/signal"
	"syscall"

	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/fdstore"
)

// fdstoreCommand is the keeper `serve` starts to hold its FUSE descriptors
// across restarts (docs/reliability.md). It is not meant to be run by hand.
var fdstoreCommand = &cli.Command{
	Name:   "fdstore",
	Usage:  "keep the daemon's FUSE connections alive across its restarts (started by serve)",
	Hidden: true,
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "socket", Required: true, Usage: "unix socket to serve"},
	},
	Action: func(ctx context.Context, c *cli.Command) error {
		// SIGTERM/SIGINT aimed at the daemon's group must not end it;
		// only being idle does (or SIGKILL).
		signal.Ignore(syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
		return fdstore.Serve(ctx, c.String("socket"))
	},
}

func init() { commands = append(commands, fdstoreCommand) }
