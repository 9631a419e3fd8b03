package cluster

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// SpendStore is a spend.Store that keeps window sums in Redis, through a Store, so that every replica
// enforces the same budgets: each reservation is one atomic script (all or nothing across the
// request's windows), settlements and releases are queued and sent in batches. It implements
// spend.Shared: when Redis does not answer a reservation (slow, or gone) the Ledger decides it in its
// own memory against this replica's share of what Redis last showed left, and what it counted
// there is added to Redis with AddLocal. Spend is not saved to a file in this mode: Redis keeps
// it.
type SpendStore struct {
	st *Store
	// leases, with leased admission, reserve enforced windows from this replica's chunks of
	// them (see UseLeases); nil with exact admission.
	leases *Leaser

	mu sync.Mutex
	// tokens holds the Redis tokens of reservations not settled yet, by what they reserved
	// (the windows and the amount): reservations alike are interchangeable, so a settlement
	// takes any token of its kind.
	tokens map[string][]uint64
	// seen holds each window's sums as Redis last reported them (by a reservation's answer or
	// a listing); sweepAt is when ended windows are next dropped from it.
	seen    map[spend.WindowID]spend.Usage
	sweepAt time.Time
}

var (
	_ spend.Shared  = (*SpendStore)(nil)
	_ spend.Carrier = (*SpendStore)(nil)
)

// spendSweepEvery is how often a SpendStore drops the ended windows it remembers.
const spendSweepEvery = time.Minute

// NewSpendStore returns a store keeping its sums through st.
func NewSpendStore(st *Store) *SpendStore {
	return &SpendStore{st: st, tokens: map[string][]uint64{}, seen: map[spend.WindowID]spend.Usage{}}
}

// UseLeases makes the store reserve from this replica's chunks of each window, leased by l
// (cluster.admission: leased), with no call to Redis while the chunks cover the reservations. A
// reservation in a shadow budget's window is still made in Redis, per request. Call it before the
// store serves any reservation.
func (r *SpendStore) UseLeases(l *Leaser) {
	r.leases = l
	l.spend.mu.Lock()
	l.spend.seen = func(u SpendUsage) {
		if x, ok := fromShared(u); ok {
			r.see([]spend.Usage{x}, l.o.Now())
		}
	}
	l.spend.mu.Unlock()
}

// leased reports whether a reservation in ws is made from leased chunks: with leased admission,
// when no window is a shadow budget's (those are counted per request in Redis).
func (r *SpendStore) leased(ws []spend.Window) bool {
	if r.leases == nil {
		return false
	}
	for i := range ws {
		if ws[i].Shadow {
			return false
		}
	}
	return true
}

// kind names what a reservation holds: its windows and amount.
func kind(keys []string, amount spend.Micros) string {
	return strings.Join(keys, "\x00") + "\x00" + strconv.FormatInt(int64(amount), 10)
}

func (r *SpendStore) push(k string, token uint64) {
	r.mu.Lock()
	r.tokens[k] = append(r.tokens[k], token)
	r.mu.Unlock()
}

func (r *SpendStore) pop(k string) (uint64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ts := r.tokens[k]
	if len(ts) == 0 {
		return 0, false
	}
	t := ts[len(ts)-1]
	if len(ts) == 1 {
		delete(r.tokens, k)
	} else {
		r.tokens[k] = ts[:len(ts)-1]
	}
	return t, true
}

// see records what Redis reported for windows, and drops ended windows once a minute.
func (r *SpendStore) see(us []spend.Usage, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !now.Before(r.sweepAt) {
		for id, u := range r.seen {
			if !u.End.After(now) {
				delete(r.seen, id)
			}
		}
		r.sweepAt = now.Add(spendSweepEvery)
	}
	for _, u := range us {
		r.seen[u.ID] = u
	}
}

func spendWindows(ws []spend.Window) []SpendWindow {
	out := make([]SpendWindow, len(ws))
	for i, w := range ws {
		out[i] = SpendWindow{Key: w.ID.Key(), Limit: int64(w.Limit), End: w.End, Shadow: w.Shadow, AllowSingleOverrun: w.AllowSingleOverrun}
	}
	return out
}

func windowKeys(ws []spend.Window) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.ID.Key()
	}
	return out
}

// Reserve implements spend.Store.
func (r *SpendStore) Reserve(ctx context.Context, ws []spend.Window, amount spend.Micros, now time.Time) (uint64, error) {
	if r.leased(ws) {
		return r.leases.ReserveSpendLeased(ctx, spendWindows(ws), int64(amount))
	}
	sums := make([]int64, 2*len(ws))
	token, over, refused, err := r.st.ReserveSpend(ctx, spendWindows(ws), int64(amount), sums)
	if err != nil {
		return over, err
	}
	if !refused {
		r.push(kind(windowKeys(ws), amount), token)
	}
	us := make([]spend.Usage, len(ws))
	for i, w := range ws {
		us[i] = spend.Usage{Window: w, Spent: spend.Micros(sums[2*i]), Reserved: spend.Micros(sums[2*i+1])}
	}
	r.see(us, now)
	return over, nil
}

