package policy

import (
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

// providerQuota is how one snapshot uses a provider's rate-limit headers
// (providers.<name>.quota): the tracker of the account's quotas, or with an account source one
// tracker per account (carried over reloads by provider name, like breakers), whether a short
// quota refuses, and the reserve kept for the highest priority.
type providerQuota struct {
	// tracker is the provider's one account's (nil when accounts is set).
	tracker *quota.Tracker
	// accounts are the trackers of the provider's accounts, the one of a request given by its
	// Dims.account(src) (nil: one account).
	accounts *quota.Accounts
	src      int
	enforce  bool
	mode     string
	reserve  float64
}

// buildQuotas gives each provider whose quota mode is not off its tracker, or its account
// trackers. A provider's trackers outlive a reload that keeps its account source (the
// accounts, or the one account): what the provider said is left is still so.
func (s *Snapshot) buildQuotas(prev *Snapshot) {
	old := map[string]*providerQuota{}
	if prev != nil {
		for _, pr := range prev.providers {
			if pr.quota != nil {
				old[pr.name] = pr.quota
			}
		}
	}
	s.topPriority = s.policy.TopPriority()
	srcs, of := s.policy.AccountSources()
	for _, pr := range s.providers {
		q := s.policy.Providers[pr.name].Quota
		if q.Mode == "" || q.Mode == config.QuotaOff {
			continue
		}
		pq := &providerQuota{enforce: q.Mode == config.QuotaEnforce, mode: q.Mode, reserve: q.Reserve}
		prevQ, prevAccount := old[pr.name], (*config.QuotaAccount)(nil)
		if prevQ != nil {
			prevAccount = prev.policy.Providers[pr.name].Quota.Account
		}
		if q.Account == nil {
			if prevQ != nil && prevQ.tracker != nil {
				pq.tracker = prevQ.tracker
			} else {
				pq.tracker = &quota.Tracker{}
			}
		} else {
			pq.src = of[pr.name]
			if prevQ != nil && prevQ.accounts != nil && prevQ.accounts.Max() == q.MaxAccounts && prevAccount != nil && srcs[pq.src].Same(prevAccount) {
				pq.accounts = prevQ.accounts
			} else {
				pq.accounts = quota.NewAccounts(q.MaxAccounts)
			}
		}
		pr.quota = pq
	}
}

// trackerFor returns the tracker of the account request dims uses at provider quota pq.
func (s *Snapshot) trackerFor(pq *providerQuota, dims *Dims) *quota.Tracker {
	if pq.accounts == nil {
		return pq.tracker
	}
	t, other, first := pq.accounts.Tracker(dims.account(pq.src))
	if first {
		name := s.providers[dims.Provider].name
		s.engine.log.Warn("a provider's requests use more accounts than its quota tracks apart: the requests of the accounts beyond share one quota, account "+quota.OtherAccount+
			" (logged once; further requests are counted in llm_bulkhead_provider_quota_account_overflow_total)",
			"provider", name, "max_accounts", pq.accounts.Max())
	}
	if other {
		s.engine.rec.QuotaAccountOverflow(s.providers[dims.Provider].name)
	}
	return t
}

// reserveQuota is admission's step for the provider's own quota: a request the quotas its
// responses last told of (less what the requests in flight hold) cannot cover is refused
// provider_quota in enforce mode (AdmitInto then tries the provider's fallback), and counted
// in either mode. A request that fits holds its estimate until its response says what is left
// (Ticket.ObserveQuota) or it ends. With an account source, the quotas are the request's
// account's.
func (e *Engine) reserveQuota(s *Snapshot, r *Request, dims *Dims, t *Ticket, now time.Time, d *Decision) (refused bool) {
	pq := s.providers[dims.Provider].quota
	if pq == nil {
		return false
	}
	top := t.want(r, dims, now).Priority >= s.topPriority
	need := quota.Need{Prompt: r.Estimate.Prompt, Completion: r.Estimate.Output}
	tr := s.trackerFor(pq, dims)
	res, v, ok := tr.Reserve(need, pq.reserve, top, now)
	if ok {
		t.quota, t.quotaRes = tr, res
		return false
	}
	name := s.providers[dims.Provider].name
	e.rec.QuotaShort(name, v.Kind.String(), pq.mode)
	if !pq.enforce {
		return false
	}
	refuseInto(d, ReasonProviderQuota, "provider/"+name, max(v.ResetIn, time.Second), dims)
	return true
}

// TracksQuota reports whether the admitted request's provider follows its rate-limit headers:
// the caller then reads them from the response (ObserveQuota).
func (t *Ticket) TracksQuota() bool { return t.quota != nil }

// ObserveQuota applies what the response's rate-limit headers said (r, parsed by
// quota.ParseHeader; invalid counts the headers whose value could not be believed) to the
// provider's quotas, and gives back what the request held of them: the provider has counted
// it. Called at most once, with the response headers.
func (t *Ticket) ObserveQuota(r *quota.Reading, invalid int, now time.Time) {
	if t.quota == nil {
		return
	}
	if invalid > 0 {
		t.engine.rec.QuotaHeadersInvalid(t.snap.providers[t.dims.Provider].name, invalid)
	}
	if r.Empty() {
		// Nothing said: the request keeps its hold until it ends (settleQuota).
		return
	}
	t.quota.Observe(&t.quotaRes, r, now)
}

// settleQuota ends the request's hold on its provider's quota: a request whose response said
// nothing of the quota is charged its real use (its estimate when usage is unknown), as the
// provider counted it.
func (t *Ticket) settleQuota(used quota.Need, now time.Time) {
	if t.quota != nil {
		t.quota.Settle(&t.quotaRes, used, now)
	}
}

// releaseQuota gives back what a request that was not admitted after all held of its
// provider's quota.
func (t *Ticket) releaseQuota() {
	if t.quota != nil {
		t.quota.Release(&t.quotaRes)
		t.quota = nil
	}
}

// ProviderQuotaView is a provider account's quotas as its responses last told them, for
// GET /admin/quotas. Account is empty for a provider without an account source (one account).
type ProviderQuotaView struct {
	Provider string        `json:"provider"`
	Account  string        `json:"account,omitempty"`
	Mode     string        `json:"mode"`
	Reserve  float64       `json:"reserve,omitempty"`
	Quotas   []quota.State `json:"quotas"`
}

// ProviderQuotas returns every provider whose quota is followed (mode shadow or enforce), with
// the quotas its responses have told of: remaining, what the requests in flight hold, limit
// and reset; a provider with an account source once per account its requests used (none
// before the first).
func (e *Engine) ProviderQuotas() []ProviderQuotaView {
	s := e.Snapshot()
	now := e.clock.Now()
	out := []ProviderQuotaView{}
	for _, pr := range s.providers {
		eachAccount(pr.quota, func(account string, t *quota.Tracker) {
			qs := t.States(now)
			if qs == nil {
				qs = []quota.State{}
			}
			out = append(out, ProviderQuotaView{Provider: pr.name, Account: account, Mode: pr.quota.mode, Reserve: pr.quota.reserve, Quotas: qs})
		})
	}
	return out
}

// quotaWorker shares the followed providers' quotas with the fleet (cluster mode): every
// interval, for each provider whose quota mode is not off (each account of it its requests on
// this replica have used, with an account source), this replica sends its latest reading and
// what its requests in flight hold, and takes the fleet's latest reading and what the other
// replicas' requests hold (one call to Redis per provider account, never on a request's path).
// A provider's account is one for the whole fleet: a replica that alone heard the provider say
// 3 requests are left tells the others within an interval, and a burst spread over the
// replicas holds against the same quota. While Redis cannot be asked, each replica goes on
// from what it last heard; the others' holdings stop counting after lease_ttl.
func (e *Engine) quotaWorker(interval, ttl time.Duration) {
	cs := e.cluster
	defer close(cs.quotaDone)
	if interval <= 0 {
		interval = 200 * time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	lastHeard := map[*quota.Tracker]time.Time{}
	for {
		select {
		case <-cs.stop:
			return
		case <-t.C:
		}
		s := e.Snapshot()
		if s == nil || !cs.store.Available() {
			e.forgetRemoteQuotas(lastHeard, ttl)
			continue
		}
		for _, pr := range s.providers {
			eachAccount(pr.quota, func(account string, tr *quota.Tracker) {
				now := e.clock.Now()
				if e.shareQuota(pr.name, account, tr, now) {
					lastHeard[tr] = now
				}
			})
		}
		e.forgetRemoteQuotas(lastHeard, ttl)
	}
}

// eachAccount calls fn with each tracker of provider quota pq (none when pq is nil), and the
// account it is ("" for a provider with one account).
func eachAccount(pq *providerQuota, fn func(account string, t *quota.Tracker)) {
	switch {
	case pq == nil:
	case pq.accounts == nil:
		fn("", pq.tracker)
	default:
		for _, a := range pq.accounts.Each() {
			fn(a.Name, a.Tracker)
		}
	}
}

// shareQuota shares tracker tr, the quotas of provider's account, with the fleet: false when
// the fleet could not be asked.
func (e *Engine) shareQuota(provider, account string, tr *quota.Tracker, now time.Time) bool {
	mine := tr.Share(now)
	var send [quota.NumKinds]cluster.QuotaShare
	for k, q := range mine {
		send[k] = cluster.QuotaShare{Limit: q.Limit, Remaining: q.Remaining, Pending: q.Pending}
		if !q.At.IsZero() {
			send[k].At = q.At.UnixMilli()
		}
		if !q.Reset.IsZero() {
			send[k].Reset = q.Reset.UnixMilli()
		}
	}
	got, err := e.cluster.store.ShareQuota(provider, account, send[:], now)
	if err != nil {
		return false
	}
	var fleet [quota.NumKinds]quota.Shared
	for k, q := range got {
		fleet[k] = quota.Shared{Limit: q.Limit, Remaining: q.Remaining, Pending: q.Pending}
		if q.At > 0 {
			fleet[k].At = time.UnixMilli(q.At)
		}
		if q.Reset > 0 {
			fleet[k].Reset = time.UnixMilli(q.Reset)
		}
	}
	tr.Merge(fleet, e.clock.Now())
	return true
}

// forgetRemoteQuotas stops counting the other replicas' holdings of a provider account's quota
// once the fleet has not been heard of it for ttl (their entries in Redis count no longer
// either). A tracker a reload dropped is forgotten with it.
func (e *Engine) forgetRemoteQuotas(lastHeard map[*quota.Tracker]time.Time, ttl time.Duration) {
	now := e.clock.Now()
	for tr, at := range lastHeard {
		if now.Sub(at) > ttl {
			tr.ForgetRemote()
			delete(lastHeard, tr)
		}
	}
}
