package egress

import (
	"context"
	"fmt"
	"net/netip"
)

// Node is the node-wide part of every environment's policy, from the
// shim's configuration.
type Node struct {
	// Enforce gives every environment a policy; without it only those
	// with the Annotation get one.
	Enforce bool
	// Allow is the default allow-list (names not yet resolved), replaced
	// by an environment's Annotation when it has one.
	Allow []Entry
	// Resolvers are where DNS may go.
	Resolvers []netip.Addr
	// Deny is denied besides the node's own addresses and Metadata.
	Deny []netip.Prefix
}

// Policy returns the policy of an environment with annotations, or false
// when none applies. nodeAddrs lists the node's addresses (NodeAddresses
// in the shim); lookup resolves names (LookupIP).
func (n Node) Policy(ctx context.Context, annotations map[string]string, lookup Lookup, nodeAddrs func() ([]netip.Prefix, error)) (Policy, bool, error) {
	v, annotated := annotations[Annotation]
	if !annotated && !n.Enforce {
		return Policy{}, false, nil
	}
	entries := n.Allow
	if annotated {
		var err error
		if entries, err = Parse(v); err != nil {
			return Policy{}, false, fmt.Errorf("annotation %s: %w", Annotation, err)
		}
	}
	allow, err := Resolve(ctx, entries, lookup)
	if err != nil {
		return Policy{}, false, err
	}
	node, err := nodeAddrs()
	if err != nil {
		return Policy{}, false, err
	}
	deny := append(append(append([]netip.Prefix(nil), node...), Metadata...), n.Deny...)
	return Policy{Allow: allow, Resolvers: n.Resolvers, Deny: deny}, true, nil
}
