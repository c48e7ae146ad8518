package layerfmt

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// AnnotationPrefetch, on a layer descriptor, lists the frames of the layer
// that its workload reads, in the order it first reads them, each with
// when, so that a lazy reader can fetch them in a few large requests as
// soon as it mounts the layer, the ones needed first (across all the
// image's layers) first, instead of one round trip per first read.
//
// The value is a comma-separated list of items "FRAMES@MS": FRAMES is a
// frame index into the TOC's frame table, or a run of consecutive indexes
// "first-last"; MS is when the recorded run first read the item's first
// frame, in milliseconds after the layer was mounted ("@MS" may be left
// out: the item is then due with the item before it, or at 0). Example:
// "0-12@35,40@120,13@121,41-60@300". It is a hint: it changes what is
// fetched when, never what is served (every frame is still verified).
const AnnotationPrefetch = "io.envsnap.layer.prefetch"

// maxPrefetchList bounds an AnnotationPrefetch value: OCI manifests are
// read whole into memory, and no workload hint needs more.
const maxPrefetchList = 1 << 20

// ErrBadPrefetch reports a malformed AnnotationPrefetch value.
var ErrBadPrefetch = errors.New("malformed prefetch list")

// PrefetchEntry is one frame of a prefetch list and when it was first read
// (milliseconds after the mount).
type PrefetchEntry struct {
	Frame int
	AtMS  int64
}

// FormatPrefetch encodes entries (in order) as an AnnotationPrefetch value.
// Consecutive frames first read within a few milliseconds after the first
// of them share an item, due at the first one's time (never later than
// recorded).
func FormatPrefetch(entries []PrefetchEntry) string {
	const sameRun = 10 // ms
	var b strings.Builder
	for i := 0; i < len(entries); {
		j := i
		for j+1 < len(entries) && entries[j+1].Frame == entries[j].Frame+1 &&
			entries[j+1].AtMS >= entries[i].AtMS && entries[j+1].AtMS-entries[i].AtMS <= sameRun {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(entries[i].Frame))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(entries[j].Frame))
		}
		b.WriteByte('@')
		b.WriteString(strconv.FormatInt(entries[i].AtMS, 10))
		i = j + 1
	}
	return b.String()
}

// ParsePrefetch decodes an AnnotationPrefetch value for a layer of
// numFrames frames. Indexes out of range, repeated indexes and negative
// times are errors: a list that does not fit the layer was made for
// another one.
func ParsePrefetch(s string, numFrames int) ([]PrefetchEntry, error) {
	if s == "" {
		return nil, nil
	}
	if len(s) > maxPrefetchList {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrBadPrefetch, len(s), maxPrefetchList)
	}
	seen := make([]bool, numFrames)
	var out []PrefetchEntry
	var at int64
	for _, item := range strings.Split(s, ",") {
		frames, ms, timed := strings.Cut(item, "@")
		if timed {
			v, err := strconv.ParseInt(ms, 10, 64)
			if err != nil || v < 0 || strconv.FormatInt(v, 10) != ms {
				return nil, fmt.Errorf("%w: %q has no valid time", ErrBadPrefetch, item)
			}
			at = v
		}
		lo, hi, isRange := strings.Cut(frames, "-")
		first, err := strconv.Atoi(lo)
		if err != nil || strconv.Itoa(first) != lo {
			return nil, fmt.Errorf("%w: %q is not a frame index", ErrBadPrefetch, item)
		}
		last := first
		if isRange {
			if last, err = strconv.Atoi(hi); err != nil || strconv.Itoa(last) != hi || last <= first {
				return nil, fmt.Errorf("%w: %q is not a run of frames", ErrBadPrefetch, item)
			}
		}
		if first < 0 || last >= numFrames {
			return nil, fmt.Errorf("%w: %q outside the layer's %d frames", ErrBadPrefetch, item, numFrames)
		}
		for k := first; k <= last; k++ {
			if seen[k] {
				return nil, fmt.Errorf("%w: frame %d listed twice", ErrBadPrefetch, k)
			}
			seen[k] = true
			out = append(out, PrefetchEntry{Frame: k, AtMS: at})
		}
	}
	return out, nil
}
