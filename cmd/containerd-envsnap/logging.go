package main

import (
	"context"
	"strings"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	"github.com/urfave/cli/v3"
)

// verboseFlag is the root's -v; urfave/cli flags are inherited by every
// subcommand, so `containerd-envsnap group publish -v ...` works too.
var verboseFlag = &cli.BoolFlag{
	Name:    "verbose",
	Aliases: []string{"v"},
	Usage:   "log library details (info level) instead of warnings and errors only",
}

// daemons log what they do at info level (serve: its log_level): that log
// is what an operator reads after the fact. Every other command is a tool
// a person runs and reads, quiet unless something needs them.
var daemons = map[string]bool{"serve": true, "arbiter": true, "fdstore": true}

// noise lists containerd library messages that a tool's user reads as a
// failure although nothing is wrong; they are dropped unless -v.
var noise = []string{
	// core/remotes/docker/config: a plain-HTTP host with TLS settings,
	// which is what the registry flags configure for a registry that may
	// speak either (a local one, --plain-http).
	"host will try HTTPS first",
	// plugins/content/local: the staging content store of convert,
	// publish and compose is temporary; fs-verity is irrelevant to it.
	"failed check for fsverity support",
}

// quietFormatter drops the noise messages; logrus writes nothing for an
// empty serialization.
type quietFormatter struct{ logrus.Formatter }

func (f quietFormatter) Format(e *logrus.Entry) ([]byte, error) {
	for _, n := range noise {
		if strings.HasPrefix(e.Message, n) {
			return nil, nil
		}
	}
	return f.Formatter.Format(e)
}

// setupLogging is the Before of every top-level command: the one place
// where the process's log level and format are chosen.
func setupLogging(ctx context.Context, cmd *cli.Command) (context.Context, error) {
	if daemons[cmd.Name] {
		return ctx, log.SetLevel("info")
	}
	if cmd.Bool(verboseFlag.Name) {
		return ctx, log.SetLevel("info")
	}
	if err := log.SetLevel("warn"); err != nil {
		return ctx, err
	}
	logrus.SetFormatter(quietFormatter{&logrus.TextFormatter{}})
	return ctx, nil
}
