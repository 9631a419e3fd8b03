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
	// seq and at say when the request was admitted: the reading its response gives counts
	// every request whose answer had arrived by then.
	seq uint64
	at  time.Time
}

// Held reports whether r holds anything.
func (r Reservation) Held() bool { return r.held }

// Tracker is one provider account's quotas as its responses last told them, less what the
// requests admitted since hold. Safe for concurrent use.
//
// The model: a response says Remaining of a quota until Reset, counting every request the
// provider had received when it answered. Which those are is known only in part: every request
// whose own answer had arrived before the answered request was sent, and the answered request
// itself. So a request holds its need from its admission (pending) until a reading is known
// to count it:
//
//   - while in flight, it holds (the provider may not have received it yet);
//   - once its answer arrives, its own reading counts it; when that reading is older than the
//     one the tracker holds (answers arrive in any order: a request sent earlier may be answered
//     later), the reading is not taken and the request goes on holding, as does one that ended
//     without a reading (an error, a response without rate-limit headers: held at its real use);
//   - a request whose answer has arrived is counted by the reading of every request sent after
//     that: taking such a reading ends its hold;
//   - the request whose reading is held holds nothing, its reading counting it; a reading of a
//     request sent after it but before its answer arrived may not count it (the provider may
//     have received the two in either order): taking that reading makes it hold again.
//
// A request fits while Remaining less everything held covers its need, above the share kept
// for the highest priority. Taking a reading only when its request was sent after the one of
// the reading held, and ending holds only for what that reading is known to count, never lets
// a burst overshoot (requests answered out of order included), at the cost of counting twice,
// until the next reading, a request the provider had counted without saying so. At Reset the
// quota is full again (Limit): the requests still in flight keep holding, the ended ones no
// longer do (the provider counted them in the window that ended).
type Tracker struct {
	mu sync.Mutex
	q  [numKinds]tracked
	// seq orders admissions and ends of holds.
	seq uint64
	// ended are the holds of requests whose answer arrived but that no reading taken is known
	// to count yet, oldest first.
	ended [maxEnded]endedHold
	n     int
}

// maxEnded bounds the ended holds kept apart; beyond it the oldest two are kept as one, that
// ends when the later of them would (a little longer than needed, never shorter).
const maxEnded = 32

// endedHold is what requests whose answers arrived hold of each quota, until a reading of a
// request sent after (seq; at, for another replica's reading) counts them.
type endedHold struct {
	seq    uint64
	at     time.Time
	amount [numKinds]int64
}

type tracked struct {
	known            bool
	limit, remaining int64
	reset            time.Time
	// pending is what the requests in flight hold; ended what the ended holds hold of it.
	pending, ended int64
	// from says which request's reading remaining is: the time it was sent and, for one of
	// this replica's, its admission; remote for one another replica took, refilled when
	// remaining is the limit since the reset (from.at).
	from             Reservation
	remote, refilled bool
	// fleet is what the requests in flight at the other replicas of a fleet hold (Merge).
	fleet int64
	// own is the request whose reading remaining is (this replica's): the reading counts it, so
	// it holds nothing while that reading is held. A later-sent request's reading that replaces
	// it counts it only if its answer had arrived when that request was sent (the provider may
	// have received the two in either order): otherwise it holds again, as an ended hold.
	own ownHold
}

// ownHold is what the request whose reading a quota holds takes of it, and when its answer
// arrived (seq in this replica's order of admissions and answers; at by the clock).
type ownHold struct {
	seq uint64
	at  time.Time
	n   int64
}

// refill makes a quota whose reset has passed full again; it is forgotten (unknown) when its
// limit was never said. The requests whose answers arrived before the reset no longer hold:
// the window they were counted in has ended.
func (t *Tracker) refill(k Kind, now time.Time) {
	q := &t.q[k]
	if !q.known || q.reset.IsZero() || now.Before(q.reset) {
		return
	}
	reset := q.reset
	t.endHolds(k, 0, reset)
	q.own = ownHold{} // counted in the window that ended
	if q.limit > 0 {
		q.remaining, q.reset = q.limit, time.Time{}
		q.from, q.remote, q.refilled = Reservation{at: reset}, true, true
		return
	}
	q.known, q.from, q.remote, q.refilled = false, Reservation{}, false, false
}

// newer reports whether the request res of this replica was sent after the one whose reading
// quota q holds (another replica's, or the reset: told by the clock).
func (q *tracked) newer(res *Reservation) bool {
	switch {
	case !q.known:
		return true
	case q.remote:
		return q.newerAt(res.at)
	}
	return res.seq > q.from.seq
}

// newerAt reports whether a request sent at is known, by the clock, to be sent after the one
// whose reading quota q holds: strictly after it, or at or after the reset when q was refilled
// (the window the reset starts counts the request).
func (q *tracked) newerAt(at time.Time) bool {
	if q.refilled {
		return !at.Before(q.from.at)
	}
	return at.After(q.from.at)
}

