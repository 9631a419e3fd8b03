package spend

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
)

// RedisStore keeps window sums in Redis, through a cluster Store, so that every replica
// enforces the same budgets: each reservation is one atomic script (all or nothing across the
// request's windows), settlements and releases are queued and sent in batches. It implements
// Shared: when Redis does not answer a reservation (slow, or gone) the Ledger decides it in its
// own memory against this replica's share of what Redis last showed left, and what it counted
// there is added to Redis with AddLocal. Spend is not saved to a file in this mode: Redis keeps
// it.
type RedisStore struct {
	st *cluster.Store

	mu sync.Mutex
	// tokens holds the Redis tokens of reservations not settled yet, by what they reserved
	// (the windows and the amount): reservations alike are interchangeable, so a settlement
	// takes any token of its kind.
	tokens map[string][]uint64
	// seen holds each window's sums as Redis last reported them (by a reservation's answer or
	// a listing); sweepAt is when ended windows are next dropped from it.
	seen    map[WindowID]Usage
	sweepAt time.Time
}

var (
	_ Shared  = (*RedisStore)(nil)
	_ Carrier = (*RedisStore)(nil)
	_ Carrier = (*MemoryStore)(nil)
)

// NewRedisStore returns a store keeping its sums through st.
func NewRedisStore(st *cluster.Store) *RedisStore {
	return &RedisStore{st: st, tokens: map[string][]uint64{}, seen: map[WindowID]Usage{}}
}

// kind names what a reservation holds: its windows and amount.
func kind(keys []string, amount Micros) string {
	return strings.Join(keys, "\x00") + "\x00" + strconv.FormatInt(int64(amount), 10)
}

func (r *RedisStore) push(k string, token uint64) {
	r.mu.Lock()
	r.tokens[k] = append(r.tokens[k], token)
	r.mu.Unlock()
}

func (r *RedisStore) pop(k string) (uint64, bool) {
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
func (r *RedisStore) see(us []Usage, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !now.Before(r.sweepAt) {
		for id, u := range r.seen {
			if !u.End.After(now) {
				delete(r.seen, id)
			}
		}
		r.sweepAt = now.Add(sweepEvery)
	}
	for _, u := range us {
		r.seen[u.ID] = u
	}
}

func sharedWindows(ws []Window) []cluster.SpendWindow {
	out := make([]cluster.SpendWindow, len(ws))
	for i, w := range ws {
		out[i] = cluster.SpendWindow{Key: w.ID.Key(), Limit: int64(w.Limit), End: w.End, Shadow: w.Shadow, AllowSingleOverrun: w.AllowSingleOverrun}
	}
	return out
}

func windowKeys(ws []Window) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.ID.Key()
	}
	return out
}

// Reserve implements Store.
func (r *RedisStore) Reserve(ctx context.Context, ws []Window, amount Micros, now time.Time) (uint64, error) {
	sums := make([]int64, 2*len(ws))
	token, over, refused, err := r.st.ReserveSpend(ctx, sharedWindows(ws), int64(amount), sums)
	if err != nil {
		return over, err
	}
	if !refused {
		r.push(kind(windowKeys(ws), amount), token)
	}
	us := make([]Usage, len(ws))
	for i, w := range ws {
		us[i] = Usage{Window: w, Spent: Micros(sums[2*i]), Reserved: Micros(sums[2*i+1])}
	}
	r.see(us, now)
	return over, nil
}

// Settle implements Store; it never blocks.
func (r *RedisStore) Settle(ws []Window, reserved, actual Micros, _ time.Time) {
	keys := windowKeys(ws)
	if token, ok := r.pop(kind(keys, reserved)); ok {
		r.st.SettleSpend(token, keys, int64(reserved), int64(actual))
	}
}

// Release implements Store; it never blocks.
func (r *RedisStore) Release(ws []Window, reserved Micros, now time.Time) {
	r.Settle(ws, reserved, 0, now)
}

