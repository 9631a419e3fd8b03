package policy

import (
	"slices"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// ClientQuota is what a client may know of its own limits (quota_endpoint): the compartments a
// request classified as Dims would pass through. Only compartments keyed by its tenant say what
// is left and in flight; a compartment other tenants share says its limits alone.
type ClientQuota struct {
	Tenant       string              `json:"tenant"`
	Feature      string              `json:"feature"`
	Tier         string              `json:"tier"`
	Provider     string              `json:"provider"`
	Compartments []ClientCompartment `json:"compartments"`
	Currency     string              `json:"currency,omitempty"`
	At           time.Time           `json:"at"`
}

// ClientCompartment is one compartment of a ClientQuota.
type ClientCompartment struct {
	Name string `json:"name"`
	// Own says the compartment is the tenant's own (keyed by tenant): the usage fields are set.
	Own           bool   `json:"own"`
	MaxConcurrent int64  `json:"max_concurrent,omitempty"`
	InFlight      *int64 `json:"in_flight,omitempty"`
	// Windows are the token and request windows: limit, and for the tenant's own what is left
	// and when everything charged has aged out.
	Windows []ClientWindow `json:"windows,omitempty"`
	Spend   []ClientSpend  `json:"spend,omitempty"`
}

// ClientWindow is a token or request window of a compartment.
type ClientWindow struct {
	Kind  string `json:"kind"` // tokens_per_minute, tokens_per_day, requests_per_minute
	Limit int64  `json:"limit"`
	// Remaining and ResetSeconds (the time until everything charged has aged out) are set for
	// the tenant's own compartments only.
	Remaining    *int64   `json:"remaining,omitempty"`
	ResetSeconds *float64 `json:"reset_seconds,omitempty"`
}

// ClientSpend is a spend budget of a compartment, in the policy's currency.
type ClientSpend struct {
	Period string `json:"period"`
	Limit  string `json:"limit"`
	// Spent (settled and reserved) and Remaining are set for the tenant's own compartments.
	Spent     string    `json:"spent,omitempty"`
	Remaining string    `json:"remaining,omitempty"`
	Reset     time.Time `json:"reset"`
}

// ClientQuota returns the quota view of a request classified as d (Classify) at now. It
// creates nothing: a tenant the server has not seen yet gets its limits with everything left.
func (s *Snapshot) ClientQuota(d Dims, now time.Time) ClientQuota {
	n := s.Names(d)
	out := ClientQuota{Tenant: n.Tenant, Feature: n.Feature, Tier: n.Tier, Provider: n.Provider, Compartments: []ClientCompartment{}, At: now}
	led := s.engine.ledger
	for _, f := range s.families {
		if !f.applies(&d) {
			continue
		}
		own := slices.Contains(f.key, dimTenant)
		var in *instance
		if f.dyn != nil {
			in = f.dyn.peek(f, &d)
		} else {
			in = f.instances[f.staticIndex(&d)]
		}
		var cc ClientCompartment
		if in != nil {
			cc = ClientCompartment{Name: in.name, Own: own, MaxConcurrent: in.limits.MaxConcurrent}
			if own {
				inflight := s.engine.sched.Stats(in.c).InFlight
				cc.InFlight = &inflight
			}
			for _, w := range []struct {
				kind string
				w    *budget.Window
			}{{"tokens_per_minute", in.tpm}, {"tokens_per_day", in.tpd}, {"requests_per_minute", in.rpm}} {
				if w.w == nil {
					continue
				}
				st := w.w.State(now)
				cw := ClientWindow{Kind: w.kind, Limit: st.Capacity}
				if own {
					secs := st.ResetIn.Seconds()
					cw.Remaining, cw.ResetSeconds = &st.Remaining, &secs
				}
				cc.Windows = append(cc.Windows, cw)
			}
			cc.Spend = clientSpend(led, in.spend, own, now)
		} else {
			// A tenant not seen yet (or evicted): its limits, everything left.
			lim := s.limitsFor(f, &d)
			name := instanceName(f.name, s.keyValues(f, &d))
			cc = ClientCompartment{Name: name, Own: own, MaxConcurrent: lim.MaxConcurrent}
			zero := int64(0)
			if own {
				cc.InFlight = &zero
			}
			for _, w := range []struct {
				kind  string
				limit int64
			}{{"tokens_per_minute", lim.TokensPerMinute}, {"tokens_per_day", lim.TokensPerDay}, {"requests_per_minute", lim.RequestsPerMinute}} {
				if w.limit <= 0 {
					continue
				}
				cw := ClientWindow{Kind: w.kind, Limit: w.limit}
				if own {
					left, secs := w.limit, 0.0
					cw.Remaining, cw.ResetSeconds = &left, &secs
				}
				cc.Windows = append(cc.Windows, cw)
			}
			cc.Spend = clientSpend(led, spendBudgets(name, lim), own, now)
		}
		out.Compartments = append(out.Compartments, cc)
	}
	if led != nil {
		out.Currency = led.Currency()
	}
	return out
}

// clientSpend lists budgets bs as a client may see them.
func clientSpend(led *spend.Ledger, bs []spend.Budget, own bool, now time.Time) []ClientSpend {
	if led == nil {
		return nil
	}
	var out []ClientSpend
	for _, b := range bs {
		w := led.Window(b, now)
		cs := ClientSpend{Period: b.Period.String(), Limit: b.Limit.String(), Reset: w.End}
		if own {
			var used spend.Micros
			if u, ok := led.Store().Get(w.ID, now); ok {
				used = u.Spent + u.Reserved
			}
			cs.Spent, cs.Remaining = used.String(), max(b.Limit-used, 0).String()
		}
		out = append(out, cs)
	}
	return out
}
