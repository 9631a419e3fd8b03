package cluster

// The Lua scripts of exact admission, each a constant whose comment is its contract (keys,
// arguments, answer), kept side by side as Redis runs them.

import (
	"strconv"
	"time"
)

// The Lua scripts below are the whole shared state machine. Each runs atomically in Redis, reads
// the time from Redis (so replicas' clocks never matter) and touches only keys under the
// deployment's hash tag (so in Redis Cluster every key lives in one slot).
//
// Keys, for prefix P (written "{P}"):
//
//	{P}:r             zset  replica id → lease expiry (ms, Redis time); live when expiry ≥ now
//	{P}:c:<name>      hash  "n:<replica>" → slots held, "t:<replica>" → in-flight tokens held
//	{P}:l:<replica>   hash  lease id → reservations of one admitted request (JSON)
//	{P}:rc:<replica>  set   the compartment keys in which the replica holds slots
//	{P}:w:<name>:<kind>:<window ms>  hash  slot number → amount charged, and the window's running
//	                  state: "L" → latest slot, "-1" → sum, "-2" → newest slot (see luaCommon)
//	{P}:seq           counter bumped by every change to slots, ordering published counts
//	{P}:e             hash  the epoch of the shared state: "id" → its id (made when a script
//	                  found the key missing: the state was lost, or never written), "p" → the
//	                  replicas still to rewrite or confirm their slots after an outage or a loss
//	                  (0: none), "u" → the time (ms, Redis time) at which they no longer count,
//	                  "g" → the number of the last wait started, "x:<replica>" → for each of
//	                  them, the number of the wait that first listed it
//
// and the channel "{P}:free", on which every change to slots publishes the compartments' new
// totals over live replicas, and every change of the epoch's waiting replicas publishes
// "e\t<epoch id>\t<replicas still waited for>". Spend budgets' keys ({P}:sp:…, {P}:spi,
// {P}:spq:…) and their scripts are in spend.go.
//
// Nothing read from Redis is taken on trust: a count that is not a non-negative integer, a
// window's sum or clock that cannot be, a member registered further ahead than any lease lasts,
// more live members than a deployment can have, are each refused as described where they are
// read.

// Bounds of what the scripts accept from Redis.
const (
	// MaxReplicas bounds the live members of one deployment: more are corrupt content, not
	// replicas (shares computed from them would fall to nothing).
	MaxReplicas = 1000
	// maxLeaseTTL bounds cluster.lease_ttl: a member registered further ahead than this cannot
	// have registered itself.
	maxLeaseTTL = time.Hour
	// dropBatch bounds the expired members one heartbeat drops with their state; beyond it the
	// rest are removed without looking (a real fleet never has that many).
	dropBatch = 256
)

// luaCommon is shared by the scripts: time, the window arithmetic and slot totals.
var luaCommon = luaWindows + luaSlots

