package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/urfave/cli/v3"

	"github.com/envsnap/envsnap/internal/convert"
	"github.com/envsnap/envsnap/internal/group"
	"github.com/envsnap/envsnap/internal/registry"
)

var groupCommand = &cli.Command{
	Name:  "group",
	Usage: "manage layer groups (independently versioned environment components)",
	Commands: []*cli.Command{{
		Name:      "publish",
		Usage:     "convert a component to envsnap layers and push it as a group",
		ArgsUsage: "REF",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "kind", Required: true, Usage: "group kind: base, task, harness, evaluator or any name"},
			&cli.StringFlag{Name: "name", Usage: "group name recorded in the manifest (default: from REF)"},
			&cli.StringSliceFlag{Name: "from-dir", Usage: "directory to publish as one layer (repeatable: one layer each)"},
			&cli.StringSliceFlag{Name: "from-tar", Usage: "tar file (plain, gzip or zstd) to publish as one layer (repeatable)"},
			&cli.StringFlag{Name: "from-image", Usage: "existing image to publish as the group: oci-layout:DIR, oci-archive:FILE (BuildKit's type=oci output), containerd:NAME or a registry reference; its Env and WorkingDir are the default contributions"},
			&cli.StringFlag{Name: "address", Value: "/run/containerd/containerd.sock", Usage: "containerd socket (with --from-image containerd:NAME)"},
			&cli.StringFlag{Name: "namespace", Value: "default", Usage: "containerd namespace (with --from-image containerd:NAME)"},
			&cli.StringFlag{Name: "prefix", Usage: "with --from-dir: where the directory's contents land in the image, e.g. /opt/harness"},
			&cli.StringFlag{Name: "owner", Usage: "with --from-dir: UID:GID for every entry (e.g. 0:0)"},
			&cli.StringFlag{Name: "mode-mask", Usage: "with --from-dir: octal mask ANDed into permissions (e.g. 755)"},
			&cli.StringFlag{Name: "mtime", Usage: "with --from-dir: RFC 3339 time or unix seconds for every entry (reproducible rebuilds)"},
			&cli.StringSliceFlag{Name: "env", Usage: "environment contribution K=V (PATH-like values are prepended when composed)"},
			&cli.StringFlag{Name: "workdir", Usage: "working directory contribution"},
			&cli.StringSliceFlag{Name: "label", Usage: "config label k=v"},
		}, registryFlags()...),
		Action: runGroupPublish,
	}, {
		Name:      "prefetch",
		Usage:     "attach prefetch lists (recorded footprints) to the layers of published groups; only new manifests are pushed",
		ArgsUsage: "REF...",
		Description: "Record footprints by running a representative environment on a node, then\n" +
			"`containerd-envsnap footprints -o fp.json` there. Layers of the groups that\n" +
			"appear in the file get the list; environments composed from the groups\n" +
			"afterwards fetch those frames in bulk as soon as a layer is mounted.",
		Flags: append([]cli.Flag{
			&cli.StringFlag{Name: "footprints", Required: true, Usage: "JSON file: layer digest -> prefetch list, as `containerd-envsnap footprints` writes it"},
		}, registryFlags()...),
		Action: runGroupPrefetch,
	}},
}

func runGroupPrefetch(ctx context.Context, c *cli.Command) error {
	if c.Args().Len() == 0 {
		return fmt.Errorf("group prefetch: want at least one REF")
	}
	b, err := os.ReadFile(c.String("footprints"))
	if err != nil {
		return err
	}
	var raw map[string]string
	if err := json.Unmarshal(b, &raw); err != nil {
		return fmt.Errorf("--footprints %s: %w", c.String("footprints"), err)
	}
	lists := make(map[digest.Digest]string, len(raw))
	for k, v := range raw {
		d, err := digest.Parse(k)
		if err != nil {
			return fmt.Errorf("--footprints %s: %q: %w", c.String("footprints"), k, err)
		}
		lists[d] = v
	}
	p := &group.Publisher{Hosts: registry.ConfigureHosts(ctx, registryOptions(c))}
	for _, ref := range c.Args().Slice() {
		desc, n, err := p.SetPrefetch(ctx, ref, lists)
		if err != nil {
			return err
		}
		fmt.Printf("%s@%s: prefetch lists on %d layers\n", ref, desc.Digest, n)
	}
	return nil
}

func init() { commands = append(commands, groupCommand) }

