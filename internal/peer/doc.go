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
// Deadlines follow the owner's progress. An owner answers "102 Processing"
// as soon as it has checked a request and again every DefaultProgressEvery
// while it fetches the frames, and sends its status only with the bytes.
// A read asks the registry too (a hedge; the first complete answer wins)
// when the owner has shown no sign of life within a delay that follows how
// long that owner's first signs of life took lately, never less than the
// configured hedge delay. A request is given up when it makes no progress
// (no sign of life before the answer, no byte of it after) for the peer
// timeout, however long it has run. An owner that is refused, cut short,
// stalls or sends a wrong byte is marked bad for a while and skipped, so
// ownership moves to the next member until it answers again; one that is
// busy (503), lacks the layer (404) or whose own registry fetch failed
// (502) is not. No read fails because a peer did.
package peer
