package envsnapshot

// DefaultMaxDepth is how many snapshot layers an image may carry above
// its original image before they are squashed into one. Each layer is one
// more overlayfs lower directory and one more lazy mount for every fork;
// eight keeps a chain of branchings cheap to mount while a squash (which
// reads every snapshot layer) stays rare.
const DefaultMaxDepth = 8

// Layout says what a new snapshot's image holds above the original image.
type Layout struct {
	// Keep is how many of the parent's snapshot layers stay as they are
	// in the image pushed first.
	Keep int
	// Squash is how many of the parent's snapshot layers are merged with
	// the new diff into one layer; 0 means no squash.
	Squash int
	// Background: the image pushed first keeps every parent layer plus
	// the diff (Keep == the parent's count, one layer over the limit),
	// and the squash follows off the snapshot's path, re-tagging the
	// reference when done. Otherwise a squash happens before the push.
	Background bool
}

// Decide places a new diff on top of an image that already carries
// parentDiffs snapshot layers, allowing maxDepth of them (values below 1
// mean DefaultMaxDepth):
//
//   - within the limit the diff is added as one more layer;
//   - when it would go one over, the diff is still added (the snapshot is
//     usable at once) and every snapshot layer plus the diff is squashed
//     into one in the background, which brings the chain back to depth 1;
//   - a parent already over the limit (its own background squash never
//     finished, or it was forked before the squash re-tagged it) is
//     squashed before the push, so no image carries more than
//     maxDepth+1 snapshot layers.
//
// Squashing all of them (rather than only the top few) keeps the rule
// simple and the merged layer the only one a long chain carries.
func Decide(parentDiffs, maxDepth int) Layout {
	if maxDepth < 1 {
		maxDepth = DefaultMaxDepth
	}
	switch {
	case parentDiffs+1 <= maxDepth:
		return Layout{Keep: parentDiffs}
	case parentDiffs+1 == maxDepth+1:
		return Layout{Keep: parentDiffs, Squash: parentDiffs, Background: true}
	}
	return Layout{Keep: 0, Squash: parentDiffs}
}
