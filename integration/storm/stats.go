package storm

import (
	"math"
	"slices"
	"sort"
)

// Percentile returns the p-th percentile (0 ≤ p ≤ 100) of xs by linear interpolation between
// the closest ranks (the "type 7" definition of R and NumPy): the value at rank p/100 × (n−1)
// of the sorted sample. ok is false for an empty sample or a p outside [0, 100]. xs is not
// modified.
func Percentile(xs []float64, p float64) (v float64, ok bool) {
	if len(xs) == 0 || !(p >= 0 && p <= 100) {
		return 0, false
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	return percentileSorted(s, p), true
}

// percentileSorted is Percentile for a sorted, non-empty sample.
func percentileSorted(s []float64, p float64) float64 {
	rank := p / 100 * float64(len(s)-1)
	lo := int(math.Floor(rank))
	hi := int(math.Ceil(rank))
	if lo == hi {
		return s[lo]
	}
	return s[lo] + (rank-float64(lo))*(s[hi]-s[lo])
}

// Stat summarises one number over the repetitions of a configuration: the median and the
// spread. N counts the repetitions that had the number at all (a batch P99 needs a finished
// document); with N zero the other fields are meaningless.
type Stat struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	N      int     `json:"n"`
}

// Summarize returns the median (the mean of the middle two for an even count) and the range
// of xs.
func Summarize(xs []float64) Stat {
	if len(xs) == 0 {
		return Stat{}
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	return Stat{Median: percentileSorted(s, 50), Min: s[0], Max: s[len(s)-1], N: len(s)}
}

// summarizeOpt summarises the present values of xs.
func summarizeOpt(xs []*float64) Stat {
	var vs []float64
	for _, x := range xs {
		if x != nil {
			vs = append(vs, *x)
		}
	}
	return Summarize(vs)
}

// percentileOpt is Percentile returning nil for an empty sample.
func percentileOpt(xs []float64, p float64) *float64 {
	v, ok := Percentile(xs, p)
	if !ok {
		return nil
	}
	return &v
}
