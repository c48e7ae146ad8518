package headline

import (
	"context"
	"fmt"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/internal/daemon"
	"github.com/envsnap/envsnap/internal/group"
)

// sharedKinds are the groups every environment has in common: the only
// ones a publisher would record a footprint for once and attach for all.
// Task groups differ per task; their reads stay on demand.
var sharedKinds = []string{group.KindBase, group.KindHarness, group.KindEvaluator}

// recordPrefetch runs one episode of t on envsnap, reads the daemon's
// footprints and attaches them to the shared groups as prefetch lists
// (containerd-envsnap group prefetch): what a publisher does once per
// group version. Environments composed afterwards carry the lists. It
// returns a note for the report.
func (b *bench) recordPrefetch(ctx context.Context, pub *episode.Published, t episode.Task) (string, error) {
	envs, err := composeEnvs(ctx, b.env.Hosts(), b.env.Registry.Host, pub, []episode.Task{t}, 1)
	if err != nil {
		return "", fmt.Errorf("compose the profiling environment: %w", err)
	}
	e := envs[0]
	if err := b.useSystem(Envsnap); err != nil {
		return "", err
	}
	if err := b.reset(); err != nil {
		return "", err
	}
	r := b.run(ctx, e, Envsnap, "profile")
	if r.Error != "" {
		return "", fmt.Errorf("profiling episode of %s: %s", t.ID, r.Error)
	}
	fps, err := daemon.GetFootprints(ctx, b.env.SnapshotterSocket)
	if err != nil {
		return "", err
	}
	lists := map[digest.Digest]string{}
	for k, v := range fps {
		if d, err := digest.Parse(k); err == nil {
			lists[d] = v
		}
	}
	p := &group.Publisher{Hosts: b.env.Hosts()}
	var done []string
	for _, kind := range sharedKinds {
		ref := pub.Refs[t.Groups[kind]]
		if ref == "" {
			continue
		}
		_, n, err := p.SetPrefetch(ctx, ref, lists)
		if err != nil {
			return "", err
		}
		done = append(done, fmt.Sprintf("%s (%d layers)", kind, n))
	}
	if err := b.reset(); err != nil {
		return "", err
	}
	return fmt.Sprintf("Prefetch lists: one episode of task %s on envsnap (not counted) recorded what it read of each layer; the lists were attached to the shared groups %s with `containerd-envsnap group prefetch`, as a publisher does once per group version. Task groups have none. Every environment below was composed afterwards.",
		t.ID, strings.Join(done, ", ")), nil
}
