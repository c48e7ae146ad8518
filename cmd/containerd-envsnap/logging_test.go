package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	"github.com/urfave/cli/v3"
)

// TestToolsQuietByDefault runs commands through urfave/cli the way main
// wires them and checks what reaches the log: a tool prints warnings and
// errors, without the library noise, unless -v; a daemon logs at info.
func TestToolsQuietByDefault(t *testing.T) {
	defer func(f logrus.Formatter, l logrus.Level) {
		logrus.SetFormatter(f)
		logrus.SetLevel(l)
		logrus.SetOutput(os.Stderr)
	}(logrus.StandardLogger().Formatter, logrus.GetLevel())

	logSome := func(ctx context.Context, _ *cli.Command) error {
		log.G(ctx).Info("publishing layer")
		log.G(ctx).WithField("host", "127.0.0.1:5000").Info("host will try HTTPS first since it is configured for HTTP with a TLS configuration")
		log.G(ctx).Warn("failed check for fsverity support")
		log.G(ctx).Warn("registry is slow")
		return nil
	}
	for _, tc := range []struct {
		args []string
		want []string
		not  []string
	}{
		{[]string{"compose"}, []string{"registry is slow"}, []string{"publishing layer", "HTTPS first", "fsverity"}},
		{[]string{"compose", "-v"}, []string{"registry is slow", "publishing layer", "HTTPS first", "fsverity"}, nil},
		{[]string{"-v", "compose"}, []string{"publishing layer", "HTTPS first"}, nil},
		{[]string{"arbiter"}, []string{"publishing layer", "registry is slow"}, nil},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out bytes.Buffer
			logrus.SetOutput(&out)
			logrus.SetFormatter(&logrus.TextFormatter{})
			logrus.SetLevel(logrus.InfoLevel)
			app := &cli.Command{
				Name:  "containerd-envsnap",
				Flags: []cli.Flag{verboseFlag},
				Commands: []*cli.Command{
					{Name: "compose", Before: setupLogging, Action: logSome},
					{Name: "arbiter", Before: setupLogging, Action: logSome},
				},
			}
			if err := app.Run(context.Background(), append([]string{"containerd-envsnap"}, tc.args...)); err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("log lacks %q:\n%s", w, out.String())
				}
			}
			for _, n := range tc.not {
				if strings.Contains(out.String(), n) {
					t.Errorf("log has %q:\n%s", n, out.String())
				}
			}
		})
	}
}
