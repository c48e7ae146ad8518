package layerfmt

import "strings"

// How a layer is presented as an overlayfs lower directory. Both the FUSE
// mount of a layer and its native copy (a plain directory tree) show
// exactly this view, so a container sees the same files whichever lower
// it was given.

// OCI whiteout names (image-spec layer.md).
const (
	WhiteoutPrefix = ".wh."
	OpaqueMarker   = ".wh..wh..opq"

	// NameMax is Linux's NAME_MAX. The TOC allows longer components, but
	// no kernel file system can hold or look them up.
	NameMax = 255

	// OverlayOpaqueXattr marks a directory overlayfs must not merge with
	// lower layers. Layer content can never set it (see HiddenXattr);
	// only the OCI opaque marker does.
	OverlayOpaqueXattr = "trusted.overlay.opaque"
)

// HiddenXattr reports whether an extended attribute of layer content is
// left out of the overlay view. containerd's applier never sets trusted.*
// attributes from an archive (pkg/archive setxattr), and the view follows
// it, which also keeps overlayfs's own trusted.overlay.* (redirect,
// metacopy) out of the content's reach; user.overlay.* is what overlayfs
// interprets instead with the userxattr mount option.
func HiddenXattr(name string) bool {
	return strings.HasPrefix(name, "trusted.") || strings.HasPrefix(name, "user.overlay.")
}

// OverlayChild maps the TOC child k of directory dir to what an overlayfs
// lower directory shows for it: under name, the entry idx whose metadata
// and data it has (the hard-link target for a hard link), or, with
// whiteout set, an overlayfs whiteout (a 0:0 character device) carrying
// the owner and mtime of the OCI marker idx. ok is false for entries that
// are not shown: the opaque marker, whiteouts that are shadowed by an
// entry of the same layer or malformed, names longer than NameMax, broken
// hard links and hard links to directories (which would make the tree a
// graph).
func (t *TOC) OverlayChild(dir, k int) (idx int, name string, whiteout, ok bool) {
	base := t.BaseName(k)
	if base == OpaqueMarker {
		return -1, "", false, false
	}
	if target, isWh := strings.CutPrefix(base, WhiteoutPrefix); isWh {
		// ".wh..wh.*" names are OCI's reserved markers, not whiteouts of
		// ".wh.*" files (which could never be looked up anyway).
		if target == "" || target == "." || target == ".." || len(target) > NameMax ||
			strings.Contains(target, "/") || strings.HasPrefix(target, WhiteoutPrefix) {
			return -1, "", false, false
		}
		// OCI: a whiteout only applies to lower layers; an entry of the
		// same name in this layer is what this layer shows.
		if _, shadowed := t.LookupChild(dir, target); shadowed {
			return -1, "", false, false
		}
		return k, target, true, true
	}
	if len(base) > NameMax {
		return -1, "", false, false
	}
	idx = k
	if t.Type(k) == TypeHardlink {
		var found bool
		if idx, found = t.Resolve(k); !found || t.Type(idx) == TypeDir {
			return -1, "", false, false
		}
	}
	return idx, base, false, true
}

// OverlayOpaque reports whether overlayfs must hide lower-layer content of
// directory dir: it holds the OCI opaque marker, or the layer deletes and
// re-creates it (".wh.<dir>" next to "<dir>" in the parent), which OCI
// defines as the same thing.
func (t *TOC) OverlayOpaque(dir int) bool {
	if _, ok := t.LookupChild(dir, OpaqueMarker); ok {
		return true
	}
	if dir == 0 {
		return false
	}
	_, ok := t.LookupChild(t.Parent(dir), WhiteoutPrefix+t.BaseName(dir))
	return ok
}

// OverlayXattrs reports whether the overlay view of the layer shows an
// extended attribute anywhere: an entry's own that HiddenXattr does not
// hide, or OverlayOpaqueXattr on an opaque directory. A lower that shows
// none can say so once (lazyfs answers ENOSYS, which the kernel remembers
// for the mount) instead of answering every query overlayfs makes of it.
func (t *TOC) OverlayXattrs() bool {
	for i := range t.n {
		r := t.rec(i)
		if xf, xn := le32(r, eXattrOff), le32(r, eXattrN); xn != 0 {
			for x := xf; x < xf+xn; x++ {
				if k, _ := t.xattr(x); !HiddenXattr(string(k)) {
					return true
				}
			}
		}
		if t.Type(i) == TypeDir && t.OverlayOpaque(i) {
			return true
		}
	}
	return false
}
