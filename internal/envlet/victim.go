package envlet

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// VictimKey is one criterion of a VictimPolicy.
type VictimKey string

const (
	// VictimLowestPriority fails lower Priority first.
	VictimLowestPriority VictimKey = "priority"
	// VictimYoungest fails the most recently admitted first: it has lost
	// the least work.
	VictimYoungest VictimKey = "youngest"
	// VictimOldest fails the earliest admitted first.
	VictimOldest VictimKey = "oldest"
	// VictimLargest fails the largest memory user first: fewest failures
	// per byte freed.
	VictimLargest VictimKey = "largest"
)

// VictimPolicy orders environments for failure when promised memory is
// really needed and the node cannot supply it: the first key decides, the
// next breaks its ties, the environment id breaks the rest (so the choice
// is deterministic).
type VictimPolicy []VictimKey

// DefaultVictimPolicy fails the lowest priority first and, among equals,
// the youngest: an RL framework resamples a failed episode, and the
// youngest has the least progress to lose.
var DefaultVictimPolicy = VictimPolicy{VictimLowestPriority, VictimYoungest}

// ParseVictimPolicy parses "priority,youngest".
func ParseVictimPolicy(s string) (VictimPolicy, error) {
	var p VictimPolicy
	for _, f := range strings.Split(s, ",") {
		k := VictimKey(strings.TrimSpace(f))
		switch k {
		case VictimLowestPriority, VictimYoungest, VictimOldest, VictimLargest:
			p = append(p, k)
		default:
			return nil, fmt.Errorf("victim policy %q: unknown key %q (want priority, youngest, oldest, largest)", s, f)
		}
	}
	return p, nil
}

func (p VictimPolicy) String() string {
	keys := make([]string, len(p))
	for i, k := range p {
		keys[i] = string(k)
	}
	return strings.Join(keys, ",")
}

// Candidate is an environment as the victim policy sees it.
type Candidate struct {
	Env      string
	Priority int
	Admitted time.Time
	// Frees is the memory failing it gives back (its promised use).
	Frees int64
}

// Order sorts candidates, first victim first.
func (p VictimPolicy) Order(c []Candidate) {
	sort.SliceStable(c, func(i, j int) bool {
		a, b := c[i], c[j]
		for _, k := range p {
			switch k {
			case VictimLowestPriority:
				if a.Priority != b.Priority {
					return a.Priority < b.Priority
				}
			case VictimYoungest:
				if !a.Admitted.Equal(b.Admitted) {
					return a.Admitted.After(b.Admitted)
				}
			case VictimOldest:
				if !a.Admitted.Equal(b.Admitted) {
					return a.Admitted.Before(b.Admitted)
				}
			case VictimLargest:
				if a.Frees != b.Frees {
					return a.Frees > b.Frees
				}
			}
		}
		return a.Env < b.Env
	})
}

// ChooseVictims returns the fewest environments, taken in the policy's
// order, whose failure frees at least excess bytes; candidates that free
// nothing are skipped. It returns all it can when even that is short.
func (p VictimPolicy) ChooseVictims(c []Candidate, excess int64) []string {
	if excess <= 0 {
		return nil
	}
	c = append([]Candidate(nil), c...)
	p.Order(c)
	var out []string
	for _, x := range c {
		if excess <= 0 {
			break
		}
		if x.Frees <= 0 {
			continue
		}
		out = append(out, x.Env)
		excess -= x.Frees
	}
	return out
}
