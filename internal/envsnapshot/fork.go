//go:build linux

package envsnapshot

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/containerd/v2/pkg/snapshotters"
)

// ForkOptions configure Fork.
type ForkOptions struct {
	// Hosts says how to reach registries (see internal/registry).
	Hosts docker.RegistryHosts
	// Snapshotter serves the forks' layers (DefaultSnapshotter).
	Snapshotter string
	// Runtime runs them (default io.containerd.runc.v2).
	Runtime string
	// IDPrefix names the containers <prefix>-<i> (default "fork").
	IDPrefix string
	// Args replace the image's entrypoint and command when set.
	Args []string
}

// Forked is one started fork.
type Forked struct {
	ID string
	// Ready is the time from the start of Fork until the fork's task was
	// running (the pull, shared by all forks, included).
	Ready time.Duration
	Err   error
}

// Fork pulls ref lazily (with the image-info labels that let envsnap serve
// its layers from the registry, as nerdctl and CRI do) and starts n
// containers from it, concurrently. They keep running; deleting them is
// the caller's business (ctr task kill, ctr container rm). The returned
// slice has one entry per fork, failed or not; the error reports the pull.
func Fork(ctx context.Context, c *client.Client, ref string, n int, o ForkOptions) (pull time.Duration, forks []Forked, err error) {
	if o.Snapshotter == "" {
		o.Snapshotter = DefaultSnapshotter
	}
	if o.Runtime == "" {
		o.Runtime = "io.containerd.runc.v2"
	}
	if o.IDPrefix == "" {
		o.IDPrefix = "fork"
	}
	start := time.Now()
	img, err := c.Pull(ctx, ref,
		client.WithResolver(docker.NewResolver(docker.ResolverOptions{Hosts: o.Hosts})),
		client.WithPullUnpack,
		client.WithPullSnapshotter(o.Snapshotter),
		client.WithImageHandlerWrapper(snapshotters.AppendInfoHandlerWrapper(ref)),
	)
	if err != nil {
		return 0, nil, fmt.Errorf("fork %s: pull: %w", ref, err)
	}
	pull = time.Since(start)
	forks = make([]Forked, n)
	var wg sync.WaitGroup
	for i := range forks {
		forks[i].ID = fmt.Sprintf("%s-%d", o.IDPrefix, i)
		wg.Add(1)
		go func(f *Forked) {
			defer wg.Done()
			f.Err = startFork(ctx, c, img, f.ID, o)
			f.Ready = time.Since(start)
		}(&forks[i])
	}
	wg.Wait()
	return pull, forks, nil
}

func startFork(ctx context.Context, c *client.Client, img client.Image, id string, o ForkOptions) (retErr error) {
	specOpts := []oci.SpecOpts{oci.WithImageConfig(img)}
	if len(o.Args) > 0 {
		specOpts = append(specOpts, oci.WithProcessArgs(o.Args...))
	}
	ctr, err := c.NewContainer(ctx, id,
		client.WithImage(img),
		client.WithSnapshotter(o.Snapshotter),
		client.WithNewSnapshot(id, img),
		client.WithRuntime(o.Runtime, nil),
		client.WithNewSpec(specOpts...),
	)
	if err != nil {
		return fmt.Errorf("fork %s: create container: %w", id, err)
	}
	defer func() {
		if retErr != nil {
			_ = ctr.Delete(context.WithoutCancel(ctx), client.WithSnapshotCleanup)
		}
	}()
	task, err := ctr.NewTask(ctx, cio.NullIO)
	if err != nil {
		return fmt.Errorf("fork %s: create task: %w", id, err)
	}
	if err := task.Start(ctx); err != nil {
		_, _ = task.Delete(context.WithoutCancel(ctx), client.WithProcessKill)
		return fmt.Errorf("fork %s: start task: %w", id, err)
	}
	return nil
}
