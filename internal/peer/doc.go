// Package peer is the cluster tier of the chunk fetcher: between a node's
// own chunk cache and the registry, nodes fetch the compressed frames of
// lazy layers from each other, so a frame leaves the registry about once
// per cluster instead of once per node.
//
// # Ownership
//
// Every frame has one owner among the live members, chosen by rendezvous
// (highest random weight) hashing of a key derived from the layer digest
// and the frame's stripe (StripeSize bytes of the compressed blob). Every
// node computes the same owner from the same member list, with no
// coordinator; a member leaving moves only the stripes it owned. A stripe,
// not a single frame, is the unit so that one coalesced read (a miss and
// its read-ahead, or a fill batch) goes to one or two owners as one
// contiguous range, and the owner fetches it from the registry in one
// request.
//
// # Trust
//
// A peer serves only frames of layers it has open (their TOC verified
// against the manifest) or already holds in its verified chunk cache, by
// content digest: it never forwards a request to another peer and never
// fetches a blob it does not know on a requester's behalf. The requester
// verifies every frame again; a frame that does not match its digest marks
// the peer bad for a while and the registry serves the read. Requests carry
// a shared bearer token (read from a file, as a mounted Kubernetes Secret)
// and/or run over mutually authenticated TLS; an unauthenticated request
// gets 401 and nothing else.
//
// # Failure
//
// A peer that does not answer within the hedge delay is raced by the
// registry (the first complete answer wins); one that fails or times out
// is marked bad for a while and skipped, so ownership moves to the next
// member until it answers again. No read fails because a peer did.
package peer
