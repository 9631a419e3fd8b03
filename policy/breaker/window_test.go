package breaker

import (
	"testing"
	"time"
)

// windowStep records one outcome (or only reads, when read is set) at a given offset and checks
// what the window then holds.
type windowStep struct {
	at   time.Duration // since the window's second 0
	bits uint8
	read bool
	want totals
}

func runWindow(t *testing.T, w *window, steps []windowStep) {
	t.Helper()
	for i, s := range steps {
		sec := int64(s.at / time.Second)
		if !s.read {
			w.record(s.bits, sec)
		}
		if got := w.totalsAt(sec); got != s.want {
			t.Fatalf("step %d at %v: totals %+v, want %+v", i, s.at, got, s.want)
		}
	}
}

const (
	ok       = uint8(0)
	fail     = bitFailed
	slowOK   = bitSlow
	slowFail = bitSlow | bitFailed
)

// TestTimeWindow ports Resilience4j's SlidingTimeWindowMetricsTest (window of 5 seconds).
func TestTimeWindow(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name  string
		steps []windowStep
	}{
		{
			name: "calls expire second by second",
			steps: []windowStep{
				{at: 0, bits: fail, want: totals{calls: 1, failed: 1}},
				{at: 100 * ms, bits: ok, want: totals{calls: 2, failed: 1}},
				{at: 200 * ms, bits: ok, want: totals{calls: 3, failed: 1}},
				{at: 1200 * ms, bits: ok, want: totals{calls: 4, failed: 1}},
				{at: 2200 * ms, bits: ok, want: totals{calls: 5, failed: 1}},
				{at: 3200 * ms, bits: fail, want: totals{calls: 6, failed: 2}},
				{at: 4200 * ms, bits: ok, want: totals{calls: 7, failed: 2}},
				{at: 5200 * ms, bits: ok, want: totals{calls: 5, failed: 1}}, // second 0 (3 calls) left
				{at: 6200 * ms, bits: ok, want: totals{calls: 5, failed: 1}},
				{at: 11200 * ms, bits: ok, want: totals{calls: 1}},
			},
		},
		{
			name: "a quiet window empties and refills",
			steps: []windowStep{
				{at: 0, bits: fail, want: totals{calls: 1, failed: 1}},
				{at: 100 * ms, bits: ok, want: totals{calls: 2, failed: 1}},
				{at: 800 * ms, bits: slowFail, want: totals{calls: 3, failed: 2, slow: 1, slowFailed: 1}},
				{at: 4800 * ms, read: true, want: totals{calls: 3, failed: 2, slow: 1, slowFailed: 1}},
				{at: 5800 * ms, read: true, want: totals{}},
				{at: 5900 * ms, bits: ok, want: totals{calls: 1}},
				{at: 10900 * ms, bits: ok, want: totals{calls: 1}},
			},
		},
		{
			name: "slow calls are counted whether they failed or not",
			steps: []windowStep{
				{at: 0, bits: slowOK, want: totals{calls: 1, slow: 1}},
				{at: 0, bits: slowFail, want: totals{calls: 2, failed: 1, slow: 2, slowFailed: 1}},
				{at: 0, bits: ok, want: totals{calls: 3, failed: 1, slow: 2, slowFailed: 1}},
				{at: 0, bits: ok, want: totals{calls: 4, failed: 1, slow: 2, slowFailed: 1}},
				{at: 0, bits: ok, want: totals{calls: 5, failed: 1, slow: 2, slowFailed: 1}},
			},
		},
		{
			name: "a second in the past is treated as the current second",
			steps: []windowStep{
				{at: 5 * time.Second, bits: fail, want: totals{calls: 1, failed: 1}},
				{at: 2 * time.Second, bits: ok, want: totals{calls: 2, failed: 1}},
				{at: 9 * time.Second, read: true, want: totals{calls: 2, failed: 1}},
				{at: 10 * time.Second, read: true, want: totals{}},
			},
		},
		{
			name: "a jump far ahead clears every bucket once",
			steps: []windowStep{
				{at: 0, bits: fail, want: totals{calls: 1, failed: 1}},
				{at: 4 * time.Second, bits: fail, want: totals{calls: 2, failed: 2}},
				{at: 1000 * time.Hour, bits: ok, want: totals{calls: 1}},
				{at: 1000*time.Hour + 4*time.Second, bits: ok, want: totals{calls: 2}},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWindow(TimeBased, 5, 0)
			runWindow(t, &w, tc.steps)
		})
	}
}

