//go:build linux

package main

import (
	"context"
	"encoding/json"
	"os"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/daemon"
)

var footprintsCommand = &cli.Command{
	Name:  "footprints",
	Usage: "print what the running environments have read of each lazy layer (layer digest -> prefetch list), for `group prefetch`",
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "address", Value: daemon.DefaultAddress, Usage: "the daemon's gRPC socket (status is read from the root-only socket beside it)"},
		&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Usage: "write the JSON to this file instead of stdout"},
	},
	Action: func(ctx context.Context, c *cli.Command) error {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		fp, err := daemon.GetFootprints(ctx, c.String("address"))
		if err != nil {
			return err
		}
		b, err := json.MarshalIndent(fp, "", "  ")
		if err != nil {
			return err
		}
		b = append(b, '\n')
		if out := c.String("output"); out != "" {
			return os.WriteFile(out, b, 0o644)
		}
		_, err = os.Stdout.Write(b)
		return err
	},
}

func init() { commands = append(commands, footprintsCommand) }
