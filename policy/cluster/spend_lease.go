package cluster

// Leased spend windows in one file: a round's report of a window is built, sent and applied under
// the window's lease, and the chunk a request reserves from is the one the last report granted.

import (
	"context"
	"fmt"
	"math"
	"sort"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Spend windows leased (cluster.admission: leased). A spend window is a calendar window (an hour,
// a day, a month of the policy's time zone) kept in the hash its exact admission keeps (see
// spend.go): a replica holds a chunk of it, charged to the window when granted, reserves each
// request's worst case from the chunk here, settles it here to its real cost, and reports at its
// lease rounds what it spent, what its requests in flight reserved, and what of the chunk it did
// not use. Fields of a window's hash beyond exact admission's:
//
//	"k"        what replicas' chunks hold unused (counted against the limit, as "r" is)
//	"t"        until when the window is tight (ms, Redis time): a need did not fit while other
//	           replicas held unused chunks; no chunk is granted beyond needs until then, and
//	           every holder gives its unused chunk back at once
//	"q:<r>"    replica r's part: "<in flight>|<unused>|<wanted>|<expiry ms>". Its in-flight
//	           reservations are counted in "r", its unused chunk in "k". An expired part gives
//	           its unused chunk back and keeps its in-flight reservations counted until the
//	           window ends (expiry 0), as a killed replica's reservations are with exact admission.
//
// A round's reports of every spend window are one script (all spend windows share the
// deployment's hash tag). What a report adds (the spend settled since the last) applies once: the
// round carries a number, and Redis keeps the last applied in this process's reservation table
// (field "lsq"); a round sent again after a lost answer carries its number and its additions
// again, so they count once. Everything else a report says is absolute (what is in flight, what is
// unused), so a report sent twice changes nothing more.

// spendChunkIntervals is how many lease intervals of a window's recent pace a chunk holds; a
// replica asks for more when it holds less than half of that.
const spendChunkIntervals = 2 * spendRenewSteps

// spendLeases are this replica's parts of the spend windows it reserves in.
type spendLeases struct {
	l *Leaser
	// script is luaSpendLease.
	script *redis.Script
	// seen, when set, is told each window's sums as a report's answer found them.
	seen func(SpendUsage)

	mu   sync.Mutex
	wins map[string]*spendLease
	seq  int64
	// resend is the round whose answer was lost: the next round carries its number and its
	// additions, so that Redis applies them once.
	resend *spendReport
}

// spendLease is this replica's part of one spend window, in micro-units.
type spendLease struct {
	w SpendWindow
	// avail is the unused chunk, inflight what requests reserved from it and hold, spent what
	// settled since the last report. Redis counts avail and inflight (as last reported, plus
	// grants) in the window: avail + inflight here never exceeds it.
	avail, inflight, spent int64
	// used is what was reserved since the last report; rate its average per interval.
	used int64
	rate float64
	// need is the largest reservation waiting for more than avail, needSum what all of them
	// want.
	need, needSum int64
	// At the last report: the window's room after grants, and whether it was tight (answered:
	// a report was answered).
	room            int64
	tight, answered bool
	// validUntil is until when avail may be used: the last answered report, plus the lease's
	// validity.
	validUntil time.Time
	// reported: what Redis has of this part (in flight, unused, wanted) as of the last answer.
	reportedIn, reportedUnused, reportedWant int64
	lastSent                                 time.Time
	urgent                                   bool
}

// spendReport is one round's report of spend windows.
type spendReport struct {
	seq    int64
	wins   []*spendLease
	spent  []int64
	unused []int64
	keys   []string
	args   []any
}

func newSpendLeases(l *Leaser) *spendLeases {
	return &spendLeases{l: l, script: redis.NewScript(luaSpendLease), wins: map[string]*spendLease{}}
}

// ReserveSpendLeased reserves amount in every window of ws from this replica's chunks, all or
// nothing. When a chunk is short it asks for a round of reports at once and waits for it, until
// cluster.timeout; over has bit i set for each window i that has no room for amount (the request
// is refused). An error wraps ErrUnavailable: Redis did not answer in time, or is gone, and the
// caller decides on its own (nothing is held).
func (l *Leaser) ReserveSpendLeased(ctx context.Context, ws []SpendWindow, amount int64) (over uint64, err error) {
	sp := l.spend
	now := l.o.Now()
	deadline := now.Add(l.st.o.Timeout)
	var needed uint64
	defer func() {
		if needed != 0 {
			sp.unneed(ws, needed, amount)
		}
	}()
	for answered := false; ; answered = true {
		over, short := sp.take(ws, amount, now, answered)
		switch {
		case short == 0:
			return 0, nil
		case over != 0:
			return over, nil
		}
		if needed == 0 {
			sp.needFor(ws, short, amount)
			needed = short
		}
		if !l.st.Available() {
			return 0, ErrUnavailable
		}
		if !l.Await(ctx, "spend", deadline.Sub(l.o.Now())) {
			if answered && ctx.Err() == nil && l.st.Available() && l.Answering() {
				// Redis answered a round for this request, but the chunks could not cover it in
				// time (other replicas hold what is left, and did not give it back yet).
				return short, nil
			}
			// No round ended in time for this request: Redis is slow, and that says nothing
			// about the window's room (a refusal would name the budget and its reset).
			return 0, fmt.Errorf("%w: no lease round answered within %s", ErrUnavailable, l.st.o.Timeout)
		}
		now = l.o.Now()
	}
}

// Await asks for a round of reports now and waits, at most left, for it to end; it reports
// whether the round ended in time. kind names what the waiting request lacks, for the metric.
func (l *Leaser) Await(ctx context.Context, kind string, left time.Duration) bool {
	if left <= 0 {
		return false
	}
	l.CountWait(kind)
	return l.awaitRound(ctx, left)
}

// awaitRound starts a round of reports now and waits, at most left, for it to end; it reports
// whether the round ended in time.
func (l *Leaser) awaitRound(ctx context.Context, left time.Duration) bool {
	next := l.Next()
	l.Kick()
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case <-next:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// take reserves amount in every window of ws if each chunk covers it. short has bit i set for
// each window i whose chunk does not; over for each of those that cannot have room: the amount is
// more than the whole limit (and no single overrun is allowed), or, after a round (answered), the
// window had too little room left and no other replica's unused chunk to give back (not tight).
func (sp *spendLeases) take(ws []SpendWindow, amount int64, now time.Time, answered bool) (over, short uint64) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	var parts [64]*spendLease
	for i := range ws {
		a := sp.part(ws[i])
		parts[i] = a
		if a.usable(now) >= amount {
			continue
		}
		short |= 1 << uint(i)
		if amount > ws[i].Limit && !ws[i].AllowSingleOverrun || answered && a.answered && !a.tight && a.room < amount {
			over |= 1 << uint(i)
		}
	}
	if short != 0 {
		return over, short
	}
	for i := range ws {
		a := parts[i]
		a.avail -= amount
		a.inflight += amount
		a.used += amount
	}
	return 0, 0
}

// part returns this replica's part of window w, making it.
func (sp *spendLeases) part(w SpendWindow) *spendLease {
	a := sp.wins[w.Key]
	if a == nil {
		a = &spendLease{w: w, urgent: true}
		sp.wins[w.Key] = a
	}
	a.w.Limit, a.w.AllowSingleOverrun = w.Limit, w.AllowSingleOverrun
	return a
}

func (a *spendLease) usable(now time.Time) int64 {
	if now.Before(a.validUntil) {
		return a.avail
	}
	return 0
}

// needFor asks the next round for amount more in each window of ws that mask names.
func (sp *spendLeases) needFor(ws []SpendWindow, mask uint64, amount int64) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	for i := range ws {
		if mask&(1<<uint(i)) != 0 {
			a := sp.part(ws[i])
			a.need = max(a.need, amount)
			a.needSum += amount
			a.urgent = true
		}
	}
}

// unneed withdraws what needFor asked for.
func (sp *spendLeases) unneed(ws []SpendWindow, mask uint64, amount int64) {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	for i := range ws {
		if mask&(1<<uint(i)) == 0 {
			continue
		}
		if a := sp.wins[ws[i].Key]; a != nil {
			a.needSum = max(a.needSum-amount, 0)
			if a.needSum == 0 {
				a.need = 0
			}
		}
	}
}

// SettleSpendLeased settles a reservation of reserved made by ReserveSpendLeased at actual: what
// it reserved beyond actual goes back to the chunk; what it cost beyond it is taken from the chunk,
// and what the chunk does not cover is spent beyond the window's room, as a settlement is with
// exact admission. The spend reaches Redis at a coming report. It never blocks.
func (l *Leaser) SettleSpendLeased(ws []SpendWindow, reserved, actual int64) {
	sp := l.spend
	sp.mu.Lock()
	defer sp.mu.Unlock()
	for i := range ws {
		a := sp.wins[ws[i].Key]
		if a == nil {
			continue
		}
		a.inflight = max(a.inflight-reserved, 0)
		if actual <= reserved {
			a.avail += reserved - actual
		} else {
			a.avail -= min(a.avail, actual-reserved)
		}
		a.spent += actual
	}
}

// SpendLeasedPending returns what this replica settled in its spend chunks that Redis has not
// applied yet.
func (l *Leaser) SpendLeasedPending() int64 {
	sp := l.spend
	sp.mu.Lock()
	defer sp.mu.Unlock()
	var n int64
	for _, a := range sp.wins {
		n += a.spent
	}
	if r := sp.resend; r != nil {
		for _, s := range r.spent {
			n += s
		}
	}
	return n
}

// tighten marks the window named key tight: another replica needs what this one's chunk holds
// unused. It is given back at once.
func (sp *spendLeases) tighten(key string) bool {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	a := sp.wins[key]
	if a == nil {
		return false
	}
	a.tight, a.urgent = true, true
	return true
}

// FlushSpend sends what this replica's chunks settled and Redis does not have yet, at a round
// started now, and waits for that round (at most wait). A carry of spend into a new time zone's
// windows runs after it, so that it moves this replica's latest spend too, instead of leaving
// it to land in the old zone's window at the next report.
func (l *Leaser) FlushSpend(wait time.Duration) {
	sp := l.spend
	sp.mu.Lock()
	owed := false
	for _, a := range sp.wins {
		if a.spent != 0 {
			a.urgent, owed = true, true
		}
	}
	sp.mu.Unlock()
	if owed && l.st.Available() {
		l.awaitRound(l.ctx, wait)
	}
}

// build makes the round's report of the spend windows that are due (nil when none is). final
// gives every unused chunk back.
func (sp *spendLeases) build(now time.Time, final bool) *spendReport {
	l := sp.l
	sp.mu.Lock()
	defer sp.mu.Unlock()
	prev := sp.resend
	resent := map[*spendLease]int{}
	if prev != nil {
		for i, a := range prev.wins {
			resent[a] = i
		}
	}
	r := &spendReport{}
	if prev != nil {
		r.seq = prev.seq
	} else {
		sp.seq++
		r.seq = sp.seq
	}
	for key, a := range sp.wins {
		_, again := resent[a]
		ended := !now.Before(a.w.End)
		if !again && !final && !a.due(now, l) {
			if ended && a.inflight == 0 && a.spent == 0 || a.idle() && now.Sub(a.lastSent) >= l.spendRenew {
				delete(sp.wins, key)
			}
			continue
		}
		if prev == nil {
			// The pace is measured between answered reports: while Redis does not answer, the
			// chunk is kept whole for the requests that come meanwhile.
			elapsed := now.Sub(a.lastSent)
			per := float64(a.used)
			if !a.lastSent.IsZero() && elapsed > 0 {
				per = per * float64(l.o.Interval) / float64(max(elapsed, l.o.Interval/4))
			}
			a.rate = 0.5*a.rate + 0.5*per
			a.used = 0
		}
		a.lastSent, a.urgent = now, false
		// Keep a chunk of spendChunkIntervals at the recent pace; give back what is beyond it
		// (everything while the window is tight, or at the end), unless a report went unanswered.
		target := int64(math.Ceil(spendChunkIntervals * a.rate))
		if a.tight || final || ended {
			target = 0
		}
		if !final && !ended && a.needSum > 0 && a.avail >= a.needSum {
			// A chunk granted for the requests waiting on this window, not taken yet, stays
			// theirs until they look again. (One that covers them only in part goes back as
			// before, so that two replicas each holding half cannot wait on each other.)
			target = max(target, a.needSum)
		}
		want := max(target-a.avail, 0)
		if a.avail > target && (prev == nil || target == 0) {
			a.avail = target
		}
		want = max(want, a.needSum-a.avail)
		need := a.need
		if a.avail >= a.needSum {
			// Already covered: asking again would only make the window look short.
			need = 0
		}
		if final || ended {
			want, need = 0, 0
		}
		var spent int64
		if i, ok := resent[a]; ok {
			spent = prev.spent[i]
		} else if prev == nil {
			spent, a.spent = a.spent, 0
		}
		r.wins = append(r.wins, a)
		r.spent = append(r.spent, spent)
		r.unused = append(r.unused, a.avail)
		r.args = append(r.args, a.w.Key, a.w.Limit, a.w.End.UnixMilli(), b01(a.w.AllowSingleOverrun), spent, a.inflight, a.avail, want, need)
		a.reportedWant = want
	}
	// A window of the lost round that is gone here (ended) still sends its additions.
	if prev != nil {
		for i, a := range prev.wins {
			if sp.wins[a.w.Key] != a {
				r.wins = append(r.wins, a)
				r.spent = append(r.spent, prev.spent[i])
				r.unused = append(r.unused, 0)
				r.args = append(r.args, a.w.Key, a.w.Limit, a.w.End.UnixMilli(), b01(a.w.AllowSingleOverrun), prev.spent[i], 0, 0, 0, 0)
			}
		}
	}
	if len(r.wins) == 0 {
		if prev == nil {
			sp.seq--
		}
		return nil
	}
	st := l.st
	r.keys = make([]string, 0, 2+len(r.wins))
	r.keys = append(r.keys, st.keys.spendIndex, st.keys.spendTokens)
	for _, a := range r.wins {
		r.keys = append(r.keys, st.spendKey(a.w.Key))
	}
	head := []any{st.o.ReplicaID, st.o.LeaseTTL.Milliseconds(), spendGrace.Milliseconds(), l.spendRenew.Milliseconds(), r.seq,
		tokenTTL.Milliseconds(), l.channel, len(r.wins)}
	r.args = append(head, r.args...)
	return r
}

// due says whether the part should be reported at this round.
func (a *spendLease) due(now time.Time, l *Leaser) bool {
	target := spendChunkIntervals * a.rate
	switch {
	case a.urgent || a.needSum > 0:
		return true
	case a.rate > 0.01 && float64(a.avail) < target/2 && !a.tight:
		// Running low at the recent pace.
		return true
	case a.idle() && a.reportedIn == 0 && a.reportedUnused == 0 && a.reportedWant == 0:
		return false
	}
	// Renewed (and what was spent added) at least every renewal.
	return now.Sub(a.lastSent) >= l.spendRenew
}

// idle: the part holds, wants and owes nothing here.
func (a *spendLease) idle() bool {
	return a.avail == 0 && a.inflight == 0 && a.spent == 0 && a.needSum == 0 && a.rate <= 0.01
}

// apply takes the answer to report r sent at now.
func (sp *spendLeases) apply(r *spendReport, res []int64, now time.Time) {
	l := sp.l
	sp.mu.Lock()
	sp.resend = nil
	var seen []SpendUsage
	if len(res) >= 1 && res[0] == 1 {
		for i, a := range r.wins {
			o := 1 + 7*i
			if o+6 >= len(res) {
				break
			}
			g, s, rs, k, tight, accepted, room := res[o], res[o+1], res[o+2], res[o+3], res[o+4] == 1, res[o+5], res[o+6]
			if accepted < r.unused[i] {
				// Redis had let this part's chunk go (it expired): only what the window had room
				// for is this replica's again.
				a.avail = max(a.avail-(r.unused[i]-accepted), 0)
			}
			a.avail += g
			a.reportedIn, a.reportedUnused = a.inflight, accepted+g
			a.tight, a.room, a.answered = tight, room, true
			a.validUntil = now.Add(l.validFor())
			seen = append(seen, SpendUsage{Key: a.w.Key, Limit: a.w.Limit, End: a.w.End, Spent: s, Reserved: rs, Leased: k})
		}
	}
	f := sp.seen
	sp.mu.Unlock()
	if f != nil {
		for _, u := range seen {
			f(u)
		}
	}
}

// failed keeps report r to be sent again.
func (sp *spendLeases) failed(r *spendReport) {
	sp.mu.Lock()
	sp.resend = r
	for _, a := range r.wins {
		a.urgent = true
	}
	sp.mu.Unlock()
}

// spendReply reads a spend lease script's answer.
func spendReply(c *redis.Cmd) ([]int64, error) {
	v, err := c.Int64Slice()
	if err != nil {
		return nil, err
	}
	return v, nil
}

// SpendLeaseInfo is this replica's chunk of one spend window, in micro-units: unused, reserved by
// its requests in flight, and settled here but not reported yet.
type SpendLeaseInfo struct {
	Window                    string
	Unused, InFlight, Pending int64
	Tight                     bool
}

// SpendLeases lists this replica's parts of spend windows, by window.
func (l *Leaser) SpendLeases() []SpendLeaseInfo {
	sp := l.spend
	sp.mu.Lock()
	out := make([]SpendLeaseInfo, 0, len(sp.wins))
	for key, a := range sp.wins {
		out = append(out, SpendLeaseInfo{Window: key, Unused: a.avail, InFlight: a.inflight, Pending: a.spent, Tight: a.tight})
	}
	sp.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Window < out[j].Window })
	return out
}

