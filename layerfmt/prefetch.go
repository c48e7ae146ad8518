package layerfmt

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// AnnotationPrefetch, on a layer descriptor, lists the frames of the layer
// that its workload reads, in the order it first reads them, so that a
// lazy reader can fetch them in a few large requests as soon as it mounts
// the layer instead of one round trip per first read. The value is a
// comma-separated list of frame indexes into the TOC's frame table, with
// runs of consecutive indexes written "first-last": "0-12,40,13,41-60".
// It is a hint: it changes what is fetched when, never what is served
// (every frame is still verified against its digest).
const AnnotationPrefetch = "io.envsnap.layer.prefetch"

// maxPrefetchList bounds an AnnotationPrefetch value: OCI manifests are
// read whole into memory, and no workload hint needs more.
const maxPrefetchList = 1 << 20

// ErrBadPrefetch reports a malformed AnnotationPrefetch value.
var ErrBadPrefetch = errors.New("malformed prefetch list")

// FormatFrameList encodes frames (in order) as an AnnotationPrefetch value.
func FormatFrameList(frames []int) string {
	var b strings.Builder
	for i := 0; i < len(frames); {
		j := i
		for j+1 < len(frames) && frames[j+1] == frames[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(frames[i]))
		if j > i {
			b.WriteByte('-')
			b.WriteString(strconv.Itoa(frames[j]))
		}
		i = j + 1
	}
	return b.String()
}

// ParseFrameList decodes an AnnotationPrefetch value for a layer of
// numFrames frames. Indexes out of range and repeated indexes are errors:
// a list that does not fit the layer was made for another one.
func ParseFrameList(s string, numFrames int) ([]int, error) {
	if s == "" {
		return nil, nil
	}
	if len(s) > maxPrefetchList {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrBadPrefetch, len(s), maxPrefetchList)
	}
	seen := make([]bool, numFrames)
	var out []int
	for _, item := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(item, "-")
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
			out = append(out, k)
		}
	}
	return out, nil
}
