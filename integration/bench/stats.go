package bench

import (
	"math"
	"slices"
	"time"
)

// Percentile returns the q-quantile (0 ≤ q ≤ 1) of sorted by the nearest-rank method: the
// smallest value with at least q of the samples at or below it. It returns 0 for no samples.
// sorted must be in ascending order.
func Percentile(sorted []time.Duration, q float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(q * float64(n)))
	return sorted[min(max(rank, 1), n)-1]
}

// Spread summarises repeated measurements of one quantity: the median, and the smallest and
// largest values, so a reader sees how much a noisy machine moved the result.
type Spread struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	N      int     `json:"n"`
}

// Summarize returns the median and range of xs; NaN values are ignored. An empty input gives
// a zero Spread.
func Summarize(xs []float64) Spread {
	v := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return Spread{}
	}
	slices.Sort(v)
	n := len(v)
	med := v[n/2]
	if n%2 == 0 {
		med = (v[n/2-1] + v[n/2]) / 2
	}
	return Spread{Median: med, Min: v[0], Max: v[n-1], N: n}
}

// Ratios divides a[i] by b[i] pairwise: the runs of a pair ran next to each other, so their
// ratio is less disturbed by the machine's changing load than a ratio of medians. A zero
// divisor gives NaN, which Summarize ignores.
func Ratios(a, b []float64) []float64 {
	out := make([]float64, min(len(a), len(b)))
	for i := range out {
		if b[i] == 0 {
			out[i] = math.NaN()
			continue
		}
		out[i] = a[i] / b[i]
	}
	return out
}

// Differences returns a[i] − b[i] pairwise.
func Differences(a, b []float64) []float64 {
	out := make([]float64, min(len(a), len(b)))
	for i := range out {
		out[i] = a[i] - b[i]
	}
	return out
}

// micros converts a duration to microseconds as a float, the unit of the latency tables.
func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
