//go:build linux

package main

import (
	"context"
	"fmt"

	"github.com/opencontainers/go-digest"
	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/native"
)

// nativeBuildCommand is the process `serve` starts to build a layer's
// native copy (native.Store.SetBuildCommand): out of the daemon's
// process, so that its lowered threads never hold up the daemon's
// garbage collector. It is not meant to be run by hand.
var nativeBuildCommand = &cli.Command{
	Name:      "native-build",
	Usage:     "build a layer's native copy from the chunk cache (started by serve)",
	ArgsUsage: "DIR",
	Hidden:    true,
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "chunks", Required: true, Usage: "chunk cache directory to read the TOC and chunks from"},
		&cli.StringFlag{Name: "toc", Required: true, Usage: "digest of the layer's encoded TOC"},
	},
	Action: func(ctx context.Context, c *cli.Command) error {
		if c.NArg() != 1 {
			return fmt.Errorf("native-build: want the directory to build, got %d arguments", c.NArg())
		}
		toc, err := digest.Parse(c.String("toc"))
		if err != nil {
			return fmt.Errorf("native-build: --toc: %w", err)
		}
		return native.BuildFromCache(ctx, c.Args().First(), c.String("chunks"), toc)
	},
}

func init() { commands = append(commands, nativeBuildCommand) }
