package cluster

// Shared spend windows in one file: their keys, the reservation script's arguments and replies,
// and the queue that batches settlements describe one Redis hash and change together.

// Spend windows: the sums of spend budgets (money, in micro-units of the policy's currency),
// shared by every replica. Unlike token budgets they are calendar windows (an hour, a day, a
// month in the policy's time zone), chosen by the caller: it names each window by its budget,
// period and the instant it starts, so that replicas on the same policy name the same window
// whatever Redis's own zone. Keys, for prefix P:
//
//	{P}:sp:<window key>  hash  "s" → spent (settled), "r" → reserved by requests in flight,
//	                     "l" → limit (as of the last reservation), "e" → end (Unix ms),
//	                     "h" → 1 for a shadow budget, "c" → spend carried from windows of
//	                     another time zone (counted as spent), "c:<window key>" → what was
//	                     carried from that window. Expires spendGrace after the window ends
//	                     (by Redis's clock).
//	{P}:spi              zset  window key → end (Unix ms): the windows not ended, for listing
//	{P}:spq:<replica>:<incarnation>  hash  reservation token → amount: this process's
//	                     reservations not settled yet. A settlement applies only if it removes
//	                     its token, so a batch sent again is applied once, and a reservation
//	                     whose answer was lost (a timeout) is undone exactly when it was made.
//	                     Its field "add" holds the id of the last spend this process added
//	                     (AddSpend) that Redis applied.
//
// A reservation is one script (one round trip); settlements and releases are queued and sent
// in batches with the lease settlements, at most settle_interval later, and so is spend counted
// in this process's memory while Redis did not answer (AddSpend): each addition carries an id,
// increasing in the order they are queued and sent, and Redis applies only ids above the last
// it applied, so a batch sent again is applied once without any reservation token.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// spendGrace is how long a window's key outlives the window's end, so that a settlement
// arriving just after the end (or from a replica whose clock is a little behind) finds it.
const spendGrace = 10 * time.Minute

// SpendWindow is one calendar window of one spend budget.
type SpendWindow struct {
	// Key names the window: its budget, period and start, stable across replicas.
	Key string
	// Limit is the budget, in micro-units.
	Limit int64
	// End is when the window ends.
	End    time.Time
	Shadow bool
	// AllowSingleOverrun lets a reservation larger than the limit run in a window that holds
	// nothing yet; otherwise it is refused.
	AllowSingleOverrun bool
}

// SpendUsage is a shared window's sums.
type SpendUsage struct {
	Key             string
	Limit           int64
	End             time.Time
	Shadow          bool
	Spent, Reserved int64
	// Leased is what replicas' chunks of the window hold unused (leased admission).
	Leased int64
}

// spendShared is a Store's state for spend added from this process's memory (see AddSpend).
// Its queue is guarded by the Store's pendMu.
type spendShared struct {
	// lastAdd is the id of the last addition queued.
	lastAdd uint64
	adds    []spendAdd
}

// spendAdd is a queued addition of spend counted in this process's memory.
type spendAdd struct {
	id                uint64
	reserved, settled int64
	windows           []SpendWindow
}

// spendOp is a queued settlement (or release: actual 0) of one reservation.
type spendOp struct {
	token            uint64
	reserved, actual int64
	keys             []string
}

// tokenTTL is how long this process's table of reservations outlives its last reservation;
// a process that died leaves it behind this long.
const tokenTTL = 35 * 24 * time.Hour

