package breaker

import "time"

// HistorySize is how many events (transitions and threshold breaches) a breaker keeps for
// History; the oldest is overwritten first. Memory grows with the events actually seen, up to
// about 30 KB per breaker.
const HistorySize = 64

// RecentCalls is how many recorded calls a breaker remembers, and how many of them each event
// of its history carries: the calls recorded last before the event, the one that caused it
// included.
const RecentCalls = 8

// Detail is what the caller knows about a call beyond its outcome, kept with the call in the
// breaker's history: the upstream's HTTP status (0 when none came) and the provider that
// answered. A plain value, safe for concurrent use.
type Detail struct {
	Status   int
	Provider string
}

// Call is one call a window recorded, as History reports it. A plain value, safe for
// concurrent use.
type Call struct {
	At time.Time `json:"at"`
	// Kind is success, failure, slow_success or slow_failure, as in Counts.
	Kind string `json:"kind"`
	// Duration is the duration compared with the slow-call duration.
	Duration time.Duration `json:"duration"`
	Status   int           `json:"status"`
	Provider string        `json:"provider,omitempty"`
}

// HistoryEntry is one event of a breaker's history with the calls recorded just before it. A
// plain value, safe for concurrent use.
type HistoryEntry struct {
	// Kind is "transition" or "threshold_exceeded".
	Kind string    `json:"kind"`
	At   time.Time `json:"at"`
	From State     `json:"from"`
	To   State     `json:"to"`
	// Reason, FailureRate, SlowRate and Generation are the event's (see Event).
	Reason      Reason  `json:"reason"`
	FailureRate float64 `json:"failure_rate"`
	SlowRate    float64 `json:"slow_rate"`
	Generation  uint64  `json:"generation"`
	// Calls are the last calls recorded before the event, oldest first, at most RecentCalls.
	// They may predate earlier events: a forced transition after a quiet hour shows the calls
	// of an hour ago.
	Calls []Call `json:"calls"`
}

// callRecord is a recorded call in the ring; n is internal time.
type callRecord struct {
	n        int64
	d        time.Duration
	status   int32
	bits     uint8
	provider string
}

type eventRecord struct {
	ev    Event
	calls [RecentCalls]callRecord
	n     int
}

// history is a breaker's ring of recent calls and events, guarded by the breaker's mutex. The
// call ring is a fixed array: recording a call writes one element and allocates nothing. The
// event ring grows on events only.
type history struct {
	calls   [RecentCalls]callRecord
	nCalls  uint64
	events  []eventRecord
	nEvents uint64
}

// call remembers a recorded call. The caller holds the breaker's lock.
func (h *history) call(n int64, d time.Duration, bits uint8, dt Detail) {
	// Field by field: a composite literal with a string would be copied with typedmemmove.
	c := &h.calls[h.nCalls%RecentCalls]
	c.n, c.d, c.status, c.bits = n, d, int32(dt.Status), bits
	c.provider = dt.Provider
	h.nCalls++
}

// event remembers e with the calls recorded before it. The caller holds the breaker's lock.
func (h *history) event(e Event) {
	var r *eventRecord
	if len(h.events) < HistorySize {
		h.events = append(h.events, eventRecord{})
		r = &h.events[len(h.events)-1]
	} else {
		r = &h.events[h.nEvents%HistorySize]
	}
	h.nEvents++
	r.ev = e
	r.n = int(min(h.nCalls, RecentCalls))
	for i := range r.n {
		r.calls[i] = h.calls[(h.nCalls-uint64(r.n)+uint64(i))%RecentCalls]
	}
}

var kindNames = [4]string{0: "success", bitFailed: "failure", bitSlow: "slow_success", bitFailed | bitSlow: "slow_failure"}

// History returns the breaker's last HistorySize events, oldest first, each with the calls
// recorded just before it. It copies under the breaker's lock. Safe for concurrent use.
func (b *Breaker) History() []HistoryEntry {
	b.mu.Lock()
	defer b.mu.Unlock()
	h := &b.hist
	out := make([]HistoryEntry, 0, len(h.events))
	first := uint64(0)
	if h.nEvents > HistorySize {
		first = h.nEvents - HistorySize
	}
	for i := first; i < h.nEvents; i++ {
		r := &h.events[i%HistorySize]
		e := HistoryEntry{Kind: r.ev.Kind.String(), At: r.ev.At, From: r.ev.From, To: r.ev.To, Reason: r.ev.Reason,
			FailureRate: r.ev.FailureRate, SlowRate: r.ev.SlowRate, Generation: r.ev.Generation, Calls: make([]Call, r.n)}
		for j := range r.n {
			c := r.calls[j]
			e.Calls[j] = Call{At: b.epoch.Add(time.Duration(c.n)), Kind: kindNames[c.bits&(bitFailed|bitSlow)], Duration: c.d,
				Status: int(c.status), Provider: c.provider}
		}
		out = append(out, e)
	}
	return out
}