// luaWindows is the part of luaCommon that the lease script uses too: time, bounds and the
// window arithmetic (a script defines every function it includes at every run).
var luaWindows = `
local SLOTS = 60
local MAXR, MAXTTL, DROPS = ` + strconv.Itoa(MaxReplicas) + `, ` + strconv.FormatInt(maxLeaseTTL.Milliseconds(), 10) + `, ` + strconv.Itoa(dropBatch) + `
local function nowms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- sane replaces a key that is not a hash (or is too large to read in bounded time) by nothing:
-- what it held then recovers as if Redis had lost it. It reports whether the key was kept.
local function sane(key, maxlen)
  local n = redis.pcall('HLEN', key)
  if type(n) == 'table' or n > maxlen then
    redis.call('UNLINK', key)
    return false
  end
  return true
end

-- count reads a count as Redis holds it: a non-negative integer, or nil for anything else (a
-- value no script writes).
local function count(v)
  local n = tonumber(v)
  if n == nil or n < 0 or n ~= math.floor(n) or n >= 2^53 then return nil end
  return n
end

-- A window's hash holds the amount charged in each slot that has one (always positive: a slot
-- refunded to nothing is deleted), and:
--   "L"   the latest slot written: the window's clock, which never runs backwards;
--   "-1"  the sum of the slot fields present;
--   "-2"  the newest slot field present (absent when there is none).
-- Every slot field lies in (L - SLOTS, L]: whatever ages out is deleted when the window is next
-- written. So reading a window takes a few fields (L, the sum, the newest slot and the current
-- slot) plus only the slots that aged out since L (none, or one, under steady traffic), instead
-- of the whole ring; only a refusal, computing its wait, reads the whole ring.
-- The sum and newest fields have negative slot numbers so that a script that knows only the
-- slot fields (an earlier version, during a rolling upgrade) takes them for slots long aged out:
-- it counts them nowhere and deletes them at its next write. A window without the sum (written
-- so, or so rewritten) is read whole, and gets its sum back at its next write.
local SUM, NEWEST = '-1', '-2'
-- AHEAD is how far (in slots: 17 windows) a window's clock may stand ahead of Redis's: time never
-- runs backwards for a window, so when Redis's clock steps back the window waits; a clock
-- further ahead was not written by a script (or Redis's clock stepped back by more than that)
-- and is reset.
local AHEAD = 1024

-- wload reads a sliding window: the sum within the window, the slot it stands at (never
-- earlier than the latest slot written: time never runs backwards for it), the amount at that
-- slot, and the amount at slot extra (when given: the slot a refund goes to).
--
-- A window is read whole, its sum and newest slot recomputed, whenever what the few fields say
-- cannot be: a clock or a sum that is not a count, a clock more than AHEAD slots ahead of
-- Redis's time, fields without the clock, a sum smaller than the current slot, or one that would go
-- negative as slots age out. (A sum lowered by hand and still plausible is believed: checking
-- it against every slot would read the whole window on every admission.)
-- Reading it whole, a slot field that is not a positive count, or lies ahead of the clock, is
-- dropped with the slots that aged out. So corrupt content never mints budget (a negative sum
-- is never believed) and never freezes a window for long (a clock far ahead is reset to Redis's
-- time).
local function wfull(w, extra)
  local cur = w.cur
  local ring, stale, sum, newest = {}, {}, 0, nil
  local all = redis.call('HGETALL', w.key)
  for i = 1, #all, 2 do
    local s = tonumber(all[i])
    if s and s >= 0 then
      local a = count(all[i + 1])
      if s <= cur - SLOTS or s > cur or a == nil or a == 0 then
        stale[#stale + 1] = all[i]
      else
        ring[s] = a
        sum = sum + a
        if newest == nil or s > newest then newest = s end
      end
    end
  end
  w.ring, w.sum, w.newest, w.at, w.wipe = ring, sum, newest, ring[cur] or 0, false
  w.stale = nil
  if #stale > 0 then w.stale = stale end
  if extra then w.extra = ring[extra] end
  return w
end

local function wload(key, slotlen, now, extra)
  local at = math.floor(now / slotlen)
  local h
  if extra then h = redis.call('HMGET', key, 'L', SUM, NEWEST, at, extra)
  else h = redis.call('HMGET', key, 'L', SUM, NEWEST, at) end
  local last, sane = -1, true
  if h[1] then
    last = count(h[1])
    if last == nil or last > at + AHEAD then last, sane = -1, false end
  end
  local cur = math.max(at, last)
  -- All fields named here, so that the table is sized once.
  local w = {key = key, slotlen = slotlen, cur = cur, now = math.max(now, cur * slotlen), last = last,
    sum = 0, newest = nil, hasnewest = h[3] ~= false, at = 0, extra = nil, stale = nil, wipe = false, ring = nil}
  if not sane or (h[1] and not h[2]) or (not h[1] and (h[2] or h[3] or h[4])) then
    -- No sum kept (or a clock that cannot be, or fields without the clock every write sets):
    -- read the window whole and keep the sum from its next write on.
    return wfull(w, extra)
  end
  if h[2] then
    w.sum = count(h[2])
    if w.sum == nil then return wfull(w, extra) end
  end
  if h[3] then
    w.newest = count(h[3])
    if w.newest == nil then return wfull(w, extra) end
  end
  if cur == at then w.at = h[4] else w.at = redis.call('HGET', key, cur) end
  if w.at then
    w.at = count(w.at)
    if w.at == nil or w.at > w.sum then return wfull(w, extra) end
  else
    w.at = 0
  end
  if extra and h[5] then
    w.extra = count(h[5])
    if w.extra == nil then return wfull(w, extra) end
  end
  if cur > last and (w.at > 0 or (w.newest and w.newest > last)) then
    -- A slot charged after the clock (only ever moved forward by a write) cannot be.
    return wfull(w, extra)
  end
  if cur > last and w.newest then
    if w.newest <= cur - SLOTS then
      -- Everything charged has aged out.
      w.wipe, w.sum, w.newest, w.at, w.extra = true, 0, nil, 0, nil
    else
      -- The slots that aged out since L: at least one, and fewer than SLOTS as the newest has not.
      local old = {}
      for s = last - SLOTS + 1, cur - SLOTS do old[#old + 1] = s end
      local v = redis.call('HMGET', key, unpack(old))
      local stale = {}
      for i = 1, #old do
        if v[i] then
          local a = count(v[i])
          if a == nil then return wfull(w, extra) end
          w.sum = w.sum - a
          stale[#stale + 1] = old[i]
        end
      end
      if w.sum < 0 then return wfull(w, extra) end
      if #stale > 0 then w.stale = stale end
    end
  end
  return w
end

-- wdrop deletes from the window what aged out.
local function wdrop(w)
  if w.wipe then
    redis.call('DEL', w.key)
    w.wipe, w.hasnewest = false, false
  elseif w.stale then
    redis.call('HDEL', w.key, unpack(w.stale))
  end
  w.stale = nil
end

-- wput writes the sum and the newest slot, and the fields and values given.
local function wput(w, ...)
  if w.newest then
    redis.call('HSET', w.key, SUM, w.sum, NEWEST, w.newest, ...)
  else
    redis.call('HSET', w.key, SUM, w.sum, ...)
    if w.hasnewest then redis.call('HDEL', w.key, NEWEST) end
  end
  w.hasnewest = w.newest ~= nil
end

-- wroom is how much may still be charged: capacity plus the debt bound, minus the sum.
local function wroom(w, cap, debt)
  return math.max(cap + debt - w.sum, 0)
end

-- wcharge adds n at the current slot (the caller bounds n) and writes the window back.
local function wcharge(w, n)
  wdrop(w)
  if n > 0 then
    w.at, w.sum, w.newest = w.at + n, w.sum + n, w.cur
    if w.ring then w.ring[w.cur] = w.at end
    wput(w, 'L', w.cur, w.cur, w.at)
  else
    wput(w, 'L', w.cur)
  end
  redis.call('PEXPIRE', w.key, (SLOTS + 1) * w.slotlen)
end

-- wrefund gives n back to slot s if s is still in the window. The window must have been loaded
-- with s as its extra slot.
local function wrefund(w, s, n)
  local have = w.extra
  if have == nil or s <= w.cur - SLOTS or s > w.cur then return end
  n = math.min(n, have)
  if n <= 0 then return end
  have = have - n
  w.sum, w.extra = w.sum - n, have
  if s == w.cur then w.at = have end
  wdrop(w)
  if have ~= 0 then
    if w.ring then w.ring[s] = have end
    wput(w, s, have)
    return
  end
  redis.call('HDEL', w.key, s)
  if w.ring then w.ring[s] = nil end
  if s == w.newest then
    -- The newest slot is gone: find the one before it (rare: a whole slot refunded).
    w.newest = nil
    for _, f in ipairs(redis.call('HKEYS', w.key)) do
      local k = tonumber(f)
      if k and k > w.cur - SLOTS and k < s and (w.newest == nil or k > w.newest) then w.newest = k end
    end
  end
  wput(w)
end

-- wwait is the time (ms) until enough charges age out for need to fit under cap. It reads the
-- whole window: it runs only on refusal.
local function wwait(w, need, cap)
  local ring = w.ring
  if ring == nil then
    ring = {}
    local h = redis.call('HGETALL', w.key)
    for i = 1, #h, 2 do
      local s = tonumber(h[i])
      if s and s >= 0 then ring[s] = tonumber(h[i + 1]) end
    end
  end
  local excess = w.sum + need - cap
  local freed = 0
  for k = w.cur - SLOTS + 1, w.cur do
    freed = freed + (ring[k] or 0)
    if freed >= excess then
      return math.max((k + SLOTS) * w.slotlen - w.now, 0)
    end
  end
  return SLOTS * w.slotlen
end

-- wreset is the time (ms) until everything charged has aged out: when the newest slot charged
-- leaves the window.
local function wreset(w)
  local k = w.newest
  if k == nil or k <= w.cur - SLOTS then return 0 end
  return math.max((k + SLOTS) * w.slotlen - w.now, 0)
end

`

