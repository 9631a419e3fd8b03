package stall

import (
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fake is a manual clock and the ticker a meter wakes on: the test says when the process ran
// (the clock) and when the meter's goroutine woke (a tick).
type fake struct {
	base    time.Time
	at      atomic.Int64 // nanoseconds since base
	ticks   chan time.Time
	tickers atomic.Int32 // tickers made and not stopped
}

func newFake() *fake {
	return &fake{base: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), ticks: make(chan time.Time)}
}

func (f *fake) now() time.Time { return f.base.Add(time.Duration(f.at.Load())) }

func (f *fake) advance(d time.Duration) { f.at.Add(int64(d)) }

func (f *fake) newTicker(d time.Duration) (<-chan time.Time, func()) {
	if d != Tick {
		panic("ticker of " + d.String())
	}
	f.tickers.Add(1)
	return f.ticks, func() { f.tickers.Add(-1) }
}

// tick advances the clock by d and wakes the meter, then waits until it has taken the wake-up.
func (f *fake) tick(d time.Duration) {
	f.advance(d)
	f.ticks <- f.now()
	synctest.Wait()
}

// TestMeterCountsLatenessBeyondThreshold: wake-ups on time or late by less than Threshold are
// no stall; a wake-up 300ms late is a stall of 300ms less Threshold. A stall is seen by a
// reading taken before the meter's goroutine runs again, and the reading does not change
// when it does.
func TestMeterCountsLatenessBeyondThreshold(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake()
		m := NewWith(f.now, f.newTicker)
		m.Start()
		f.tick(Tick)
		f.tick(Tick + Threshold - time.Millisecond) // jitter
		f.tick(Tick - 2*time.Millisecond)           // an early tick makes up nothing
		if got := m.Stalled(f.now()); got != 0 {
			t.Fatalf("stalled %v after wake-ups within the threshold, want 0", got)
		}
		// The process stalls: the meter's wake-up, due 10ms after the last, comes 300ms late.
		f.advance(Tick + 300*time.Millisecond)
		want := 300*time.Millisecond - Threshold
		if got := m.Stalled(f.now()); got != want {
			t.Errorf("before the meter ran again: stalled %v, want %v (the stall in progress)", got, want)
		}
		if got := m.Total(); got != 0 {
			t.Errorf("total %v before the meter ran again, want 0", got)
		}
		f.tick(0)
		if got, total := m.Stalled(f.now()), m.Total(); got != want || total != want {
			t.Errorf("after the meter ran: stalled %v, total %v; want both %v", got, total, want)
		}
		f.tick(Tick)
		f.advance(Tick + Threshold) // overdue by exactly the threshold: not yet a stall
		if got := m.Stalled(f.now()); got != want {
			t.Errorf("overdue by the threshold: stalled %v, want %v", got, want)
		}
		f.advance(20 * time.Millisecond)
		if got := m.Stalled(f.now()); got != want+20*time.Millisecond {
			t.Errorf("20ms into a second stall: stalled %v, want %v", got, want+20*time.Millisecond)
		}
		f.tick(0)
		want += 20 * time.Millisecond

		// Stopped, the meter counts nothing, whatever the clock does, and ends its goroutine
		// and its ticker; started again, it adds to the total.
		m.Stop()
		if n := f.tickers.Load(); n != 0 {
			t.Errorf("%d tickers left running after Stop", n)
		}
		f.advance(time.Minute)
		if got := m.Stalled(f.now()); got != want {
			t.Errorf("stopped for a minute: stalled %v, want %v", got, want)
		}
		m.Start()
		m.Start() // running already: nothing more
		f.tick(Tick + 100*time.Millisecond)
		want += 100*time.Millisecond - Threshold
		if got := m.Stalled(f.now()); got != want {
			t.Errorf("after a restart and a stall of 100ms: stalled %v, want %v", got, want)
		}
		m.Stop()
		m.Stop()
	})
}

// TestMeterReadingsNeverDecrease: whatever the order of readings and wake-ups around a stall,
// a reading at a later time is never less than one before it.
func TestMeterReadingsNeverDecrease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake()
		m := NewWith(f.now, f.newTicker)
		m.Start()
		defer m.Stop()
		var prev time.Duration
		for i, step := range []time.Duration{3, 7, 12, 40, 1, 250, 9, 10, 16, 2, 33} {
			f.advance(step * time.Millisecond)
			if got := m.Stalled(f.now()); got < prev {
				t.Fatalf("step %d: reading %v after %v", i, got, prev)
			} else {
				prev = got
			}
			if i%2 == 0 {
				f.tick(0)
			}
		}
		if prev == 0 {
			t.Error("no stall counted")
		}
	})
}

// BenchmarkStalled measures a reading of a running meter, as adaptive limits take three per
// request.
func BenchmarkStalled(b *testing.B) {
	m := New()
	m.Start()
	defer m.Stop()
	now := time.Now()
	var sum time.Duration
	for b.Loop() {
		sum += m.Stalled(now)
	}
	_ = sum
}
