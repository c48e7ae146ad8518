//go:build linux

package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/log"
	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/daemon"
)

var serveCommand = &cli.Command{
	Name:  "serve",
	Usage: "run the lazy snapshotter for containerd (proxy plugin \"envsnap\")",
	Flags: []cli.Flag{
		&cli.StringFlag{Name: "config", Value: daemon.DefaultConfigPath, Usage: "TOML configuration file; flags override it"},
		&cli.StringFlag{Name: "root", Value: daemon.DefaultRoot, Usage: "state directory (snapshots, layer mounts, chunk cache)"},
		&cli.StringFlag{Name: "address", Value: daemon.DefaultAddress, Usage: "unix socket containerd connects to"},
		&cli.StringFlag{Name: "hosts-dir", Value: daemon.DefaultHostsDir, Usage: "containerd certs.d directory for registry hosts"},
		&cli.StringSliceFlag{Name: "hint-source", Usage: "registry host or repository prefix ending in / that layer hint annotations may send the daemon to (repeatable; default: the registries with a directory in --hosts-dir; \"none\" allows none)"},
		&cli.StringFlag{Name: "docker-config", Usage: "docker config.json (or its directory) with registry credentials"},
		&cli.StringFlag{Name: "metrics-address", Usage: "host:port serving /metrics only (off when empty; a port alone listens on 127.0.0.1)"},
		&cli.StringFlag{Name: "cache-size", Value: daemon.DefaultCacheSize.String(), Usage: "bound of the node chunk cache (e.g. 20GiB)"},
		&cli.BoolFlag{Name: "passthrough", Value: false, Usage: "let the kernel read fully cached files from local copies (FUSE passthrough): the native copies with --native-lowers, unpacked copies of single files without; every open of a layer file then goes to the daemon"},
		&cli.BoolFlag{Name: "native-lowers", Value: true, Usage: "give new containers a plain directory copy of layers whose chunks are all cached, instead of the FUSE mount"},
		&cli.BoolFlag{Name: "fill", Value: true, Usage: "fetch whole layers in the background once mounted"},
		&cli.IntFlag{Name: "serve-nice", Value: daemon.DefaultServeNice, Usage: "nice value of the daemon's threads serving file-system requests (0 leaves them as started)"},
		&cli.BoolFlag{Name: "writable-volatile", Value: true, Usage: "mount containers' writable layers with overlayfs' volatile option (no sync reaches the disk; a layer mounted across a host restart is refused)"},
		&cli.BoolFlag{Name: "eager", Usage: "fetch each layer completely before serving it (on-demand fetching off)"},
		&cli.StringFlag{Name: "lazy-min-size", Value: daemon.DefaultLazyMinSize.String(), Usage: "layers smaller than this are unpacked by containerd instead of served lazily (0: every layer in the envsnap format is lazy)"},
		&cli.DurationFlag{Name: "fill-delay", Value: time.Duration(daemon.DefaultFillDelay), Usage: "start the background fill this long after a layer is mounted"},
		&cli.DurationFlag{Name: "read-timeout", Value: time.Duration(daemon.DefaultReadTimeout), Usage: "fail a FUSE read with EIO after this long"},
		&cli.StringFlag{Name: "memory-limit", Value: defaultMemoryLimit, Usage: "soft limit of the Go heap (GOMEMLIMIT) beyond the frame cache, unless the environment sets one; 0 disables"},
		&cli.StringFlag{Name: "frame-cache-size", Value: daemon.DefaultFrameCacheSize.String(), Usage: "decoded frames kept in memory for all layers (0: a few MiB per layer)"},
		&cli.BoolFlag{Name: "keep-mounts", Value: true, Usage: "keep layer mounts (and the containers reading them) alive across restarts with a descriptor keeper process"},
		&cli.StringFlag{Name: "keeper-command", Usage: "start the descriptor keeper with this command (words split at blanks) followed by `fdstore --socket SOCKET`, instead of this binary as a child: e.g. a launcher ending in a containerd-envsnap binary that makes the keeper outlive the daemon's cgroup (the DaemonSet's nsenter + systemd-run)"},
		&cli.StringFlag{Name: "log-level", Value: daemon.DefaultLogLevel, Usage: "trace, debug, info, warn or error"},
	},
	Action: runServe,
}

func init() { commands = append(commands, serveCommand) }

