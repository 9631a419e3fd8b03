package cluster

// The lease script below is the whole of leased admission's shared state. A replica runs it for
// one compartment at a time, every lease interval while it uses the compartment (at once when a
// request of its own waits for capacity), and never on a request's path.
//
// Keys, for key prefix P and compartment name C (every key of a compartment carries the hash tag
// {P|C}, so a Redis Cluster spreads compartments over its shards):
//
//	{P|C}:ls                     hash  the compartment's leases:
//	                                   "born"    → when the hash was made (ms, Redis time);
//	                                   "al", "ali" → the fleet's learned concurrency limit, and
//	                                   when it last rose (adaptive compartments);
//	                                   "r:<r>"   → replica r's entry, one string: the slots and
//	                                   in-flight tokens leased to it, what it last said it wants
//	                                   of each, when its leases expire (ms, Redis time), the
//	                                   number of its last report applied, and what it wants of
//	                                   each window per chunk.
//	{P|C}:w:<kind>:<window ms>   hash  a sliding window, laid out as the per-request script's
//	                                   windows are (see luaCommon); window chunks are charged to
//	                                   it when granted and refunded when given back unused.
//	{P}:le                       string the leases' epoch: "<made ms>:<f|l>", made when it
//	                                   is missing — "f" (fresh) by a replica that knew no epoch
//	                                   (a new deployment), "l" (lost) by one that knew an earlier
//	                                   one (Redis lost its state while replicas held leases).