// endHolds ends the ended holds of quota k that a reading counts: those that ended before the
// admission seq of this replica's request, or (seq 0) before the instant sent. It drops the
// ended holds that no longer hold anything.
func (t *Tracker) endHolds(k Kind, seq uint64, sent time.Time) {
	q := &t.q[k]
	for i := range t.n {
		e := &t.ended[i]
		if e.amount[k] != 0 && ((seq != 0 && e.seq < seq) || (seq == 0 && e.at.Before(sent))) {
			q.ended -= e.amount[k]
			e.amount[k] = 0
		}
	}
	j := 0
	for i := range t.n {
		if t.ended[i].amount != ([numKinds]int64{}) {
			t.ended[j] = t.ended[i]
			j++
		}
	}
	t.n = j
}

// replaceOwn is called as quota k takes a reading of a request sent after the one held: its
// own request holds again unless the new reading is known to count it (counted: its answer
// had arrived before the new reading's request was sent).
func (t *Tracker) replaceOwn(k Kind, counted bool) {
	q := &t.q[k]
	o := q.own
	q.own = ownHold{}
	if o.n == 0 || counted {
		return
	}
	var amount [numKinds]int64
	amount[k] = o.n
	q.ended += o.n
	t.addEnded(endedHold{seq: o.seq, at: o.at, amount: amount})
}

// addEnded keeps e among the ended holds, in the order of their answers. When they are full
// the oldest two become one that ends when the later of them would.
func (t *Tracker) addEnded(e endedHold) {
	if t.n == maxEnded {
		a, b := &t.ended[0], &t.ended[1]
		for k := range b.amount {
			b.amount[k] += a.amount[k]
		}
		copy(t.ended[:], t.ended[1:t.n])
		t.n--
	}
	i := t.n
	for i > 0 && t.ended[i-1].seq > e.seq {
		t.ended[i] = t.ended[i-1]
		i--
	}
	t.ended[i] = e
	t.n++
}

// hold keeps what a request answered at answered (its place among admissions) held of the known
// quotas (amount, per kind) until a reading counts it.
func (t *Tracker) hold(amount [numKinds]int64, answered uint64, now time.Time) {
	for k := range t.q {
		if !t.q[k].known {
			// No reading yet: the first one is taken whatever it missed, as it would be
			// without this request.
			amount[k] = 0
		}
		t.q[k].ended += amount[k]
	}
	if amount == ([numKinds]int64{}) {
		return
	}
	t.addEnded(endedHold{seq: answered, at: now, amount: amount})
}

// Sent marks a request sent again without a reservation of its own (an attempt Envoy's router
// retried: the request's reservation holds for its last attempt) at now, so that the reading
// of its response (Observe) is placed among the others by when it was sent, and it holds what
// it took (one request) once answered, until a reading counts it.
func (t *Tracker) Sent(now time.Time) Reservation {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.seq++
	return Reservation{seq: t.seq, at: now}
}

// Verdict is Reserve's answer for a request that does not fit.
type Verdict struct {
	// Kind is the first quota that cannot cover the request.
	Kind Kind
	// Left is what that quota has for it (less what is held and the reserve), and ResetIn how
	// long until the provider says it is full again (0 when it did not say).
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
		t.refill(Kind(k), now)
		q := &t.q[k]
		if !q.known {
			continue
		}
		left := q.remaining - q.pending - q.ended - q.fleet
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
	t.seq++
	return Reservation{need: need, held: true, seq: t.seq, at: now}, Verdict{}, true
}

// Observe applies the reading of the response to the request res holds for, which gives back
// what it held: the reading counts it. A reading of a request sent before the one whose
// reading a quota holds is not taken for that quota (it may miss requests the one held
// counts), nor is the request's hold given back then. A quota the reading says nothing of
// keeps its state and the request's hold; one it gives only a part of (no limit, no reset)
// keeps the rest.
func (t *Tracker) Observe(res *Reservation, r *Reading, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var keep [numKinds]int64
	// answered orders this answer among admissions: a request admitted after it is sent after
	// it arrived.
	t.seq++
	answered := t.seq
	// placed: res says when its request was sent (admitted, or Sent).
	placed := res.held || res.seq != 0
	for k := range t.q {
		t.refill(Kind(k), now)
		w, q := &r.Windows[k], &t.q[k]
		if !placed {
			// A reading with no request of its own (none was admitted against the quota):
			// the oldest there can be.
			if w.Has&HasRemaining == 0 || q.known {
				continue
			}
		} else if w.Has&HasRemaining == 0 || !q.newer(res) {
			keep[k] = res.need.amount(Kind(k))
			continue
		}
		if placed {
			// The reading held is of a request sent before this one; this one's reading
			// counts it only if it was answered before this one was sent.
			t.replaceOwn(Kind(k), q.own.seq < res.seq)
			t.endHolds(Kind(k), res.seq, time.Time{})
			q.from, q.remote, q.refilled = *res, false, false
			q.from.held = false
			q.own = ownHold{seq: answered, at: now, n: res.need.amount(Kind(k))}
		} else {
			q.own = ownHold{}
		}
		q.known, q.remaining = true, w.Remaining
		if w.Has&HasLimit != 0 {
			q.limit = w.Limit
			q.remaining = min(q.remaining, q.limit)
		}
		if w.Has&HasReset != 0 {
			// Without one, the reset last said still holds: the same window, counted down.
			q.reset = w.Reset
		}
		t.refill(Kind(k), now)
	}
	t.release(res)
	if placed {
		// Answered: the request holds on where this reading was not taken for it.
		t.hold(keep, answered, now)
	}
}

