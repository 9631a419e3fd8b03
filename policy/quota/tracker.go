package quota

import (
	"sync"
	"time"
)

// Need is what a request takes from a provider's quotas: one request, and its estimated
// tokens (prompt and completion apart, for providers that count them apart).
type Need struct {
	Prompt, Completion int64
}

// amount returns how much of quota k a request needing n takes.
func (n Need) amount(k Kind) int64 {
	switch k {
	case Requests:
		return 1
	case InputTokens:
		return n.Prompt
	case OutputTokens:
		return n.Completion
	}
	return n.Prompt + n.Completion
}

// Reservation is what an admitted request holds of a provider's quotas until its response
// says how much is left (Tracker.Observe) or it ends (Tracker.Settle). The zero value holds
// nothing.
type Reservation struct {
	need Need
	held bool
}

// Held reports whether r holds anything.
func (r Reservation) Held() bool { return r.held }

// Tracker is one provider account's quotas as its responses last told them, less what the
// requests admitted since hold. Safe for concurrent use.
//
// The model: a response says Remaining of a quota until Reset. Every admitted request whose
// response has not said so yet holds its need (pending): the provider may not have counted it
// in the last reading, and counting it twice for the short time until its own response
// arrives is the safe side. A request fits while Remaining − pending covers its need, above
// the share kept for the highest priority. At Reset the quota is full again (Limit); the
// requests still in flight keep holding their need. A request that ends without a reading
// (an error, or a response without rate-limit headers) is charged to Remaining at its real
// use, as the provider would have.
type Tracker struct {
	mu sync.Mutex
	q  [numKinds]tracked
}

type tracked struct {
	known            bool
	limit, remaining int64
	reset            time.Time
	pending          int64
	// at is when the reading the quota holds was taken (zero: none, or refilled since).
	at time.Time
	// remote is what the requests in flight at the other replicas of a fleet hold (Merge).
	remote int64
}

// refill makes a quota whose reset has passed full again; it is forgotten (unknown) when its
// limit was never said.
func (q *tracked) refill(now time.Time) {
	if !q.known || q.reset.IsZero() || now.Before(q.reset) {
		return
	}
	if q.limit > 0 {
		q.remaining, q.reset, q.at = q.limit, time.Time{}, time.Time{}
		return
	}
	q.known, q.at = false, time.Time{}
}

// Verdict is Reserve's answer for a request that does not fit.
type Verdict struct {
	// Kind is the first quota that cannot cover the request.
	Kind Kind
	// Left is what that quota has for it (less pending and the reserve), and ResetIn how long
	// until the provider says it is full again (0 when it did not say).
	Left    int64
	ResetIn time.Duration
}

// Reserve takes need from every known quota when all of them cover it, keeping reserve (a
// share of each quota's limit, 0 to 1) for the highest priority unless top is set. ok false
// says which quota is short; nothing is taken then.
func (t *Tracker) Reserve(need Need, reserve float64, top bool, now time.Time) (Reservation, Verdict, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.q {
		q := &t.q[k]
		q.refill(now)
		if !q.known {
			continue
		}
		left := q.remaining - q.pending - q.remote
		if !top && reserve > 0 && q.limit > 0 {
			left -= int64(reserve * float64(q.limit))
		}
		if n := need.amount(Kind(k)); n > 0 && n > left {
			var in time.Duration
			if !q.reset.IsZero() {
				in = q.reset.Sub(now)
			}
			return Reservation{}, Verdict{Kind: Kind(k), Left: max(left, 0), ResetIn: in}, false
		}
	}
	for k := range t.q {
		t.q[k].pending += need.amount(Kind(k))
	}
	return Reservation{need: need, held: true}, Verdict{}, true
}

// Observe applies a response's reading, giving back the reservation of the request it answers
// (the provider has now counted it). A quota the reading says nothing of keeps its state;
// one it gives only a part of (no limit, no reset) keeps the rest.
func (t *Tracker) Observe(res *Reservation, r *Reading, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.release(res)
	for k := range t.q {
		w, q := &r.Windows[k], &t.q[k]
		if w.Has&HasRemaining == 0 {
			continue
		}
		q.known, q.remaining, q.at = true, w.Remaining, now
		if w.Has&HasLimit != 0 {
			q.limit = w.Limit
			q.remaining = min(q.remaining, q.limit)
		}
		if w.Has&HasReset != 0 {
			// Without one, the reset last said still holds: the same window, counted down.
			q.reset = w.Reset
		}
		q.refill(now)
	}
}