// defaultMemoryLimit: 50 environments reading 280 MB of a layer at once
// peaked at 486 MiB RSS without a limit, almost all of it garbage the
// collector had not yet been asked to return (frames are decoded into
// short-lived MiB-sized buffers); with a 128 MiB soft limit it was
// 195 MiB, with 100 MiB 141 MiB, at no measurable cost in wall time
// (TestBenchLoad50, docs/reliability.md).
const defaultMemoryLimit = "100MiB"

// setMemoryLimit applies the Go runtime's soft memory limit plus extra
// (the frame cache, live data the collector cannot free), leaving an
// explicit GOMEMLIMIT alone.
func setMemoryLimit(v string, extra int64) error {
	if _, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		return nil
	}
	n, err := daemon.ParseSize(v)
	if err != nil {
		return fmt.Errorf("--memory-limit: %w", err)
	}
	if n > 0 {
		debug.SetMemoryLimit(n + extra)
	}
	return nil
}

func runServe(ctx context.Context, c *cli.Command) error {
	cfg, err := daemon.LoadConfig(c.String("config"), c.IsSet("config"))
	if err != nil {
		return err
	}
	// Flags given explicitly win over the file.
	set := func(name string, apply func()) {
		if c.IsSet(name) {
			apply()
		}
	}
	set("root", func() { cfg.Root = c.String("root") })
	set("address", func() { cfg.Address = c.String("address") })
	set("hosts-dir", func() { cfg.HostsDir = c.String("hosts-dir") })
	set("docker-config", func() { cfg.DockerConfig = c.String("docker-config") })
	set("hint-source", func() {
		cfg.HintSources = []string{}
		for _, v := range c.StringSlice("hint-source") {
			if v != "none" {
				cfg.HintSources = append(cfg.HintSources, v)
			}
		}
	})
	set("metrics-address", func() { cfg.MetricsAddress = c.String("metrics-address") })
	set("passthrough", func() { cfg.Passthrough = c.Bool("passthrough") })
	set("native-lowers", func() { cfg.NativeLowers = c.Bool("native-lowers") })
	set("fill", func() { cfg.Fill = c.Bool("fill") })
	set("fill-delay", func() { cfg.FillDelay = daemon.Duration(c.Duration("fill-delay")) })
	set("eager", func() { cfg.Eager = c.Bool("eager") })
	set("writable-volatile", func() { cfg.WritableVolatile = c.Bool("writable-volatile") })
	set("serve-nice", func() { cfg.ServeNice = int(c.Int("serve-nice")) })
	set("read-timeout", func() { cfg.ReadTimeout = daemon.Duration(c.Duration("read-timeout")) })
	set("log-level", func() { cfg.LogLevel = c.String("log-level") })
	if c.IsSet("cache-size") {
		n, err := daemon.ParseSize(c.String("cache-size"))
		if err != nil {
			return fmt.Errorf("--cache-size: %w", err)
		}
		cfg.CacheSize = daemon.Size(n)
	}
	if c.IsSet("lazy-min-size") {
		n, err := daemon.ParseSize(c.String("lazy-min-size"))
		if err != nil {
			return fmt.Errorf("--lazy-min-size: %w", err)
		}
		cfg.LazyMinSize = daemon.Size(n)
	}
	if c.IsSet("frame-cache-size") {
		n, err := daemon.ParseSize(c.String("frame-cache-size"))
		if err != nil {
			return fmt.Errorf("--frame-cache-size: %w", err)
		}
		cfg.FrameCacheSize = daemon.Size(n)
	}
	if err := setMemoryLimit(c.String("memory-limit"), int64(cfg.FrameCacheSize)); err != nil {
		return err
	}
	if c.Bool("keep-mounts") {
		if cmd := strings.Fields(c.String("keeper-command")); len(cmd) > 0 {
			cfg.KeeperCommand = cmd
		} else {
			self, err := os.Executable()
			if err != nil {
				return fmt.Errorf("find own binary for the descriptor keeper: %w", err)
			}
			cfg.KeeperCommand = []string{self}
		}
	}
	// The daemon's own binary even if a newer one replaced it on disk:
	// the build process must make the trees this daemon's marker
	// version promises.
	cfg.NativeBuildCommand = []string{"/proc/self/exe"}
	if err := log.SetLevel(cfg.LogLevel); err != nil {
		return fmt.Errorf("log level: %w", err)
	}
	if err := log.SetFormat(log.TextFormat); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := daemon.Run(ctx, cfg); err != nil {
		log.G(ctx).WithError(err).Error("containerd-envsnap serve")
		return err
	}
	return nil
}
