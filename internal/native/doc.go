// Package native keeps kernel-native copies of lazy layers: once every
// chunk of a layer is in the node cache, its overlayfs lower directory is
// unpacked into a plain directory tree, so containers started afterwards
// read it at the speed of the node's disk instead of through FUSE.
package native
