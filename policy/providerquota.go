package policy

import (
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/cluster"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

// providerQuota is how one snapshot uses a provider's rate-limit headers
// (providers.<name>.quota): the tracker of the account's quotas (carried over reloads by
// provider name, like breakers), whether a short quota refuses, and the reserve kept for the
// highest priority.
type providerQuota struct {
	tracker *quota.Tracker
	enforce bool
	mode    string
	reserve float64
}

// buildQuotas gives each provider whose quota mode is not off its tracker.
func (s *Snapshot) buildQuotas(prev *Snapshot) {
	old := map[string]*quota.Tracker{}
	if prev != nil {
		for _, pr := range prev.providers {
			if pr.quota != nil {
				old[pr.name] = pr.quota.tracker
			}
		}
	}
	s.topPriority = s.policy.TopPriority()
	for _, pr := range s.providers {
		q := s.policy.Providers[pr.name].Quota
		if q.Mode == "" || q.Mode == config.QuotaOff {
			continue
		}
		tr := old[pr.name]
		if tr == nil {
			tr = &quota.Tracker{}
		}
		pr.quota = &providerQuota{tracker: tr, enforce: q.Mode == config.QuotaEnforce, mode: q.Mode, reserve: q.Reserve}
	}
}

// reserveQuota is admission's step for the provider's own quota: a request the quotas its
// responses last told of (less what the requests in flight hold) cannot cover is refused
// provider_quota in enforce mode (AdmitInto then tries the provider's fallback), and counted
// in either mode. A request that fits holds its estimate until its response says what is left
// (Ticket.ObserveQuota) or it ends.
func (e *Engine) reserveQuota(s *Snapshot, r *Request, dims *Dims, t *Ticket, now time.Time, d *Decision) (refused bool) {
	pq := s.providers[dims.Provider].quota
	if pq == nil {
		return false
	}
	top := t.want(r, dims, now).Priority >= s.topPriority
	need := quota.Need{Prompt: r.Estimate.Prompt, Completion: r.Estimate.Output}
	res, v, ok := pq.tracker.Reserve(need, pq.reserve, top, now)
	if ok {
		t.quota, t.quotaRes = pq.tracker, res
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

// ProviderQuotaView is a provider's quotas as its responses last told them, for
// GET /admin/quotas.
type ProviderQuotaView struct {
	Provider string        `json:"provider"`
	Mode     string        `json:"mode"`
	Reserve  float64       `json:"reserve,omitempty"`
	Quotas   []quota.State `json:"quotas"`
}

// ProviderQuotas returns every provider whose quota is followed (mode shadow or enforce), with
// the quotas its responses have told of: remaining, what the requests in flight hold, limit
// and reset.
func (e *Engine) ProviderQuotas() []ProviderQuotaView {
	s := e.Snapshot()
	now := e.clock.Now()
	out := []ProviderQuotaView{}
	for _, pr := range s.providers {
		if pq := pr.quota; pq != nil {
			qs := pq.tracker.States(now)
			if qs == nil {
				qs = []quota.State{}
			}
			out = append(out, ProviderQuotaView{Provider: pr.name, Mode: pq.mode, Reserve: pq.reserve, Quotas: qs})
		}
	}
	return out
}

// quotaWorker shares the followed providers' quotas with the fleet (cluster mode): every
// interval, for each provider whose quota mode is not off, this replica sends its latest
// reading and what its requests in flight hold, and takes the fleet's latest reading and what
// the other replicas' requests hold (one call to Redis per provider, never on a request's
// path). A provider's account is one for the whole fleet: a replica that alone heard the
// provider say 3 requests are left tells the others within an interval, and a burst spread
// over the replicas holds against the same quota. While Redis cannot be asked, each replica
// goes on from what it last heard; the others' holdings stop counting after lease_ttl.
func (e *Engine) quotaWorker(interval, ttl time.Duration) {
	cs := e.cluster
	defer close(cs.quotaDone)
	if interval <= 0 {
		interval = 200 * time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	lastHeard := map[string]time.Time{}
	for {
		select {
		case <-cs.stop:
			return
		case <-t.C:
		}
		s := e.Snapshot()
		if s == nil || !cs.store.Available() {
			e.forgetRemoteQuotas(s, lastHeard, ttl)
			continue
		}
		for _, pr := range s.providers {
			if pr.quota == nil {
				continue
			}
			now := e.clock.Now()
			mine := pr.quota.tracker.Share(now)
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
			got, err := cs.store.ShareQuota(pr.name, send[:], now)
			if err != nil {
				continue
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
			pr.quota.tracker.Merge(fleet, e.clock.Now())
			lastHeard[pr.name] = now
		}
		e.forgetRemoteQuotas(s, lastHeard, ttl)
	}
}

// forgetRemoteQuotas stops counting the other replicas' holdings of a provider's quota once
// the fleet has not been heard for ttl (their entries in Redis count no longer either).
func (e *Engine) forgetRemoteQuotas(s *Snapshot, lastHeard map[string]time.Time, ttl time.Duration) {
	if s == nil {
		return
	}
	now := e.clock.Now()
	for _, pr := range s.providers {
		if pr.quota == nil {
			continue
		}
		if at, ok := lastHeard[pr.name]; ok && now.Sub(at) > ttl {
			pr.quota.tracker.ForgetRemote()
			delete(lastHeard, pr.name)
		}
	}
}
