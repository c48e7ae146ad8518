package main

import (
	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/registry"
)

// registryFlags are shared by every subcommand that talks to registries,
// so they all resolve hosts and credentials the way containerd does.
func registryFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "hosts-dir", Value: registry.DefaultHostsDir, Usage: "containerd certs.d directory (hosts.toml per registry host)"},
		&cli.StringFlag{Name: "docker-config", Usage: "docker config.json or its directory, for registry credentials (default $DOCKER_CONFIG or ~/.docker)"},
		&cli.BoolFlag{Name: "plain-http", Usage: "use plain HTTP for registries without a hosts.toml"},
	}
}

func registryOptions(c *cli.Command) registry.Options {
	return registry.Options{
		HostsDir:     c.String("hosts-dir"),
		DockerConfig: c.String("docker-config"),
		PlainHTTP:    c.Bool("plain-http"),
	}
}