// luaSlots is the part of luaCommon that exact admission's scripts use: slot totals, the
// membership and the epoch's wait.
const luaSlots = `
-- live returns whether replica r is live: registered, its registration not expired. memo keeps
-- the answers of one script run, so each replica is looked up once whatever the number of
-- compartments: the admission path never reads the membership whole (however many members a
-- corrupt set holds).
local function live(rkey, r, now, memo)
  local v = memo[r]
  if v == nil then
    local s = tonumber(redis.call('ZSCORE', rkey, r))
    v = s ~= nil and s >= now
    memo[r] = v
  end
  return v
end

-- totals sums a compartment's slots and tokens over live replicas, and replica me's part (me is
-- live; nil for none). A live replica's field that is not a count cannot be: bad is set (mine
-- when it is me's own), and the caller takes the compartment as full until that replica
-- rewrites what it holds.
local function totals(ckey, rkey, now, memo, me)
  local h = redis.call('HGETALL', ckey)
  local n, t, mn, mt, bad, mine = 0, 0, 0, 0, false, false
  for i = 1, #h, 2 do
    local f = h[i]
    local kind, r = string.sub(f, 1, 2), string.sub(f, 3)
    if (kind == 'n:' or kind == 't:') and (r == me or live(rkey, r, now, memo)) then
      local v = count(h[i + 1])
      if v == nil then
        bad = true
        if r == me then mine = true end
      elseif kind == 'n:' then
        n = n + v
        if r == me then mn = v end
      else
        t = t + v
        if r == me then mt = v end
      end
    end
  end
  return n, t, mn, mt, bad, mine
end

-- bump adds dn slots and dt tokens to replica me's part of a compartment, and returns its slots.
-- A part that is not a count (content no script writes) starts again from nothing: the
-- replica's next heartbeat finds it short of what it holds and rewrites it.
local function bump(ckey, me, dn, dt)
  local nf, tf = 'n:' .. me, 't:' .. me
  local n = redis.pcall('HINCRBY', ckey, nf, dn)
  if type(n) ~= 'number' then
    -- Not an integer: start again from nothing.
    n = math.max(dn, 0)
    redis.call('HSET', ckey, nf, n)
    redis.call('HDEL', ckey, tf)
  end
  if n <= 0 then
    redis.call('HDEL', ckey, nf, tf)
    return 0
  end
  if dt ~= 0 then
    local t = redis.pcall('HINCRBY', ckey, tf, dt)
    if type(t) ~= 'number' or t < 0 then redis.call('HSET', ckey, tf, math.max(dt, 0)) end
  end
  return n
end

-- record counts a lease of replica me in the compartments ARGV lists from index a (nc × key
-- index, tokens held), listing them in its set rc, and returns the index after them.
local function record(me, rc, a, nc, freed)
  for _ = 1, nc do
    local ckey = KEYS[tonumber(ARGV[a])]
    bump(ckey, me, 1, tonumber(ARGV[a + 1]))
    redis.call('SADD', rc, ckey)
    freed[ckey] = true
    a = a + 2
  end
  return a
end

-- announce publishes totals (a list of {key, slots, tokens}) under a new sequence number.
local function announce(chan, seqkey, list)
  local seq = redis.call('INCR', seqkey)
  local parts = {tostring(seq)}
  for _, e in ipairs(list) do
    parts[#parts + 1] = e[1] .. '\t' .. e[2] .. '\t' .. e[3]
  end
  if #parts > 1 then redis.call('PUBLISH', chan, table.concat(parts, '\n')) end
  return seq
end

-- publish announces the new totals of the compartment keys in set (a table key → true).
local function publish(chan, rkey, seqkey, set, now)
  local memo, list = {}, {}
  for ckey in pairs(set) do
    local n, t = totals(ckey, rkey, now, memo, nil)
    list[#list + 1] = {ckey, n, t}
  end
  return announce(chan, seqkey, list)
end

-- drop removes replica r's slots from every compartment it holds them in, and its leases.
local function drop(prefix, r, freed)
  local rc = prefix .. ':rc:' .. r
  for _, ckey in ipairs(redis.call('SMEMBERS', rc)) do
    redis.call('HDEL', ckey, 'n:' .. r, 't:' .. r)
    freed[ckey] = true
  end
  redis.call('DEL', rc, prefix .. ':l:' .. r)
end

-- hdel deletes fields of a hash, a thousand at a time (unpack takes only so many).
local function hdel(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

-- The epoch's wait: after an outage or a loss of the shared state, the replicas that may hold
-- slots Redis does not count are listed ("x:<replica>", "p" of them, until "u"), and every
-- replica that was cut off keeps enforcing its part of the limits until none is. holdover ends
-- the wait and says so on the channel.
local function holdover(ekey, id, chan)
  local gone = {}
  for _, f in ipairs(redis.call('HKEYS', ekey)) do
    if string.sub(f, 1, 2) == 'x:' then gone[#gone + 1] = f end
  end
  hdel(ekey, gone)
  redis.call('HSET', ekey, 'p', 0, 'u', 0)
  redis.call('PUBLISH', chan, 'e\t' .. (id or '') .. '\t0')
end

-- hold reads the epoch: its id (false when the key is missing: the state was lost, or never
-- written), the replicas still waited for and the ms left. A wait past its deadline is over.
local function hold(ekey, now, chan)
  local e = redis.call('HMGET', ekey, 'id', 'p', 'u')
  local p, u = count(e[2]) or 0, count(e[3]) or 0
  if p > 0 and u <= now then
    holdover(ekey, e[1], chan)
    p = 0
  end
  if p == 0 then u = now end
  return e[1], p, u - now
end

-- unexpect stops waiting for replica r (it rewrote or confirmed its slots, left, or expired) and
-- returns how many replicas are still waited for.
local function unexpect(ekey, id, r, chan)
  if redis.call('HDEL', ekey, 'x:' .. r) == 0 then return count(redis.call('HGET', ekey, 'p')) or 0 end
  local p = (count(redis.call('HGET', ekey, 'p')) or 1) - 1
  if p <= 0 then
    holdover(ekey, id, chan)
    return 0
  end
  redis.call('HSET', ekey, 'p', p)
  return p
end

-- expect waits (also) for every replica of list but me, until deadline at least, and returns how
-- many are waited for, the deadline and the wait's number. Replicas already waited for stay so:
-- a wait that starts again while one is under way adds to it. Each replica it lists is marked
-- with the wait's number: only a heartbeat sent once its replica had heard of that wait
-- confirms it (one sent before, and run late, says nothing of what that replica admitted
-- since it was sent).
local function expect(ekey, id, me, list, now, deadline, chan)
  local e = redis.call('HMGET', ekey, 'p', 'u', 'g')
  local p, u, g = count(e[1]) or 0, count(e[2]) or 0, (count(e[3]) or 0) + 1
  if p == 0 then u = 0 end
  for _, r in ipairs(list) do
    if r ~= me and p < MAXR and redis.call('HSETNX', ekey, 'x:' .. r, g) == 1 then p = p + 1 end
  end
  u = math.max(u, deadline)
  redis.call('HSET', ekey, 'p', p, 'u', u, 'g', g)
  redis.call('PUBLISH', chan, 'e\t' .. id .. '\t' .. p)
  return p, u, g
end

-- tidy removes members registered further ahead than any lease lasts (no replica registered
-- them), and drops expired members with their state: DROPS at most, the rest (more than a fleet
-- has) only from the membership. Returns how many members it removed without dropping state.
local function tidy(rkey, ekey, id, prefix, now, chan, freed)
  local bogus = redis.call('ZREMRANGEBYSCORE', rkey, '(' .. (now + MAXTTL), '+inf')
  local expired = redis.call('ZRANGEBYSCORE', rkey, '-inf', '(' .. now, 'LIMIT', 0, DROPS)
  for _, r in ipairs(expired) do
    drop(prefix, r, freed)
    redis.call('ZREM', rkey, r)
    unexpect(ekey, id, r, chan)
  end
  if #expired == DROPS then
    bogus = bogus + redis.call('ZREMRANGEBYSCORE', rkey, '-inf', '(' .. now)
  end
  return bogus
end
`