// Settle ends a request whose response gave no reading: it goes on holding its real use
// (used: prompt and completion tokens; one request) until a reading counts it, as the provider
// did.
func (t *Tracker) Settle(res *Reservation, used Need, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.release(res) {
		return
	}
	var amount [numKinds]int64
	for k := range t.q {
		t.refill(Kind(k), now)
		amount[k] = used.amount(Kind(k))
	}
	t.seq++
	t.hold(amount, t.seq, now)
}

// Release gives back a reservation without charging anything: the request never reached the
// provider (refused later in admission, or cancelled before it was sent).
func (t *Tracker) Release(res *Reservation) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.release(res)
}

// release gives back what res holds as in flight; false when it held nothing.
func (t *Tracker) release(res *Reservation) bool {
	if !res.held {
		return false
	}
	for k := range t.q {
		t.q[k].pending = max(t.q[k].pending-res.need.amount(Kind(k)), 0)
	}
	res.held = false
	return true
}

// Shared is one quota as a fleet of replicas shares it (cluster mode): the latest reading (At:
// when the request whose response gave it was sent, zero for none; Reset zero when not said)
// and what requests hold of it that no reading is known to count — sent by Share: this
// replica's; given to Merge: the other replicas'.
type Shared struct {
	At               time.Time
	Limit, Remaining int64
	Reset            time.Time
	Pending          int64
}

// NumKinds is the number of quota kinds a Share holds (requests, tokens, input and output
// tokens), in Kind order.
const NumKinds = int(numKinds)

// Share returns, per quota kind, the reading this tracker holds and what its requests hold.
func (t *Tracker) Share(now time.Time) [NumKinds]Shared {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out [NumKinds]Shared
	for k := range t.q {
		t.refill(Kind(k), now)
		q := &t.q[k]
		out[k].Pending = q.pending + q.ended
		if q.known && !q.refilled && !q.from.at.IsZero() {
			out[k].At, out[k].Limit, out[k].Remaining, out[k].Reset = q.from.at, q.limit, q.remaining, q.reset
		}
	}
	return out
}

// Merge applies what the fleet knows: a reading of a request sent later than the one of this
// tracker's reading replaces it (another replica heard from the provider since), ending the
// holds of this replica's requests answered before that request was sent; and the other
// replicas' holds count against every quota as this replica's own do. A reading whose reset
// has passed is not applied (the quota is full again, as refill would say). Across replicas
// "before" is told by their clocks: keep them synchronised (NTP) far closer than a request's
// round trip.
func (t *Tracker) Merge(fleet [NumKinds]Shared, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.q {
		t.refill(Kind(k), now)
		q, f := &t.q[k], &fleet[k]
		q.fleet = max(f.Pending, 0)
		if f.At.IsZero() || (q.known && !q.newerAt(f.At)) || (!f.Reset.IsZero() && !now.Before(f.Reset)) || f.Remaining < 0 {
			continue
		}
		t.replaceOwn(Kind(k), q.own.at.Before(f.At))
		t.endHolds(Kind(k), 0, f.At)
		q.known, q.from, q.remote, q.refilled = true, Reservation{at: f.At}, true, false
		q.limit, q.remaining, q.reset = max(f.Limit, 0), f.Remaining, f.Reset
		if q.limit > 0 {
			q.remaining = min(q.remaining, q.limit)
		}
	}
}

// ForgetRemote stops counting the other replicas' holds: the fleet could not be asked for
// longer than their holdings count.
func (t *Tracker) ForgetRemote() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.q {
		t.q[k].fleet = 0
	}
}

// State is one quota as the tracker has it, for the admin API and metrics: Pending is what
// this replica's requests hold of it (in flight, or answered but not yet known to be counted
// in Remaining), Remote what the other replicas' requests hold (cluster mode).
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
		t.refill(Kind(k), now)
		q := &t.q[k]
		if q.known {
			out = append(out, State{Kind: Kind(k).String(), Limit: q.limit, Remaining: q.remaining, Pending: q.pending + q.ended, Remote: q.fleet, Reset: q.reset})
		}
	}
	return out
}
