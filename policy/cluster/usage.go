package cluster

// Fleet usage in one file: the Lua that merges a table, the store that numbers and sends deltas
// and the reads of the fleet's answer share one encoding of a row, and change together.

// Usage by tenant and model, fleet-wide. Each replica's usage.Tracker keeps an outbox of what it
// counted (usage.Tracker.Share); a UsageStore takes it every UsageFlushInterval (and at Close)
// and adds each table to the fleet's tables in Redis, one per grouping and bucket of time, by the
// Space-Saving merge the tracker's own tables use. Keys, for prefix P:
//
//	{P}:u:<by>:<level>:<start ms>  hash  a fleet table: by t, m or tm (tenant, model, both),
//	                level 5m, 1h or 1d, start the bucket's start (Unix ms). "S" → slack,
//	                "N" → total, and per group "<bytes of tenant>:<tenant><model>" → its row.
//	                A row or total is "err,requests,prompt,completion,cached,spend" then
//	                ",<reason>=<refusals>" per refusal reason counted (spend in micro-units).
//	                Expires usage.Keep(level) after the bucket ends.
//	{P}:um:<replica>:<incarnation>  string  the number of the last delta of this process that
//	                Redis applied.
//
// Each delta carries a number, increasing in the order they are sent, and a delta is sent only
// once the one before it was applied: Redis applies a delta only if its number is above the last
// applied, so a delta whose answer was lost (a timeout) is sent again and counted once. A delta
// that could not be sent stays queued, and what the tracker counts meanwhile waits in its outbox,
// both bounded like the tracker's own tables.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// UsageFlushInterval is how often a replica adds what it counted to the fleet's usage tables: the
// most the fleet's answer lags behind another replica's traffic.
const UsageFlushInterval = 5 * time.Second

// maxUsageName bounds a tenant's or a model's name in a fleet table (bytes): a group with a
// longer name has no row there, its counts are the rest's (_other).
const maxUsageName = 1024