// luaAdmit admits one request, all or nothing: request rates and token budgets reserved at the
// estimate, and a slot in every compartment with a concurrency or in-flight-token limit.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, then compartment and window keys
//	ARGV: 1 me, 2 lease id, 3 channel, 4 number of compartments C, 5 number of windows W,
//	      then C × (key index, max slots, max tokens, tokens held, shadow),
//	      then W × (key index, capacity, debt bound, slot length ms, amount, shadow)
//
// No two windows may share a key: each window is read once and written back from what was read.
//
// Returns {status, index, retry ms, seq, C × (others' slots, others' tokens),
// W × (remaining, reset ms), shadowed} where shadowed has bit i-1 set for each window i and
// bit W+i-1 for each compartment i that refused in shadow mode (and admitted), and status is 0 admitted, 1 refused by window
// index (1-based), 2 refused by compartment index, 3 this replica is not registered (its state
// was lost, or its own part of a compartment was not a count: it must resync first). A window
// refusal is {1, index, retry ms, 0, remaining, reset ms}: the refusing window's room and when it
// is all back, for the refusal's rate-limit headers. A compartment where a live replica's part
// is not a count is full until that replica rewrites it.
var luaAdmit = luaCommon + `
local me, lease, chan = ARGV[1], ARGV[2], ARGV[3]
local nc, nw = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = nowms()
local score = tonumber(redis.call('ZSCORE', KEYS[1], me))
if not score or score < now then return {3, 0, 0, 0} end
local memo = {[me] = true}
local a = 6
local comps = {}
for i = 1, nc do
  comps[i] = {key = KEYS[tonumber(ARGV[a])], max = tonumber(ARGV[a + 1]), maxt = tonumber(ARGV[a + 2]),
    tokens = tonumber(ARGV[a + 3]), shadow = ARGV[a + 4] == '1'}
  a = a + 5
end
local wins = {}
for i = 1, nw do
  wins[i] = {key = KEYS[tonumber(ARGV[a])], cap = tonumber(ARGV[a + 1]), debt = tonumber(ARGV[a + 2]),
    slotlen = tonumber(ARGV[a + 3]), amount = tonumber(ARGV[a + 4]), shadow = ARGV[a + 5] == '1'}
  a = a + 6
end
local shadowed = 0
-- Windows first (rates before budgets: the caller orders them), without writing anything.
for i, wi in ipairs(wins) do
  local w = wload(wi.key, wi.slotlen, now)
  wi.w = w
  local need = math.min(wi.amount, wi.cap)
  if w.sum + need > wi.cap then
    if not wi.shadow then return {1, i, wwait(w, need, wi.cap), 0, wi.cap - w.sum, wreset(w)} end
    shadowed = shadowed + 2 ^ (i - 1)
  end
end
-- Then slots.
local out = {0, 0, 0, 0}
for i, c in ipairs(comps) do
  local n, t, mn, mt, bad, mine = totals(c.key, KEYS[1], now, memo, me)
  if mine then
    -- This replica's own part cannot be: drop it, and rewrite what this replica holds.
    redis.call('HDEL', c.key, 'n:' .. me, 't:' .. me)
    return {3, 0, 0, 0}
  end
  c.others, c.otherst, c.mine_t = n - mn, t - mt, mt
  local full = bad or (c.max > 0 and n >= c.max) or (c.maxt > 0 and t > 0 and t + math.min(c.tokens, c.maxt) > c.maxt)
  if full then
    if not c.shadow then
      local res = {2, i, 0, tonumber(redis.call('GET', KEYS[4])) or 0}
      for _, d in ipairs(comps) do
        if d.others == nil then
          local dn, dt, dmn, dmt = totals(d.key, KEYS[1], now, memo, me)
          d.others, d.otherst = dn - dmn, dt - dmt
        end
        res[#res + 1] = d.others
        res[#res + 1] = d.otherst
      end
      return res
    end
    shadowed = shadowed + 2 ^ (nw + i - 1)
  end
end
-- Everything fits: charge, take the slots and record the lease.
local rec = {}
for i, wi in ipairs(wins) do
  local w = wi.w
  local n = math.min(wi.amount, wroom(w, wi.cap, wi.debt))
  wcharge(w, n)
  rec[i] = {w.cur, n}
end
local list = {}
for _, c in ipairs(comps) do
  local mn = redis.call('HINCRBY', c.key, 'n:' .. me, 1)
  local mt = c.tokens
  if c.tokens > 0 then mt = redis.call('HINCRBY', c.key, 't:' .. me, c.tokens) else mt = c.mine_t end
  redis.call('SADD', KEYS[3], c.key)
  list[#list + 1] = {c.key, c.others + mn, c.otherst + mt}
end
redis.call('HSET', KEYS[2], lease, cjson.encode(rec))
if nc > 0 then out[4] = announce(chan, KEYS[4], list) end
for _, c in ipairs(comps) do
  out[#out + 1] = c.others
  out[#out + 1] = c.otherst
end
for _, wi in ipairs(wins) do
  out[#out + 1] = wi.cap - wi.w.sum
  out[#out + 1] = wreset(wi.w)
end
out[#out + 1] = shadowed
return out
`