// luaLease renews replica r's lease of one compartment and grants it a new one.
//
//	KEYS: 1 the lease hash, then (when ARGV[3] is 1, outside Redis Cluster) the epoch key and
//	      the replicas' registrations, then the window keys
//	ARGV: 1 me, 2 lease ttl ms, 3 1 if the epoch key is given, 4 recovery ms, 5 the report's
//	      number ("<incarnation>:<count>"), 6 max slots (0: none), 7 slots leased to me now, 8 slots in use, 9 slots wanted,
//	      10 max tokens (0: none), 11 tokens leased to me now, 12 tokens in use, 13 tokens wanted,
//	      14 number of windows W, 15-18 a learned limit's min, max (0: not learned), initial and
//	      step interval ms, 19-20 this replica's proposal: from the limit, to the limit (0: none),
//	      21-22 the channel on which to name the compartment, and its name, 23 what this
//	      replica's requests need ("<slots>:<tokens>": in flight, queued and asking), 24 the
//	      epoch as this replica knows it (see luaEpochCommon; "" when none), then W × (kind,
//	      capacity, debt bound, slot ms, chunk wanted, largest single need, extra to charge,
//	      returns R, R × (slot, amount), moves M, M × (from slot, to slot, amount))
//
// A replica's lease of slots (and tokens) is what it reports holding: the script trusts a
// replica's word about itself (a heartbeat rewrites its own truth) and bounds everything else it
// reads. It grows the lease, at most to the replica's max-min fair share of the limit among
// replicas' wants and never beyond what the others' leases leave; it never shrinks it (the
// replica shrinks it itself, once its requests drain, and reports the smaller lease next time),
// but returns the target the replica should shrink to. So the leases in the hash never add up to
// more than the limit, and a replica never holds more than its entry says.
//
// A window's chunk is charged to the window when granted, at most the replica's fair share (by
// the chunks replicas want) of the window's room; a single need that fits the window's room is
// granted whole. A chunk outlives the slot it was charged in: when a request takes from it in a
// later slot, the replica moves what the chunk still holds to that slot, and reports the move;
// moves apply first (what is used of a chunk then always lies in a slot no earlier than its use,
// so it ages out of the window no sooner than it should), and move no more than the origin slot
// holds. Returns are refunds to the slot a chunk was charged in (or last moved to); extra is
// what settled requests cost beyond their reservations, charged now up to the debt bound.
//
// While a compartment recovers — its hash was found missing in an epoch that may have lost it,
// or a replica found its own lease gone — no lease of slots or tokens grows: replicas re-assert
// what they hold until every holder has reported once (the recovery time is longer than the
// longest gap between a holder's reports). Windows do not recover: a window Redis lost starts
// empty, as it does for the per-request script.
//
// A learned concurrency limit (max_concurrent: adaptive) is the fleet's, kept in the hash ("al",
// and "ali": when it last rose); each replica's controller proposes how to move it.
//
// Returns {status, slots granted, slots target, tokens granted, tokens target, pressure,
// recovering, replicas holding, learned limit (0: none), the epoch, the slots and tokens every
// lease holds at most and that bound's number,
// W × (chunk granted, slot charged, remaining, reset ms, wait ms, ms until the slot charged
// ends)}.
//
// Every replica knows a bound on what the compartment's leases hold, so that while Redis is
// lost its part of the limits is its lease and an equal part of what is free under the bound.
// The hash keeps the bound ("gS", "gT") and its number ("gq"). When the leases come to hold
// more than the bound, it rises to what they hold under a new number, published to every
// replica as "g\t<number>\t<slots>\t<tokens>\t<compartment>". When they hold less, it is
// lowered to what they hold without a new number (a replica that knew the higher bound counts
// on less free room, on the safe side), at most once per recovery time: leases that shrink and
// grow back within it publish nothing. While the compartment recovers the bound is its limit:
// nothing is known to be free.
// status is 0, or 2 when the hash held more fields than a compartment can (it was rewritten).
// pressure is 1 when another replica wants more than it holds. wait is, when a single need did
// not fit, the time until it would.
var luaLease = luaWindows + luaEpochCommon + `
local MAXFIELDS = 1100
-- No replica writes an entry longer than about 200 bytes (five counts, a report number and a
-- want per window); a longer one would only make matching it slow.
local MAXENTRY = 512
local me, ttl = ARGV[1], tonumber(ARGV[2])
local hasEpoch, recov = ARGV[3] == '1', tonumber(ARGV[4])
-- The deployment's epoch as this replica knows it ("" when it knows none yet).
local known = ARGV[24]
local inc, seq = string.match(ARGV[5], '^(%d+):(%d+)$')
seq = tonumber(seq)
local maxs, hs, us, ws = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local maxt, ht, ut, wt = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local nw = tonumber(ARGV[14])
-- A learned (adaptive) concurrency limit is the fleet's: min, max, initial, the step interval
-- (ms), and this replica's proposal, from the limit it last saw (0: none) to a new one.
local amin, amax, ainit, aint = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17]), tonumber(ARGV[18])
local afrom, ato = tonumber(ARGV[19]), tonumber(ARGV[20])
-- The channel on which a replica short of its share names the compartment, and itself (empty:
-- none).
local chan, cname = ARGV[21], ARGV[22]
-- What this replica's requests need: in flight, queued and asking.
local needs, needt = string.match(ARGV[23], '^(%d+):(%d+)$')
needs, needt = tonumber(needs) or 0, tonumber(needt) or 0
local L = KEYS[1]
local wk = 2
-- Outside Redis Cluster the scripts reach the deployment's keys too: the epoch, and the
-- replicas registered (KEYS[3]).
if hasEpoch then wk = 4 end
local now = nowms()
local status = 0

-- whole reads a count: a whole number from 0 to 1e15, else nil (a value that cannot be).
local function whole(v)
  local n = tonumber(v)
  if n == nil or n < 0 or n ~= math.floor(n) or n > 1e15 then return nil end
  return n
end


if not sane(L, MAXFIELDS) then status = 2 end

-- The windows' kinds: each replica's entry says what it wants of each, per chunk; D[kind] will
-- hold the other replicas' wants.
local D, DL = {}, {}
local a = 25
for i = 1, nw do
  DL[i] = {}
  D[ARGV[a]] = DL[i]
  a = a + 8 + 2 * tonumber(ARGV[a + 7])
  a = a + 1 + 3 * (tonumber(ARGV[a]) or 0)
end

-- Read the leases, dropping entries that are expired or cannot be. A replica's entry is one
-- field, "r:<replica>" → "<slots>|<tokens>|<slots wanted>|<tokens wanted>|<expiry ms>|
-- <incarnation>:<report count>|<kind>=<chunk wanted>,…", at most MAXENTRY bytes.
-- Every report reads every entry: each is matched once, and the other replicas' go to flat
-- arrays (field F, slots S, tokens T, slots wanted WS, tokens wanted WT, chunks wanted D[kind];
-- n of them), of which the shares below need only sums in the common case.
-- The compartment's own fields besides "born": counts, read into meta.
local COUNTS = {al = true, ali = true, gq = true, gS = true, gT = true, gL = true}
local h = redis.call('HGETALL', L)
local myf = me ~= '' and 'r:' .. me
local born, mine
local meta = {}
local F, S, T, WS, WT, n = {}, {}, {}, {}, {}, 0
local bad = {}
for i = 1, #h, 2 do
  local f, v = h[i], h[i + 1]
  if f == 'born' then
    born = whole(v)
    if born == nil or born > now then born = nil; bad[#bad + 1] = f end
  elseif COUNTS[f] then
    meta[f] = whole(v)
  elseif f == myf then
    -- This replica's own: what it holds and wants it says anew; only the number of its last
    -- report applied is read.
    local es, et, ews, ewt, ex, qi, qn
    if #v <= MAXENTRY then es, et, ews, ewt, ex, qi, qn = string.match(v, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+):(%d+)|') end
    if es == nil or (#es > 15 and es + 0 > 1e15) or (#et > 15 and et + 0 > 1e15) or (#ews > 15 and ews + 0 > 1e15) or
        (#ewt > 15 and ewt + 0 > 1e15) or (#ex > 15 and ex + 0 > 1e15) then
      bad[#bad + 1] = f
    else
      mine = {q = {qi, qn + 0}}
    end
  else
    -- Another replica's: digits (so whole numbers) of at most 1e15. Its leases expire its lease
    -- ttl after its last report ran, by this same clock: an expiry beyond the longest ttl a
    -- policy may set cannot be. One beyond this replica's ttl is another replica's longer one
    -- (a slow replica, a rolling change of the cluster section): outside Redis Cluster it must
    -- be a replica registered live.
    -- (Digits convert as operands: "+ 0" costs less than a call of tonumber. A number of 15
    -- digits or fewer is below 1e15; the expiry's bound is below it too.)
    -- What it wants of windows ("<kind>=<want>" pairs, comma-separated) is, when it has one or
    -- none, matched with the rest (k, eq and dv); otherwise (ds) read pair by pair. (Every
    -- pattern here takes time linear in the entry's length.)
    local es, et, ews, ewt, ex, k, eq, dv, ds
    if #v <= MAXENTRY and string.find(f, '^r:.') then
      es, et, ews, ewt, ex, k, eq, dv = string.match(v, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|%d+:%d+|(%a*)(=?)(%d*)$')
      if es == nil then
        es, et, ews, ewt, ex, ds = string.match(v, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|%d+:%d+|(.*)$')
      end
    end
    local x = ex and ex + 0
    if es == nil or (#es > 15 and es + 0 > 1e15) or (#et > 15 and et + 0 > 1e15) or (#ews > 15 and ews + 0 > 1e15) or
        (#ewt > 15 and ewt + 0 > 1e15) or x < now or x > now + MAXTTL + 1000 or
        (hasEpoch and x > now + ttl + 1000 and (tonumber(redis.call('ZSCORE', KEYS[3], string.sub(f, 3))) or 0) < now) then
      bad[#bad + 1] = f
    else
      n = n + 1
      F[n], S[n], WS[n] = f, es + 0, ews + 0
      if maxt > 0 then T[n], WT[n] = et + 0, ewt + 0 end
      if nw > 0 then
        for j = 1, nw do DL[j][n] = 0 end
        if ds then
          for pair in string.gmatch(ds, '[^,]+') do
            local k2, dv2 = string.match(pair, '^(%w+)=(%d+)$')
            if k2 and D[k2] then D[k2][n] = whole(dv2) or 0 end
          end
        elseif eq ~= '' and k ~= '' and dv ~= '' and D[k] and (#dv < 16 or dv + 0 <= 1e15) then
          D[k][n] = dv + 0
        end
      end
    end
  end
end
if #bad > 0 then redis.call('HDEL', L, unpack(bad)) end
local al, ali, gq, gS, gT, gL = meta.al, meta.ali, meta.gq, meta.gS, meta.gT, meta.gL

-- The epoch: read (and kept) here where the script can reach its key, else as the replica last
-- learned it.
local epoch = known
if hasEpoch then epoch = epochOf(KEYS[2], known, now, recov) end
if born == nil then
  -- The hash is new: either the compartment was not in use anywhere, or Redis lost it. It was
  -- lost when the epoch is one Redis began after losing its state, less than the recovery
  -- time ago: every holder has then not reported yet, and no lease grows until they have. A
  -- hash rewritten because it could not be recovers too.
  born = now - recov
  local created, flag = string.match(epoch, '^(%d+):([fl])$')
  if status ~= 0 or created == nil then
    born = now
  elseif flag == 'l' and now - tonumber(created) < recov then
    born = tonumber(created)
  end
  redis.call('HSET', L, 'born', born)
elseif mine == nil and hs > 0 and now - born >= recov then
  -- This replica holds slots the hash does not know of: the hash lost them. Recover.
  born = now
  redis.call('HSET', L, 'born', born)
end
local recovering = now - born < recov
local hadEntry = mine ~= nil
if mine == nil then mine = {} end
-- Deltas (returns, extra) apply once per report: a report resent after its answer was lost
-- carries the number it had. A replica restarted under the same id counts anew.
local fresh = mine.q == nil or mine.q[1] ~= inc or seq > mine.q[2]

-- wmove moves n (at most what slot from holds) from slot from to the later slot to (at most the
-- window's current slot): what a chunk still held when a request took from it in a later slot.
-- The window's sum does not change. A slot that aged out holds nothing to move.
local function wmove(w, from, to, n)
  to = math.min(to, w.cur)
  if n == nil or n <= 0 or from == nil or to == nil or to <= from or from <= w.cur - SLOTS then return end
  local h = redis.call('HMGET', w.key, from, to)
  local have, there = count(h[1]) or 0, count(h[2]) or 0
  n = math.min(n, have)
  if n <= 0 then return end
  wdrop(w)
  have, there = have - n, there + n
  if to == w.cur then w.at = there end
  if w.newest == nil or to > w.newest then w.newest = to end
  if w.ring then w.ring[from], w.ring[to] = have, there end
  if have > 0 then
    wput(w, 'L', w.cur, from, have, to, there)
  else
    if w.ring then w.ring[from] = nil end
    redis.call('HDEL', w.key, from)
    wput(w, 'L', w.cur, to, there)
  end
end

-- fairshare is the max-min fair share of cap that this replica gets when it wants mine and the
-- others want W (total: their sum): in (want, replica id) order, each gets the least of its want
-- and an even part of what those before it left. Every replica computes the same order.
-- Without sorting: when the wants fit, each gets its want; else those below the level where an
-- even part stops covering a want get their want, and the rest split what they leave evenly,
-- the first in that order one more.
local function fairshare(W, total, want, cap)
  if want <= 0 then return 0 end
  if total + want <= cap then return want end
  local v = {want}
  for i = 1, n do
    if W[i] > 0 then v[#v + 1] = W[i] end
  end
  table.sort(v)
  local m, left = #v, cap
  for k = 1, m do
    local level = v[k]
    if level >= math.ceil(left / (m - k + 1)) then
      if want < level then return want end
      local before = 0
      for i = 1, n do
        local w = W[i]
        if w >= level and (w < want or (w == want and string.sub(F[i], 3) < me)) then before = before + 1 end
      end
      local even = math.floor(left / (m - k + 1))
      if before < left - even * (m - k + 1) then return even + 1 end
      return even
    end
    left = left - level
  end
  return want
end

-- lease computes the grant and the target of one held resource (the others hold H and want W),
-- of which this replica wants want, its requests use used and need need (queued ones
-- included): the grant never below what this replica holds, the target never above its fair
-- share nor what the others' leases leave (a limit lowered below the leases admits nothing new
-- until they drain).
local function lease(H, W, want, cap, held, used, need)
  if cap <= 0 then return held, held, false, 0 end
  local others, pressure, total = 0, false, 0
  for i = 1, n do
    local v, w = H[i], W[i]
    if v > cap then v = cap end
    others, total = others + v, total + w
    if w > v then pressure = true end
  end
  local fair = fairshare(W, total, want, cap)
  local room = cap - others
  local grant = held
  if not recovering and fair > held and room > held then grant = math.min(fair, room) end
  -- The target may be below what the replica uses: it then admits nothing new until its
  -- requests drain below it (a lease shrinks only as its own holdings drain).
  local target = math.max(math.min(fair, grant, room), 0)
  if need > math.max(target, used) and not recovering and chan ~= '' then
    -- Requests wait here for more than the lease gives: tell the other holders, whose wants the
    -- hash may have from before their demand fell (a steady lease reports once a renewal).
    -- They report at their next round, giving back what they do not use. The name is followed
    -- by this replica's, which hears its own publication too.
    redis.call('PUBLISH', chan, cname .. '\n' .. me)
  end
  return grant, target, pressure, others + grant
end

if amax > 0 then
  -- The learned limit: a proposal moves it by the ratio the replica's controller moved its own
  -- view of it. A cut applies at once; a raise at most once per step interval for the fleet
  -- (every replica's controller would otherwise raise it in the same interval).
  if al == nil or al < amin or al > amax then al = ainit end
  if afrom > 0 and ato > 0 and ato ~= afrom then
    local next = al * ato / afrom
    if next < al then
      al = math.max(amin, math.floor(next))
    elseif ali == nil or ali > now or now - ali >= aint then
      al = math.min(amax, math.max(al + 1, math.floor(next)))
      ali = now
      redis.call('HSET', L, 'ali', ali)
    end
  end
  redis.call('HSET', L, 'al', al)
  maxs = al
end
local gs, tgs, ps, sums = lease(S, WS, ws, maxs, hs, us, needs)
local gt, tgt, pt, sumt = lease(T, WT, wt, maxt, ht, ut, needt)
if recovering then
  -- Holders have yet to re-assert their leases: nothing is known to be free.
  sums, sumt = maxs, maxt
end
-- The bound on what the leases hold (see above). Its number is Redis's clock (ms), or one more
-- than the last: a hash Redis lost and made anew numbers its bounds after every bound before.
gq, gS, gT = gq or 0, gS or 0, gT or 0
if sums > gS or sumt > gT then
  gq, gS, gT = math.max(gq + 1, now), math.max(gS, sums), math.max(gT, sumt)
  redis.call('HSET', L, 'gq', gq, 'gS', gS, 'gT', gT)
  if chan ~= '' then redis.call('PUBLISH', chan, 'g\t' .. gq .. '\t' .. gS .. '\t' .. gT .. '\t' .. cname) end
elseif (sums < gS or sumt < gT) and (gL == nil or gL > now or now - gL >= recov) then
  gS, gT = sums, sumt
  redis.call('HSET', L, 'gS', gS, 'gT', gT, 'gL', now)
end

local out = {status, gs, tgs, gt, tgt, 0, 0, 0, al or 0, epoch, gS, gT, gq}
if ps or pt then out[6] = 1 end
if recovering then out[7] = 1 end

-- Windows.
a = 25
local ds = {}
local idle = gs == 0 and gt == 0 and ws == 0 and wt == 0
for i = 1, nw do
  local kind, cap, debt, slotlen = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local want, need, extra, nret = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  a = a + 8
  local key = KEYS[wk + i - 1]
  if not sane(key, 2 * SLOTS + 8) then status = 2 end
  local w = wload(key, slotlen, now)
  local ra = a
  a = a + 2 * nret
  local nmov = tonumber(ARGV[a]) or 0
  a = a + 1
  for _ = 1, nmov do
    local from, to, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
    if fresh then wmove(w, from, to, n) end
  end
  for k = 1, nret do
    local s, back = tonumber(ARGV[ra + 2 * k - 2]), tonumber(ARGV[ra + 2 * k - 1])
    -- A replica tells a slot's end from the answer that granted the chunk, a round trip early:
    -- a return to the slot after Redis's clock follows a move to it, which went to the clock's
    -- slot instead.
    if s ~= nil and s > w.cur then s = w.cur end
    if fresh and back > 0 and s > w.cur - SLOTS and s <= w.cur then
      w.extra = tonumber(redis.call('HGET', key, s))
      wrefund(w, s, back)
    end
  end
  if fresh and extra > 0 then
    local more = math.min(extra, wroom(w, cap, debt))
    if more > 0 then wcharge(w, more) end
  end
  if want > 0 or need > 0 then idle = false end
  -- A report that gives back or charges something keeps this replica's entry, and with it the
  -- report's number, until the next report: sent again after a lost answer, it applies nothing
  -- twice.
  if nret > 0 or extra > 0 then idle = false end
  -- Chunks come out of the window's capacity, never its debt bound (settlements' only).
  local room = math.max(cap - w.sum, 0)
  local g = 0
  if want > 0 then
    -- This replica's fair share of the window's room, by the chunks replicas want.
    local A, total = D[kind], 0
    for j = 1, n do total = total + A[j] end
    g = fairshare(A, total, want, room)
    ds[#ds + 1] = kind .. '=' .. want
  end
  local wait = 0
  if need > 0 and g < need then
    if need <= room then
      g = need
    elseif need > cap and w.sum <= 0 then
      -- More than the whole capacity: it takes an empty window, as in one process.
      g = math.min(need, cap + debt)
    else
      wait = wwait(w, math.min(need, cap), cap)
    end
  end
  if g > 0 then wcharge(w, g) end
  out[#out + 1] = g
  out[#out + 1] = w.cur
  out[#out + 1] = cap - w.sum
  out[#out + 1] = wreset(w)
  out[#out + 1] = wait
  out[#out + 1] = (w.cur + 1) * slotlen - w.now
end

-- Write this replica's entry (or drop it: an idle replica holds nothing).
if idle then
  if hadEntry then redis.call('HDEL', L, 'r:' .. me) end
else
  local q = ARGV[5]
  if not fresh then q = mine.q[1] .. ':' .. mine.q[2] end
  redis.call('HSET', L, 'r:' .. me, gs .. '|' .. gt .. '|' .. ws .. '|' .. wt .. '|' .. (now + ttl) .. '|' .. q .. '|' .. table.concat(ds, ','))
  n = n + 1
end
out[8] = n
-- Keep the hash (and its birth) a good while after the last holder left, so that a compartment
-- coming back is not taken for one that lost its state.
redis.call('PEXPIRE', L, math.max(3600000, 4 * ttl))
return out
`

