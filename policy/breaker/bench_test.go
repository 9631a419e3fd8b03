package breaker

import (
	"runtime"
	"testing"
	"time"
)

// benchBreaker returns a CLOSED breaker that never opens under successes.
func benchBreaker(tb testing.TB, kind WindowType, size int) *Breaker {
	tb.Helper()
	cfg := Defaults()
	cfg.WindowType = kind
	cfg.WindowSize = size
	cfg.MinimumCalls = min(size, 10)
	b, err := New("bench", cfg, t0, WithListener(func(Event) {}))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// TestAdmissionDoesNotAllocate pins the zero-allocation promise of the hot path: Acquire and
// Record in CLOSED, refusals in OPEN and FORCED_OPEN, and a probe round trip in HALF_OPEN.
func TestAdmissionDoesNotAllocate(t *testing.T) {
	tests := []struct {
		name  string
		setup func(b *Breaker)
		op    func(b *Breaker, now time.Time)
	}{
		{
			name:  "closed acquire and record",
			setup: func(*Breaker) {},
			op: func(b *Breaker, now time.Time) {
				p, _ := b.Acquire(now)
				b.Record(p, Success, time.Millisecond, now)
			},
		},
		{
			name:  "closed acquire and record with detail",
			setup: func(*Breaker) {},
			op: func(b *Breaker, now time.Time) {
				p, _ := b.Acquire(now)
				b.RecordDetail(p, Success, time.Millisecond, now, Detail{Status: 200, Provider: "deepseek"})
			},
		},
		{
			name:  "open refusal",
			setup: func(b *Breaker) { _ = b.Transition(Open, t0) },
			op:    func(b *Breaker, now time.Time) { _, _ = b.Acquire(t0) },
		},
		{
			name:  "forced open refusal",
			setup: func(b *Breaker) { _ = b.Transition(ForcedOpen, t0) },
			op:    func(b *Breaker, now time.Time) { _, _ = b.Acquire(now) },
		},
		{
			name:  "half open probe released",
			setup: func(b *Breaker) { _ = b.Transition(Open, t0); _ = b.Transition(HalfOpen, t0) },
			op: func(b *Breaker, now time.Time) {
				p, _ := b.Acquire(t0)
				b.Release(p)
			},
		},
		{
			name:  "transition with a listener",
			setup: func(*Breaker) {},
			op:    func(b *Breaker, now time.Time) { _ = b.Transition(Closed, now) },
		},
	}
	for _, tc := range tests {
		for _, kind := range []WindowType{CountBased, TimeBased} {
			t.Run(tc.name+" "+kind.String(), func(t *testing.T) {
				b := benchBreaker(t, kind, 100)
				tc.setup(b)
				i := 0
				allocs := testing.AllocsPerRun(1000, func() {
					i++
					tc.op(b, t0.Add(time.Duration(i)*time.Millisecond))
				})
				if allocs != 0 {
					t.Fatalf("%v allocations per operation, want 0", allocs)
				}
			})
		}
	}
}

func BenchmarkAcquireRecordClosed(b *testing.B) {
	for _, kind := range []WindowType{CountBased, TimeBased} {
		b.Run(kind.String(), func(b *testing.B) {
			br := benchBreaker(b, kind, 100)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				i++
				now := t0.Add(time.Duration(i) * time.Microsecond)
				p, err := br.Acquire(now)
				if err != nil {
					b.Fatal(err)
				}
				br.Record(p, Success, time.Millisecond, now)
			}
		})
	}
}

// contended runs op from 64 goroutines whatever GOMAXPROCS is.
func contended(b *testing.B, op func()) {
	b.SetParallelism((64 + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			op()
		}
	})
}

func BenchmarkAcquireRecordClosedContended64(b *testing.B) {
	for _, kind := range []WindowType{CountBased, TimeBased} {
		b.Run(kind.String(), func(b *testing.B) {
			br := benchBreaker(b, kind, 100)
			contended(b, func() {
				p, err := br.Acquire(t0)
				if err != nil {
					b.Error(err)
					return
				}
				br.Record(p, Success, time.Millisecond, t0)
			})
		})
	}
}

func BenchmarkAcquireOpen(b *testing.B) {
	br := benchBreaker(b, CountBased, 100)
	if err := br.Transition(Open, t0); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := br.Acquire(t0); err == nil {
			b.Fatal("permitted while OPEN")
		}
	}
}

func BenchmarkAcquireOpenContended64(b *testing.B) {
	br := benchBreaker(b, CountBased, 100)
	if err := br.Transition(Open, t0); err != nil {
		b.Fatal(err)
	}
	contended(b, func() { _, _ = br.Acquire(t0) })
}

func BenchmarkSnapshot(b *testing.B) {
	br := benchBreaker(b, TimeBased, 60)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		br.Snapshot(t0.Add(time.Duration(i) * time.Millisecond))
	}
}