// luaSpendReserve reserves amount in every window, all or nothing.
//
//	KEYS: 1 the window index, 2 this process's reservations, then one key per window
//	ARGV: 1 amount, 2 grace ms, 3 token, 4 token table ttl ms, then per window: limit, end ms,
//	      shadow, allow a single overrun
//
// A window has room when spent + reserved + amount ≤ limit (reserved counting the chunks
// leased admission's replicas hold, "k"), or, when it allows a single
// overrun, when it holds nothing yet. Returns {over, refused, now ms, then per window its spent
// and reserved sums after the call}: over has bit i-1 set for each window i without room;
// refused is 1 when an enforced one had none, and then nothing changed.
const luaSpendReserve = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local amount, grace = tonumber(ARGV[1]), tonumber(ARGV[2])
local over, refused = 0, 0
local sums, leased = {}, {}
for i = 3, #KEYS do
  local a = 5 + (i - 3) * 4
  local limit, shadow, overrun = tonumber(ARGV[a]), ARGV[a + 2] == '1', ARGV[a + 3] == '1'
  local h = redis.call('HMGET', KEYS[i], 's', 'r', 'c', 'k')
  -- Leased admission's replicas hold chunks of the window ("k"): counted as reserved.
  leased[i] = tonumber(h[4]) or 0
  local s, r = (tonumber(h[1]) or 0) + (tonumber(h[3]) or 0), (tonumber(h[2]) or 0) + leased[i]
  sums[#sums + 1], sums[#sums + 2] = s, r
  local used = s + r
  if used > limit - amount and not (overrun and used == 0) then
    over = over + 2 ^ (i - 3)
    if not shadow then refused = 1 end
  end
end
if refused == 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - grace)
  redis.call('HSET', KEYS[2], ARGV[3], amount)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  for i = 3, #KEYS do
    local a = 5 + (i - 3) * 4
    local e = tonumber(ARGV[a + 1])
    sums[(i - 3) * 2 + 2] = redis.call('HINCRBY', KEYS[i], 'r', amount) + leased[i]
    redis.call('HSET', KEYS[i], 'l', ARGV[a], 'e', ARGV[a + 1], 'h', ARGV[a + 2])
    redis.call('PEXPIREAT', KEYS[i], e + grace)
    redis.call('ZADD', KEYS[1], e, KEYS[i])
  end
end
local out = {over, refused, now}
for j = 1, #sums do out[#out + 1] = sums[j] end
return out
`

// luaSpendSettle applies a batch of settlements, each only if its reservation is still
// recorded (it is removed as it is applied), so that none is applied twice and none undoes a
// reservation that was never made.
//
//	KEYS: 1 this process's reservations, then window keys
//	ARGV: 1 count, then per settlement: token, reserved, actual, n, n × key index
//
// A window that has ended (by Redis's clock) or expired is left alone: its budget has reset.
// Returns the number of settlements applied.
const luaSpendSettle = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local a, applied = 2, 0
for _ = 1, tonumber(ARGV[1]) do
  local token, reserved, actual, n = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  if redis.call('HDEL', KEYS[1], token) == 1 then
    applied = applied + 1
    for j = 0, n - 1 do
      local k = KEYS[tonumber(ARGV[a + j])]
      local e = tonumber(redis.call('HGET', k, 'e') or 0)
      if e > now then
        if reserved > 0 then
          local r = redis.call('HINCRBY', k, 'r', -reserved)
          if r < 0 then redis.call('HSET', k, 'r', 0) end
        end
        if actual > 0 then redis.call('HINCRBY', k, 's', actual) end
      end
    end
  end
  a = a + n
end
return applied
`

// luaSpendAdd adds spend counted in a process's memory to the windows, each addition once.
//
//	KEYS: 1 the window index, 2 the process's reservations (its field "add" holds the id of the
//	      last addition applied), then window keys
//	ARGV: 1 grace ms, 2 token table ttl ms, 3 count, then per addition: id, reserved, settled, n,
//	      then n × (key index, limit, end ms, shadow)
//
// An addition whose id is not above the last applied was applied already (a batch sent again)
// and changes nothing. reserved may be negative (a reservation counted here ended); a window's
// reserved sum never goes below zero. A window that has ended (by Redis's clock) is left alone.
// Returns the number of additions applied.
const luaSpendAdd = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace = tonumber(ARGV[1])
local mark = tonumber(redis.call('HGET', KEYS[2], 'add') or 0)
local a, applied = 4, 0
for _ = 1, tonumber(ARGV[3]) do
  local id, reserved, settled, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  if id > mark then
    mark, applied = id, applied + 1
    for j = 0, n - 1 do
      local b = a + j * 4
      local k, e = KEYS[tonumber(ARGV[b])], tonumber(ARGV[b + 2])
      if e > now then
        if reserved ~= 0 then
          local r = redis.call('HINCRBY', k, 'r', reserved)
          if r < 0 then redis.call('HSET', k, 'r', 0) end
        end
        if settled ~= 0 then redis.call('HINCRBY', k, 's', settled) end
        redis.call('HSET', k, 'l', ARGV[b + 1], 'e', ARGV[b + 2], 'h', ARGV[b + 3])
        redis.call('PEXPIREAT', k, e + grace)
        redis.call('ZADD', KEYS[1], e, k)
      end
    end
  end
  a = a + n * 4