// luaSettle settles and releases a batch of leases of this replica, and records leases it
// admitted without Redis. A lease already settled (or dropped with its replica's state) is
// skipped, and a lease already recorded is not recorded again, so a retried batch never counts
// twice.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, then compartment and window keys
//	ARGV: 1 me, 2 channel, 3 number of leases, then per lease: lease id, actual tokens,
//	      C, W, C × (key index, tokens held),
//	      W × (key index, position in the lease's record, capacity, debt bound, slot ms)
//
// actual -1 records the lease (its C slots taken) instead of settling it; it has no windows.
// Only windows that count tokens are settled (a request-rate window charged its one request at
// admission and keeps it). A lease's windows are settled from the reservations its record holds: an over-estimate is
// refunded to the slot it was charged in, an under-estimate charged now up to the debt bound.
// A record without reservations (a lease rewritten by a resync, or recorded) charges nothing:
// the request's use was counted where it was admitted; so does a record that is not one this
// script wrote. Returns the number of leases settled or recorded.
var luaSettle = luaCommon + `
local me, chan = ARGV[1], ARGV[2]
local batch = tonumber(ARGV[3])
local now = nowms()
local a = 4
local freed = {}
local settled = 0
for _ = 1, batch do
  local lease, actual = ARGV[a], tonumber(ARGV[a + 1])
  local nc, nw = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  local first = a
  a = a + nc * 2 + nw * 5
  if actual < 0 then
    if redis.call('HSETNX', KEYS[2], lease, '[]') == 1 then
      settled = settled + 1
      record(me, KEYS[3], first, nc, freed)
    end
  else
    local recs = redis.call('HGET', KEYS[2], lease)
    if recs then
      settled = settled + 1
      redis.call('HDEL', KEYS[2], lease)
      local ok, rec = pcall(cjson.decode, recs)
      if not ok or type(rec) ~= 'table' then rec = {} end
      local b = first
      for _ = 1, nc do
        local ckey, tokens = KEYS[tonumber(ARGV[b])], tonumber(ARGV[b + 1])
        b = b + 2
        if bump(ckey, me, -1, -tokens) <= 0 then redis.call('SREM', KEYS[3], ckey) end
        freed[ckey] = true
      end
      for i = 1, nw do
        local wkey, pos = KEYS[tonumber(ARGV[b])], tonumber(ARGV[b + 1])
        local cap, debt, slotlen = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
        b = b + 5
        local r = rec[pos]
        local at, held = nil, nil
        if type(r) == 'table' then at, held = count(r[1]), count(r[2]) end
        -- An exact estimate leaves the window as it is: it is not even read.
        local d = held and actual - held or 0
        if d > 0 then
          local w = wload(wkey, slotlen, now)
          wcharge(w, math.min(d, wroom(w, cap, debt)))
        elseif d < 0 and at then
          wrefund(wload(wkey, slotlen, now, at), at, -d)
        end
      end
    end
  end
end
if next(freed) ~= nil then publish(chan, KEYS[1], KEYS[4], freed, now) end
return settled
`

