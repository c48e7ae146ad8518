package envsnapshot

// DefaultMaxDepth is how many snapshot layers an image may carry above
// its original image before a snapshot squashes them into one. Each layer
// is one more overlayfs lower directory and one more lazy mount for every
// fork; eight keeps a chain of branchings cheap to mount while a squash
// (which reads every snapshot layer) stays rare.
const DefaultMaxDepth = 8

// Layout says what a new snapshot's image holds above the original image.
type Layout struct {
	// Keep is how many of the parent's snapshot layers stay as they are.
	Keep int
	// Squash is how many of the parent's snapshot layers (those above
	// Keep) are merged with the new diff into one layer; 0 means the new
	// diff is pushed as a layer of its own.
	Squash int
}

// Decide places a new diff on top of an image that already carries
// parentDiffs snapshot layers, allowing at most maxDepth of them (values
// below 1 mean DefaultMaxDepth). Within the limit the diff is added as one
// more layer; past it, every snapshot layer is merged with the diff into
// one, so the chain drops back to depth 1 and the next maxDepth-1
// snapshots are plain appends again. Squashing all of them (rather than
// only the top few) keeps the rule simple and the merged layer the only
// one a long chain carries.
func Decide(parentDiffs, maxDepth int) Layout {
	if maxDepth < 1 {
		maxDepth = DefaultMaxDepth
	}
	if parentDiffs+1 <= maxDepth {
		return Layout{Keep: parentDiffs}
	}
	return Layout{Keep: 0, Squash: parentDiffs}
}
