// Package envsnapshot snapshots and forks running environments: the files
// of a container on the envsnap snapshotter become one layer in the
// envsnap format on top of the container's own image, pushed as a new
// image whose other layers are linked, never copied; forks start from that
// image lazily on any node.
//
// A snapshot is taken in four steps: the container's cgroup is frozen
// (containerd's task Pause) while its writable layer, the overlayfs upper
// directory of its active snapshot, is copied to a staging directory on
// tmpfs; the container is thawed; the copy is written as an OCI diff
// (overlay whiteouts and opaque directories become OCI whiteouts) and
// encoded with layerfmt; the layer, then the config, then the manifest are
// pushed. Only the manifest makes the snapshot visible, so a failure never
// leaves an image that refers to missing blobs.
//
// Chains of snapshots (a fork snapshotted again) add one layer each until
// Decide says to squash them into one.
//
// Process state (memory, open files, sockets) is not captured: see
// docs/snapshots.md.
package envsnapshot
