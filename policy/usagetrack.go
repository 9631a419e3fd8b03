package policy

import (
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// Usage by tenant and model (usage section of the policy): the engine owns a usage.Tracker that
// outlives reloads; every finished request is recorded at settlement (Ticket.Done) and every
// refusal admission decides (AdmitInto), each by one call. The tracker copies the tenant's and
// the model's names only when a group takes a row, so the hot path allocates nothing.

// usageReasons are the refusal reasons usage counts, indexed as reasons.
var usageReasons = func() []string {
	out := make([]string, len(reasons))
	for i, r := range reasons {
		out[i] = string(r)
	}
	return out
}()

// A tracker counts every reason.
var _ [usage.MaxReasons - len(reasons)]struct{}

// usageReason returns r's index in usageReasons, -1 if it has none.
func usageReason(r Reason) int {
	for i, x := range reasons {
		if x == r {
			return i
		}
	}
	return -1
}

// buildUsage configures the tracker once the snapshot goes live.
func (s *Snapshot) buildUsage() {
	p, e := s.policy, s.engine
	s.usageOn = p.Usage.On()
	// With prices, every request's cost is counted, spend budget or not.
	s.usagePrices = len(p.Prices) > 0
	settings := usage.Settings{Enabled: s.usageOn, TableSize: p.Usage.TableSize, Location: p.Location(), Tenants: p.Usage.TenantMetrics}
	s.onCommit(func() { e.usage.Configure(settings, e.clock.Now()) })
}

// Usage returns the engine's usage tracker: what tenants and models used, for /admin/usage, the
// state file and metrics.
func (e *Engine) Usage() *usage.Tracker { return e.usage }

// recordUsage records the finished request: its settled tokens, the prompt tokens the response
// said were cached, and its cost — what its spend budgets were charged, or, without one, what
// the prices say it cost.
func (t *Ticket) recordUsage(o Outcome, settled Settled, now time.Time) {
	s := t.snap
	if !s.usageOn {
		return
	}
	ev := usage.Event{Tenant: t.dims.Tenant, Model: t.dims.Model, Refusal: -1, Prompt: settled.Prompt, Completion: settled.Completion}
	if o.Usage.Known {
		ev.Cached = min(max(o.Usage.Cached, 0), settled.Prompt)
	}
	switch {
	case settled.HasCost:
		ev.Spend = settled.Cost
	case s.usagePrices:
		ev.Spend = t.cost(o, settled)
	}
	t.engine.usage.Record(now, &ev)
}

// recordRefusal records refused decision d of request r, at its arrival.
func (e *Engine) recordRefusal(s *Snapshot, r *Request, d *Decision) {
	if d.Verdict == Admit || !s.usageOn {
		return
	}
	i := usageReason(d.Reason)
	if i < 0 {
		return
	}
	now := r.Now
	if now.IsZero() {
		now = e.clock.Now()
	}
	e.usage.Record(now, &usage.Event{Tenant: d.Dims.Tenant, Model: d.Dims.Model, Refusal: i})
}

// cost is what the ticket's request cost at outcome o settled as settled, as its spend budgets
// would be charged (see settleSpend): nothing for a request that never reached the provider.
func (t *Ticket) cost(o Outcome, settled Settled) spend.Micros {
	served := o.Status >= 200 && o.Status < 300
	if settled.Total == 0 && !o.Usage.Known && !served {
		return 0
	}
	return t.price(o, settled, served)
}