func runGroupPublish(ctx context.Context, c *cli.Command) error {
	if c.Args().Len() != 1 {
		return fmt.Errorf("group publish: want one REF argument")
	}
	ref := c.Args().First()
	opts, err := dirOptions(c)
	if err != nil {
		return err
	}
	var sources []group.TarSource
	for _, d := range c.StringSlice("from-dir") {
		if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
			return fmt.Errorf("--from-dir %s: not a directory", d)
		}
		sources = append(sources, group.DirSource(d, opts))
	}
	for _, t := range c.StringSlice("from-tar") {
		sources = append(sources, group.TarFileSource(t))
	}
	image := c.String("from-image")
	if len(sources) == 0 && image == "" {
		return fmt.Errorf("group publish: give --from-dir, --from-tar or --from-image")
	}
	if len(sources) > 0 && image != "" {
		return fmt.Errorf("group publish: --from-image makes the whole group; it does not mix with --from-dir or --from-tar")
	}
	labels := map[string]string{}
	for _, kv := range c.StringSlice("label") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return fmt.Errorf("--label %q: want k=v", kv)
		}
		labels[k] = v
	}
	name := c.String("name")
	if name == "" {
		name = refName(ref)
	}
	p := &group.Publisher{Hosts: registry.ConfigureHosts(ctx, registryOptions(c)), Progress: os.Stderr}
	meta := group.Meta{Kind: c.String("kind"), Name: name, Env: c.StringSlice("env"), WorkingDir: c.String("workdir"), Labels: labels}
	var res *group.Result
	if image != "" {
		tmp, err := os.MkdirTemp("", "envsnap-group-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		layers, cfg, err := group.ImageLayers(ctx, image, convert.Options{
			Registry: registryOptions(c), ContainerdAddress: c.String("address"), ContainerdNamespace: c.String("namespace"),
		}, tmp)
		if err != nil {
			return fmt.Errorf("group publish --from-image %s: %w", image, err)
		}
		if !c.IsSet("env") {
			meta.Env = cfg.Env
		}
		if !c.IsSet("workdir") {
			meta.WorkingDir = cfg.WorkingDir
		}
		res, err = p.PublishLayers(ctx, ref, layers, meta)
		if err != nil {
			return err
		}
	} else {
		var err error
		if res, err = p.Publish(ctx, ref, sources, meta); err != nil {
			return err
		}
	}
	fmt.Printf("%s@%s kind=%s layers=%d uploaded=%d (%d bytes) existing=%d in %s\n",
		ref, res.Manifest.Digest, c.String("kind"), len(res.Layers), res.UploadedLayers, res.UploadedBytes, res.SkippedLayers, res.Duration.Round(time.Millisecond))
	return nil
}

func dirOptions(c *cli.Command) (group.DirOptions, error) {
	o := group.DirOptions{Prefix: c.String("prefix")}
	if s := c.String("owner"); s != "" {
		u, g, ok := strings.Cut(s, ":")
		uid, err1 := strconv.Atoi(u)
		gid, err2 := strconv.Atoi(g)
		if !ok || err1 != nil || err2 != nil {
			return o, fmt.Errorf("--owner %q: want UID:GID", s)
		}
		o.UID, o.GID = &uid, &gid
	}
	if s := c.String("mode-mask"); s != "" {
		m, err := strconv.ParseUint(s, 8, 32)
		if err != nil {
			return o, fmt.Errorf("--mode-mask %q: %w", s, err)
		}
		o.ModeMask = fs.FileMode(m)
	}
	if s := c.String("mtime"); s != "" {
		t, err := time.Parse(time.RFC3339, s)
		if err != nil {
			secs, err2 := strconv.ParseInt(s, 10, 64)
			if err2 != nil {
				return o, fmt.Errorf("--mtime %q: want RFC 3339 or unix seconds", s)
			}
			t = time.Unix(secs, 0)
		}
		o.ModTime = &t
	}
	return o, nil
}

// refName is the last path element of a reference without tag or digest:
// "reg/envsnap/harness/claude-code:2.0" -> "claude-code".
func refName(ref string) string {
	if i := strings.IndexByte(ref, '@'); i >= 0 {
		ref = ref[:i]
	}
	if i := strings.LastIndexByte(ref, '/'); i >= 0 {
		ref = ref[i+1:]
	}
	if i := strings.IndexByte(ref, ':'); i >= 0 {
		ref = ref[:i]
	}
	return ref
}