// Usage implements Store: the shared windows of every replica. While Redis cannot be asked it
// lists the windows as Redis last reported them to this replica.
func (r *RedisStore) Usage(now time.Time) []Usage {
	us, err := r.st.SpendUsage(context.Background())
	if err != nil {
		r.mu.Lock()
		out := make([]Usage, 0, len(r.seen))
		for _, u := range r.seen {
			if u.End.After(now) {
				out = append(out, u)
			}
		}
		r.mu.Unlock()
		sortUsage(out)
		return out
	}
	out := make([]Usage, 0, len(us))
	for _, u := range us {
		if x, ok := fromShared(u); ok {
			out = append(out, x)
		}
	}
	r.see(out, now)
	sortUsage(out)
	return out
}

// Get implements Store; while Redis cannot be asked it answers what Redis last reported.
func (r *RedisStore) Get(id WindowID, now time.Time) (Usage, bool) {
	u, ok, err := r.st.SpendGet(context.Background(), id.Key())
	if err != nil {
		return r.Seen(id, now)
	}
	if !ok {
		return Usage{}, false
	}
	return fromShared(u)
}

// Replicas implements Shared: the live replicas last seen.
func (r *RedisStore) Replicas() int { return r.st.Live() }

// Seen implements Shared.
func (r *RedisStore) Seen(id WindowID, now time.Time) (Usage, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u, ok := r.seen[id]
	if !ok || !u.End.After(now) {
		return Usage{}, false
	}
	return u, true
}

// AddLocal implements Shared.
func (r *RedisStore) AddLocal(ws []Window, reserved, settled Micros) {
	r.st.AddSpend(sharedWindows(ws), int64(reserved), int64(settled))
}

// Pending implements Shared.
func (r *RedisStore) Pending() map[WindowID]Pending {
	p := r.st.SpendPending()
	if len(p) == 0 {
		return nil
	}
	out := make(map[WindowID]Pending, len(p))
	for k, a := range p {
		if id, ok := parseWindowKey(k); ok {
			out[id] = Pending{Reserved: Micros(a.Reserved), Settled: Micros(a.Settled)}
		}
	}
	return out
}

// Carry implements Carrier: in Redis, where each window keeps what it carried from each other
// window, so that replicas changing zone at different moments together carry everything once.
func (r *RedisStore) Carry(moves []Move, _ time.Time) (int, error) {
	sm := make([]cluster.SpendMove, len(moves))
	for i, m := range moves {
		sm[i] = cluster.SpendMove{From: m.From.Key(), To: sharedWindows([]Window{m.To})[0]}
	}
	return r.st.CarrySpend(context.Background(), sm)
}

// PendingTotal implements Shared.
func (r *RedisStore) PendingTotal() Micros { return Micros(r.st.SpendPendingTotal()) }

// fromShared reads a shared window back.
func fromShared(u cluster.SpendUsage) (Usage, bool) {
	id, ok := parseWindowKey(u.Key)
	if !ok {
		return Usage{}, false
	}
	return Usage{
		Window: Window{ID: id, Limit: Micros(u.Limit), End: u.End, Shadow: u.Shadow},
		Spent:  Micros(u.Spent), Reserved: Micros(u.Reserved),
	}, true
}

// parseWindowKey reads WindowID.Key's "<budget>|<period>|<start>" (the budget may itself hold
// "|").
func parseWindowKey(key string) (WindowID, bool) {
	rest, start, ok1 := cutLast(key)
	budget, period, ok2 := cutLast(rest)
	p, ok3 := ParsePeriod(period)
	at, err := strconv.ParseInt(start, 10, 64)
	if !ok1 || !ok2 || !ok3 || err != nil || budget == "" {
		return WindowID{}, false
	}
	return WindowID{Budget: budget, Period: p, Start: at}, true
}

func cutLast(s string) (before, after string, ok bool) {
	i := strings.LastIndexByte(s, '|')
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}
