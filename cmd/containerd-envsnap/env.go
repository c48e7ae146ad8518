//go:build linux

package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/docker/go-units"
	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/envsnapshot"
	"github.com/envsnap/envsnap/internal/registry"
)

func containerdFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "address", Value: "/run/containerd/containerd.sock", Usage: "containerd socket"},
		&cli.StringFlag{Name: "namespace", Value: "default", Usage: "containerd namespace"},
		&cli.StringFlag{Name: "snapshotter", Value: envsnapshot.DefaultSnapshotter, Usage: "the envsnap snapshotter's name in containerd"},
	}
}

var envCommand = &cli.Command{
	Name:  "env",
	Usage: "snapshot running environments and fork them",
	Commands: []*cli.Command{{
		Name:      "snapshot",
		Usage:     "freeze a container, push its files as one layer on top of its image, thaw it",
		ArgsUsage: "CONTAINER",
		Flags: append(append(containerdFlags(),
			&cli.StringFlag{Name: "push", Required: true, Usage: "reference to push the snapshot image to"},
			&cli.StringFlag{Name: "max-diff-size", Value: units.BytesSize(envsnapshot.DefaultMaxDiffSize), Usage: "refuse a diff with more file data than this (e.g. 512MiB; 0: no cap)"},
			&cli.IntFlag{Name: "max-depth", Value: envsnapshot.DefaultMaxDepth, Usage: "snapshot layers above the original image before they are squashed into one"},
		), registryFlags()...),
		Action: runEnvSnapshot,
	}, {
		Name:      "fork",
		Usage:     "start N containers from a snapshot (or any) image, served lazily by envsnap",
		ArgsUsage: "REF [-- ARGS...]",
		Flags: append(append(containerdFlags(),
			&cli.IntFlag{Name: "count", Aliases: []string{"n"}, Value: 1, Usage: "number of forks"},
			&cli.StringFlag{Name: "runtime", Value: "io.containerd.runc.v2", Usage: "runtime for the forks"},
			&cli.StringFlag{Name: "id-prefix", Value: "fork", Usage: "containers are named PREFIX-0 .. PREFIX-(N-1)"},
		), registryFlags()...),
		Action: runEnvFork,
	}},
}

func init() { commands = append(commands, envCommand) }

func connect(c *cli.Command) (*client.Client, error) {
	cl, err := client.New(c.String("address"), client.WithDefaultNamespace(c.String("namespace")))
	if err != nil {
		return nil, fmt.Errorf("connect to containerd: %w", err)
	}
	return cl, nil
}

func runEnvSnapshot(ctx context.Context, c *cli.Command) error {
	if c.Args().Len() != 1 {
		return fmt.Errorf("env snapshot: give one container ID")
	}
	maxSize, err := units.RAMInBytes(c.String("max-diff-size"))
	if err != nil {
		return fmt.Errorf("--max-diff-size: %w", err)
	}
	if maxSize == 0 {
		maxSize = -1 // no cap
	}
	// An interrupt cancels the snapshot instead of killing the process,
	// which could otherwise leave the container frozen.
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	cl, err := connect(c)
	if err != nil {
		return err
	}
	defer cl.Close()
	res, err := envsnapshot.Take(ctx, cl, c.Args().First(), c.String("push"), envsnapshot.Options{
		Hosts:       registry.ConfigureHosts(ctx, registryOptions(c)),
		Snapshotter: c.String("snapshotter"),
		MaxDiffSize: maxSize,
		MaxDepth:    int(c.Int("max-depth")),
		Log:         os.Stderr,
	})
	if err != nil {
		return err
	}
	fmt.Printf("%s@%s\n", res.Ref, res.Manifest.Digest)
	fmt.Printf("pre-copied %s while running; frozen %s (%s; reading %s: %d files read frozen, %d taken from the pre-copy), diff %d entries (%d whiteouts, %d opaque dirs), %d data bytes -> layer %d bytes; uploaded %d bytes, %d layers linked; depth %d",
		res.Precopy.Round(time.Millisecond), res.Frozen.Round(time.Microsecond), res.Freezer, res.Copy.Round(time.Microsecond), res.FilesCopied, res.FilesReused, res.Diff.Entries, res.Diff.Whiteouts, res.Diff.Opaque, res.Diff.DataBytes,
		res.Layer.Size, res.UploadedBytes, res.LayersLinked, res.Depth)
	if res.EncodedEarly {
		fmt.Printf(" (the layer was encoded while the pre-copy was read: nothing changed before the freeze)")
	}
	if res.Squashed > 0 {
		fmt.Printf(" (squashed %d earlier snapshot layers)", res.Squashed)
	}
	fmt.Printf("; total %s\n", res.Duration.Round(time.Millisecond))
	if res.Squash != nil {
		// The snapshot is pushed and usable; the squash only has to
		// finish before this process exits.
		fmt.Printf("depth %d is over --max-depth: squashing in the background (the snapshot above is usable meanwhile)\n", res.Depth)
		sq, err := res.Squash.Wait()
		if err != nil {
			// The snapshot above stands (one layer over the limit); the
			// next snapshot of it squashes before it pushes.
			fmt.Fprintf(os.Stderr, "warning: %v; %s@%s stays as pushed\n", err, res.Ref, res.Manifest.Digest)
			return nil
		}
		fmt.Printf("%s@%s\n", sq.Ref, sq.Manifest.Digest)
		fmt.Printf("squashed %d snapshot layers into one (layer %d bytes), uploaded %d bytes; depth 1; took %s\n",
			sq.Squashed, sq.Layer.Size, sq.UploadedBytes, sq.Duration.Round(time.Millisecond))
	}
	return nil
}

func runEnvFork(ctx context.Context, c *cli.Command) error {
	args := c.Args().Slice()
	if len(args) < 1 {
		return fmt.Errorf("env fork: give an image reference")
	}
	n := int(c.Int("count"))
	if n < 1 {
		return fmt.Errorf("env fork: -n must be at least 1")
	}
	cl, err := connect(c)
	if err != nil {
		return err
	}
	defer cl.Close()
	pull, forks, err := envsnapshot.Fork(ctx, cl, args[0], n, envsnapshot.ForkOptions{
		Hosts:       registry.ConfigureHosts(ctx, registryOptions(c)),
		Snapshotter: c.String("snapshotter"),
		Runtime:     c.String("runtime"),
		IDPrefix:    c.String("id-prefix"),
		Args:        args[1:],
	})
	if err != nil {
		return err
	}
	fmt.Printf("pulled %s lazily in %s\n", args[0], pull.Round(time.Millisecond))
	failed := 0
	for _, f := range forks {
		if f.Err != nil {
			failed++
			fmt.Printf("%s\tFAILED\t%v\n", f.ID, f.Err)
			continue
		}
		fmt.Printf("%s\tready\t%s\n", f.ID, f.Ready.Round(time.Millisecond))
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d forks failed", failed, n)
	}
	return nil
}