end
redis.call('HSET', KEYS[2], 'add', mark)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return applied
`

var spendAddScript = redis.NewScript(luaSpendAdd)

// luaSpendCarry carries spend from windows of a time zone no longer used into the windows of
// the same budgets and periods that the zone in use makes current. Each destination keeps what
// it carried from each source ("c:<source>") and their sum ("c", counted as spent); a carry
// raises what it keeps from a source to what the source holds now (spent, reserved and what it
// carried itself, except what it carried from the destination: switching back and forth counts
// nothing twice), and never lowers it. Replicas that change zone at different moments each
// carry what the old window holds then: the last to change carries everything.
//
//	KEYS: 1 the window index, then per move: source key, destination key
//	ARGV: 1 grace ms, then per move: source window key, destination window key, destination
//	      limit, destination end ms, destination shadow
//
// A move whose source or destination has ended (by Redis's clock) is skipped. Returns the
// number of destinations changed.
const luaSpendCarry = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace = tonumber(ARGV[1])
local changed = 0
for i = 0, (#KEYS - 1) / 2 - 1 do
  local src, dst, a = KEYS[2 + 2 * i], KEYS[3 + 2 * i], 2 + 5 * i
  local h = redis.call('HMGET', src, 's', 'r', 'c', 'e', 'c:' .. ARGV[a + 1])
  local de = tonumber(ARGV[a + 3])
  if (tonumber(h[4]) or 0) > now and de > now then
    local amount = (tonumber(h[1]) or 0) + (tonumber(h[2]) or 0) + (tonumber(h[3]) or 0) - (tonumber(h[5]) or 0)
    local field = 'c:' .. ARGV[a]
    local old = tonumber(redis.call('HGET', dst, field) or 0)
    if amount > old then
      redis.call('HSET', dst, field, amount)
      redis.call('HINCRBY', dst, 'c', amount - old)
      if redis.call('HEXISTS', dst, 'l') == 0 then
        redis.call('HSET', dst, 'l', ARGV[a + 2], 'h', ARGV[a + 4])
      end
      redis.call('HSET', dst, 'e', de)
      redis.call('PEXPIREAT', dst, de + grace)
      redis.call('ZADD', KEYS[1], de, dst)
      changed = changed + 1
    end
  end
end
return changed
`

var spendCarryScript = redis.NewScript(luaSpendCarry)

// SpendMove carries the spend of window From (a key) into window To.
type SpendMove struct {
	From string
	To   SpendWindow
}