// luaUsage is shared by the usage scripts: reading, checking and writing a fleet table.
var luaUsage = luaCommon + `
local MAXROWS, MAXNAME = ` + strconv.Itoa(usage.MaxTableSize) + `, ` + strconv.Itoa(maxUsageName) + `

-- uvalue reads a row or a total: nil for anything a replica never writes.
local function uvalue(v)
  if type(v) ~= 'string' or #v > 2048 then return nil end
  local r, i = {ref = {}}, 0
  for part in string.gmatch(v, '[^,]+') do
    i = i + 1
    if i <= 6 then
      local n = count(part)
      if n == nil then return nil end
      r[i] = n
    else
      local name, n = string.match(part, '^([%w_]+)=(%d+)$')
      n = count(n)
      if name == nil or n == nil or r.ref[name] ~= nil or i > 6 + 64 then return nil end
      r.ref[name] = n
    end
  end
  if i < 6 or r[5] > r[3] then return nil end
  return r
end

local function uzero() return {0, 0, 0, 0, 0, 0, ref = {}} end

local function uweight(r)
  local w = r[2] + r[3] + r[4]
  for _, n in pairs(r.ref) do w = w + n end
  return w
end

-- uadd adds the counts of x to r (not the error).
local function uadd(r, x)
  for i = 2, 6 do r[i] = r[i] + x[i] end
  for name, n in pairs(x.ref) do r.ref[name] = (r.ref[name] or 0) + n end
end

local function ubelow(a, b)
  for i = 2, 6 do if a[i] > b[i] then return false end end
  for name, n in pairs(a.ref) do if n > (b.ref[name] or 0) then return false end end
  return true
end

local function uformat(r)
  local out = {}
  for i = 1, 6 do out[i] = string.format('%.0f', r[i]) end
  local names = {}
  for name, n in pairs(r.ref) do if n > 0 then names[#names + 1] = name end end
  table.sort(names)
  for _, name in ipairs(names) do out[#out + 1] = name .. '=' .. string.format('%.0f', r.ref[name]) end
  return table.concat(out, ',')
end

-- ukey checks a row's field: the tenant's length, a colon, the tenant and the model, of a table
-- by kind (t: no model, m: no tenant).
local function ukey(f, kind)
  local c = string.find(f, ':', 1, true)
  if c == nil or c == 1 or c > 5 then return false end
  local head = string.sub(f, 1, c - 1)
  if not string.match(head, '^%d+$') then return false end
  local tl, ml = tonumber(head), #f - c - tonumber(head)
  if ml < 0 or tl > MAXNAME or ml > MAXNAME then return false end
  if kind == 't' then return ml == 0 end
  if kind == 'm' then return tl == 0 end
  return true
end

-- uload reads a fleet table. A key that is not a hash, holds more rows than a table can, or
-- holds anything a replica never writes (a value that is not a row, a row whose error is above
-- the slack, rows counting more than the total) is deleted: the table starts again empty. It
-- returns the table and whether it deleted the key.
local function uload(key, kind)
  local t = {slack = 0, total = uzero(), rows = {}, n = 0}
  if not sane(key, MAXROWS + 2) then return t, true end
  local all = redis.call('HGETALL', key)
  if #all == 0 then return t, false end
  local ok, total, sum = true, nil, uzero()
  for i = 1, #all, 2 do
    local f, v = all[i], all[i + 1]
    if f == 'S' then
      local n = count(v)
      if n == nil then ok = false break end
      t.slack = n
    elseif f == 'N' then
      total = uvalue(v)
      if total == nil then ok = false break end
    else
      local r = uvalue(v)
      if r == nil or not ukey(f, kind) then ok = false break end
      t.rows[f] = r
      t.n = t.n + 1
      uadd(sum, r)
    end
  end
  if ok then
    ok = total ~= nil and ubelow(sum, total)
    for _, r in pairs(t.rows) do
      if r[1] > t.slack then ok = false end
    end
  end
  if not ok then
    redis.call('UNLINK', key)
    return {slack = 0, total = uzero(), rows = {}, n = 0}, true
  end
  t.total = total
  return t, false
end

-- uhset writes fields (a list of field, value pairs) in batches.
local function uhset(key, kv)
  for i = 1, #kv, 1000 do
    redis.call('HSET', key, unpack(kv, i, math.min(i + 999, #kv)))
  end
end
`

