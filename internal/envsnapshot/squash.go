package envsnapshot

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/log"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/envsnap/envsnap/internal/fetch"
	"github.com/envsnap/envsnap/layerfmt"
)

// mnode is one path of a squashed layer: an entry of one of the input
// layers, or a whiteout that must hide what the image below has there.
type mnode struct {
	layer    int // index into the inputs; -1 for a whiteout
	idx      int // entry index in that layer's TOC
	whiteout bool
	// opaque: the directory hides everything the image below has in it,
	// because an input made it opaque, deleted it, or replaced it with a
	// non-directory before it came back as a directory.
	opaque bool
}

// Squash writes to w one OCI layer tar equivalent to the layers read by
// layers applied in order (lowest first) on top of the image below:
// applying the result gives the same tree as applying each of them.
// Whiteouts and opaque directories are merged: a whiteout of something an
// upper layer re-creates disappears, a directory re-created over a
// whiteout or a non-directory becomes opaque (the image below must not
// show through). Of those, only the ones that hide something of below are
// written: a name created in one input and deleted in a later one leaves
// nothing, because a whiteout that hides nothing is not invisible
// everywhere (overlayfs lists it, with stat failing, in a directory no
// lower layer shares). A nil below is an image nothing is known of: every
// whiteout and opaque marker is kept, which is equivalent on any image
// but may leave such phantom entries. Hard links stay hard links when
// their names survive; a file's data is read from the layer that holds it.
func Squash(ctx context.Context, w io.Writer, below *Below, layers []*layerfmt.Reader) error {
	nodes := map[string]*mnode{}
	removeTree := func(p string) {
		delete(nodes, p)
		prefix := p + "/"
		if p == "." {
			prefix = ""
		}
		for k := range nodes {
			if strings.HasPrefix(k, prefix) {
				delete(nodes, k)
			}
		}
	}
	for li, r := range layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		toc := r.TOC()
		// Whiteouts apply to the layers below only: all of them first,
		// then the layer's own entries.
		var opaqueDirs []string
		for i := 1; i < toc.Len(); i++ {
			name := toc.Name(i)
			dir, base := path.Split(name)
			dir = strings.TrimSuffix(dir, "/")
			if dir == "" {
				dir = "."
			}
			switch {
			case base == whiteoutOpaque:
				opaqueDirs = append(opaqueDirs, dir)
				for k := range nodes {
					if dir == "." || strings.HasPrefix(k, dir+"/") {
						delete(nodes, k)
					}
				}
			case strings.HasPrefix(base, whiteoutPrefix):
				target := path.Join(dir, strings.TrimPrefix(base, whiteoutPrefix))
				removeTree(target)
				nodes[target] = &mnode{layer: -1, whiteout: true}
			}
		}
		for i := 1; i < toc.Len(); i++ {
			name := toc.Name(i)
			base := path.Base(name)
			if strings.HasPrefix(base, whiteoutPrefix) {
				continue
			}
			isDir := toc.Type(i) == layerfmt.TypeDir
			old := nodes[name]
			switch {
			case old == nil:
				nodes[name] = &mnode{layer: li, idx: i}
			case isDir && !old.whiteout && layers[old.layer].TOC().Type(old.idx) == layerfmt.TypeDir:
				// A directory over a directory merges; an implicit entry
				// (no metadata of its own) leaves the older one.
				if !toc.Entry(i).Implicit {
					old.layer, old.idx = li, i
				}
			default:
				removeTree(name)
				nodes[name] = &mnode{layer: li, idx: i, opaque: isDir}
			}
		}
		for _, d := range opaqueDirs {
			if n := nodes[d]; n != nil && !n.whiteout {
				n.opaque = true
			}
		}
	}
	paths := make([]string, 0, len(nodes))
	for p := range nodes {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	tw := tar.NewWriter(w)
	type dataKey struct{ layer, idx int }
	written := map[dataKey]string{} // data entry -> first name written for it
	for _, p := range paths {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := nodes[p]
		if n.whiteout && !below.hides(nodes, p) {
			continue
		}
		if n.whiteout {
			dir, base := path.Split(p)
			if err := tw.WriteHeader(whiteoutHeader(path.Join(dir, whiteoutPrefix+base))); err != nil {
				return fmt.Errorf("squash: whiteout %s: %w", p, err)
			}
			continue
		}
		r := layers[n.layer]
		toc := r.TOC()
		dataIdx := n.idx
		if toc.Type(n.idx) == layerfmt.TypeHardlink {
			j, ok := toc.Resolve(n.idx)
			if !ok {
				return fmt.Errorf("squash: hard link %s of layer %d does not resolve", p, n.layer)
			}
			dataIdx = j
		}
		e := toc.Entry(dataIdx)
		hdr, err := entryHeader(p, e)
		if err != nil {
			return fmt.Errorf("squash: %s: %w", p, err)
		}
		key := dataKey{n.layer, dataIdx}
		if e.Type == layerfmt.TypeReg {
			if first, ok := written[key]; ok {
				// The inode's metadata stays on the link, as tar(1)
				// writes it: containerd's applier chmods the inode
				// with a link's mode.
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				written[key] = p
			}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return fmt.Errorf("squash: header %s: %w", p, err)
		}
		if hdr.Typeflag == tar.TypeReg && hdr.Size > 0 {
			f, err := r.Open(e.Name)
			if err != nil {
				return fmt.Errorf("squash: open %s in layer %d: %w", e.Name, n.layer, err)
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return fmt.Errorf("squash: read %s from layer %d: %w", e.Name, n.layer, err)
			}
		}
		if n.opaque && below.hidesUnder(nodes, p) {
			if err := tw.WriteHeader(whiteoutHeader(path.Join(p, whiteoutOpaque))); err != nil {
				return fmt.Errorf("squash: opaque marker %s: %w", p, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("squash: finish tar: %w", err)
	}
	return nil
}

// Below is the image a squashed layer is applied on, known by the TOCs of
// its layers (lowest first). It answers one question: does a whiteout or
// an opaque marker of the squash hide anything of it.
type Below struct {
	tocs []*layerfmt.TOC
}

// NewBelow describes an image by its layers' TOCs, lowest first.
func NewBelow(tocs ...*layerfmt.TOC) *Below { return &Below{tocs: tocs} }

// readBelow reads the TOCs of layers (lowest first) from the registry:
// one tail read each. It returns nil, nil when a layer is not in the
// envsnap format: its file list would cost a download of the whole blob,
// and the squash is still equivalent without it (see Squash).
func readBelow(ctx context.Context, hosts docker.RegistryHosts, ref string, layers []ocispec.Descriptor) (*Below, error) {
	tocs := make([]*layerfmt.TOC, 0, len(layers))
	for _, l := range layers {
		want := digest.Digest(l.Annotations[layerfmt.AnnotationTOCDigest])
		if want == "" {
			log.G(ctx).WithField("layer", l.Digest).Info("squash: a layer of the image is not in the envsnap format; keeping every whiteout")
			return nil, nil
		}
		br, err := fetch.NewBlobReader(hosts, ref, l)
		if err != nil {
			return nil, err
		}
		toc, err := layerfmt.ReadTOC(ctx, br.ReaderAt(ctx), l.Size, want)
		if err != nil {
			return nil, fmt.Errorf("read TOC of image layer %s: %w", l.Digest, err)
		}
		tocs = append(tocs, toc)
	}
	return NewBelow(tocs...), nil
}

// hides reports whether a whiteout at p in the squashed layer (whose
// entries are nodes) hides something of b: b shows p, and no directory
// of the squash above p is opaque already. A nil b is unknown and might
// show anything.
func (b *Below) hides(nodes map[string]*mnode, p string) bool {
	return !opaqueAbove(nodes, p) && (b == nil || b.shows(p))
}

// hidesUnder is hides for an opaque marker on directory d: b shows
// something inside d.
func (b *Below) hidesUnder(nodes map[string]*mnode, d string) bool {
	return !opaqueAbove(nodes, d) && (b == nil || b.showsUnder(d))
}

// opaqueAbove reports whether a proper ancestor of p is an opaque
// directory of the squash, which hides all of below beneath it.
func opaqueAbove(nodes map[string]*mnode, p string) bool {
	for a := path.Dir(p); a != "."; a = path.Dir(a) {
		if n := nodes[a]; n != nil && n.opaque {
			return true
		}
	}
	return false
}

// shows reports whether the image has an entry at p (a cleaned relative
// path, not "."), with OCI semantics: looking from the top layer down, an
// entry of a layer is what shows; a whiteout of p or of a directory above
// it, a non-directory above it, or an opaque directory above it hides
// every layer below that one.
func (b *Below) shows(p string) bool {
	parts := strings.Split(p, "/")
	for li := len(b.tocs) - 1; li >= 0; li-- {
		t := b.tocs[li]
		cur, stop := 0, t.OverlayOpaque(0)
		for j, c := range parts {
			i, ok := t.LookupChild(cur, c)
			if !ok {
				if _, wh := t.LookupChild(cur, whiteoutPrefix+c); wh {
					return false
				}
				break // the rest of p is not in this layer
			}
			if j == len(parts)-1 {
				return true
			}
			if t.Type(i) != layerfmt.TypeDir {
				return false
			}
			stop = stop || t.OverlayOpaque(i)
			cur = i
		}
		if stop {
			return false
		}
	}
	return false
}

// showsUnder reports whether the image shows anything inside directory d
// ("." for the root): some layer has a child of d that shows.
func (b *Below) showsUnder(d string) bool {
	for _, t := range b.tocs {
		i, ok := t.Lookup(d)
		if !ok || t.Type(i) != layerfmt.TypeDir {
			continue
		}
		first, n := t.ChildRange(i)
		for k := first; k < first+n; k++ {
			if _, name, wh, ok := t.OverlayChild(i, k); ok && !wh && b.shows(path.Join(d, name)) {
				return true
			}
		}
	}
	return false
}

// entryHeader is the tar header of a TOC entry under another name.
func entryHeader(name string, e layerfmt.Entry) (*tar.Header, error) {
	hdr := &tar.Header{
		Name:    name,
		Mode:    int64(e.Mode.Perm()),
		Uid:     e.UID,
		Gid:     e.GID,
		ModTime: e.ModTime,
		Format:  tar.FormatPAX,
	}
	for bit, unix := range map[fs.FileMode]int64{fs.ModeSetuid: 0o4000, fs.ModeSetgid: 0o2000, fs.ModeSticky: 0o1000} {
		if e.Mode&bit != 0 {
			hdr.Mode |= unix
		}
	}
	switch e.Type {
	case layerfmt.TypeReg:
		hdr.Typeflag, hdr.Size = tar.TypeReg, e.Size
	case layerfmt.TypeDir:
		hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
	case layerfmt.TypeSymlink:
		hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, e.Linkname
	case layerfmt.TypeChar:
		hdr.Typeflag = tar.TypeChar
	case layerfmt.TypeBlock:
		hdr.Typeflag = tar.TypeBlock
	case layerfmt.TypeFIFO:
		hdr.Typeflag = tar.TypeFifo
	default:
		return nil, fmt.Errorf("entry type %s", e.Type)
	}
	hdr.Devmajor, hdr.Devminor = int64(e.Devmajor), int64(e.Devminor)
	for k, v := range e.Xattrs {
		if hdr.PAXRecords == nil {
			hdr.PAXRecords = map[string]string{}
		}
		hdr.PAXRecords["SCHILY.xattr."+k] = v
	}
	return hdr, nil
}
