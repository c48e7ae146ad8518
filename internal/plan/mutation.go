package plan

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"

	"github.com/bluekeyes/go-gitdiff/gitdiff"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/layerfmt"
)

// LayerOpener opens one layer of a group for reading files.
type LayerOpener func(ctx context.Context, g *Group, layer ocispec.Descriptor) (*layerfmt.Reader, error)

// RemoteLayerOpener reads layers straight from the group's registry with
// range requests: only the TOC and the chunks of the files read cross the
// network, each verified against the TOC digest in the layer's annotation.
func RemoteLayerOpener(hosts docker.RegistryHosts) LayerOpener {
	return func(ctx context.Context, g *Group, layer ocispec.Descriptor) (*layerfmt.Reader, error) {
		toc := digest.Digest(layer.Annotations[layerfmt.AnnotationTOCDigest])
		if toc == "" {
			return nil, fmt.Errorf("layer %s of %s: %w", layer.Digest, g.Ref, layerfmt.ErrNotLayer)
		}
		br, err := fetch.NewBlobReader(hosts, g.Ref, layer)
		if err != nil {
			return nil, err
		}
		return layerfmt.NewReader(br.ReaderAt(ctx), layer.Size, toc)
	}
}

// groupFS looks files up through a group's layers, topmost first, honouring
// OCI whiteouts and opaque directories, opening each layer only when needed.
type groupFS struct {
	ctx    context.Context
	open   LayerOpener
	g      *Group
	layers []*layerfmt.Reader
	err    []error
}

func newGroupFS(ctx context.Context, open LayerOpener, g *Group) *groupFS {
	n := len(g.Manifest.Layers)
	return &groupFS{ctx: ctx, open: open, g: g, layers: make([]*layerfmt.Reader, n), err: make([]error, n)}
}

func (gfs *groupFS) layer(i int) (*layerfmt.Reader, error) {
	if gfs.layers[i] == nil && gfs.err[i] == nil {
		gfs.layers[i], gfs.err[i] = gfs.open(gfs.ctx, gfs.g, gfs.g.Manifest.Layers[i])
	}
	return gfs.layers[i], gfs.err[i]
}

var errNotInGroup = errors.New("not in group")

// lstat finds name (slash-separated, relative to the image root) and
// returns the layer that holds it and its entry.
func (gfs *groupFS) lstat(name string) (*layerfmt.Reader, layerfmt.Entry, error) {
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	for i := len(gfs.g.Manifest.Layers) - 1; i >= 0; i-- {
		r, err := gfs.layer(i)
		if err != nil {
			return nil, layerfmt.Entry{}, fmt.Errorf("open layer %d of %s: %w", i, gfs.g.Ref, err)
		}
		if fi, err := r.Lstat(name); err == nil {
			return r, fi.Sys().(layerfmt.Entry), nil
		}
		if _, err := r.Lstat(path.Join(dir, ".wh."+base)); err == nil {
			break
		}
		if opaqueAbove(r, dir) {
			break
		}
	}
	return nil, layerfmt.Entry{}, fmt.Errorf("%s: %w %s", name, errNotInGroup, gfs.g.Ref)
}

// opaqueAbove reports whether the layer marks dir or one of its ancestors
// opaque, which hides everything lower layers hold below it.
func opaqueAbove(r *layerfmt.Reader, dir string) bool {
	for d := dir; ; d = path.Dir(d) {
		if d == "" {
			d = "."
		}
		if _, err := r.Lstat(path.Join(d, ".wh..wh..opq")); err == nil {
			return true
		}
		if d == "." || d == "/" {
			return false
		}
	}
}