// luaUsageFlush adds deltas of this process, in order, to the fleet tables of their buckets,
// each unless Redis applied it already.
//
//	KEYS: 1 this process's mark, then each delta's tables to add to
//	ARGV: 1 the mark's ttl ms, 2 table size, 3 number of deltas D, then D × (the delta's number,
//	      kind (t, m or tm), slack, total, rows n, n × (field, row), tables m, m × the time the
//	      table expires (Unix ms))
//
// A delta is merged as the tracker merges tables: a group's counts and error are summed, and for
// each side without a row for it that side's slack is added to its error; the slack is the sum
// of the slacks. Beyond size rows, the rows of the smallest estimates (error plus weight) are
// dropped — their counts stay in the total, the rest's — and the largest dropped estimate becomes
// the slack if it is larger. A table whose time has passed is left alone.
// Returns {the deltas applied now (the others were before), then the keys repaired}.
var luaUsageFlush = luaUsage + `
local now = nowms()
local ttl, size, nd = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local repaired = {}
local mark = redis.pcall('GET', KEYS[1])
if type(mark) == 'table' then
  redis.call('UNLINK', KEYS[1])
  repaired[#repaired + 1] = KEYS[1]
  mark = 0
elseif mark then
  local n = count(mark)
  if n == nil then repaired[#repaired + 1] = KEYS[1] end
  mark = n or 0
else
  mark = 0
end

-- merge adds delta d to the table at key, of kind, that expires at exp.
local function merge(key, kind, exp, d)
  local t, bad = uload(key, kind)
  if bad then repaired[#repaired + 1] = key end
  local st, sd = t.slack, d.slack
  local dirty = {}
  if sd > 0 then
    for f, r in pairs(t.rows) do
      if d.rows[f] == nil then
        r[1] = r[1] + sd
        dirty[f] = true
      end
    end
  end
  for f, x in pairs(d.rows) do
    local r = t.rows[f]
    if r then
      r[1] = r[1] + x[1]
    else
      r = uzero()
      r[1] = x[1] + st
      t.rows[f] = r
      t.n = t.n + 1
    end
    uadd(r, x)
    dirty[f] = true
  end
  uadd(t.total, d.total)
  t.slack = st + sd
  if t.n > size then
    local list = {}
    for f, r in pairs(t.rows) do list[#list + 1] = {f, r[1] + uweight(r)} end
    table.sort(list, function(a, b)
      if a[2] ~= b[2] then return a[2] > b[2] end
      return a[1] < b[1]
    end)
    t.slack = math.max(t.slack, list[size + 1][2])
    local gone = {}
    for i = size + 1, #list do
      local f = list[i][1]
      gone[#gone + 1] = f
      t.rows[f], dirty[f] = nil, nil
    end
    for i = 1, #gone, 1000 do
      redis.call('HDEL', key, unpack(gone, i, math.min(i + 999, #gone)))
    end
  end
  local kv = {'S', string.format('%.0f', t.slack), 'N', uformat(t.total)}
  for f in pairs(dirty) do
    kv[#kv + 1] = f
    kv[#kv + 1] = uformat(t.rows[f])
  end
  uhset(key, kv)
  redis.call('PEXPIREAT', key, exp)
end

local a, k, applied = 4, 2, 0
for _ = 1, nd do
  local id, kind, n = tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 4])
  local rows, m = a + 5, tonumber(ARGV[a + 5 + 2 * n])
  if id > mark then
    local d = {slack = tonumber(ARGV[a + 2]), total = uvalue(ARGV[a + 3]), rows = {}}
    for i = 0, n - 1 do
      d.rows[ARGV[rows + 2 * i]] = uvalue(ARGV[rows + 2 * i + 1])
    end
    for j = 1, m do
      local exp = tonumber(ARGV[rows + 2 * n + j])
      if exp > now then merge(KEYS[k + j - 1], kind, exp, d) end
    end
    mark, applied = id, applied + 1
  end
  a, k = rows + 2 * n + 1 + m, k + m
end
if applied > 0 then redis.call('SET', KEYS[1], mark, 'PX', ttl) end
local out = {applied}
for _, key in ipairs(repaired) do out[#out + 1] = key end
return out
`

// luaUsageRead reads fleet tables, deleting those that hold what no replica writes.
//
//	KEYS: the tables
//	ARGV: 1 kind (t, m or tm)
//
// Returns, per table, {1 if it was deleted, else 0, then its fields and values}.
var luaUsageRead = luaUsage + `
local out = {}
for i, key in ipairs(KEYS) do
  local _, bad = uload(key, ARGV[1])
  local t = {0}
  if bad then
    t[1] = 1
  else
    local all = redis.call('HGETALL', key)
    for j = 1, #all do t[j + 1] = all[j] end
  end
  out[i] = t
end
return out
`

