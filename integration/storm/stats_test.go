package storm

import (
	"math"
	"slices"
	"testing"
)

func TestPercentile(t *testing.T) {
	five := []float64{5, 1, 4, 2, 3}
	tests := []struct {
		name string
		xs   []float64
		p    float64
		want float64
		ok   bool
	}{
		{"median of an odd sample", five, 50, 3, true},
		{"minimum", five, 0, 1, true},
		{"maximum", five, 100, 5, true},
		{"interpolated between ranks", five, 90, 4.6, true},
		{"P99 of five", five, 99, 4.96, true},
		{"median of an even sample", []float64{1, 2, 3, 4}, 50, 2.5, true},
		{"single value", []float64{7}, 99, 7, true},
		{"ties", []float64{2, 2, 2, 9}, 50, 2, true},
		{"empty sample", nil, 50, 0, false},
		{"below range", five, -1, 0, false},
		{"above range", five, 100.5, 0, false},
		{"not a number", five, math.NaN(), 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := slices.Clone(tt.xs)
			got, ok := Percentile(tt.xs, tt.p)
			if ok != tt.ok || math.Abs(got-tt.want) > 1e-9 {
				t.Fatalf("Percentile(%v, %v) = %v, %v; want %v, %v", tt.xs, tt.p, got, ok, tt.want, tt.ok)
			}
			if !slices.Equal(before, tt.xs) {
				t.Fatalf("Percentile reordered its input: %v", tt.xs)
			}
		})
	}
}

// The P99 of 100 values 1..100 sits between the 99th and the 100th: rank 0.99 × 99 = 98.01.
func TestPercentileOfHundred(t *testing.T) {
	xs := make([]float64, 100)
	for i := range xs {
		xs[i] = float64(100 - i)
	}
	got, _ := Percentile(xs, 99)
	if math.Abs(got-99.01) > 1e-9 {
		t.Fatalf("P99 = %v, want 99.01", got)
	}
}

func TestSummarize(t *testing.T) {
	tests := []struct {
		name string
		xs   []float64
		want Stat
	}{
		{"empty", nil, Stat{}},
		{"one run", []float64{1.5}, Stat{Median: 1.5, Min: 1.5, Max: 1.5, N: 1}},
		{"three runs", []float64{3, 1, 2}, Stat{Median: 2, Min: 1, Max: 3, N: 3}},
		{"four runs take the middle mean", []float64{4, 1, 3, 2}, Stat{Median: 2.5, Min: 1, Max: 4, N: 4}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Summarize(tt.xs); got != tt.want {
				t.Fatalf("Summarize(%v) = %+v, want %+v", tt.xs, got, tt.want)
			}
		})
	}
}

func TestSummarizeOptSkipsMissingValues(t *testing.T) {
	one, three := 1.0, 3.0
	got := summarizeOpt([]*float64{nil, &three, nil, &one})
	if want := (Stat{Median: 2, Min: 1, Max: 3, N: 2}); got != want {
		t.Fatalf("summarizeOpt = %+v, want %+v", got, want)
	}
	if got := summarizeOpt([]*float64{nil}); got.N != 0 {
		t.Fatalf("no values: N = %d, want 0", got.N)
	}
}
