//go:build linux

package main

import (
	"context"
	"encoding/json"
	"os"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/arbiter"
	"github.com/envsnap/envsnap/shim/config"
)

var envsCommand = &cli.Command{
	Name:  "envs",
	Usage: "list live envlet environments with their quota and usage (from the node arbiter)",
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "socket", Usage: "arbiter socket (default from $ENVLET_CONFIG, else " + arbiter.DefaultSocket + ")"},
		&cli.BoolFlag{Name: "all", Aliases: []string{"a"}, Usage: "include recently ended environments"},
		&cli.BoolFlag{Name: "json", Usage: "print the raw JSON listing"},
		&cli.StringFlag{Name: "timeline", Usage: "print the quota timeline of environment `ID` as CSV"},
	},
	Action: func(ctx context.Context, c *cli.Command) error {
		socket := c.String("socket")
		if socket == "" {
			if cfg, err := config.Load(); err == nil {
				socket = cfg.Arbiter.Socket
			}
		}
		// The listing is not on a controller's hot path: allow a loaded
		// arbiter a second per call.
		cl := arbiter.NewClient(arbiter.ClientConfig{Socket: socket, Timeout: 100 * time.Millisecond})
		defer cl.Close()
		if id := c.String("timeline"); id != "" {
			points, err := cl.Timeline(ctx, id)
			if err != nil {
				return err
			}
			return arbiter.WriteTimelineCSV(os.Stdout, points)
		}
		envs, err := cl.List(ctx, c.Bool("all"))
		if err != nil {
			return err
		}
		if c.Bool("json") {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			return enc.Encode(envs)
		}
		return arbiter.WriteEnvTable(os.Stdout, envs)
	},
}

func init() { commands = append(commands, envsCommand) }