// UsageStore keeps a tracker's usage in the fleet's tables in Redis, through a Store, and reads
// the fleet's windows back. Safe for concurrent use.
type UsageStore struct {
	st      *Store
	tr      *usage.Tracker
	now     func() time.Time
	every   time.Duration
	markKey string
	flush   *redis.Script
	read    *redis.Script
	log     *slog.Logger

	// mu makes flushes one at a time; queue holds the deltas taken and not applied yet, in
	// order, and last the number of the last delta taken.
	mu    sync.Mutex
	queue []usageOp
	last  uint64

	repairLog throttle.Gate
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

// usageOp is a delta with its number.
type usageOp struct {
	id uint64
	d  usage.Delta
}

// UsageOptions configure a UsageStore.
type UsageOptions struct {
	// Now is the clock the tracker counts by.
	Now func() time.Time
	// Interval is how often the tracker's outbox is sent (0: UsageFlushInterval).
	Interval time.Duration
}

// NewUsageStore makes tr share what it counts (usage.Tracker.Share) and starts sending it to
// Redis through st every interval, until Close.
func NewUsageStore(st *Store, tr *usage.Tracker, o UsageOptions) *UsageStore {
	if o.Interval <= 0 {
		o.Interval = UsageFlushInterval
	}
	u := &UsageStore{st: st, tr: tr, now: o.Now, every: o.Interval, log: st.log,
		markKey: st.tag + ":um:" + st.o.ReplicaID + ":" + strconv.FormatInt(time.Now().UnixNano(), 36),
		flush:   redis.NewScript(luaUsageFlush), read: redis.NewScript(luaUsageRead),
		stop: make(chan struct{}), done: make(chan struct{})}
	tr.Share(true)
	go u.loop()
	return u
}

func (u *UsageStore) loop() {
	defer close(u.done)
	t := time.NewTicker(u.every)
	defer t.Stop()
	for {
		select {
		case <-u.stop:
			return
		case <-t.C:
			_ = u.Flush()
		}
	}
}

// byKind names a grouping in keys.
var byKind = [...]string{usage.ByTenant: "t", usage.ByModel: "m", usage.ByTenantModel: "tm"}

func (u *UsageStore) tableKey(by usage.By, b usage.Bucket) string {
	return u.st.tag + ":u:" + byKind[by] + ":" + b.Level + ":" + strconv.FormatInt(b.Start.UnixMilli(), 10)
}

// Flush sends what the tracker counted since the last flush (to the day buckets at most every
// usage.DayEvery), after what an earlier flush could not send: a flush's deltas
// (one per table) in one call, more when earlier ones wait. It returns at the first call Redis
// did not answer (its deltas stay queued, and are sent again by the next flush), each call
// bounded by the write timeout.
func (u *UsageStore) Flush() error { return u.push(false) }

// push is Flush; with all, what was counted goes to every bucket at once (the store stops).
func (u *UsageStore) push(all bool) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	took := false
	for {
		if len(u.queue) == 0 {
			if took {
				return nil
			}
			took = true
			for _, d := range u.tr.TakeDelta(u.now(), all) {
				u.last++
				u.queue = append(u.queue, usageOp{id: u.last, d: d})
			}
			if len(u.queue) == 0 {
				return nil
			}
		}
		if !u.st.available.Load() {
			return ErrUnavailable
		}
		// Deltas go together up to flushBatch rows, at least one.
		n, rows := 1, len(u.queue[0].d.Table.Rows)
		for n < len(u.queue) && rows+len(u.queue[n].d.Table.Rows) <= flushBatch {
			rows += len(u.queue[n].d.Table.Rows)
			n++
		}
		if err := u.send(u.queue[:n]); err != nil {
			return err
		}
		clear(u.queue[:n])
		u.queue = u.queue[n:]
	}
}

// flushBatch is how many rows, at most, one usage flush call carries (unless one delta has more):
// the script runs as long as its tables take to merge.
const flushBatch = 4096

