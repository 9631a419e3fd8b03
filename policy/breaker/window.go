package breaker

// Outcome bits of one recorded call. A call can be both failed and slow; it then counts for
// both rates, as in Resilience4j.
const (
	bitFailed uint8 = 1 << iota
	bitSlow
)

// totals aggregates the calls a window currently holds.
type totals struct {
	calls, failed, slow, slowFailed int64
}

func (t *totals) add(bits uint8, k int64) {
	t.calls += k
	if bits&bitFailed != 0 {
		t.failed += k
	}
	if bits&bitSlow != 0 {
		t.slow += k
		if bits&bitFailed != 0 {
			t.slowFailed += k
		}
	}
}

// rates returns the failure and slow-call rates in percent, or −1 for both while fewer than
// minimum calls are buffered: Resilience4j reports −1 rather than a rate computed from too few
// calls to mean anything.
func (t totals) rates(minimum int) (failure, slow float64) {
	if t.calls == 0 || t.calls < int64(minimum) {
		return -1, -1
	}
	return float64(t.failed) * 100 / float64(t.calls), float64(t.slow) * 100 / float64(t.calls)
}

// bucket holds the calls recorded during one second of a TIME_BASED window. uint32 keeps an
// hour-long window at 56 KiB; a single second would need four billion calls to overflow it.
type bucket struct {
	calls, failed, slow, slowFailed uint32
}

// window is a sliding window of call outcomes, COUNT_BASED (a ring of the last size outcomes)
// or TIME_BASED (a ring of size one-second buckets). A window of size 0 holds nothing and is
// never recorded into. It is not safe for concurrent use; the Breaker's mutex guards it.
type window struct {
	kind WindowType
	size int
	sum  totals

	// COUNT_BASED: ring[head] is the next slot to overwrite; filled counts used slots.
	ring   []uint8
	head   int
	filled int

	// TIME_BASED: buckets[cur] holds second curSec; the slots before it (circularly) hold the
	// size−1 previous seconds.
	buckets []bucket
	cur     int
	curSec  int64
}

// newWindow returns an empty window whose current second, for TIME_BASED, is sec.
func newWindow(kind WindowType, size int, sec int64) window {
	w := window{kind: kind, size: size, curSec: sec}
	if size <= 0 {
		w.size = 0
		return w
	}
	if kind == TimeBased {
		w.buckets = make([]bucket, size)
	} else {
		w.ring = make([]uint8, size)
	}
	return w
}

// reset empties the window in place, keeping its memory, and makes sec its current second.
func (w *window) reset(sec int64) {
	clear(w.ring)
	clear(w.buckets)
	w.sum = totals{}
	w.head, w.filled, w.cur, w.curSec = 0, 0, 0, sec
}

// record adds one call outcome at second sec (ignored by COUNT_BASED windows).
func (w *window) record(bits uint8, sec int64) {
	if w.size == 0 {
		return
	}
	if w.kind == TimeBased {
		w.slide(sec)
		b := &w.buckets[w.cur]
		b.calls++
		if bits&bitFailed != 0 {
			b.failed++
		}
		if bits&bitSlow != 0 {
			b.slow++
			if bits&bitFailed != 0 {
				b.slowFailed++
			}
		}
		w.sum.add(bits, 1)
		return
	}
	if w.filled == w.size {
		w.sum.add(w.ring[w.head], -1)
	} else {
		w.filled++
	}
	w.ring[w.head] = bits
	w.sum.add(bits, 1)
	w.head++
	if w.head == w.size {
		w.head = 0
	}
}

// totalsAt returns what the window holds as of second sec: for TIME_BASED, calls older than
// size seconds have expired.
func (w *window) totalsAt(sec int64) totals {
	if w.kind == TimeBased && w.size > 0 {
		w.slide(sec)
	}
	return w.sum
}

// slide makes sec the current second, expiring the buckets it leaves behind. A second before
// the current one (a clock that went backwards) moves nothing: it is treated as no time having
// passed, so the calls are added to the current bucket rather than overwriting a bucket that
// still holds younger calls, which is how Resilience4j's window would be corrupted.
func (w *window) slide(sec int64) {
	if sec <= w.curSec {
		return
	}
	steps := sec - w.curSec
	if steps > int64(w.size) {
		steps = int64(w.size)
	}
	for range steps {
		w.cur++
		if w.cur == w.size {
			w.cur = 0
		}
		b := &w.buckets[w.cur]
		w.sum.calls -= int64(b.calls)
		w.sum.failed -= int64(b.failed)
		w.sum.slow -= int64(b.slow)
		w.sum.slowFailed -= int64(b.slowFailed)
		*b = bucket{}
	}
	w.curSec = sec
}