// luaSpendLease reports this replica's parts of spend windows and grants it chunks.
//
//	KEYS: 1 the window index, 2 this process's reservation table, then one key per window
//	ARGV: 1 me, 2 lease ttl ms, 3 grace ms, 4 how long a window stays tight ms, 5 the round's
//	      number, 6 the reservation table's ttl ms, 7 the channel to name a tight window on,
//	      8 number of windows W, then W × (window key, limit, end ms, allow a single overrun,
//	      spent since the last round, in flight, unused, chunk wanted, single need)
//
// A round whose number is below the last applied is stale and changes nothing; one equal to it
// was applied (its answer was lost) and adds nothing again. A window that has ended (by Redis's
// clock) is left alone. A chunk is granted out of the window's room (limit less spent, carried,
// reserved and other chunks), at most this replica's max-min fair share of it by the chunks
// replicas want; a single need is granted whole when it fits, or, with a single overrun allowed,
// when the window holds nothing at all. A need that does not fit while other replicas hold unused
// chunks makes the window tight.
//
// Returns {1 (0: stale), then W × (granted, spent, reserved, unused chunks, tight, this
// replica's unused part accepted, room)}.
const luaSpendLease = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, ttl, grace, tightms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local seq = tonumber(ARGV[5])
local last = tonumber(redis.call('HGET', KEYS[2], 'lsq') or 0) or 0
if seq < last then return {0} end
local fresh = seq > last
if fresh then
  redis.call('HSET', KEYS[2], 'lsq', seq)
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
local chan = ARGV[7]
local nw = tonumber(ARGV[8])
local out = {1}