// send adds deltas, in order, to the fleet tables that can still be asked for. u.mu is held.
func (u *UsageStore) send(ops []usageOp) error {
	now := u.now()
	reasons := u.tr.Reasons()
	keys := []string{u.markKey}
	args := []any{usage.Keep(usage.LevelDay).Milliseconds(), max(u.tr.TableSize(), usage.MinTableSize), 0}
	nd := 0
	for i := range ops {
		op := &ops[i]
		ft := &op.d.Table
		var exps []any
		for _, b := range op.d.Targets {
			if exp := b.End.Add(usage.Keep(b.Level)); exp.After(now) {
				keys = append(keys, u.tableKey(ft.By, b))
				exps = append(exps, exp.UnixMilli())
			}
		}
		if len(exps) == 0 {
			continue
		}
		nd++
		args = append(args, op.id, byKind[ft.By], ft.Slack, formatUsage(0, &ft.Total, reasons), 0)
		at, n := len(args)-1, 0
		for i := range ft.Rows {
			r := &ft.Rows[i]
			if len(r.Key.Tenant) > maxUsageName || len(r.Key.Model) > maxUsageName {
				continue
			}
			args = append(args, usageField(r.Key), formatUsage(r.Err, &r.Counts, reasons))
			n++
		}
		args[at] = n
		args = append(args, len(exps))
		args = append(args, exps...)
	}
	if nd == 0 {
		return nil
	}
	args[2] = nd
	ctx, cancel := context.WithTimeout(u.st.ctx, u.st.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	res, err := u.st.run(ctx, u.flush, keys, args...).Slice()
	u.st.met.observe("usage_flush", start, err)
	if err != nil {
		return err
	}
	u.repaired("usage_flush", res[min(1, len(res)):])
	return nil
}

// repaired reports the keys a usage script deleted or reset (their content was corrupt).
func (u *UsageStore) repaired(op string, keys []any) {
	if len(keys) == 0 {
		return
	}
	u.st.met.lost.WithLabelValues(causeCorrupt).Add(float64(len(keys)))
	names := make([]string, 0, len(keys))
	for _, k := range keys {
		s, _ := k.(string)
		names = append(names, s)
	}
	msg := "usage tables in Redis held content no replica writes: deleted them, the fleet's usage there starts again from what is counted next"
	u.st.noteError(op, msg+" ("+strings.Join(names, ", ")+")")
	if ok, held := u.repairLog.Allow(time.Now(), time.Minute); ok {
		u.log.Error(msg, "replica", u.st.o.ReplicaID, "op", op, "keys", names, "repairs_not_logged", held)
	}
}

// usageField is a group's field in a fleet table.
func usageField(k usage.Key) string {
	return strconv.Itoa(len(k.Tenant)) + ":" + k.Tenant + k.Model
}

// parseUsageField reads a group's field back.
func parseUsageField(f string) (usage.Key, bool) {
	head, rest, ok := strings.Cut(f, ":")
	n, err := strconv.Atoi(head)
	if !ok || err != nil || n < 0 || n > len(rest) {
		return usage.Key{}, false
	}
	return usage.Key{Tenant: rest[:n], Model: rest[n:]}, true
}

// formatUsage writes a row (or a total, err 0) as the scripts read it.
func formatUsage(err uint64, c *usage.Counts, reasons []string) string {
	b := make([]byte, 0, 64)
	for i, v := range []uint64{err, c.Requests, c.Prompt, c.Completion, min(c.Cached, c.Prompt), uint64(max(c.Spend, 0))} {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, v, 10)
	}
	for i, name := range reasons {
		if n := c.Refusals[i]; n > 0 {
			b = append(b, ',')
			b = append(b, name...)
			b = append(b, '=')
			b = strconv.AppendUint(b, n, 10)
		}
	}
	return string(b)
}

// parseUsage reads a row or a total: its error and counts, the refusals of reasons this build
// does not count left out.
func parseUsage(v string, reasons []string) (err uint64, c usage.Counts, ok bool) {
	parts := strings.Split(v, ",")
	if len(parts) < 6 {
		return 0, c, false
	}
	var n [6]uint64
	for i := range n {
		x, e := strconv.ParseUint(parts[i], 10, 64)
		if e != nil {
			return 0, c, false
		}
		n[i] = x
	}
	c = usage.Counts{Requests: n[1], Prompt: n[2], Completion: n[3], Cached: n[4], Spend: money.Micros(n[5])}
	for _, p := range parts[6:] {
		name, num, found := strings.Cut(p, "=")
		x, e := strconv.ParseUint(num, 10, 64)
		if !found || e != nil {
			return 0, c, false
		}
		if i := slices.Index(reasons, name); i >= 0 {
			c.Refusals[i] += x
		}
	}
	return n[0], c, true
}

// ErrUsageOff is returned by Report while the tracker does not count.
var ErrUsageOff = errors.New("usage is not counted")