// Settle ends a request whose response gave no reading: its reservation goes back and its
// real use (used: prompt and completion tokens; one request) is charged to what is left.
func (t *Tracker) Settle(res *Reservation, used Need, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !res.held {
		return
	}
	t.release(res)
	for k := range t.q {
		q := &t.q[k]
		q.refill(now)
		if q.known {
			// What this replica now believes is left, shared with a fleet like a reading.
			q.remaining, q.at = max(q.remaining-used.amount(Kind(k)), 0), now
		}
	}
}

// Release gives back a reservation without charging anything: the request never reached the
// provider (refused later in admission, or cancelled before it was sent).
func (t *Tracker) Release(res *Reservation) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.release(res)
}

func (t *Tracker) release(res *Reservation) {
	if !res.held {
		return
	}
	for k := range t.q {
		t.q[k].pending = max(t.q[k].pending-res.need.amount(Kind(k)), 0)
	}
	res.held = false
}

// Shared is one quota as a fleet of replicas shares it (cluster mode): the latest reading (At:
// when it was taken, zero for none; Reset zero when not said) and what requests in flight hold
// of it — sent by Share: this replica's; given to Merge: the other replicas'.
type Shared struct {
	At               time.Time
	Limit, Remaining int64
	Reset            time.Time
	Pending          int64
}

// NumKinds is the number of quota kinds a Share holds (requests, tokens, input and output
// tokens), in Kind order.
const NumKinds = int(numKinds)

// Share returns, per quota kind, the reading this tracker holds and what its requests in
// flight hold.
func (t *Tracker) Share(now time.Time) [NumKinds]Shared {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out [NumKinds]Shared
	for k := range t.q {
		q := &t.q[k]
		q.refill(now)
		out[k].Pending = q.pending
		if q.known && !q.at.IsZero() {
			out[k].At, out[k].Limit, out[k].Remaining, out[k].Reset = q.at, q.limit, q.remaining, q.reset
		}
	}
	return out
}

// Merge applies what the fleet knows: a reading later than this tracker's replaces it (another
// replica heard from the provider since), and the other replicas' requests in flight count
// against every quota as this replica's own do. A reading whose reset has passed is not
// applied (the quota is full again, as refill would say).
func (t *Tracker) Merge(fleet [NumKinds]Shared, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.q {
		q, f := &t.q[k], &fleet[k]
		q.remote = max(f.Pending, 0)
		if f.At.IsZero() || !f.At.After(q.at) || (!f.Reset.IsZero() && !now.Before(f.Reset)) || f.Remaining < 0 {
			q.refill(now)
			continue
		}
		q.known, q.at, q.limit, q.remaining, q.reset = true, f.At, max(f.Limit, 0), f.Remaining, f.Reset
		if q.limit > 0 {
			q.remaining = min(q.remaining, q.limit)
		}
	}
}

// ForgetRemote stops counting the other replicas' requests in flight: the fleet could not be
// asked for longer than their holdings count.
func (t *Tracker) ForgetRemote() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.q {
		t.q[k].remote = 0
	}
}

// State is one quota as the tracker has it, for the admin API and metrics. Remote is what the
// other replicas' requests in flight hold (cluster mode).
type State struct {
	Kind      string    `json:"kind"`
	Limit     int64     `json:"limit,omitempty"`
	Remaining int64     `json:"remaining"`
	Pending   int64     `json:"pending"`
	Remote    int64     `json:"remote_pending,omitempty"`
	Reset     time.Time `json:"reset,omitzero"`
}

// States returns the quotas the provider has told of.
func (t *Tracker) States(now time.Time) []State {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []State
	for k := range t.q {
		q := &t.q[k]
		q.refill(now)
		if q.known {
			out = append(out, State{Kind: Kind(k).String(), Limit: q.limit, Remaining: q.remaining, Pending: q.pending, Remote: q.remote, Reset: q.reset})
		}
	}
	return out
}
