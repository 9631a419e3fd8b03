// Package budget implements token budgets and request rates that are reserved before a
// request runs and settled to its real cost after.
//
// A Window counts what was charged during the last window (a minute, a day). Charges older
// than the window no longer count, so capacity comes back continuously as old charges age out
// — in steps of 1/60 of the window (one second for a per-minute budget) — and never all at once
// on a boundary. Unlike a token bucket, whose full bucket plus a window of refill admits twice
// the budget in one window, a Window admits at most its capacity in any window, plus what
// settlement adds beyond estimates. Settlement charges the excess (the window may go into
// bounded debt, which delays later admissions) or refunds the unused part to the slot it was
// charged in, so over time the real spend matches the budget.
//
// Imports: only the standard library. Imported by: package policy (a compartment's token and
// request windows) and policy/cluster (the same windows kept in Redis).
package budget

import (
	"math"
	"sync"
	"time"
)

// Slots is the number of steps a window is divided into.
const Slots = 60

// Window is a sliding-window budget. Safe for concurrent use.
type Window struct {
	mu       sync.Mutex
	capacity int64
	maxDebt  int64
	slot     time.Duration
	ring     [Slots]int64
	sum      int64
	// last is the absolute slot number (Unix time / slot) of the latest instant seen. Time never
	// runs backwards for a Window: an earlier instant is treated as last.
	last int64
	// latest is the latest instant seen; an earlier now is taken as latest.
	latest time.Time
	// forgiven counts charges dropped because they would exceed the debt bound.
	forgiven int64
}

// Charge identifies where a reservation was charged, for settling it later.
type Charge struct {
	slot   int64
	amount int64
}

// Amount returns how much the charge took.
func (c Charge) Amount() int64 { return c.amount }

// MakeCharge returns a charge of amount in slot, for a window kept elsewhere (a lease of a window
// shared by replicas) whose charges are carried the same way.
func MakeCharge(slot, amount int64) Charge { return Charge{slot: slot, amount: amount} }

// Slot returns the slot the charge was made in.
func (c Charge) Slot() int64 { return c.slot }

// New returns a Window admitting capacity per window, allowing settlement to push the charged
// sum up to capacity × (1 + maxDebt), starting empty at now. window must be at least Slots
// nanoseconds.
func New(capacity int64, window time.Duration, maxDebt float64, now time.Time) *Window {
	w := &Window{}
	w.configure(capacity, window, maxDebt)
	w.last = w.slotOf(now)
	w.latest = now
	return w
}

func (w *Window) configure(capacity int64, window time.Duration, maxDebt float64) {
	w.capacity = capacity
	w.maxDebt = int64(float64(capacity) * maxDebt)
	w.slot = max(window/Slots, 1)
}

func (w *Window) slotOf(t time.Time) int64 { return t.UnixNano() / int64(w.slot) }

// advance moves the window to now, dropping charges that aged out, and returns the instant
// the window now stands at (now, or the latest instant seen if now is earlier).
func (w *Window) advance(now time.Time) time.Time {
	if now.Before(w.latest) {
		return w.latest
	}
	w.latest = now
	n := w.slotOf(now)
	if n <= w.last {
		return now
	}
	if n-w.last >= Slots {
		w.ring = [Slots]int64{}
		w.sum = 0
	} else {
		for k := w.last + 1; k <= n; k++ {
			i := k % Slots
			w.sum -= w.ring[i]
			w.ring[i] = 0
		}
	}
	w.last = n
	return now
}

// charge adds n to the current slot, up to the debt bound, and returns what it took. What the
// bound keeps out of a settlement is forgiven; what it keeps out of a reservation is not (yet):
// settlement charges the rest of the real cost, or forgives it then.
func (w *Window) charge(n int64, settling bool) int64 {
	room := w.capacity + w.maxDebt - w.sum
	if n > room {
		if settling {
			w.forgiven += n - max(room, 0)
		}
		n = max(room, 0)
	}
	w.ring[w.last%Slots] += n
	w.sum += n
	return n
}

// Reserve charges n if the window has room for it (a request larger than the whole capacity
// needs an empty window). Otherwise it charges nothing and returns the time until enough
// charges age out for n to fit.
func (w *Window) Reserve(n int64, now time.Time) (Charge, bool, time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now = w.advance(now)
	need := min(n, w.capacity)
	if w.sum+need <= w.capacity {
		return Charge{slot: w.last, amount: w.charge(n, false)}, true, 0
	}
	return Charge{}, false, w.waitFor(need, now)
}

// waitFor returns how long until the charged sum drops to capacity - need.
func (w *Window) waitFor(need int64, now time.Time) time.Duration {
	excess := w.sum + need - w.capacity
	freed := int64(0)
	for k := w.last - Slots + 1; k <= w.last; k++ {
		freed += w.ring[((k%Slots)+Slots)%Slots]
		if freed >= excess {
			// Slot k leaves the window when slot k+Slots begins.
			at := time.Unix(0, (k+Slots)*int64(w.slot))
			return max(at.Sub(now), 0)
		}
	}
	return w.slot * Slots
}

