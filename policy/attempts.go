package policy

import (
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

// AttemptTarget is where the attempts of one admitted request report when Envoy's router
// retries it behind the ext_proc filter: the breaker that judged its admission and its
// provider's quota. A request's outcome (Ticket.Done) is its last attempt's; the attempts the
// router retried before it are reported here, one by one, so that the breaker counts every
// call that reached the provider. It holds nothing of the ticket, so it may outlive it.
type AttemptTarget struct {
	engine *Engine
	// provider is the provider's name (the snapshot's string, not the request's).
	provider string
	bs       *breakerSet
	brk      *breaker.Breaker
	tenant   string
	quota    *quota.Tracker
	valid    bool
}

// AttemptTarget returns where the admitted request's retried attempts report. It allocates
// (the tenant is copied, the target may outlive the request's memory).
func (t *Ticket) AttemptTarget() AttemptTarget {
	if !t.active {
		return AttemptTarget{}
	}
	a := AttemptTarget{engine: t.engine, provider: t.snap.providers[t.dims.Provider].name, brk: t.brk, quota: t.quota, valid: true}
	if t.brk != nil {
		a.bs = t.snap.providers[t.dims.Provider].breakers
		a.tenant = strings.Clone(t.dims.Tenant)
	}
	return a
}

// Valid reports whether the target came from an admitted ticket.
func (a *AttemptTarget) Valid() bool { return a.valid }

// RecordRetried records in the request's breaker the outcome o of an attempt the router
// retried (o.Status 0: it failed before response headers; TTFB and Duration are the
// attempt's own), judged as a request's outcome is (failure and ignore lists, no_response_as,
// a retry-after that opens the breaker or holds the tenant back). The router made the attempt
// without asking the breaker, so it is recorded only where the breaker permits every call
// (CLOSED, METRICS_ONLY): in HALF_OPEN its probes are the requests it admitted, and OPEN has
// already decided. It reports whether the breaker recorded it; false too without a breaker.
func (a *AttemptTarget) RecordRetried(o Outcome) bool {
	if a.brk == nil {
		return false
	}
	permit, ok := a.brk.Unlimited()
	if !ok {
		return false
	}
	now := o.At
	if now.IsZero() {
		now = a.engine.clock.Now()
	}
	outcome, d, openFor := a.bs.judge.outcome(o)
	if outcome != breaker.Success && outcome != breaker.Failure {
		return false
	}
	a.brk.RecordDetail(permit, outcome, d, now, breaker.Detail{Status: o.Status, Provider: a.bs.provider})
	a.bs.holdFor(a.tenant, o.Status, openFor, a.brk, now)
	return true
}

// QuotaSent marks an attempt sent at now, for the reading of its response (ObserveQuota); the
// zero Reservation when the provider's quota is not followed.
func (a *AttemptTarget) QuotaSent(now time.Time) quota.Reservation {
	if a.quota == nil {
		return quota.Reservation{}
	}
	return a.quota.Sent(now)
}

// ObserveQuota applies what an attempt's rate-limit headers said (r, parsed by
// quota.ParseHeader) to the provider's quotas, for a provider whose policy follows them; sent is
// the attempt's QuotaSent. The request's own hold stays until its last attempt's response
// (Ticket.ObserveQuota) or its end.
func (a *AttemptTarget) ObserveQuota(sent *quota.Reservation, r *quota.Reading, invalid int, now time.Time) {
	if a.quota == nil {
		return
	}
	if invalid > 0 {
		a.engine.rec.QuotaHeadersInvalid(a.provider, invalid)
	}
	if r.Empty() {
		return
	}
	a.quota.Observe(sent, r, now)
}

// TracksQuota reports whether the request's provider follows its rate-limit headers.
func (a *AttemptTarget) TracksQuota() bool { return a.quota != nil }
