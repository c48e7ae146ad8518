// Package native keeps kernel-native copies of lazy layers: once every
// chunk of a layer is in the node cache, its overlayfs lower directory is
// unpacked into a plain directory tree, so containers started afterwards
// read it at the speed of the node's disk instead of through FUSE.
//
// A copy shows exactly the tree the layer's FUSE mount presents
// (layerfmt.TOC.OverlayChild): the overlayfs lower directory containerd's
// overlay applier would have unpacked from the layer.
//
// Invariants: a copy is built only from chunks verified against the TOC's
// digests (a missing or corrupt chunk fails the build, never yields a
// wrong file); it is built under a temporary name, renamed into place,
// synced, and only then marked complete, so a crash leaves nothing that
// is used; its bytes are charged to the bound it shares with the chunk
// cache, where copies give way before chunks; and a copy is never removed
// while the InUse oracle (the snapshotter) reports its layer, since
// containerd mounts lower directories by path at any time while a
// snapshot that names them exists.
package native