// Take charges n unconditionally (up to the debt bound): shadow mode, or accounting for a
// request admitted without a reservation.
func (w *Window) Take(n int64, now time.Time) Charge {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	return Charge{slot: w.last, amount: w.charge(n, false)}
}

// Settle corrects charge c to the real cost actual: an over-estimate is refunded to the slot it
// was charged in (if that slot is still in the window), an under-estimate is charged now.
func (w *Window) Settle(c Charge, actual int64, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	if d := actual - c.amount; d > 0 {
		w.charge(d, true)
	} else if d < 0 {
		w.refund(c.slot, -d)
	}
}

// Refund gives back all of c (the request was refused later in admission and never ran).
func (w *Window) Refund(c Charge, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	w.refund(c.slot, c.amount)
}

func (w *Window) refund(slot, n int64) {
	if slot <= w.last-Slots || slot > w.last {
		return // aged out already: the charge no longer counts anyway
	}
	i := ((slot % Slots) + Slots) % Slots
	n = min(n, w.ring[i])
	w.ring[i] -= n
	w.sum -= n
}

// Reconfigure changes capacity, window and debt bound, keeping what was charged. When the
// window length changes, everything charged is kept in the current slot (it counts for one
// full new window), because old slot boundaries no longer mean anything.
func (w *Window) Reconfigure(capacity int64, window time.Duration, maxDebt float64, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	if max(window/Slots, 1) != w.slot {
		sum := w.sum
		w.configure(capacity, window, maxDebt)
		w.ring = [Slots]int64{}
		w.last = w.slotOf(w.latest)
		w.ring[w.last%Slots] = sum
		w.sum = sum
		return
	}
	w.configure(capacity, window, maxDebt)
}

// Empty reports whether nothing charged counts against the window at now: forgetting the
// window then loses nothing.
func (w *Window) Empty(now time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	return w.sum == 0
}

// State is a point-in-time view of a Window.
type State struct {
	Capacity int64
	// Used is what counts against the window now (may exceed Capacity while in debt).
	Used int64
	// Remaining is Capacity - Used, negative in debt.
	Remaining int64
	// ResetIn is the time until everything charged has aged out.
	ResetIn time.Duration
	// Forgiven is the total charge dropped at the debt bound.
	Forgiven int64
}

// State returns the window's state at now.
func (w *Window) State(now time.Time) State {
	w.mu.Lock()
	defer w.mu.Unlock()
	now = w.advance(now)
	st := State{Capacity: w.capacity, Used: w.sum, Remaining: w.capacity - w.sum, Forgiven: w.forgiven}
	for k := w.last; k > w.last-Slots; k-- {
		if w.ring[((k%Slots)+Slots)%Slots] != 0 {
			st.ResetIn = max(time.Unix(0, (k+Slots)*int64(w.slot)).Sub(now), 0)
			break
		}
	}
	return st
}

// maxRestored bounds the sum a window restores: sums stay far from overflowing.
const maxRestored = math.MaxInt64 / 4

// SlotCharge is what one slot of a window counts, at its place in time: slot Index of a window
// whose slots are Length long spans [Index×Length, (Index+1)×Length) since the Unix epoch.
type SlotCharge struct {
	Index  int64
	Amount int64
}

// Save returns the window's slot length and every slot that counts against it at now, oldest
// first, with its absolute place in time: what a state file keeps, so that a window restored
// later resumes exactly, and what aged out meanwhile is gone.
func (w *Window) Save(now time.Time) (time.Duration, []SlotCharge) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	var out []SlotCharge
	for k := w.last - Slots + 1; k <= w.last; k++ {
		if n := w.ring[((k%Slots)+Slots)%Slots]; n != 0 {
			out = append(out, SlotCharge{Index: k, Amount: n})
		}
	}
	return w.slot, out
}

// Restore replaces what the window counts with charges that Save gave a window whose slots were
// slot long, and returns the sum it kept. Each charge counts as made at the last instant of its
// slot, in the slot of this window that holds that instant: with the slot length unchanged it
// lands where it was; under another length it ages out as a charge made then would, never
// later. A charge whose slot has aged out of the window by now is dropped; one later than now (a
// clock that was ahead when it was saved) counts in the current slot, for one whole window from
// now. Capacity and debt bound stay this window's: a restored sum above a lowered capacity is
// debt, which ages out as charged.
func (w *Window) Restore(slot time.Duration, charges []SlotCharge, now time.Time) int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.advance(now)
	w.ring = [Slots]int64{}
	w.sum = 0
	if slot <= 0 {
		return 0
	}
	for _, c := range charges {
		if c.Amount <= 0 || c.Index < 0 || c.Index >= math.MaxInt64/int64(slot) {
			continue
		}
		k := ((c.Index+1)*int64(slot) - 1) / int64(w.slot)
		if k <= w.last-Slots {
			continue // aged out
		}
		// The sum saturates far below overflow, whatever the charges.
		n := min(c.Amount, maxRestored-w.sum)
		if n <= 0 {
			break
		}
		w.ring[min(k, w.last)%Slots] += n
		w.sum += n
	}
	return w.sum
}
