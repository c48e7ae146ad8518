package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/docker/go-units"
	"os"
	"time"

	"github.com/urfave/cli/v3"
	"golang.org/x/sys/unix"

	"github.com/envsnap/envsnap/internal/convert"
	"github.com/envsnap/envsnap/layerfmt"
)

var convertCommand = &cli.Command{
	Name:      "convert",
	Usage:     "convert an image's layers to the envsnap lazy layer format",
	ArgsUsage: "SRC DST (each oci-layout:DIR, oci-archive:FILE.tar or a registry reference; SRC may also be containerd:IMAGE)",
	Flags: append(registryFlags(),
		&cli.StringSliceFlag{Name: "platform", Usage: "platforms to keep from a multi-platform image (default: all)"},
		&cli.IntFlag{Name: "chunk-size", Value: layerfmt.DefaultChunkSize, Usage: "uncompressed frame size in bytes"},
		&cli.IntFlag{Name: "level", Value: layerfmt.DefaultCompressionLevel, Usage: "zstd compression level"},
		&cli.IntFlag{Name: "parallel", Value: 2, Usage: "layers converted at once"},
		&cli.StringFlag{Name: "address", Value: "/run/containerd/containerd.sock", Usage: "containerd socket, for containerd:IMAGE sources"},
		&cli.StringFlag{Name: "namespace", Value: "default", Usage: "containerd namespace, for containerd:IMAGE sources"},
		&cli.StringFlag{Name: "hint-source", Usage: "repository (host/path) to name in the layers' hint annotations, where snapshotters fetch the blobs (default: a registry DST's repository; none for a layout or archive)"},
	),
	Action: runConvert,
}

func init() { commands = append(commands, convertCommand) }

func runConvert(ctx context.Context, c *cli.Command) error {
	if c.NArg() != 2 {
		return errors.New("convert needs SRC and DST")
	}
	src, err := convert.ParseLocation(c.Args().Get(0))
	if err != nil {
		return err
	}
	dst, err := convert.ParseLocation(c.Args().Get(1))
	if err != nil {
		return err
	}
	opts := convert.Options{
		Platforms: c.StringSlice("platform"),
		Registry:  registryOptions(c),
		LayerOptions: []layerfmt.WriteOption{
			layerfmt.WithChunkSize(int(c.Int("chunk-size"))),
			layerfmt.WithCompressionLevel(int(c.Int("level"))),
		},
		Parallel:            int(c.Int("parallel")),
		ContainerdAddress:   c.String("address"),
		ContainerdNamespace: c.String("namespace"),
		HintSource:          c.String("hint-source"),
	}
	if isTerminal(os.Stderr) {
		opts.Progress = func(e convert.LayerEvent) {
			verb := "converted"
			if e.Passed {
				verb = "kept     "
			}
			fmt.Fprintf(os.Stderr, "%s %s %s -> %s (%s)\n", verb, shortDigest(e.Source.Digest.Encoded()),
				units.BytesSize(float64(e.Source.Size)), units.BytesSize(float64(e.Result.Size)), e.Duration.Round(time.Millisecond))
		}
	}
	s, err := convert.Run(ctx, src, dst, opts)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "%s: %d manifests, %d layers (%d converted), %s -> %s, %s\n",
		dst, s.Manifests, s.Layers, s.Converted, units.BytesSize(float64(s.BytesIn)), units.BytesSize(float64(s.BytesOut)), s.Duration.Round(time.Millisecond))
	fmt.Println(s.Root.Digest)
	return nil
}

func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func shortDigest(s string) string { return s[:min(12, len(s))] }