// luaHeartbeat renews this replica's registration, tidies the membership (dropping the state of
// replicas whose registration expired), confirms that this replica's slots are counted when the
// epoch waits for it, reads back what Redis holds as this replica's part of compartments (the
// caller checks it against what it holds), and reports the membership and the totals of the
// compartments with requests waiting here.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, 5 epoch, then M compartments this
//	      replica holds slots in, then K compartments to report
//	ARGV: 1 me, 2 lease ttl ms, 3 channel, 4 key prefix (with its hash tag), 5 the epoch this
//	      replica registered in, 6 confirm (1: every slot this replica holds is counted in Redis),
//	      7 M, 8 K, 9 the number of the last wait this replica had heard of when it took the
//	      view it confirms (a wait started later is not confirmed)
//
// Returns {registered, live, seq, waiting, wait ms left, members removed unseen, the last wait's
// number, M × (my slots, my tokens), (my most slots, my most tokens) over the other compartments
// listed as mine, K × (slots, tokens), then the live members' ids}. registered is 0 when this
// replica's registration expired or was lost, or the epoch is not the one it registered in (it
// must resync), and it is then not renewed. live is -1 when more than MaxReplicas members are
// live (corrupt content: no id is listed). A part that is not a count is -1.
var luaHeartbeat = luaCommon + `
local me, ttl, chan, prefix, myepoch = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local confirm, m, k, heard = ARGV[6] == '1', tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local now = nowms()
local id, p, left = hold(KEYS[5], now, chan)
local score = tonumber(redis.call('ZSCORE', KEYS[1], me))
local registered = 0
if id and id == myepoch and score and score >= now then
  registered = 1
  redis.call('ZADD', KEYS[1], now + ttl, me)
  if confirm and p > 0 and (count(redis.call('HGET', KEYS[5], 'x:' .. me)) or 0) <= heard then
    p = unexpect(KEYS[5], id, me, chan)
    if p == 0 then left = 0 end
  end
end
local g = count(redis.call('HGET', KEYS[5], 'g')) or 0
local freed = {}
local bogus = tidy(KEYS[1], KEYS[5], id, prefix, now, chan, freed)
local seq = tonumber(redis.call('GET', KEYS[4])) or 0
if next(freed) ~= nil then seq = publish(chan, KEYS[1], KEYS[4], freed, now) end
local ms = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'LIMIT', 0, MAXR + 1)
local n = #ms
if n > MAXR then n, ms = -1, {} end
local out = {registered, n, seq, p, left, bogus, g}
local mine = {}
for i = 1, m do
  local ckey = KEYS[5 + i]
  mine[ckey] = true
  local h = redis.call('HMGET', ckey, 'n:' .. me, 't:' .. me)
  out[#out + 1] = count(h[1] or 0) or -1
  out[#out + 1] = count(h[2] or 0) or -1
end
local xn, xt = 0, 0
if registered == 1 then
  for _, ckey in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    if not mine[ckey] then
      local h = redis.call('HMGET', ckey, 'n:' .. me, 't:' .. me)
      local cn, ct = count(h[1] or 0), count(h[2] or 0)
      if cn == nil or ct == nil then
        xn, xt = -1, -1
        break
      end
      xn, xt = math.max(xn, cn), math.max(xt, ct)
    end
  end
end
out[#out + 1] = xn
out[#out + 1] = xt
local memo = {}
for i = 1, k do
  local ckey = KEYS[5 + m + i]
  -- A live replica's part in a compartment its own set does not list: list it there, so that
  -- the replica's next heartbeat checks it.
  local h = redis.call('HGETALL', ckey)
  for j = 1, #h, 2 do
    local kind, r = string.sub(h[j], 1, 2), string.sub(h[j], 3)
    if (kind == 'n:' or kind == 't:') and r ~= '' and live(KEYS[1], r, now, memo) then
      redis.call('SADD', prefix .. ':rc:' .. r, ckey)
    end
  end
  local cn, ct = totals(ckey, KEYS[1], now, memo, nil)
  out[#out + 1] = cn
  out[#out + 1] = ct
end
for _, r in ipairs(ms) do out[#out + 1] = r end
return out
`