// CarrySpend carries each move's source window into its destination (see luaSpendCarry), in
// one call bounded by the write timeout, and returns how many destinations changed. It fails at
// once while the store is unavailable.
func (s *Store) CarrySpend(ctx context.Context, moves []SpendMove) (int, error) {
	if !s.available.Load() {
		return 0, ErrUnavailable
	}
	if len(moves) == 0 {
		return 0, nil
	}
	keys := make([]string, 0, 1+2*len(moves))
	keys = append(keys, s.keys.spendIndex)
	args := make([]any, 0, 1+5*len(moves))
	args = append(args, spendGrace.Milliseconds())
	for _, m := range moves {
		keys = append(keys, s.spendKey(m.From), s.spendKey(m.To.Key))
		args = append(args, m.From, m.To.Key, m.To.Limit, m.To.End.UnixMilli(), b01(m.To.Shadow))
	}
	ctx, cancel := context.WithTimeout(ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	n, err := s.run(ctx, spendCarryScript, keys, args...).Int()
	s.met.observe("spend_carry", start, err)
	return n, err
}

func (s *Store) spendKey(key string) string { return s.tag + ":sp:" + key }

// ReserveSpend reserves amount (micro-units) in every window of ws, all or nothing, waiting at
// most the configured timeout. over has bit i set for each window i without room (shadow ones
// included); refused says an enforced window had none, and then nothing was reserved. sums, when
// it has room for them, gets each window's spent and reserved sums after the call (at 2i and
// 2i+1), as Redis held them. A reservation made is settled or released with SettleSpend and its
// token. An error wraps ErrUnavailable: the store is unavailable or did not answer in time;
// nothing is held (a reservation whose answer was lost is undone in the background).
func (s *Store) ReserveSpend(ctx context.Context, ws []SpendWindow, amount int64, sums []int64) (token uint64, over uint64, refused bool, err error) {
	if !s.available.Load() {
		return 0, 0, false, ErrUnavailable
	}
	token = s.NextLease()
	keys := make([]string, 0, len(ws)+2)
	keys = append(keys, s.keys.spendIndex, s.keys.spendTokens)
	args := make([]any, 0, 4+4*len(ws))
	args = append(args, amount, spendGrace.Milliseconds(), strconv.FormatUint(token, 10), tokenTTL.Milliseconds())
	for i := range ws {
		keys = append(keys, s.spendKey(ws[i].Key))
		args = append(args, ws[i].Limit, ws[i].End.UnixMilli(), b01(ws[i].Shadow), b01(ws[i].AllowSingleOverrun))
	}
	s.rewrite.RLock()
	defer s.rewrite.RUnlock()
	cctx, cancel := context.WithTimeout(ctx, s.o.Timeout)
	start := time.Now()
	res, err := s.run(cctx, s.spendReserve, keys, args...).Int64Slice()
	cancel()
	s.met.observe("spend_reserve", start, err)
	if err != nil {
		// The script may have run without its answer reaching us: undo it, after anything
		// queued (undoing a reservation Redis never recorded does nothing).
		s.queueSpend(spendOp{token: token, reserved: amount, keys: keys[2:]})
		if ctx.Err() == nil {
			s.noteFailure(err)
		}
		return 0, 0, false, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	s.failures.Store(0)
	if len(res) < 3 {
		return 0, 0, false, fmt.Errorf("%w: short reply", ErrUnavailable)
	}
	s.noteRedisTime(start, res[2])
	if len(res) >= 3+2*len(ws) && len(sums) >= 2*len(ws) {
		copy(sums, res[3:3+2*len(ws)])
	}
	return token, uint64(res[0]), res[1] == 1, nil
}

// AddSpend queues spend this process counted in its own memory while Redis did not answer:
// reserved (negative when such a reservation ended) and settled micro-units are added to every
// window of ws, creating it if Redis has none. Additions are sent in the order they were queued,
// with the settlements, and each is applied exactly once however often a batch is sent. It
// never blocks.
func (s *Store) AddSpend(ws []SpendWindow, reserved, settled int64) {
	if reserved == 0 && settled == 0 {
		return
	}
	s.pendMu.Lock()
	if len(s.spend.adds) >= s.o.MaxPending {
		// Redis has been gone long: forget the oldest (counted).
		s.spend.adds = s.spend.adds[1:]
		s.met.dropped.Inc()
	}
	s.spend.lastAdd++
	s.spend.adds = append(s.spend.adds, spendAdd{id: s.spend.lastAdd, reserved: reserved, settled: settled,
		windows: append([]SpendWindow(nil), ws...)})
	s.setQueueLocked()
	s.pendMu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// setQueueLocked reports every queued settlement and addition. s.pendMu is held.
func (s *Store) setQueueLocked() {
	s.met.queue.Set(float64(len(s.pending) + len(s.spendPending) + len(s.spend.adds)))
}

// SpendAdded is what AddSpend queued for one window and Redis has not applied yet.
type SpendAdded struct {
	Reserved, Settled int64
}

// SpendPending returns, by window key, what AddSpend queued that Redis has not applied yet.
func (s *Store) SpendPending() map[string]SpendAdded {
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	if len(s.spend.adds) == 0 {
		return nil
	}
	out := map[string]SpendAdded{}
	for _, a := range s.spend.adds {
		for _, w := range a.windows {
			p := out[w.Key]
			p.Reserved += a.reserved
			p.Settled += a.settled
			out[w.Key] = p
		}
	}
	return out
}

// SpendPendingTotal returns the sum of what AddSpend queued that Redis has not applied yet
// (reserved plus settled, each addition once whatever its windows).
func (s *Store) SpendPendingTotal() int64 {
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	var sum int64
	for _, a := range s.spend.adds {
		sum += a.reserved + a.settled
	}
	return sum
}

// flushSpendAdds sends every queued addition, in order. On error the unsent ones stay queued;
// a batch sent again is applied once.
func (s *Store) flushSpendAdds() error {
	for {
		s.pendMu.Lock()
		n := min(len(s.spend.adds), maxBatch)
		batch := append([]spendAdd(nil), s.spend.adds[:n]...)
		s.pendMu.Unlock()
		if n == 0 {
			return nil
		}
		keys := batchKeys{keys: []string{s.keys.spendIndex, s.keys.spendTokens}}
		args := []any{spendGrace.Milliseconds(), tokenTTL.Milliseconds(), n}
		for _, a := range batch {
			args = append(args, strconv.FormatUint(a.id, 10), a.reserved, a.settled, len(a.windows))
			for _, w := range a.windows {
				args = append(args, keys.index(s.spendKey(w.Key)), w.Limit, w.End.UnixMilli(), b01(w.Shadow))
			}
		}
		if err := s.runBatch(spendAddScript, "spend_add", keys.keys, args); err != nil {
			return err
		}
		s.pendMu.Lock()
		// Drop what was sent: every addition up to the batch's last id (those dropped from the
		// front meanwhile included).
		last := batch[n-1].id
		j := 0
		for j < len(s.spend.adds) && s.spend.adds[j].id <= last {
			j++
		}
		s.spend.adds = s.spend.adds[j:]
		s.setQueueLocked()
		s.pendMu.Unlock()
	}
}

// noteRedisTime records how far Redis's clock (now, Unix ms, read during a call started at
// start) is from this replica's.
func (s *Store) noteRedisTime(start time.Time, now int64) {
	mid := start.Add(time.Since(start) / 2)
	off := time.UnixMilli(now).Sub(mid)
	s.met.clockOffset.Set(off.Seconds())
	if off > time.Second || off < -time.Second {
		if !s.skewLogged.Swap(true) {
			s.log.Warn("this replica's clock differs from Redis's by more than a second: spend windows are chosen by each replica's clock, so charges near a window's start or end may land in the neighbouring window",
				"replica", s.o.ReplicaID, "offset", off.String())
		}
	} else {
		s.skewLogged.Store(false)
	}
}

// SettleSpend queues the settlement of the reservation token of reserved micro-units in the
// windows named by keys: reserved is given back and actual charged (a release is a settlement
// with actual 0). It never blocks; settlements are sent in batches, each applied once.
func (s *Store) SettleSpend(token uint64, keys []string, reserved, actual int64) {
	ks := make([]string, len(keys))
	for i, k := range keys {
		ks[i] = s.spendKey(k)
	}
	s.queueSpend(spendOp{token: token, reserved: reserved, actual: actual, keys: ks})
}

func (s *Store) queueSpend(op spendOp) {
	s.pendMu.Lock()
	if len(s.spendPending) >= s.o.MaxPending {
		// Redis has been gone long: forget the oldest. Its reservation stays counted in Redis
		// until its window ends (on the side of refusing).
		s.spendPending = s.spendPending[1:]
		s.met.dropped.Inc()
	}
	s.spendPending = append(s.spendPending, op)
	s.setQueueLocked()
	s.pendMu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// batchKeys are the keys of a batch script: each key once, named in the arguments by its index
// (from 1, as Lua counts).
type batchKeys struct {
	keys []string
	idx  map[string]int
}

// index returns key's index, adding it.
func (b *batchKeys) index(key string) int {
	if i, ok := b.idx[key]; ok {
		return i
	}
	if b.idx == nil {
		b.idx = map[string]int{}
	}
	b.keys = append(b.keys, key)
	b.idx[key] = len(b.keys)
	return len(b.keys)
}

// runBatch runs a script off the admission path, bounded by the write timeout, and records its
// round trip as op.
func (s *Store) runBatch(sc *redis.Script, op string, keys []string, args []any) error {
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	err := s.run(ctx, sc, keys, args...).Err()
	s.met.observe(op, start, err)
	return err
}

// flushSpend sends every queued spend settlement, then every queued addition. On error the
// unsent ones stay queued, in order; a batch sent again after an error is applied once.
func (s *Store) flushSpend() error {
	if err := s.flushSpendSettlements(); err != nil {
		return err
	}
	return s.flushSpendAdds()
}

func (s *Store) flushSpendSettlements() error {
	for {
		s.pendMu.Lock()
		n := min(len(s.spendPending), maxBatch)
		batch := append([]spendOp(nil), s.spendPending[:n]...)
		s.pendMu.Unlock()
		if n == 0 {
			return nil
		}
		keys := batchKeys{keys: []string{s.keys.spendTokens}}
		args := []any{n}
		for _, op := range batch {
			args = append(args, strconv.FormatUint(op.token, 10), op.reserved, op.actual, len(op.keys))
			for _, k := range op.keys {
				args = append(args, keys.index(k))
			}
		}
		if err := s.runBatch(s.spendSettle, "spend_settle", keys.keys, args); err != nil {
			return err
		}
		s.pendMu.Lock()
		// Drop what was sent: the queue up to the batch's last settlement, unless that was
		// dropped from the front meanwhile (with everything before it).
		last := batch[n-1].token
		for j := range s.spendPending {
			if s.spendPending[j].token == last {
				s.spendPending = s.spendPending[j+1:]
				break
			}
		}
		s.setQueueLocked()
		s.pendMu.Unlock()
	}
}

// SpendUsage lists the shared windows that have not ended (by Redis's clock), bounded by the
// write timeout. It fails at once while the store is unavailable.
func (s *Store) SpendUsage(ctx context.Context) ([]SpendUsage, error) {
	if !s.available.Load() {
		return nil, ErrUnavailable
	}
	ctx, cancel := context.WithTimeout(ctx, s.o.WriteTimeout)
	defer cancel()
	// Windows that ended by this replica's clock, give or take the grace, are not asked for;
	// Redis's clock decides about the rest.
	pipe := s.client.Pipeline()
	tc := pipe.Time(ctx)
	zc := pipe.ZRangeByScore(ctx, s.keys.spendIndex, &redis.ZRangeBy{
		Min: "(" + strconv.FormatInt(time.Now().Add(-spendGrace).UnixMilli(), 10), Max: "+inf"})
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, err
	}
	return s.spendGet(ctx, zc.Val(), tc.Val())
}

// SpendGet returns one shared window's sums; ok is false when Redis holds nothing for it. It
// fails at once while the store is unavailable.
func (s *Store) SpendGet(ctx context.Context, key string) (u SpendUsage, ok bool, err error) {
	if !s.available.Load() {
		return u, false, ErrUnavailable
	}
	ctx, cancel := context.WithTimeout(ctx, s.o.WriteTimeout)
	defer cancel()
	us, err := s.spendGet(ctx, []string{s.spendKey(key)}, time.Time{})
	if err != nil || len(us) == 0 {
		return u, false, err
	}
	return us[0], true, nil
}

// spendGet reads the windows at keys, in one round trip with Redis's clock, and returns those
// that have not ended by it (or by now, when given).
func (s *Store) spendGet(ctx context.Context, keys []string, now time.Time) ([]SpendUsage, error) {
	if len(keys) == 0 {
		return nil, nil
	}
	pipe := s.client.Pipeline()
	var tc *redis.TimeCmd
	if now.IsZero() {
		tc = pipe.Time(ctx)
	}
	cmds := make([]*redis.SliceCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.HMGet(ctx, k, "s", "r", "l", "e", "h", "c", "k")
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return nil, err
	}
	if tc != nil {
		now = tc.Val()
	}
	prefix := s.tag + ":sp:"
	out := make([]SpendUsage, 0, len(keys))
	for i, c := range cmds {
		v, err := c.Result()
		if err != nil || len(v) != 7 || v[3] == nil {
			continue
		}
		num := func(x any) int64 {
			str, _ := x.(string)
			n, _ := strconv.ParseInt(str, 10, 64)
			return n
		}
		end := time.UnixMilli(num(v[3]))
		if !end.After(now) {
			continue
		}
		out = append(out, SpendUsage{Key: strings.TrimPrefix(keys[i], prefix), Spent: num(v[0]) + num(v[5]), Reserved: num(v[1]),
			Limit: num(v[2]), End: end, Shadow: num(v[4]) == 1, Leased: num(v[6])})
	}
	return out, nil
}
