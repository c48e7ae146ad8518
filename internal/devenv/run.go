package devenv

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/containerd/v2/pkg/snapshotters"
	"github.com/containerd/errdefs"
)

// Pull pulls ref with client.Pull, unpack and the image-info labels that
// let a remote snapshotter serve layers lazily (the path CRI's local pull
// mode and Go clients using snapshotters.AppendInfoHandlerWrapper take).
func (e *Env) Pull(ctx context.Context, ref, snapshotter string) (client.Image, error) {
	img, err := e.Client.Pull(ctx, ref,
		client.WithResolver(e.Resolver()),
		client.WithPullUnpack,
		client.WithPullSnapshotter(snapshotter),
		client.WithImageHandlerWrapper(snapshotters.AppendInfoHandlerWrapper(ref)),
	)
	if err != nil {
		return nil, fmt.Errorf("pull %s with snapshotter %s: %w", ref, snapshotter, err)
	}
	return img, nil
}

// RunOptions configures RunContainer.
type RunOptions struct {
	Snapshotter string            // default "overlayfs"
	Runtime     string            // default "io.containerd.runc.v2"
	Args        []string          // process args; default the image's
	Annotations map[string]string // OCI spec annotations
	Env         []string
	Timeout     time.Duration // default 2 minutes
	SpecOpts    []oci.SpecOpts
	// Stdout, when set, also receives the container's stdout as it comes
	// (the result still holds all of it), e.g. to time a readiness line.
	Stdout io.Writer
}

// RunResult is what a finished container left.
type RunResult struct {
	ID       string
	Stdout   string
	Stderr   string
	ExitCode uint32
}

var containerCounter atomic.Int64

// Run creates, starts and waits for a container from img, then deletes
// it with its snapshot. A non-zero exit is in the result, not an error.
func (e *Env) Run(ctx context.Context, img client.Image, o RunOptions) (RunResult, error) {
	if o.Snapshotter == "" {
		o.Snapshotter = "overlayfs"
	}
	if o.Runtime == "" {
		o.Runtime = "io.containerd.runc.v2"
	}
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	id := fmt.Sprintf("c%d-%d", time.Now().UnixNano()%1e6, containerCounter.Add(1))
	res := RunResult{ID: id}
	specOpts := []oci.SpecOpts{oci.WithImageConfig(img)}
	if len(o.Args) > 0 {
		specOpts = append(specOpts, oci.WithProcessArgs(o.Args...))
	}
	if len(o.Env) > 0 {
		specOpts = append(specOpts, oci.WithEnv(o.Env))
	}
	if len(o.Annotations) > 0 {
		specOpts = append(specOpts, oci.WithAnnotations(o.Annotations))
	}
	specOpts = append(specOpts, o.SpecOpts...)
	c, err := e.Client.NewContainer(ctx, id,
		client.WithSnapshotter(o.Snapshotter),
		client.WithNewSnapshot(id+"-snap", img),
		client.WithRuntime(o.Runtime, nil),
		client.WithNewSpec(specOpts...),
	)
	if err != nil {
		return res, fmt.Errorf("create container: %w", err)
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(e.Context(), 30*time.Second)
		defer dcancel()
		_ = c.Delete(dctx, client.WithSnapshotCleanup)
	}()
	var stdout, stderr OutputBuffer
	var out io.Writer = &stdout
	if o.Stdout != nil {
		out = io.MultiWriter(&stdout, o.Stdout)
	}
	task, err := c.NewTask(ctx, cio.NewCreator(cio.WithStreams(nil, out, &stderr)))
	if err != nil {
		return res, fmt.Errorf("create task: %w", err)
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(e.Context(), 30*time.Second)
		defer dcancel()
		_, _ = task.Delete(dctx, client.WithProcessKill)
	}()
	statusC, err := task.Wait(ctx)
	if err != nil {
		return res, fmt.Errorf("wait task: %w", err)
	}
	if err := task.Start(ctx); err != nil {
		return res, fmt.Errorf("start task: %w", err)
	}
	select {
	case st := <-statusC:
		code, _, err := st.Result()
		if err != nil {
			return res, fmt.Errorf("task result: %w", err)
		}
		res.ExitCode = code
	case <-ctx.Done():
		_ = task.Kill(e.Context(), syscall.SIGKILL)
		return res, fmt.Errorf("container %s did not exit within %s: %w (stdout so far %q)", id, o.Timeout, ctx.Err(), stdout.String())
	}
	// The IO copy finishes after the exit event; closing the IO waits for it.
	if tio := task.IO(); tio != nil {
		tio.Wait()
	}
	res.Stdout, res.Stderr = stdout.String(), stderr.String()
	return res, nil
}

// OutputBuffer collects a container's output while it runs; safe for a
// reader while the IO copy writes.
type OutputBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *OutputBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *OutputBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// AdmissionRejected reports whether err is the envlet arbiter refusing a
// container the node cannot take now (ADMISSION_REJECTED): back-pressure,
// not a failure of the environment.
func AdmissionRejected(err error) bool {
	return err != nil && (errdefs.IsResourceExhausted(err) || strings.Contains(err.Error(), "ADMISSION_REJECTED"))
}

// RunAdmitted is Run for a caller that places a refused container again,
// as a scheduler places a refused pod: while the envlet arbiter refuses it
// (AdmissionRejected) it tries again every second, until ctx ends or wait
// has passed. It returns how many times the container was refused.
func (e *Env) RunAdmitted(ctx context.Context, img client.Image, o RunOptions, wait time.Duration) (RunResult, int, error) {
	deadline := time.Now().Add(wait)
	for refused := 0; ; refused++ {
		out, err := e.Run(ctx, img, o)
		if !AdmissionRejected(err) || time.Now().After(deadline) {
			return out, refused, err
		}
		select {
		case <-ctx.Done():
			return out, refused, err
		case <-time.After(time.Second):
		}
	}
}
