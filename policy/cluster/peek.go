package cluster

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// luaPeek finds the first of an admission's windows that has no room for its amount, charging
// nothing: what the admission script would refuse first. Admission asks it only on a refusal's
// path, when a request another step refuses (the provider's breaker, a spend budget) might be
// refused by a window first — so that exact admission refuses for the reasons, in the order, that
// leased admission and one process do.
//
//	KEYS: the window keys
//	ARGV: W × (capacity, slot length ms, amount, shadow)
//
// Returns {index (1-based, 0: every window has room), wait ms, left, reset ms}.
var luaPeek = luaCommon + `
local now = nowms()
local a = 1
for i = 1, #KEYS do
  local cap, slotlen, amount, shadow = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3] == '1'
  a = a + 4
  if not shadow then
    local w = wload(KEYS[i], slotlen, now)
    local need = math.min(amount, cap)
    if w.sum + need > cap then return {i, wwait(w, need, cap), cap - w.sum, wreset(w)} end
  end
end
return {0, 0, 0, 0}
`

// Peek is what the admission script would find of windows (in their order) for one request: the
// index of the first without room for its amount (-1: none), and that window's wait, room left
// and reset, as a window refusal reports them. It charges nothing, waits at most the configured
// timeout, and an error means nothing is known.
func (s *Store) Peek(ctx context.Context, windows []Window, r *Result) (int, error) {
	if !s.available.Load() {
		return -1, ErrUnavailable
	}
	if len(windows) == 0 {
		return -1, nil
	}
	keys := make([]string, len(windows))
	args := make([]any, 0, 4*len(windows))
	for i := range windows {
		w := &windows[i]
		keys[i] = s.windowKey(w)
		args = append(args, w.Capacity, slotMillis(w.Length), w.Amount, b01(w.Shadow))
	}
	cctx, cancel := context.WithTimeout(ctx, s.o.Timeout)
	start := time.Now()
	res, err := s.run(cctx, s.peek, keys, args...).Int64Slice()
	cancel()
	s.met.observe("peek", start, err)
	if err != nil {
		return -1, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if len(res) < 4 || res[0] < 0 || res[0] > int64(len(windows)) {
		return -1, fmt.Errorf("%w: unexpected peek answer %s", ErrUnavailable, strconv.Quote(fmt.Sprint(res)))
	}
	i := int(res[0]) - 1
	if i >= 0 {
		*r = Result{Status: RefusedWindow, Index: i, RetryAfter: time.Duration(res[1]) * time.Millisecond,
			WindowLeft: res[2], WindowReset: time.Duration(res[3]) * time.Millisecond, WindowKnown: true}
	}
	return i, nil
}