// Report returns window q of the fleet: this replica's usage is sent first (as Flush, whatever
// it finds; to the day buckets too when the window reads them), then the fleet's tables of the
// window are read in one call bounded by the write timeout. An error wraps ErrUnavailable when
// Redis cannot be asked.
func (u *UsageStore) Report(ctx context.Context, q usage.Query) (usage.Report, error) {
	if u.tr.TableSize() == 0 {
		return usage.Report{}, ErrUsageOff
	}
	_ = u.push(q.Window >= usage.Week)
	if !u.st.available.Load() {
		return usage.Report{}, ErrUnavailable
	}
	now := u.now()
	from, buckets := u.tr.FleetWindow(now, q.Window)
	keys := make([]string, len(buckets))
	for i, b := range buckets {
		keys[i] = u.tableKey(q.By, b)
	}
	ctx, cancel := context.WithTimeout(ctx, u.st.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	res, err := u.st.run(ctx, u.read, keys, byKind[q.By]).Slice()
	u.st.met.observe("usage_read", start, err)
	if err != nil {
		return usage.Report{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	reasons := u.tr.Reasons()
	tabs := make([]usage.FleetTable, 0, len(buckets))
	var bad []any
	for i, x := range res {
		if i >= len(buckets) {
			break
		}
		vals, _ := x.([]any)
		if len(vals) == 0 {
			continue
		}
		if f, _ := vals[0].(int64); f == 1 {
			bad = append(bad, keys[i])
			continue
		}
		if ft, ok := parseTable(q.By, buckets[i], vals[1:], reasons); ok {
			tabs = append(tabs, ft)
		}
	}
	u.repaired("usage_read", bad)
	rep, ok := u.tr.FleetReport(q, from, now, tabs)
	if !ok {
		return usage.Report{}, ErrUsageOff
	}
	return rep, nil
}

// parseTable reads a fleet table's fields and values (as the read script checked them).
func parseTable(by usage.By, b usage.Bucket, kv []any, reasons []string) (usage.FleetTable, bool) {
	ft := usage.FleetTable{By: by, Bucket: b}
	if len(kv) == 0 {
		return ft, false
	}
	for i := 0; i+1 < len(kv); i += 2 {
		f, _ := kv[i].(string)
		v, _ := kv[i+1].(string)
		switch f {
		case "S":
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return ft, false
			}
			ft.Slack = n
		case "N":
			_, c, ok := parseUsage(v, reasons)
			if !ok {
				return ft, false
			}
			ft.Total = c
		default:
			k, ok := parseUsageField(f)
			e, c, ok2 := parseUsage(v, reasons)
			if !ok || !ok2 {
				return ft, false
			}
			ft.Rows = append(ft.Rows, usage.TableRow{Key: k, Err: e, Counts: c})
		}
	}
	return ft, true
}

// Pending returns how many deltas are queued that Redis has not applied yet.
func (u *UsageStore) Pending() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.queue)
}

// Close stops the periodic flush and sends what is left, bounded by ctx and the write timeout.
// What Redis could not be sent is lost to the fleet (logged with the requests it counted). Once
// everything was applied, this process's mark is deleted: it sends nothing more.
func (u *UsageStore) Close(ctx context.Context) {
	u.closeOnce.Do(func() {
		close(u.stop)
		<-u.done
		err := u.push(true)
		u.mu.Lock()
		defer u.mu.Unlock()
		if err == nil {
			cctx, cancel := context.WithTimeout(ctx, u.st.o.WriteTimeout)
			defer cancel()
			start := time.Now()
			err = u.st.client.Del(cctx, u.markKey).Err()
			u.st.met.observe("usage_flush", start, err)
			return
		}
		for _, d := range u.tr.TakeDelta(u.now(), true) {
			u.queue = append(u.queue, usageOp{d: d})
		}
		var lost uint64
		for _, op := range u.queue {
			if op.d.Table.By == usage.ByTenant {
				lost += op.d.Table.Total.Requests + op.d.Table.Total.RefusalsTotal()
			}
		}
		u.log.Warn("usage this replica counted could not be added to the fleet's tables in Redis before it stopped: the fleet's answer leaves it out",
			"replica", u.st.o.ReplicaID, "requests", lost, "error", err)
	})
}
