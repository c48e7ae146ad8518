package headline

import (
	"math"
	"sort"
	"time"
)

// Summary is the distribution of one measure over environments.
type Summary struct {
	N      int     `json:"n"`
	Median float64 `json:"median"`
	P95    float64 `json:"p95"`
	Max    float64 `json:"max"`
}

// summarize uses the nearest-rank percentile: with 16 samples P95 is the
// 16th value, the worst; no interpolation invents a value nobody saw.
func summarize(xs []float64) Summary {
	if len(xs) == 0 {
		return Summary{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	rank := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return Summary{N: len(s), Median: rank(0.5), P95: rank(0.95), Max: s[len(s)-1]}
}

func seconds(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = d.Seconds()
	}
	return out
}

// median is the middle value of xs, the mean of the two middle ones for
// an even count: Summary.Median's nearest rank would take the lower of
// two rounds' ratios, which flatters whichever system it favours.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
