package modelstub

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"time"
)

// Think is the distribution of the model's time per answer (time to the
// last token). Lognormal by default: most turns are short, a few long
// ones gate the rollout, as generation lengths do.
type Think struct {
	Median time.Duration
	// P95 sets the spread (lognormal sigma = ln(P95/Median)/1.645);
	// equal to Median, or Fixed, makes every answer take Median.
	P95   time.Duration
	Fixed bool
	// Max caps one draw: the tail of a lognormal is unbounded and one
	// answer of many minutes would stand for a model that timed out.
	Max  time.Duration
	Seed uint64
}

// DefaultThink is the setting: median 6 s, p95 20 s.
var DefaultThink = Think{Median: 6 * time.Second, P95: 20 * time.Second, Max: 2 * time.Minute, Seed: 1}

// z95 is the standard normal's 95th percentile.
const z95 = 1.6448536269514722

// Validate says what is wrong with t.
func (t Think) Validate() error {
	if t.Median < 0 || t.P95 < 0 || t.Max < 0 {
		return fmt.Errorf("think time: negative duration in %+v", t)
	}
	if !t.Fixed && t.P95 < t.Median {
		return fmt.Errorf("think time: p95 %s below the median %s", t.P95, t.Median)
	}
	return nil
}

// Draw is the think time of turn of the rollout sample: a pure function
// of the seed, the sample and the turn, so every system in a run sees the
// same model (the same think times for the same rollout).
func (t Think) Draw(sample string, turn int) time.Duration {
	if t.Fixed || t.P95 <= t.Median || t.Median == 0 {
		return t.Median
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d", sample, turn)
	r := rand.New(rand.NewPCG(t.Seed, h.Sum64()))
	sigma := math.Log(float64(t.P95)/float64(t.Median)) / z95
	d := time.Duration(float64(t.Median) * math.Exp(sigma*r.NormFloat64()))
	if t.Max > 0 && d > t.Max {
		d = t.Max
	}
	return d
}
