package deploy

import (
	"context"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/containerd/v2/pkg/snapshotters"
)

// Example_goClient is the Go client snippet of docs/clients.md, compiled
// with the tests so it cannot drift from containerd's API: pull with the
// remote-snapshot labels into envsnap, run under the envlet shim with an
// initial quota.
func Example_goClient() {
	ctx := namespaces.WithNamespace(context.Background(), "default")
	c, err := client.New("/run/containerd/containerd.sock")
	if err != nil {
		panic(err)
	}
	defer c.Close()

	ref := "registry.example.com/envsnap/env/task-1234:1"
	img, err := c.Pull(ctx, ref,
		client.WithPullUnpack,
		client.WithPullSnapshotter("envsnap"),
		// Adds the image ref and layer digests to each layer's Prepare:
		// without them envsnap cannot serve the layer lazily and containerd
		// downloads it.
		client.WithImageHandlerWrapper(snapshotters.AppendInfoHandlerWrapper(ref)),
	)
	if err != nil {
		panic(err)
	}

	ctr, err := c.NewContainer(ctx, "task-1234",
		client.WithImage(img),
		client.WithSnapshotter("envsnap"), // before WithNewSnapshot
		client.WithNewSnapshot("task-1234-rootfs", img),
		client.WithRuntime("io.containerd.envlet.v2", nil),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithAnnotations(map[string]string{
			"io.envsnap.envlet.initial-cpu":    "1",
			"io.envsnap.envlet.initial-memory": "2Gi",
		})),
	)
	if err != nil {
		panic(err)
	}
	defer ctr.Delete(ctx, client.WithSnapshotCleanup)

	task, err := ctr.NewTask(ctx, cio.NewCreator(cio.WithStdio))
	if err != nil {
		panic(err)
	}
	defer task.Delete(ctx, client.WithProcessKill)
	exit, err := task.Wait(ctx)
	if err != nil {
		panic(err)
	}
	if err := task.Start(ctx); err != nil {
		panic(err)
	}
	<-exit // task.Kill(ctx, syscall.SIGTERM) stops it early
}