local function fairshare(list, cap)
  table.sort(list, function(x, y) if x[2] ~= y[2] then return x[2] < y[2] end return x[1] < y[1] end)
  local left, n = cap, #list
  for j, it in ipairs(list) do
    local give = math.min(it[2], math.floor(left / (n - j + 1)))
    if it[1] == me then return give end
    left = left - give
  end
  return 0
end

local function count(v)
  local n = tonumber(v)
  if n == nil or n ~= n or n < 0 or n > 1e15 then return 0 end
  return math.floor(n)
end

local a = 9
for i = 1, nw do
  local key = KEYS[2 + i]
  local wname, limit, e, overrun = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3] == '1'
  local S, F, U = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local want, need = tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8])
  a = a + 9
  local g, s, r, k, tight, accepted, room = 0, 0, 0, 0, 0, 0, 0
  if e > now then
    local h = redis.call('HGETALL', key)
    local c, tu = 0, 0
    local mf, mu, alive = 0, 0, false
    local wants, drop = {}, {}
    local others = 0
    for j = 1, #h, 2 do
      local f, v = h[j], h[j + 1]
      if f == 's' then s = count(v)
      elseif f == 'r' then r = count(v)
      elseif f == 'c' then c = count(v)
      elseif f == 'k' then k = count(v)
      elseif f == 't' then tu = count(v)
      else
        local rep = string.match(f, '^q:(.+)$')
        if rep then
          local ef, eu, ew, ex = string.match(v, '^(%d+)|(%d+)|(%d+)|(%d+)$')
          ef, eu, ew, ex = tonumber(ef), tonumber(eu), tonumber(ew), tonumber(ex)
          if ef == nil then
            drop[#drop + 1] = f
          elseif rep == me then
            mf, mu, alive = ef, eu, ex >= now
            if not alive then
              -- Expired: its unused part was let go.
              k = k - eu
              mu = 0
            end
          elseif ex > 0 and ex < now then
            -- Another replica's part expired: its unused chunk goes back to the window, its
            -- reservations in flight stay counted until the window ends.
            k = k - eu
            if ef > 0 then redis.call('HSET', key, f, ef .. '|0|0|0') else drop[#drop + 1] = f end
          else
            others = others + eu
            if ew > 0 and ex > 0 then wants[#wants + 1] = {rep, ew} end
          end
        end
      end
    end
    if #drop > 0 then redis.call('HDEL', key, unpack(drop)) end
    k = math.max(k, 0)
    if fresh then s = s + S end
    r = math.max(r + F - mf, 0)
    k = math.max(k - mu, 0)
    -- This part's unused chunk: what Redis had for it, or, once it expired, what the window
    -- has room for.
    room = limit - s - c - r - k
    accepted = U
    if not alive and U > 0 then accepted = math.max(math.min(U, room), 0) end
    k = k + accepted
    room = room - accepted
    local istight = tu > now
    if want > 0 and not istight and room > 0 then
      wants[#wants + 1] = {me, want}
      g = math.min(want, fairshare(wants, room))
    end
    if need > g then
      if need <= room then
        g = need
      elseif overrun and s + c + r + k == 0 then
        -- More than the whole limit, in a window that holds nothing: the single overrun.
        g = need
      elseif others > 0 then
        tu = now + tightms
        istight = true
        redis.call('HSET', key, 't', tu)
        if chan ~= '' then redis.call('PUBLISH', chan, 'sp:' .. wname) end
      end
    end
    k = k + g
    room = limit - s - c - r - k
    if istight then tight = 1 end
    if #h > 0 or g > 0 or S > 0 or F > 0 or accepted > 0 then
      redis.call('HSET', key, 's', s, 'r', r, 'k', k, 'l', limit, 'e', e)
      redis.call('HSETNX', key, 'h', 0)
      local mine = accepted + g
      if F == 0 and mine == 0 and want == 0 then
        redis.call('HDEL', key, 'q:' .. me)
      else
        redis.call('HSET', key, 'q:' .. me, F .. '|' .. mine .. '|' .. want .. '|' .. (now + ttl))
      end
      redis.call('PEXPIREAT', key, e + grace)
      redis.call('ZADD', KEYS[1], e, key)
    end
    s = s + c
  end
  out[#out + 1] = g
  out[#out + 1] = s
  out[#out + 1] = r
  out[#out + 1] = k
  out[#out + 1] = tight
  out[#out + 1] = accepted
  out[#out + 1] = room
end
return out
`
