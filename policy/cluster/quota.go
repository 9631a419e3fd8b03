package cluster

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// QuotaFields is the number of values a provider quota's share carries per quota kind (see
// QuotaShare).
const QuotaFields = 5

// QuotaShare is what this replica knows of one quota of a provider's account, and, as
// ShareQuota returns it, what the fleet knows: when the latest reading of it was taken (Unix
// milliseconds; 0: none), the limit, what was left and when it is full again (Unix
// milliseconds; 0: not said), and the requests in flight that hold part of it (sent: this
// replica's; returned: the other replicas').
type QuotaShare struct {
	At, Limit, Remaining, Reset, Pending int64
}

// luaQuota shares one provider account's quotas across the fleet. KEYS[1] is the provider's hash:
// per quota kind k, field "r<k>" the latest reading ("at,limit,remaining,reset"), and per
// replica field "p:<id>" what its requests in flight hold ("expires,p0,p1,…"). ARGV: replica
// id, now (ms), how long this replica's entry counts (ms), the number of kinds, then per kind
// at, limit, remaining, reset, pending. A reading replaces the stored one only when it is
// later. Returns per kind the latest reading and the sum the other live replicas hold; entries
// past their time, or set to expire later than lease_ttl from now, are deleted. The hash is bounded: beyond 4096 fields it is rebuilt from what
// this call knows (a hash grown by hand or by a flood of replica ids holds nothing useful).
var luaQuota = luaCommon + `
local key, me, now, ttl, n = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
sane(key, 4096)
local mine = {now + ttl}
local out = {}
for k = 1, n do
  local a = 4 + (k - 1) * 5
  local at, lim, rem, reset, pend = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  mine[#mine + 1] = pend
  local f = 'r' .. (k - 1)
  local cur = redis.call('HGET', key, f)
  local sat, slim, srem, sreset = 0, 0, 0, 0
  if cur then
    local i = 0
    for v in string.gmatch(cur, '[^,]+') do
      i = i + 1
      local x = tonumber(v) or 0
      if i == 1 then sat = x elseif i == 2 then slim = x elseif i == 3 then srem = x else sreset = x end
    end
  end
  if at > 0 and at > sat and at <= now + 60000 and rem >= 0 and lim >= 0 then
    sat, slim, srem, sreset = at, lim, rem, reset
    redis.call('HSET', key, f, at .. ',' .. lim .. ',' .. rem .. ',' .. reset)
  end
  out[#out + 1] = sat
  out[#out + 1] = slim
  out[#out + 1] = srem
  out[#out + 1] = sreset
  out[#out + 1] = 0
end
redis.call('HSET', key, 'p:' .. me, table.concat(mine, ','))
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local f, v = all[i], all[i + 1]
  if string.sub(f, 1, 2) == 'p:' and f ~= 'p:' .. me then
    local j, exp = 0, 0
    for x in string.gmatch(v, '[^,]+') do
      local num = tonumber(x) or 0
      if j == 0 then
        exp = num
        -- An entry that expires later than any replica could have set it is not one.
        if exp <= now or exp > now + ttl then exp = 0 break end
      elseif j <= n and num > 0 then
        out[(j - 1) * 5 + 5] = out[(j - 1) * 5 + 5] + math.min(num, 1e15)
      end
      j = j + 1
    end
    if exp == 0 then redis.call('HDEL', key, f) end
  end
end
redis.call('PEXPIRE', key, math.max(ttl, 600000))
return out
`

var quotaScript = redis.NewScript(luaQuota)

// quotaKey is the hash of a provider account's quotas: the provider's own for its one account
// (account ""), else one per account in the same hash slot. The account (a value read from
// requests) follows the hash tag, so that nothing it holds can change the slot or reach another
// provider's keys.
func (s *Store) quotaKey(provider, account string) string {
	key := "{" + s.o.KeyPrefix + "|pq:" + provider + "}:pq"
	if account != "" {
		key += ":a:" + account
	}
	return key
}

// ShareQuota tells the fleet what this replica knows of the quotas of provider's account
// (account "" for a provider with one account; mine, one per quota kind) and returns what the fleet knows: per kind the latest reading any replica took and what
// the other replicas' requests in flight hold. This replica's holdings count for the others
// for lease_ttl after the call. One round trip, off the request path; bounded by the write
// timeout.
func (s *Store) ShareQuota(provider, account string, mine []QuotaShare, now time.Time) ([]QuotaShare, error) {
	key := s.quotaKey(provider, account)
	args := make([]any, 0, 4+QuotaFields*len(mine))
	args = append(args, s.o.ReplicaID, now.UnixMilli(), s.o.LeaseTTL.Milliseconds(), len(mine))
	for _, q := range mine {
		args = append(args, q.At, q.Limit, q.Remaining, q.Reset, q.Pending)
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.o.WriteTimeout)
	defer cancel()
	start := time.Now()
	res, err := s.run(ctx, quotaScript, []string{key}, args...).Int64Slice()
	s.met.observe("quota", start, err)
	if err != nil {
		return nil, err
	}
	if len(res) != QuotaFields*len(mine) {
		return nil, fmt.Errorf("the quota script answered %d values for %d quotas", len(res), len(mine))
	}
	out := make([]QuotaShare, len(mine))
	for k := range out {
		r := res[k*QuotaFields:]
		out[k] = QuotaShare{At: r[0], Limit: r[1], Remaining: r[2], Reset: r[3], Pending: r[4]}
	}
	return out, nil
}