func (gfs *groupFS) readFile(name string) ([]byte, layerfmt.Entry, error) {
	r, e, err := gfs.lstat(name)
	if err != nil {
		return nil, e, err
	}
	if e.Type != layerfmt.TypeReg {
		return nil, e, fmt.Errorf("%s is a %s, not a regular file", name, e.Type)
	}
	f, err := r.Open(name)
	if err != nil {
		return nil, e, err
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	return b, e, err
}

// applyMutation applies m's patch to g's files and returns the changed files
// as one envsnap layer (deleted files become whiteouts).
func applyMutation(ctx context.Context, open LayerOpener, g *Group, m *Mutation) (*Blob, error) {
	text, err := m.PatchText()
	if err != nil {
		return nil, err
	}
	files, _, err := gitdiff.Parse(bytes.NewReader(text))
	if err != nil {
		return nil, fmt.Errorf("parse patch: %w", err)
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("patch changes no file")
	}
	gfs := newGroupFS(ctx, open, g)
	root := strings.Trim(path.Clean(m.Dir), "/")
	type change struct {
		name     string
		data     []byte
		mode     int64
		uid      int
		gid      int
		whiteout bool
	}
	var changes []change
	dirs := map[string]bool{}
	for _, f := range files {
		oldName := path.Join(root, f.OldName)
		newName := path.Join(root, f.NewName)
		var src []byte
		var e layerfmt.Entry
		if !f.IsNew {
			src, e, err = gfs.readFile(oldName)
			if err != nil {
				return nil, fmt.Errorf("patch %s: %w", f.OldName, err)
			}
		} else {
			e = layerfmt.Entry{Mode: 0o644}
		}
		if f.IsDelete {
			changes = append(changes, change{name: oldName, whiteout: true})
			dirs[path.Dir(oldName)] = true
			continue
		}
		var out bytes.Buffer
		if err := gitdiff.Apply(&out, bytes.NewReader(src), f); err != nil {
			var ae *gitdiff.ApplyError
			if errors.As(err, &ae) && ae.Fragment > 0 {
				return nil, fmt.Errorf("patch %s: hunk %d (line %d of the file) does not apply: %w", f.NewName, ae.Fragment, ae.Line, err)
			}
			return nil, fmt.Errorf("patch %s does not apply: %w", f.NewName, err)
		}
		mode := int64(e.Mode.Perm()) | tarSpecialBits(e.Mode)
		if f.NewMode != 0 {
			mode = int64(f.NewMode.Perm())
		}
		if f.IsRename && oldName != newName {
			changes = append(changes, change{name: oldName, whiteout: true})
			dirs[path.Dir(oldName)] = true
		}
		changes = append(changes, change{name: newName, data: out.Bytes(), mode: mode, uid: e.UID, gid: e.GID})
		dirs[path.Dir(newName)] = true
	}

	// Parent directories go in the layer with the group's own metadata:
	// overlayfs takes a merged directory's attributes from its topmost
	// layer, so a default-mode directory here would change them.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	parents := map[string]bool{}
	for d := range dirs {
		for ; d != "." && d != "" && d != "/"; d = path.Dir(d) {
			parents[d] = true
		}
	}
	dirList := make([]string, 0, len(parents))
	for d := range parents {
		dirList = append(dirList, d)
	}
	sort.Strings(dirList)
	for _, d := range dirList {
		_, e, err := gfs.lstat(d)
		hdr := &tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, Format: tar.FormatPAX}
		if err == nil {
			if e.Type != layerfmt.TypeDir {
				return nil, fmt.Errorf("patch: %s is not a directory in %s", d, g.Ref)
			}
			hdr.Mode = int64(e.Mode.Perm()) | tarSpecialBits(e.Mode)
			hdr.Uid, hdr.Gid, hdr.ModTime = e.UID, e.GID, e.ModTime
		} else if !errors.Is(err, errNotInGroup) {
			return nil, err
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
	}
	sort.Slice(changes, func(i, j int) bool { return changes[i].name < changes[j].name })
	for _, c := range changes {
		if c.whiteout {
			dir, base := path.Split(c.name)
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: dir + ".wh." + base, Mode: 0o600, Format: tar.FormatPAX}); err != nil {
				return nil, err
			}
			continue
		}
		hdr := &tar.Header{Typeflag: tar.TypeReg, Name: c.name, Mode: c.mode, Uid: c.uid, Gid: c.gid, Size: int64(len(c.data)), Format: tar.FormatPAX}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(c.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	var blob bytes.Buffer
	wr, err := layerfmt.Convert(ctx, &blob, &buf)
	if err != nil {
		return nil, fmt.Errorf("convert mutation layer: %w", err)
	}
	return &Blob{
		Desc: ocispec.Descriptor{
			MediaType:   layerfmt.MediaTypeLayer,
			Digest:      wr.Digest,
			Size:        wr.Size,
			Annotations: wr.Annotations(),
		},
		DiffID: wr.DiffID,
		Data:   blob.Bytes(),
	}, nil
}

func tarSpecialBits(m fs.FileMode) int64 {
	var bits int64
	if m&fs.ModeSetuid != 0 {
		bits |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		bits |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		bits |= 0o1000
	}
	return bits
}
