package bench

import (
	"math"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	ms := func(ns ...int) []time.Duration {
		out := make([]time.Duration, len(ns))
		for i, n := range ns {
			out[i] = time.Duration(n) * time.Millisecond
		}
		return out
	}
	tests := []struct {
		name   string
		sorted []time.Duration
		q      float64
		want   time.Duration
	}{
		{"empty", nil, 0.5, 0},
		{"one sample is every percentile", ms(7), 0.99, 7 * time.Millisecond},
		{"median of four is the second (nearest rank)", ms(1, 2, 3, 4), 0.5, 2 * time.Millisecond},
		{"median of five", ms(1, 2, 3, 4, 5), 0.5, 3 * time.Millisecond},
		{"p99 of 100 is the 99th", ms(seq(100)...), 0.99, 99 * time.Millisecond},
		{"p99 of 1000 is the 990th", ms(seq(1000)...), 0.99, 990 * time.Millisecond},
		{"p0 is the minimum", ms(3, 4, 5), 0, 3 * time.Millisecond},
		{"p100 is the maximum", ms(3, 4, 5), 1, 5 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Percentile(tt.sorted, tt.q); got != tt.want {
				t.Errorf("Percentile(%v) = %v, want %v", tt.q, got, tt.want)
			}
		})
	}
}

// seq returns 1..n.
func seq(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i + 1
	}
	return out
}

func TestSummarize(t *testing.T) {
	tests := []struct {
		name string
		in   []float64
		want Spread
	}{
		{"empty", nil, Spread{}},
		{"odd count, unsorted", []float64{5, 1, 3}, Spread{Median: 3, Min: 1, Max: 5, N: 3}},
		{"even count averages the middle two", []float64{4, 1, 3, 2}, Spread{Median: 2.5, Min: 1, Max: 4, N: 4}},
		{"NaN is ignored", []float64{math.NaN(), 2, 4}, Spread{Median: 3, Min: 2, Max: 4, N: 2}},
		{"only NaN", []float64{math.NaN()}, Spread{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Summarize(tt.in); got != tt.want {
				t.Errorf("Summarize(%v) = %+v, want %+v", tt.in, got, tt.want)
			}
		})
	}
}

func TestRatiosAndDifferences(t *testing.T) {
	// Given two runs per repetition, paired by index.
	bulkhead := []float64{900, 1000, 0}
	noop := []float64{1000, 1000, 0}

	r := Ratios(bulkhead, noop)
	if r[0] != 0.9 || r[1] != 1 || !math.IsNaN(r[2]) {
		t.Errorf("Ratios = %v, want [0.9 1 NaN]", r)
	}
	if s := Summarize(r); s.Median != 0.95 || s.N != 2 {
		t.Errorf("Summarize(Ratios) = %+v, want median 0.95 over 2", s)
	}
	if d := Differences([]float64{10, 7}, []float64{4, 9, 100}); len(d) != 2 || d[0] != 6 || d[1] != -2 {
		t.Errorf("Differences = %v, want [6 -2] (shorter input wins)", d)
	}
}
