package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/urfave/cli/v3"
	"golang.org/x/sync/errgroup"

	"github.com/envsnap/envsnap/internal/plan"
	"github.com/envsnap/envsnap/internal/registry"
)

var composeCommand = &cli.Command{
	Name:      "compose",
	Usage:     "compose environment plans into images (metadata only: no layer is downloaded or re-uploaded)",
	ArgsUsage: "[PLAN.toml|PLAN.json ...]",
	Flags: append([]cli.Flag{
		&cli.StringFlag{Name: "tasks", Usage: "task list: one JSON plan per line (batch mode)"},
		&cli.StringFlag{Name: "target", Usage: "where the image goes (one plan), overriding the plan's target"},
		&cli.StringFlag{Name: "target-pattern", Usage: "target for each plan; {name} is replaced by the plan name, e.g. reg/envsnap/env/{name}:1"},
		&cli.BoolFlag{Name: "local", Usage: "write straight into containerd's content and image stores and prepare the snapshots (no registry write)"},
		&cli.StringFlag{Name: "address", Value: "/run/containerd/containerd.sock", Usage: "containerd socket (with --local)"},
		&cli.StringFlag{Name: "namespace", Value: "default", Usage: "containerd namespace (with --local)"},
		&cli.StringFlag{Name: "snapshotter", Value: "envsnap", Usage: "snapshotter that serves the layers (with --local)"},
		&cli.IntFlag{Name: "concurrency", Value: 8, Usage: "plans composed at once"},
		&cli.BoolFlag{Name: "quiet", Usage: "print only the summary"},
	}, registryFlags()...),
	Action: runCompose,
}

func init() { commands = append(commands, composeCommand) }

func runCompose(ctx context.Context, c *cli.Command) error {
	plans, err := loadPlans(c)
	if err != nil {
		return err
	}
	hosts := registry.ConfigureHosts(ctx, registryOptions(c))
	composer := &plan.Composer{Hosts: hosts, OpenLayer: plan.RemoteLayerOpener(hosts)}

	var cl *client.Client
	if c.Bool("local") {
		cl, err = client.New(c.String("address"), client.WithDefaultNamespace(c.String("namespace")))
		if err != nil {
			return fmt.Errorf("connect to containerd: %w", err)
		}
		defer cl.Close()
	}
	start := time.Now()
	var uploaded atomic.Int64
	var done atomic.Int64
	var printMu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(max(1, int(c.Int("concurrency"))))
	for _, p := range plans {
		target, err := planTarget(c, p, len(plans))
		if err != nil {
			return err
		}
		g.Go(func() error {
			img, err := composer.Compose(gctx, p)
			if err != nil {
				return err
			}
			var detail string
			if cl != nil {
				if err := plan.WriteLocal(gctx, cl, img, target, c.String("snapshotter")); err != nil {
					return err
				}
				detail = "local"
			} else {
				st, err := composer.Push(gctx, img, target)
				if err != nil {
					return err
				}
				uploaded.Add(st.UploadedBytes)
				detail = fmt.Sprintf("%d layers linked, %d bytes uploaded", st.LayersLinked, st.UploadedBytes)
			}
			n := done.Add(1)
			if !c.Bool("quiet") {
				printMu.Lock()
				fmt.Printf("[%d/%d] %s -> %s@%s (%d layers, %s)\n", n, len(plans), p.Name, target, img.Desc.Digest, len(img.Manifest.Layers), detail)
				printMu.Unlock()
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	el := time.Since(start)
	fmt.Printf("composed %d plans from %d distinct groups in %s (%.1f plans/s), %d bytes uploaded, 0 layer bytes\n",
		len(plans), composer.ResolvedGroups(), el.Round(time.Millisecond), float64(len(plans))/el.Seconds(), uploaded.Load())
	return nil
}

func loadPlans(c *cli.Command) ([]*plan.Plan, error) {
	var plans []*plan.Plan
	if t := c.String("tasks"); t != "" {
		f, err := os.Open(t)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		ps, err := plan.ReadTasks(f, filepath.Dir(t))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", t, err)
		}
		plans = append(plans, ps...)
	}
	for _, path := range c.Args().Slice() {
		p, err := plan.Load(path)
		if err != nil {
			return nil, err
		}
		if p.Name == "" {
			p.Name = strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
		}
		plans = append(plans, p)
	}
	if len(plans) == 0 {
		return nil, fmt.Errorf("compose: give plan files or --tasks")
	}
	return plans, nil
}

func planTarget(c *cli.Command, p *plan.Plan, n int) (string, error) {
	switch {
	case c.String("target") != "":
		if n > 1 {
			return "", fmt.Errorf("--target names one image; use --target-pattern for %d plans", n)
		}
		return c.String("target"), nil
	case c.String("target-pattern") != "":
		return strings.ReplaceAll(c.String("target-pattern"), "{name}", p.Name), nil
	case p.Target != "":
		return p.Target, nil
	}
	return "", fmt.Errorf("plan %s: no target (set target in the plan, --target or --target-pattern)", p.Name)
}
