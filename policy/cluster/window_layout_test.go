package cluster

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// The window layout changed: a window's hash used to hold only its slots and "L", and every
// script read it whole. legacyWindow is that layout's arithmetic, as the scripts of earlier
// versions have it. During a rolling upgrade both run against the same keys, and a window
// written by either must read right in the other.
const legacyWindow = `
-- wload reads a sliding window: its charged slots, their sum within the window and the slot it
-- stands at (never earlier than the latest slot written: time never runs backwards for it).
local function wload(key, slotlen, now)
  local h = redis.call('HGETALL', key)
  local w = {key = key, slotlen = slotlen, ring = {}, sum = 0, stale = {}, last = -1}
  for i = 1, #h, 2 do
    if h[i] == 'L' then w.last = tonumber(h[i + 1]) else w.ring[tonumber(h[i])] = tonumber(h[i + 1]) end
  end
  local cur = math.floor(now / slotlen)
  if cur < w.last then cur = w.last end
  w.cur = cur
  w.now = math.max(now, cur * slotlen)
  for s, a in pairs(w.ring) do
    if s <= cur - SLOTS then
      w.stale[#w.stale + 1] = s
      w.ring[s] = nil
    else
      w.sum = w.sum + a
    end
  end
  return w
end

-- wroom is how much may still be charged: capacity plus the debt bound, minus the sum.
local function wroom(w, cap, debt)
  return math.max(cap + debt - w.sum, 0)
end

-- wcharge adds n at the current slot (the caller bounds n) and writes the window back.
local function wcharge(w, n)
  if #w.stale > 0 then redis.call('HDEL', w.key, unpack(w.stale)) w.stale = {} end
  if n > 0 then
    redis.call('HINCRBY', w.key, w.cur, n)
    w.ring[w.cur] = (w.ring[w.cur] or 0) + n
    w.sum = w.sum + n
  end
  redis.call('HSET', w.key, 'L', w.cur)
  redis.call('PEXPIRE', w.key, (SLOTS + 1) * w.slotlen)
end

-- wrefund gives n back to slot s if s is still in the window.
local function wrefund(w, s, n)
  if #w.stale > 0 then redis.call('HDEL', w.key, unpack(w.stale)) w.stale = {} end
  local have = w.ring[s]
  if have == nil or s <= w.cur - SLOTS or s > w.cur then return end
  n = math.min(n, have)
  if n <= 0 then return end
  if have - n == 0 then redis.call('HDEL', w.key, s) w.ring[s] = nil
  else redis.call('HINCRBY', w.key, s, -n) w.ring[s] = have - n end
  w.sum = w.sum - n
end

-- wwait is the time (ms) until enough charges age out for need to fit under cap.
local function wwait(w, need, cap)
  local excess = w.sum + need - cap
  local freed = 0
  for k = w.cur - SLOTS + 1, w.cur do
    freed = freed + (w.ring[k] or 0)
    if freed >= excess then
      return math.max((k + SLOTS) * w.slotlen - w.now, 0)
    end
  end
  return SLOTS * w.slotlen
end

-- wreset is the time (ms) until everything charged has aged out.
local function wreset(w)
  for k = w.cur, w.cur - SLOTS + 1, -1 do
    if (w.ring[k] or 0) ~= 0 then return math.max((k + SLOTS) * w.slotlen - w.now, 0) end
  end
  return 0
end

`

// legacyCommon is luaCommon with the window arithmetic of the earlier layout.
var legacyCommon = func() string {
	from := strings.Index(luaCommon, "-- A window's hash holds")
	to := strings.Index(luaCommon, "-- live returns")
	if from < 0 || to < from {
		panic("luaCommon has moved its window arithmetic")
	}
	return luaCommon[:from] + strings.TrimPrefix(legacyWindow, "\n") + luaCommon[to:]
}()

var (
	legacyAdmitAt     = redis.NewScript(atInstant(legacyCommon, luaAdmit))
	legacySettleAt    = redis.NewScript(atInstant(legacyCommon, luaSettle))
	legacyWindowState = redis.NewScript(legacyCommon + strings.TrimPrefix(luaWindowState, luaCommon))
)

