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
// request's windows), settlements and releases are queued and sent in batches. While Redis is
// unavailable Reserve returns an error and the Ledger reserves in its own memory instead (the
// caller divides the limits by the live replicas then, as it does every other limit). Spend
// is not saved to a file in this mode: Redis keeps it.
type RedisStore struct {
	st *cluster.Store

	mu sync.Mutex
	// tokens holds the Redis tokens of reservations not settled yet, by what they reserved
	// (the windows and the amount): reservations alike are interchangeable, so a settlement
	// takes any token of its kind.
	tokens map[string][]uint64
}

// NewRedisStore returns a store keeping its sums through st.
func NewRedisStore(st *cluster.Store) *RedisStore {
	return &RedisStore{st: st, tokens: map[string][]uint64{}}
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
func (r *RedisStore) Reserve(ctx context.Context, ws []Window, amount Micros, _ time.Time) (uint64, error) {
	token, over, refused, err := r.st.ReserveSpend(ctx, sharedWindows(ws), int64(amount))
	if err == nil && !refused {
		r.push(kind(windowKeys(ws), amount), token)
	}
	return over, err
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

// Usage implements Store: the shared windows of every replica. It is empty while Redis cannot
// be reached.
func (r *RedisStore) Usage(time.Time) []Usage {
	us, err := r.st.SpendUsage(context.Background())
	if err != nil {
		return nil
	}
	out := make([]Usage, 0, len(us))
	for _, u := range us {
		if x, ok := fromShared(u); ok {
			out = append(out, x)
		}
	}
	return out
}

// Get implements Store.
func (r *RedisStore) Get(id WindowID, _ time.Time) (Usage, bool) {
	u, ok, err := r.st.SpendGet(context.Background(), id.Key())
	if err != nil || !ok {
		return Usage{}, false
	}
	return fromShared(u)
}

// fromShared reads a shared window back; its key is WindowID.Key's "<budget>|<period>|<start>"
// (the budget may itself hold "|").
func fromShared(u cluster.SpendUsage) (Usage, bool) {
	rest, start, ok1 := cutLast(u.Key)
	budget, period, ok2 := cutLast(rest)
	p, ok3 := ParsePeriod(period)
	at, err := strconv.ParseInt(start, 10, 64)
	if !ok1 || !ok2 || !ok3 || err != nil || budget == "" {
		return Usage{}, false
	}
	return Usage{
		Window: Window{ID: WindowID{Budget: budget, Period: p, Start: at}, Limit: Micros(u.Limit), End: u.End, Shadow: u.Shadow},
		Spent:  Micros(u.Spent), Reserved: Micros(u.Reserved),
	}, true
}

func cutLast(s string) (before, after string, ok bool) {
	i := strings.LastIndexByte(s, '|')
	if i < 0 {
		return s, "", false
	}
	return s[:i], s[i+1:], true
}