// Settle implements spend.Store; it never blocks.
func (r *SpendStore) Settle(ws []spend.Window, reserved, actual spend.Micros, _ time.Time) {
	if r.leased(ws) {
		r.leases.SettleSpendLeased(spendWindows(ws), int64(reserved), int64(actual))
		return
	}
	keys := windowKeys(ws)
	if token, ok := r.pop(kind(keys, reserved)); ok {
		r.st.SettleSpend(token, keys, int64(reserved), int64(actual))
	}
}

// Release implements spend.Store; it never blocks.
func (r *SpendStore) Release(ws []spend.Window, reserved spend.Micros, now time.Time) {
	r.Settle(ws, reserved, 0, now)
}

// Usage implements spend.Store: the shared windows of every replica. While Redis cannot be asked it
// lists the windows as Redis last reported them to this replica.
func (r *SpendStore) Usage(now time.Time) []spend.Usage {
	us, err := r.st.SpendUsage(context.Background())
	if err != nil {
		r.mu.Lock()
		out := make([]spend.Usage, 0, len(r.seen))
		for _, u := range r.seen {
			if u.End.After(now) {
				out = append(out, u)
			}
		}
		r.mu.Unlock()
		spend.SortUsage(out)
		return out
	}
	out := make([]spend.Usage, 0, len(us))
	for _, u := range us {
		if x, ok := fromShared(u); ok {
			out = append(out, x)
		}
	}
	r.see(out, now)
	spend.SortUsage(out)
	return out
}

// Get implements spend.Store; while Redis cannot be asked it answers what Redis last reported.
// With leased admission it answers what the last lease report found, when it found the window:
// a refusal asks Redis nothing more.
func (r *SpendStore) Get(id spend.WindowID, now time.Time) (spend.Usage, bool) {
	if r.leases != nil {
		if u, ok := r.Seen(id, now); ok {
			return u, true
		}
	}
	u, ok, err := r.st.SpendGet(context.Background(), id.Key())
	if err != nil {
		return r.Seen(id, now)
	}
	if !ok {
		return spend.Usage{}, false
	}
	return fromShared(u)
}

// Replicas implements spend.Shared: the live replicas last seen.
func (r *SpendStore) Replicas() int { return r.st.Live() }

// Gone implements spend.Shared: the store is unavailable and found Redis gone, not just slow
// for this replica (see State.Gone).
func (r *SpendStore) Gone() bool { return r.st.Gone() }

// Seen implements spend.Shared.
func (r *SpendStore) Seen(id spend.WindowID, now time.Time) (spend.Usage, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u, ok := r.seen[id]
	if !ok || !u.End.After(now) {
		return spend.Usage{}, false
	}
	return u, true
}

// AddLocal implements spend.Shared.
func (r *SpendStore) AddLocal(ws []spend.Window, reserved, settled spend.Micros) {
	r.st.AddSpend(spendWindows(ws), int64(reserved), int64(settled))
}

// Pending implements spend.Shared.
func (r *SpendStore) Pending() map[spend.WindowID]spend.Pending {
	p := r.st.SpendPending()
	if len(p) == 0 {
		return nil
	}
	out := make(map[spend.WindowID]spend.Pending, len(p))
	for k, a := range p {
		if id, ok := spend.ParseWindowKey(k); ok {
			out[id] = spend.Pending{Reserved: spend.Micros(a.Reserved), Settled: spend.Micros(a.Settled)}
		}
	}
	return out
}

// Carry implements spend.Carrier: in Redis, where each window keeps what it carried from each other
// window, so that replicas changing zone at different moments together carry everything once.
func (r *SpendStore) Carry(moves []spend.Move, _ time.Time) (int, error) {
	if r.leases != nil {
		// What this replica's chunks settled reaches Redis at a report: send it first, so that
		// the carry moves it too.
		r.leases.FlushSpend(r.st.o.WriteTimeout)
	}
	sm := make([]SpendMove, len(moves))
	for i, m := range moves {
		sm[i] = SpendMove{From: m.From.Key(), To: spendWindows([]spend.Window{m.To})[0]}
	}
	return r.st.CarrySpend(context.Background(), sm)
}

// PendingTotal implements spend.Shared.
func (r *SpendStore) PendingTotal() spend.Micros { return spend.Micros(r.st.SpendPendingTotal()) }

// fromShared reads a shared window back.
func fromShared(u SpendUsage) (spend.Usage, bool) {
	id, ok := spend.ParseWindowKey(u.Key)
	if !ok {
		return spend.Usage{}, false
	}
	return spend.Usage{
		Window: spend.Window{ID: id, Limit: spend.Micros(u.Limit), End: u.End, Shadow: u.Shadow},
		Spent:  spend.Micros(u.Spent), Reserved: spend.Micros(u.Reserved), Leased: spend.Micros(u.Leased),
	}, true
}