// Sequences in which each operation runs, at random, on the scripts of either layout count
// what the reference counts: each layout reads what the other wrote.
func TestSharedWindowMixedLayoutsMatchReference(t *testing.T) {
	rd := redistest.Standalone(t)
	h := newSharedWindows(t, rd.Addr())
	rng := rand.New(rand.NewPCG(3, 4))
	h.legacy = func() bool { return rng.IntN(2) == 0 }
	for name, seq := range diffScenarios() {
		t.Run(name, func(t *testing.T) {
			for j := range byte(4) {
				h.run(t, withJitter(seq, j))
			}
		})
	}
	t.Run("random", func(t *testing.T) {
		for range 300 {
			b := make([]byte, 3+3*(8+rng.IntN(diffMaxOps-8)))
			for i := range b {
				b[i] = byte(rng.UintN(256))
			}
			b[0] %= 32
			for i := 3; i+3 <= len(b); i += 3 {
				if rng.IntN(3) > 0 {
					b[i] = b[i]&^(7<<3) | byte(rng.IntN(6))<<3
				}
			}
			h.run(t, b)
			if t.Failed() {
				return
			}
		}
	})
}

// A window written in the earlier layout (slots and "L", no sum) is read whole once, counts
// what it held, and is rewritten with its sum at its next change; the earlier scripts then
// still read it right.
func TestSharedWindowReadsEarlierLayout(t *testing.T) {
	rd := redistest.Standalone(t)
	h := newSharedWindows(t, rd.Addr())
	ctx := context.Background()
	const capacity, sl = 100, 1000
	cur := diffBase/sl + 100
	ms := cur*sl + 500
	key := diffTag + ":w:old"
	keys := append(h.keys[:4:4], key)
	channel := diffTag + ":free"
	slot := func(k int64) string { return strconv.FormatInt(k, 10) }
	// Slot cur-61 is still in the window at L = cur-2, but not at cur.
	if err := h.rc.HSet(ctx, key, "L", cur-2, slot(cur-61), 9, slot(cur-30), 10, slot(cur-2), 7).Err(); err != nil {
		t.Fatal(err)
	}
	wantHash := func(want map[string]int64) {
		t.Helper()
		m, err := h.rc.HGetAll(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		got := make(map[string]int64, len(m))
		for f, v := range m {
			got[f], _ = strconv.ParseInt(v, 10, 64)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("window hash %v, want %v", got, want)
		}
	}
	wantState := func(st [2]int64, remaining, reset int64) {
		t.Helper()
		if st != [2]int64{remaining, reset} {
			t.Fatalf("remaining, reset %v, want [%d %d]", st, remaining, reset)
		}
	}
	v, err := windowState.Run(ctx, h.rc, []string{key}, capacity, sl, ms).Slice()
	if err != nil {
		t.Fatal(err)
	}
	// Slot cur-2 leaves the window when slot cur+58 begins.
	wantState(pair(t, v), capacity-17, (cur+58)*sl-ms)

	reply, st := h.call(t, admitAt, keys, diffMe, "old1", channel, 0, 1, 5, capacity, 0, sl, 5, 0, capacity, sl, ms)
	if r := ints(t, reply); r[0] != 0 || r[4] != capacity-22 || r[5] != (cur+60)*sl-ms {
		t.Fatalf("admission replied %v", r)
	}
	wantState(st, capacity-22, (cur+60)*sl-ms)
	wantHash(map[string]int64{"L": cur, "-1": 22, "-2": cur, slot(cur - 30): 10, slot(cur - 2): 7, slot(cur): 5})

	// Refunding the newest slot whole brings the newest back to the one before it.
	reply, st = h.call(t, settleAt, keys, diffMe, channel, 1, "old1", 0, 0, 1, 5, 1, capacity, 0, sl, capacity, sl, ms)
	if reply.(int64) != 1 {
		t.Fatalf("settled %v leases, want 1", reply)
	}
	wantState(st, capacity-17, (cur+58)*sl-ms)
	wantHash(map[string]int64{"L": cur, "-1": 17, "-2": cur - 2, slot(cur - 30): 10, slot(cur - 2): 7})

	// The earlier scripts take the sum and newest fields for slots long gone and drop them.
	ms += sl
	reply, st = h.call(t, legacyAdmitAt, keys, diffMe, "old2", channel, 0, 1, 5, capacity, 0, sl, 3, 0, capacity, sl, ms)
	if r := ints(t, reply); r[0] != 0 || r[4] != capacity-20 {
		t.Fatalf("admission by the earlier scripts replied %v", r)
	}
	wantState(st, capacity-20, (cur+61)*sl-ms)
	wantHash(map[string]int64{"L": cur + 1, slot(cur - 30): 10, slot(cur - 2): 7, slot(cur + 1): 3})
	v, err = windowState.Run(ctx, h.rc, []string{key}, capacity, sl, ms).Slice()
	if err != nil {
		t.Fatal(err)
	}
	wantState(pair(t, v), capacity-20, (cur+61)*sl-ms)
}

// countReads turns a script as atInstant does, and makes it reply {its own reply, fields of
// window KEYS[5] read, whole reads of it (HGETALL, HKEYS)}.
func countReads(common, script string) string {
	body, ok := strings.CutPrefix(script, luaCommon)
	if !ok || strings.Count(body, "local now = nowms()") != 1 {
		panic("the script does not start with luaCommon and read the time once")
	}
	body = strings.Replace(body, "local now = nowms()", "local now = tonumber(ARGV[#ARGV])", 1)
	return `
local real = redis
local reads, whole = 0, 0
local redis = setmetatable({call = function(cmd, key, ...)
  local r = real.call(cmd, key, ...)
  if key == KEYS[5] then
    if cmd == 'HGETALL' then whole, reads = whole + 1, reads + #r / 2
    elseif cmd == 'HKEYS' then whole, reads = whole + 1, reads + #r
    elseif cmd == 'HMGET' then reads = reads + select('#', ...)
    elseif cmd == 'HGET' then reads = reads + 1 end
  end
  return r
end}, {__index = real})
` + common + "local function op()\n" + body + "\nend\nlocal r = op()\nreturn {r, reads, whole}\n"
}

// Under steady traffic an admission or settlement reads a few fields of each window, not its
// whole ring of up to 60 slots; after a gap it reads the slots that aged out during the gap.
func TestSharedWindowReadsFewFields(t *testing.T) {
	rd := redistest.Standalone(t)
	h := newSharedWindows(t, rd.Addr())
	channel := diffTag + ":free"
	const capacity, sl = 1_000_000, 1000
	for _, c := range []struct {
		layout  string
		common  string
		atMost  int64 // fields read by one admission or settlement a slot after the last
		atWhole int64 // whole reads by it
	}{{"current", luaCommon, 6, 0}, {"earlier", legacyCommon, 61, 1}} {
		t.Run(c.layout, func(t *testing.T) {
			admit := redis.NewScript(countReads(c.common, luaAdmit))
			settle := redis.NewScript(countReads(c.common, luaSettle))
			key := fmt.Sprintf("%s:w:reads:%s", diffTag, c.layout)
			keys := append(h.keys[:4:4], key)
			run := func(s *redis.Script, args ...any) (reply any, reads, whole int64) {
				t.Helper()
				v, err := s.Run(context.Background(), h.rc, keys, args...).Slice()
				if err != nil || len(v) != 3 {
					t.Fatalf("script: %v %v", v, err)
				}
				return v[0], v[1].(int64), v[2].(int64)
			}
			admitAt := func(lease string, amount, ms int64) (int64, int64) {
				t.Helper()
				reply, reads, whole := run(admit, diffMe, lease, channel, 0, 1, 5, capacity, 0, sl, amount, 0, ms)
				if r := ints(t, reply); r[0] != 0 {
					t.Fatalf("admission replied %v", r)
				}
				return reads, whole
			}
			settleAt := func(lease string, actual, ms int64) (int64, int64) {
				t.Helper()
				reply, reads, whole := run(settle, diffMe, channel, 1, lease, actual, 0, 1, 5, 1, capacity, 0, sl, ms)
				if reply.(int64) != 1 {
					t.Fatalf("settled %v leases, want 1", reply)
				}
				return reads, whole
			}
			want := func(what string, reads, whole, atMost, atWhole int64) {
				t.Helper()
				if reads > atMost || whole != atWhole {
					t.Errorf("%s read %d fields and the whole window %d times, want at most %d and %d", what, reads, whole, atMost, atWhole)
				}
			}
			ms := diffBase
			// A full ring: a charge in every slot of the window.
			for k := range int64(60) {
				admitAt("fill"+strconv.FormatInt(k, 10), 10, ms+k*sl)
			}
			ms += 60 * sl
			reads, whole := admitAt("a", 10, ms)
			want("an admission", reads, whole, c.atMost, c.atWhole)
			reads, whole = settleAt("a", 4, ms+sl)
			want("a refund", reads, whole, c.atMost, c.atWhole)
			admitAt("b", 10, ms+sl)
			reads, whole = settleAt("b", 10, ms+2*sl)
			want("an exact settlement", reads, whole, 0, 0)
			admitAt("c", 10, ms+2*sl)
			reads, whole = settleAt("c", 30, ms+3*sl)
			want("a charge at settlement", reads, whole, c.atMost, c.atWhole)
			if c.layout == "current" {
				// After a gap of 20 slots, the 20 that aged out meanwhile.
				reads, whole = admitAt("d", 10, ms+23*sl)
				want("an admission after a gap", reads, whole, 4+20, 0)
				// After a gap longer than the window, nothing but the window's clock and sum.
				reads, whole = admitAt("e", 10, ms+100*sl)
				want("an admission after a long gap", reads, whole, 4, 0)
			}
		})
	}
}