// luaResync replaces everything this replica holds with what it really holds: at start, after
// Redis lost its state, after the replica's registration expired, after an outage, or when what
// Redis holds as its part is not what it holds. It makes the epoch when it is missing. When the
// state was lost, or this replica was cut off (it may have admitted what Redis did not count,
// and so may the others), the epoch waits for every other replica (the live members, and those
// this replica knew) to rewrite or confirm its slots; otherwise this replica is no longer waited
// for.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, 5 epoch, then compartment keys
//	ARGV: 1 me, 2 lease ttl ms, 3 channel, 4 key prefix, 5 cut off (1), 6 number of known
//	      replicas N, N × id, then done (1: the leases given are all this replica holds; 0: it
//	      may admit more without Redis until it is available again: the epoch waits for it to
//	      confirm with a heartbeat), number of leases, then per lease: lease id, C,
//	      C × (key index, tokens held)
//
// Returns {live, seq, epoch id, waiting, wait ms left, lost (1: the epoch was missing), the last
// wait's number, then the live members' ids (none when there are more than MaxReplicas)}. An id
// this replica knew that no replica has (one with a space) keeps the wait until its deadline:
// this replica knew more replicas than it could name.
var luaResync = luaCommon + `
local me, ttl, chan, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local cutoff, known = ARGV[5] == '1', tonumber(ARGV[6])
local now = nowms()
local id, p, left = hold(KEYS[5], now, chan)
local lost = 0
if not id then
  lost = 1
  local t = redis.call('TIME')
  id = t[1] .. string.format('%06d', tonumber(t[2]))
  redis.call('DEL', KEYS[5])
  redis.call('HSET', KEYS[5], 'id', id, 'p', 0, 'u', 0)
end
local freed = {}
drop(prefix, me, freed)
redis.call('ZADD', KEYS[1], now + ttl, me)
local a = 7 + known
local done, leases = ARGV[a] == '1', tonumber(ARGV[a + 1])
a = a + 2
for _ = 1, leases do
  local lease, nc = ARGV[a], tonumber(ARGV[a + 1])
  a = record(me, KEYS[3], a + 2, nc, freed)
  redis.call('HSET', KEYS[2], lease, '[]')
end
local deadline = now + ttl
if lost == 1 or cutoff then
  -- Every live member is waited for until its registration would expire (a replica that does
  -- not renew it by then counts nowhere anyway), and, when the state was lost, the replicas
  -- this one knew for a lease of its own (their registrations were lost too).
  local list = {}
  if lost == 1 then
    for i = 1, known do list[#list + 1] = ARGV[6 + i] end
  end
  local ms = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'WITHSCORES', 'LIMIT', 0, MAXR)
  for i = 1, #ms, 2 do
    list[#list + 1] = ms[i]
    deadline = math.max(deadline, math.min(tonumber(ms[i + 1]), now + MAXTTL))
  end
  p, deadline = expect(KEYS[5], id, me, list, now, deadline, chan)
  left = deadline - now
end
local g
if done then
  p = unexpect(KEYS[5], id, me, chan)
else
  -- Waited for until it confirms (with a heartbeat, once its leases admitted without Redis
  -- are all recorded).
  p, deadline, g = expect(KEYS[5], id, me, {}, now, now + ttl, chan)
  if redis.call('HSETNX', KEYS[5], 'x:' .. me, g) == 1 then
    p = p + 1
    redis.call('HSET', KEYS[5], 'p', p)
    redis.call('PUBLISH', chan, 'e\t' .. id .. '\t' .. p)
  end
  left = deadline - now
end
if p == 0 then left = 0 end
local seq = publish(chan, KEYS[1], KEYS[4], freed, now)
local out = {redis.call('ZCOUNT', KEYS[1], now, '+inf'), seq, id, p, left, lost,
  count(redis.call('HGET', KEYS[5], 'g')) or 0}
if out[1] <= MAXR then
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'LIMIT', 0, MAXR)) do out[#out + 1] = r end
end
return out
`

