// Package throttle bounds how often a log line of one kind is written: a storm of the same event
// (refusals by a breaker, a provider reporting absurd usage, a collector that is down) writes one
// line per interval, and the next line says how many were held back in between, so that the
// log stays readable and nothing goes uncounted. The metrics count every event; the log shows
// that it happens, and an example.
package throttle

import (
	"sync"
	"sync/atomic"
	"time"
)

// Gate lets one line of its kind through per interval and counts the ones it holds back. The
// zero value is ready: no line has gone through yet. Safe for concurrent use: of callers racing
// for the same interval exactly one gets through, and every line held back is counted in the
// next line let through. A line inside the interval is held back without a lock; only the calls
// that may start a new interval take one.
type Gate struct {
	mu   sync.Mutex
	last atomic.Int64 // Unix nanoseconds of the last line let through; 0 for none yet
	held atomic.Uint64
}

// Allow reports whether a line may be written at now, at most one per every, and if so how many
// were held back since the last one. now comes from the caller's clock; a clock that steps back
// holds lines back until it passes the last one's time by every again.
func (g *Gate) Allow(now time.Time, every time.Duration) (ok bool, held uint64) {
	n := now.UnixNano()
	within := func() bool {
		last := g.last.Load()
		return last != 0 && n-last < int64(every)
	}
	if within() {
		g.held.Add(1)
		return false, 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if within() {
		g.held.Add(1)
		return false, 0
	}
	// What was held back belongs to the interval now over: take it before the new interval
	// starts, so that a line held back against the new one is counted in the next report.
	held = g.held.Swap(0)
	g.last.Store(n)
	return true, held
}
