// Package stall measures how long this process could not run: a CPU-throttled container, a
// machine short of CPU, a long garbage collection pause. While the process is stalled nothing
// it times moves on, and what happened meanwhile (a first token reaching the socket) is
// processed only when the stall ends, as if it had just happened: waits and latencies measured
// across a stall are inflated by it. Adaptive limits subtract the stalled time the meter
// reports from the waits they judge.
//
// A Meter wakes every Tick on a ticker; a wake-up later than Tick after the one before it by
// more than Threshold means the process was stalled for that lateness beyond Threshold (the
// part of a stall that fell within the sleep cannot be seen, so a stall is under-counted by at
// most Tick + Threshold). The meter adds it to a cumulative total, and Stalled also counts a
// stall still in progress, or one that ended before the meter's own goroutine ran again: a
// reading taken just after a stall includes it whichever goroutine the scheduler runs first.
//
// Imports: only the standard library. Imported by: package policy (the engine runs one meter
// while some compartment has an adaptive limit).
package stall

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// Tick is how often the meter wakes. A wake-up of an otherwise idle process costs about
	// 0.15ms of CPU (the runtime wakes its threads and its monitor), so a meter costs under 1%
	// of one core in an idle process, and its goroutine's few microseconds in a busy one
	// (BenchmarkMeterCPU); a stall is under-counted by at most Tick + Threshold.
	Tick = 25 * time.Millisecond
	// Threshold is the lateness of a wake-up that is scheduling jitter, not a stall.
	Threshold = 5 * time.Millisecond
)

// idle is Meter.last while the meter does not run: no stall is in progress then.
const idle = -1 << 62

// Meter measures the process's stalls while it runs (Start to Stop). Safe for concurrent use;
// reading it takes no lock.
type Meter struct {
	now       func() time.Time
	newTicker func(time.Duration) (<-chan time.Time, func())
	// origin is the reference of last: readings of a clock with a monotonic part stay
	// monotonic in nanoseconds since origin.
	origin time.Time

	// seq is odd while the meter writes last and total: readers retry (a sequence lock, so
	// that the pair is read consistently without a lock).
	seq atomic.Uint64
	// last is the latest wake-up, in nanoseconds since origin (idle while stopped); total the
	// stalled nanoseconds recorded.
	last, total atomic.Int64

	// mu serialises Start and Stop; running lets Start return without it.
	mu         sync.Mutex
	running    atomic.Bool
	stop, done chan struct{}
}

// New returns a meter of the process's stalls on the system clock. It does not run until
// Start.
func New() *Meter {
	return NewWith(time.Now, func(d time.Duration) (<-chan time.Time, func()) {
		t := time.NewTicker(d)
		return t.C, t.Stop
	})
}

// NewWith returns a meter reading the time from now and waking on the ticks of the tickers
// newTicker makes (a channel and its stop function), for tests.
func NewWith(now func() time.Time, newTicker func(time.Duration) (<-chan time.Time, func())) *Meter {
	m := &Meter{now: now, newTicker: newTicker, origin: now()}
	m.last.Store(idle)
	return m
}

// Start starts measuring, in a goroutine of its own; it does nothing when the meter runs. It
// costs an atomic load when the meter runs already.
func (m *Meter) Start() {
	if m.running.Load() {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.running.Load() {
		return
	}
	ticks, stopTicker := m.newTicker(Tick)
	m.stop, m.done = make(chan struct{}), make(chan struct{})
	m.write(m.now().Sub(m.origin), m.total.Load())
	m.running.Store(true)
	go m.run(ticks, stopTicker, m.stop, m.done)
}

// Stop stops measuring and waits for the meter's goroutine to end. The total is kept, and a
// later Start adds to it.
func (m *Meter) Stop() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.running.Load() {
		return
	}
	close(m.stop)
	<-m.done
	m.write(idle, m.total.Load())
	m.running.Store(false)
}

func (m *Meter) run(ticks <-chan time.Time, stopTicker func(), stop, done chan struct{}) {
	defer close(done)
	defer stopTicker()
	for {
		select {
		case <-stop:
			return
		case <-ticks:
			m.record(m.now().Sub(m.origin))
		}
	}
}

// record takes a wake-up at n (nanoseconds since origin): its lateness beyond Threshold is
// stalled time.
func (m *Meter) record(n time.Duration) {
	total := m.total.Load()
	if late := n - time.Duration(m.last.Load()) - Tick; late > Threshold {
		total += int64(late - Threshold)
	}
	m.write(n, total)
}

// write stores last and total under the sequence lock (only the meter's goroutine, or Start
// and Stop while it does not run, write).
func (m *Meter) write(last time.Duration, total int64) {
	m.seq.Add(1)
	m.last.Store(int64(last))
	m.total.Store(total)
	m.seq.Add(1)
}

// Stalled returns the process's stalled time up to now (a reading of the meter's clock): the
// total recorded, plus the stall in progress when the meter is overdue by more than Threshold.
// While the meter runs, readings at later times never decrease.
func (m *Meter) Stalled(now time.Time) time.Duration {
	for {
		s := m.seq.Load()
		if s&1 != 0 {
			runtime.Gosched()
			continue
		}
		last, total := m.last.Load(), m.total.Load()
		if m.seq.Load() != s {
			continue
		}
		if last == idle {
			return time.Duration(total)
		}
		pending := now.Sub(m.origin) - time.Duration(last) - Tick - Threshold
		return time.Duration(total) + max(pending, 0)
	}
}

// Total returns the stalled time recorded so far (a stall in progress not included).
func (m *Meter) Total() time.Duration { return time.Duration(m.total.Load()) }