func TestRates(t *testing.T) {
	tests := []struct {
		name             string
		t                totals
		minimum          int
		wantFail, wantSl float64
	}{
		{name: "no calls", t: totals{}, minimum: 1, wantFail: -1, wantSl: -1},
		{name: "below minimum", t: totals{calls: 4, failed: 4}, minimum: 5, wantFail: -1, wantSl: -1},
		{name: "at minimum", t: totals{calls: 5, failed: 1, slow: 2}, minimum: 5, wantFail: 20, wantSl: 40},
		{name: "a third", t: totals{calls: 3, failed: 1}, minimum: 1, wantFail: 100.0 / 3, wantSl: 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, s := tc.t.rates(tc.minimum)
			if f != tc.wantFail || s != tc.wantSl {
				t.Fatalf("rates = %v, %v; want %v, %v", f, s, tc.wantFail, tc.wantSl)
			}
		})
	}
}

// TestCountWindow ports Resilience4j's FixedSizeSlidingWindowMetricsTest (window of 3 calls).
func TestCountWindow(t *testing.T) {
	tests := []struct {
		name  string
		steps []windowStep
	}{
		{
			name: "the oldest outcome leaves when the window is full",
			steps: []windowStep{
				{bits: fail, want: totals{calls: 1, failed: 1}},
				{bits: ok, want: totals{calls: 2, failed: 1}},
				{bits: slowFail, want: totals{calls: 3, failed: 2, slow: 1, slowFailed: 1}},
				{bits: ok, want: totals{calls: 3, failed: 1, slow: 1, slowFailed: 1}}, // first failure left
				{bits: ok, want: totals{calls: 3, failed: 1, slow: 1, slowFailed: 1}},
				{bits: ok, want: totals{calls: 3}}, // slow failure left
			},
		},
		{
			name: "time does not expire a count window",
			steps: []windowStep{
				{at: 0, bits: fail, want: totals{calls: 1, failed: 1}},
				{at: 1000 * time.Hour, read: true, want: totals{calls: 1, failed: 1}},
			},
		},
		{
			name: "wraps many times",
			steps: func() []windowStep {
				var s []windowStep
				for range 10 {
					s = append(s, windowStep{bits: slowOK, want: totals{calls: min(int64(len(s)+1), 3), slow: min(int64(len(s)+1), 3)}})
				}
				return append(s, windowStep{bits: fail, want: totals{calls: 3, failed: 1, slow: 2}})
			}(),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := newWindow(CountBased, 3, 0)
			runWindow(t, &w, tc.steps)
		})
	}
}

func TestWindowReset(t *testing.T) {
	for _, kind := range []WindowType{CountBased, TimeBased} {
		t.Run(kind.String(), func(t *testing.T) {
			w := newWindow(kind, 4, 0)
			for range 6 {
				w.record(fail, 0)
			}
			w.reset(7)
			if got := w.totalsAt(7); got != (totals{}) {
				t.Fatalf("after reset: %+v, want empty", got)
			}
			w.record(ok, 7)
			w.record(fail, 8)
			if got := w.totalsAt(8); got != (totals{calls: 2, failed: 1}) {
				t.Fatalf("after reset and two calls: %+v", got)
			}
		})
	}
	t.Run("empty window records nothing", func(t *testing.T) {
		w := newWindow(CountBased, 0, 0)
		w.record(fail, 0)
		if got := w.totalsAt(0); got != (totals{}) {
			t.Fatalf("size-0 window holds %+v", got)
		}
	})
}

// TestBucketAlignment checks that TIME_BASED buckets start on wall-clock seconds, as
// Resilience4j's epoch-second buckets do, even when the breaker is created mid-second.
func TestBucketAlignment(t *testing.T) {
	start := t0.Add(900 * time.Millisecond) // 12:00:00.9
	cfg := r4jConfig()
	cfg.WindowSize = 2
	cfg.MinimumCalls = 1
	cfg.FailureRateThreshold = 100
	b, err := New("p", cfg, start)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		at       time.Time
		outcome  Outcome
		buffered int
	}{
		{name: "12:00:00.9 second 0", at: start, outcome: Success, buffered: 1},
		{name: "12:00:01.1 second 1", at: t0.Add(1100 * time.Millisecond), outcome: Success, buffered: 2},
		{name: "12:00:01.95 still second 1", at: t0.Add(1950 * time.Millisecond), outcome: Success, buffered: 3},
		{name: "12:00:02.0 drops second 0", at: t0.Add(2 * time.Second), outcome: Success, buffered: 3},
		{name: "12:00:03.0 drops second 1", at: t0.Add(3 * time.Second), outcome: Success, buffered: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := b.Acquire(tc.at)
			if err != nil {
				t.Fatal(err)
			}
			b.Record(p, tc.outcome, 0, tc.at)
			if got := b.Snapshot(tc.at).BufferedCalls; got != tc.buffered {
				t.Fatalf("BufferedCalls = %d, want %d", got, tc.buffered)
			}
		})
	}
}
