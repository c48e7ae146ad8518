// Package envsnapshot snapshots and forks running environments: the files
// of a container on the envsnap snapshotter become one layer in the
// envsnap format on top of the container's own image, pushed as a new
// image whose other layers are linked, never copied; forks start from that
// image lazily on any node.
//
// A snapshot is taken in five steps: the container's writable layer, the
// overlayfs upper directory of its active snapshot, is pre-copied into
// memory while the container runs (the data and xattrs of its regular
// files), while the upload session is opened and the base layers are
// linked, and the layer is already encoded from the pre-copy and
// streamed; the container's cgroup is frozen (directly, v1 freezer or v2
// cgroup.freeze) while the rest is read (files that changed, or may have,
// since the pre-copy, and every entry that is not a regular file); the
// container is thawed; if the frozen read is exactly the pre-copy's diff
// the layer encoded from the pre-copy is kept, else the frozen read's
// entries are written as an OCI diff (overlay whiteouts and opaque
// directories become OCI whiteouts) straight into a layerfmt.Writer, the
// layer streamed to the registry in chunks as it is encoded; then the
// config, and the manifest last. Only the manifest
// makes the snapshot visible, so a failure never leaves an image that
// refers to missing blobs.
//
// Chains of snapshots (a fork snapshotted again) add one layer each; past
// the depth limit Decide has them squashed into one, in the background
// after the snapshot was pushed.
//
// Process state (memory, open files, sockets) is not captured: see
// docs/snapshots.md.
package envsnapshot