// luaLeave drops this replica's slots and registration at once (graceful stop), and no longer
// waits for it.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, 5 epoch
//	ARGV: 1 me, 2 channel, 3 key prefix
var luaLeave = luaCommon + `
local me, chan, prefix = ARGV[1], ARGV[2], ARGV[3]
local now = nowms()
local freed = {}
drop(prefix, me, freed)
redis.call('ZREM', KEYS[1], me)
local id = hold(KEYS[5], now, chan)
unexpect(KEYS[5], id, me, chan)
publish(chan, KEYS[1], KEYS[4], freed, now)
return 1
`

// luaRepair deletes the keys that are not of the type the scripts write (content no script
// writes: a SET over a compartment's hash, say), so that the scripts stop failing on them. Any
// deletion loses slots: it deletes the epoch too, so that every replica rewrites what it holds
// (and waits for the others to) as after a loss of the whole state, and says so on the channel.
//
//	KEYS: the keys to check
//	ARGV: 1 channel, 2 epoch key, then per key its type: zset, hash, set, or counter (a string
//	      holding an integer)
//
// Returns "key (type)" for each key deleted.
const luaRepair = `
local bad = {}
for i, k in ipairs(KEYS) do
  local want = ARGV[i + 2]
  local t = redis.call('TYPE', k)['ok']
  local ok = t == 'none' or t == want or (want == 'counter' and t == 'string' and tonumber(redis.call('GET', k)) ~= nil)
  if not ok then
    redis.call('DEL', k)
    bad[#bad + 1] = k .. ' (' .. t .. ')'
  end
end
if #bad > 0 then
  redis.call('DEL', ARGV[2])
  redis.call('PUBLISH', ARGV[1], 'e\t\t1')
end
return bad
`
