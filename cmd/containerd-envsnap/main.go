// Command containerd-envsnap is the envsnap node daemon and its tools: the
// lazy snapshotter (serve), the layer converter, layer-group publishing and
// environment composition, and the node quota arbiter.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/urfave/cli/v3"
)

// commands is filled by the init functions of the files beside this one, one
// file per subcommand, so that each subcommand's flags live next to its code.
var commands []*cli.Command

func main() {
	for _, c := range commands {
		if c.Before != nil {
			panic("command " + c.Name + " has its own Before; chain it with setupLogging")
		}
		c.Before = setupLogging
	}
	app := &cli.Command{
		Name:     "containerd-envsnap",
		Usage:    "lazy, composable environments for containerd",
		Flags:    []cli.Flag{verboseFlag},
		Commands: commands,
	}
	if err := app.Run(context.Background(), os.Args); err != nil {
		fmt.Fprintf(os.Stderr, "containerd-envsnap: %v\n", err)
		os.Exit(1)
	}
}
