package cluster

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
//
// and the channel "{P}:free", on which every change to slots publishes the compartments' new
// totals over live replicas. Spend budgets' keys ({P}:sp:…, {P}:spi, {P}:spq:…) and their
// scripts are in spend.go.

// luaCommon is shared by the scripts: time, the window arithmetic and slot totals.
const luaCommon = `
local SLOTS = 60
local function nowms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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

-- wload reads a sliding window: the sum within the window, the slot it stands at (never
-- earlier than the latest slot written: time never runs backwards for it), the amount at that
-- slot, and the amount at slot extra (when given: the slot a refund goes to).
local function wload(key, slotlen, now, extra)
  local at = math.floor(now / slotlen)
  local h
  if extra then h = redis.call('HMGET', key, 'L', SUM, NEWEST, at, extra)
  else h = redis.call('HMGET', key, 'L', SUM, NEWEST, at) end
  local last = -1
  if h[1] then last = tonumber(h[1]) end
  local cur = math.max(at, last)
  -- All fields named here, so that the table is sized once.
  local w = {key = key, slotlen = slotlen, cur = cur, now = math.max(now, cur * slotlen), last = last,
    sum = 0, newest = nil, hasnewest = h[3] ~= false, at = 0, extra = nil, stale = nil, wipe = false, ring = nil}
  if h[1] and not h[2] then
    -- No sum kept: read the window whole and keep the sum from its next write on.
    local ring, stale, sum, newest = {}, {}, 0, nil
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local s = tonumber(all[i])
      if s and s >= 0 then
        if s <= cur - SLOTS then
          stale[#stale + 1] = s
        else
          local a = tonumber(all[i + 1])
          ring[s] = a
          sum = sum + a
          if a ~= 0 and (newest == nil or s > newest) then newest = s end
        end
      end
    end
    w.ring, w.sum, w.newest, w.at = ring, sum, newest, ring[cur] or 0
    if #stale > 0 then w.stale = stale end
    if extra then w.extra = ring[extra] end
    return w
  end
  if h[2] then w.sum = tonumber(h[2]) end
  if h[3] then w.newest = tonumber(h[3]) end
  if cur == at then w.at = tonumber(h[4]) or 0 else w.at = tonumber(redis.call('HGET', key, cur)) or 0 end
  if extra and h[5] then w.extra = tonumber(h[5]) end
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
          w.sum = w.sum - tonumber(v[i])
          stale[#stale + 1] = old[i]
        end
      end
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

-- live returns the set of live replicas.
local function live(rkey, now)
  local set = {}
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', rkey, now, '+inf')) do set[r] = true end
  return set
end

-- totals sums a compartment's slots and tokens over live replicas, and this replica's part.
local function totals(ckey, alive, me)
  local h = redis.call('HGETALL', ckey)
  local n, t, mn, mt = 0, 0, 0, 0
  for i = 1, #h, 2 do
    local f = h[i]
    local r = string.sub(f, 3)
    if alive[r] then
      local v = tonumber(h[i + 1])
      if string.sub(f, 1, 2) == 'n:' then
        n = n + v
        if r == me then mn = v end
      elseif string.sub(f, 1, 2) == 't:' then
        t = t + v
        if r == me then mt = v end
      end
    end
  end
  return n, t, mn, mt
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
  local alive = live(rkey, now)
  local list = {}
  for ckey in pairs(set) do
    local n, t = totals(ckey, alive, '')
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
// was lost: it must resync first). A window refusal is {1, index, retry ms, 0, remaining, reset ms}:
// the refusing window's room and when it is all back, for the refusal's rate-limit headers.
const luaAdmit = luaCommon + `
local me, lease, chan = ARGV[1], ARGV[2], ARGV[3]
local nc, nw = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = nowms()
local score = redis.call('ZSCORE', KEYS[1], me)
if not score or tonumber(score) < now then return {3, 0, 0, 0} end
local alive = live(KEYS[1], now)
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
  local n, t, mn, mt = totals(c.key, alive, me)
  c.others, c.otherst, c.mine_t = n - mn, t - mt, mt
  local full = (c.max > 0 and n >= c.max) or (c.maxt > 0 and t > 0 and t + math.min(c.tokens, c.maxt) > c.maxt)
  if full then
    if not c.shadow then
      local res = {2, i, 0, tonumber(redis.call('GET', KEYS[4]) or 0)}
      for _, d in ipairs(comps) do
        if d.others == nil then
          local dn, dt, dmn, dmt = totals(d.key, alive, me)
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