// luaEpochCommon keeps the deployment's epoch. A replica passes the epoch it knows. When the
// key is missing (or holds what cannot be), the epoch is made anew: lost when the replica knew
// another one (Redis lost its state under a running fleet), fresh when it knew none (a new
// deployment, or a replica's first call). A fresh epoch younger than the recovery time that a
// replica knowing an earlier epoch finds is one a replica started meanwhile made: it is marked
// lost. A compartment hash made in a lost epoch's recovery time recovers (no lease grows until
// every holder has reported); in a fresh epoch, or later, it is new.
const luaEpochCommon = `
local function epochOf(key, known, now, recov)
  local ep = redis.pcall('GET', key)
  if type(ep) == 'table' then redis.call('DEL', key); ep = false end
  local created, flag
  if ep then created, flag = string.match(ep, '^(%d+):([fl])$') end
  if created == nil or tonumber(created) > now then
    if known ~= '' then flag = 'l' else flag = 'f' end
    ep = now .. ':' .. flag
    redis.call('SET', key, ep)
  elseif known ~= '' and known ~= ep and flag == 'f' and now - tonumber(created) < recov then
    ep = created .. ':l'
    redis.call('SET', key, ep)
  end
  return ep
end
`

// luaEpoch returns the deployment's epoch, keeping it as luaEpochCommon says: a replica learns
// it at start and every renewal, so that it knows the epoch before Redis can lose it.
//
//	KEYS: 1 the epoch key
//	ARGV: 1 the epoch this replica knows ("" when none), 2 recovery ms
var luaEpoch = luaWindows + luaEpochCommon + `
return epochOf(KEYS[1], ARGV[1], nowms(), tonumber(ARGV[2]))
`
