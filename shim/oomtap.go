package shim

import (
	"context"
	"sync/atomic"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/shim"
)

// OOMTap is the publisher runc's task service gets: it passes every event
// on and tells the Service of each TaskOOM. runc's service sees the
// kernel's OOM kills in memory.events while the container's cgroup
// exists; with the systemd cgroup driver systemd removes the cgroup as
// soon as its last task is gone, often before the shim, seeing the init's
// exit, can read the counters itself (Service.finish).
type OOMTap struct {
	shim.Publisher
	svc atomic.Pointer[Service]
}

// Notify makes the tap tell s of the OOM kills from now on.
func (p *OOMTap) Notify(s *Service) { p.svc.Store(s) }

func (p *OOMTap) Publish(ctx context.Context, topic string, event events.Event) error {
	if ev, ok := event.(*eventstypes.TaskOOM); ok && topic == runtime.TaskOOMEventTopic {
		if s := p.svc.Load(); s != nil {
			s.sawOOM(ev.ContainerID)
		}
	}
	return p.Publisher.Publish(ctx, topic, event)
}