// luaSettle settles and releases a batch of leases of this replica. A lease already settled (or
// dropped with its replica's state) is skipped, so a retried batch never settles twice.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, then compartment and window keys
//	ARGV: 1 me, 2 channel, 3 number of leases, then per lease: lease id, actual tokens,
//	      C, W, C × (key index, tokens held),
//	      W × (key index, position in the lease's record, capacity, debt bound, slot ms)
//
// Only windows that count tokens are settled (a request-rate window charged its one request at
// admission and keeps it). A lease's windows are settled from the reservations its record holds: an over-estimate is
// refunded to the slot it was charged in, an under-estimate charged now up to the debt bound.
// A record without reservations (a lease rewritten by a resync) charges nothing: the request's
// use was counted where it was admitted. Returns the number of leases settled.
const luaSettle = luaCommon + `
local me, chan = ARGV[1], ARGV[2]
local count = tonumber(ARGV[3])
local now = nowms()
local a = 4
local freed = {}
local settled = 0
for _ = 1, count do
  local lease, actual = ARGV[a], tonumber(ARGV[a + 1])
  local nc, nw = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  a = a + 4
  local recs = redis.call('HGET', KEYS[2], lease)
  local first = a
  a = a + nc * 2 + nw * 5
  if recs then
    settled = settled + 1
    redis.call('HDEL', KEYS[2], lease)
    local rec = cjson.decode(recs)
    local b = first
    for _ = 1, nc do
      local ckey, tokens = KEYS[tonumber(ARGV[b])], tonumber(ARGV[b + 1])
      b = b + 2
      local n = redis.call('HINCRBY', ckey, 'n:' .. me, -1)
      if tokens > 0 then redis.call('HINCRBY', ckey, 't:' .. me, -tokens) end
      if n <= 0 then
        redis.call('HDEL', ckey, 'n:' .. me, 't:' .. me)
        redis.call('SREM', KEYS[3], ckey)
      end
      freed[ckey] = true
    end
    for i = 1, nw do
      local wkey, pos = KEYS[tonumber(ARGV[b])], tonumber(ARGV[b + 1])
      local cap, debt, slotlen = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
      b = b + 5
      local r = rec[pos]
      -- An exact estimate leaves the window as it is: it is not even read.
      local d = r and actual - r[2] or 0
      if d > 0 then
        local w = wload(wkey, slotlen, now)
        wcharge(w, math.min(d, wroom(w, cap, debt)))
      elseif d < 0 then
        wrefund(wload(wkey, slotlen, now, r[1]), r[1], -d)
      end
    end
  end
end
if next(freed) ~= nil then publish(chan, KEYS[1], KEYS[4], freed, now) end
return settled
`

// luaHeartbeat renews this replica's leases, drops the state of replicas whose leases expired,
// and reports the membership.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, then compartment keys to report
//	ARGV: 1 me, 2 lease ttl ms, 3 channel, 4 key prefix (with its hash tag)
//
// Returns {registered, live replicas, seq, K × (slots, tokens)}: registered is 0 when this
// replica's registration had expired or was lost (its slots may have been dropped: it must
// resync), and the replica is then not renewed.
const luaHeartbeat = luaCommon + `
local me, ttl, chan, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local now = nowms()
local score = redis.call('ZSCORE', KEYS[1], me)
local registered = 0
if score and tonumber(score) >= now then
  registered = 1
  redis.call('ZADD', KEYS[1], now + ttl, me)
end
local freed = {}
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)) do
  drop(prefix, r, freed)
  redis.call('ZREM', KEYS[1], r)
end
local seq = tonumber(redis.call('GET', KEYS[4]) or 0)
if next(freed) ~= nil then seq = publish(chan, KEYS[1], KEYS[4], freed, now) end
local alive = live(KEYS[1], now)
local n = 0
for _ in pairs(alive) do n = n + 1 end
local out = {registered, n, seq}
for i = 5, #KEYS do
  local cn, ct = totals(KEYS[i], alive, '')
  out[#out + 1] = cn
  out[#out + 1] = ct
end
return out
`

// luaResync replaces everything this replica holds with what it really holds: after Redis lost
// its state, after the replica's registration expired, or at start.
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq, then compartment keys
//	ARGV: 1 me, 2 lease ttl ms, 3 channel, 4 key prefix, 5 number of leases,
//	      then per lease: lease id, C, C × (key index, tokens held)
//
// Returns {live replicas, seq}.
const luaResync = luaCommon + `
local me, ttl, chan, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local count = tonumber(ARGV[5])
local now = nowms()
local freed = {}
drop(prefix, me, freed)
redis.call('ZADD', KEYS[1], now + ttl, me)
local a = 6
for _ = 1, count do
  local lease, nc = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  for _ = 1, nc do
    local ckey, tokens = KEYS[tonumber(ARGV[a])], tonumber(ARGV[a + 1])
    a = a + 2
    redis.call('HINCRBY', ckey, 'n:' .. me, 1)
    if tokens > 0 then redis.call('HINCRBY', ckey, 't:' .. me, tokens) end
    redis.call('SADD', KEYS[3], ckey)
    freed[ckey] = true
  end
  redis.call('HSET', KEYS[2], lease, '[]')
end
local seq = publish(chan, KEYS[1], KEYS[4], freed, now)
local n = redis.call('ZCOUNT', KEYS[1], now, '+inf')
return {n, seq}
`

// luaLeave drops this replica's slots and registration at once (graceful stop).
//
//	KEYS: 1 replicas, 2 my leases, 3 my compartments, 4 seq
//	ARGV: 1 me, 2 channel, 3 key prefix
const luaLeave = luaCommon + `
local me, chan, prefix = ARGV[1], ARGV[2], ARGV[3]
local now = nowms()
local freed = {}
drop(prefix, me, freed)
redis.call('ZREM', KEYS[1], me)
publish(chan, KEYS[1], KEYS[4], freed, now)
return 1
`
