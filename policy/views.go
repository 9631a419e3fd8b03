package policy

import (
	"errors"
	"fmt"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/budget"
)

// CompartmentView is a compartment's state for the admin API and dashboard.
type CompartmentView struct {
	Name              string       `json:"name"`
	Family            string       `json:"family"`
	Mode              string       `json:"mode"`
	InFlight          int64        `json:"in_flight"`
	MaxConcurrent     int64        `json:"max_concurrent"`
	InFlightTokens    int64        `json:"in_flight_tokens"`
	MaxInflightTokens int64        `json:"max_inflight_tokens"`
	Queued            int          `json:"queued"`
	QueueDepth        int64        `json:"queue_depth"`
	MaxWait           string       `json:"max_wait,omitempty"`
	Priority          int64        `json:"priority"`
	Pool              string       `json:"pool,omitempty"`
	Guaranteed        int64        `json:"guaranteed,omitempty"`
	AvgHold           string       `json:"avg_hold,omitempty"`
	Admitted          uint64       `json:"admitted"`
	Refused           uint64       `json:"refused_full"`
	ShadowRefusals    uint64       `json:"shadow_refusals"`
	Budgets           []BudgetView `json:"budgets,omitempty"`

	// RemoteInFlight and RemoteInFlightTokens are what other replicas hold (cluster mode), as
	// last reported; the limits count them with this replica's own.
	RemoteInFlight       int64 `json:"remote_in_flight,omitempty"`
	RemoteInFlightTokens int64 `json:"remote_in_flight_tokens,omitempty"`

	// Lease is this replica's lease of the fleet's limits (cluster.admission: leased).
	Lease *LeaseView `json:"lease,omitempty"`

	// Overflow is set only on the overflow compartment of a tenant-keyed family
	// (<family>/_overflow), so that the dashboard can say what it is and how near the family is
	// to needing it.
	Overflow *OverflowView `json:"overflow,omitempty"`

	// Adaptive is set on compartments with max_concurrent: adaptive: the learned limit (also
	// in MaxConcurrent), its baselines and last signals.
	Adaptive *AdaptiveView `json:"adaptive,omitempty"`
}

// LeaseView is what this replica may hold of a compartment's limits under leased cluster
// admission: its lease while Redis answers, its part of the limits while Redis is unavailable
// (Part; the limits shown are then the part).
type LeaseView struct {
	Slots          int64 `json:"slots"`
	InflightTokens int64 `json:"inflight_tokens"`
	Part           bool  `json:"part,omitempty"`
}

// OverflowView describes a tenant-keyed family's overflow compartment: new tenants share it
// while the family already tracks max_instances tenants and none of them can be evicted (each
// has requests queued or in flight, or tokens still charged to a budget window). It has the
// limits of tenants.default_tier.
type OverflowView struct {
	// Tracked is how many tenant compartments the family holds now (the overflow not counted).
	Tracked int `json:"tracked"`
	// MaxInstances is the family's compartments[].max_instances.
	MaxInstances int `json:"max_instances"`
}

// BudgetView is one budget window of a compartment.
type BudgetView struct {
	Kind      string `json:"kind"` // tokens_per_minute, tokens_per_day, requests_per_minute
	Capacity  int64  `json:"capacity"`
	Used      int64  `json:"used"`
	Remaining int64  `json:"remaining"`
	ResetIn   string `json:"reset_in"`
	// Forgiven is what settlement could not charge because the window was at its debt bound
	// (max_debt), since the budget was created.
	Forgiven int64 `json:"forgiven"`
}

// Compartments returns the state of every compartment: static ones in family order, then
// tenant-keyed ones by name.
func (e *Engine) Compartments() []CompartmentView {
	s := e.Snapshot()
	now := e.clock.Now()
	var out []CompartmentView
	for _, in := range append(s.staticInstances(), s.dynamicInstances()...) {
		st := e.sched.Stats(in.c)
		v := CompartmentView{
			Name: in.name, Family: in.family.name, Mode: "enforce", InFlight: st.InFlight, MaxConcurrent: st.Limits.MaxConcurrent,
			InFlightTokens: st.InFlightTokens, MaxInflightTokens: st.Limits.MaxInflightTokens, Queued: st.Queued,
			QueueDepth: st.Limits.QueueDepth, Priority: st.Limits.Priority, Pool: st.Pool, Guaranteed: st.Guaranteed,
			Admitted: st.Admitted, Refused: st.Refused, ShadowRefusals: st.ShadowRefusals,
			RemoteInFlight: st.Remote, RemoteInFlightTokens: st.RemoteTokens,
		}
		if st.Limits.Shadow {
			v.Mode = "shadow"
		}
		if st.Leased {
			v.Lease = &LeaseView{Slots: st.LeaseSlots, InflightTokens: st.LeaseTokens, Part: st.LeasePart}
		}
		if d := in.family.dyn; d != nil {
			if tracked, max, ok := d.overflowOf(in); ok {
				v.Overflow = &OverflowView{Tracked: tracked, MaxInstances: max}
			}
		}
		if st.Pool != "" {
			v.MaxConcurrent = st.PoolMax
		}
		if in.adaptive != nil {
			v.Adaptive = in.adaptive.view()
		}
		if in.limits.HasMaxWait {
			v.MaxWait = in.limits.MaxWait.String()
		}
		if st.AvgHold > 0 {
			v.AvgHold = st.AvgHold.Round(time.Millisecond).String()
		}
		if in.tpm != nil {
			v.Budgets = append(v.Budgets, budgetView("tokens_per_minute", in.tpm.State(now)))
		}
		if in.tpd != nil {
			v.Budgets = append(v.Budgets, budgetView("tokens_per_day", in.tpd.State(now)))
		}
		if in.rpm != nil {
			v.Budgets = append(v.Budgets, budgetView("requests_per_minute", in.rpm.State(now)))
		}
		out = append(out, v)
	}
	return out
}

// overflowOf reports whether in is the store's overflow compartment and, if so, how many
// tenant compartments the store holds and may hold.
func (st *dynStore) overflowOf(in *instance) (tracked, max int, ok bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if in != st.overflow {
		return 0, 0, false
	}
	return len(st.entries), st.max, true
}

func budgetView(kind string, st budget.State) BudgetView {
	return BudgetView{Kind: kind, Capacity: st.Capacity, Used: st.Used, Remaining: st.Remaining, ResetIn: st.ResetIn.Round(time.Millisecond).String(),
		Forgiven: st.Forgiven}
}

// BreakerView is a breaker's state for the admin API and dashboard.
type BreakerView struct {
	Name     string           `json:"name"`
	Provider string           `json:"provider"`
	Fallback string           `json:"fallback,omitempty"`
	Snapshot breaker.Snapshot `json:"snapshot"`
	Calls    breaker.Counts   `json:"calls"`
}

// Breakers returns the state of every breaker, by provider.
func (e *Engine) Breakers() []BreakerView {
	s := e.Snapshot()
	now := e.clock.Now()
	var out []BreakerView
	for _, pr := range s.providers {
		if pr.breakers == nil {
			continue
		}
		fb := ""
		if pr.fallback >= 0 {
			fb = s.providers[pr.fallback].name
		}
		for _, b := range pr.breakers.all() {
			out = append(out, BreakerView{Name: b.Name(), Provider: pr.name, Fallback: fb, Snapshot: b.Snapshot(now), Calls: b.Counts()})
		}
	}
	return out
}

// ErrNoSuchBreaker is returned by ForceBreaker for an unknown name.
var ErrNoSuchBreaker = errors.New("no such breaker")

// ForceBreaker moves the named breaker to state (FORCED_OPEN, DISABLED, METRICS_ONLY, CLOSED,
// OPEN or HALF_OPEN) on an operator's request.
func (e *Engine) ForceBreaker(name string, state string) error {
	to, err := breaker.ParseState(state)
	if err != nil {
		return err
	}
	b := e.Snapshot().breakerNamed(name)
	if b == nil {
		return fmt.Errorf("%w: %s", ErrNoSuchBreaker, name)
	}
	if err := b.Transition(to, e.clock.Now()); err != nil {
		return err
	}
	e.log.Warn("breaker state forced by an operator", "breaker", name, "state", to.String())
	return nil
}

// breakerNamed returns the breaker called name (a provider's, or a per-model one), or nil.
func (s *Snapshot) breakerNamed(name string) *breaker.Breaker {
	for _, pr := range s.providers {
		if pr.breakers == nil {
			continue
		}
		for _, b := range pr.breakers.all() {
			if b.Name() == name {
				return b
			}
		}
	}
	return nil
}

// BreakerEvents returns the history of the named breaker: its last breaker.HistorySize
// transitions and threshold breaches, oldest first, each with the calls recorded just before it.
func (e *Engine) BreakerEvents(name string) ([]breaker.HistoryEntry, error) {
	b := e.Snapshot().breakerNamed(name)
	if b == nil {
		return nil, fmt.Errorf("%w: %s", ErrNoSuchBreaker, name)
	}
	return b.History(), nil
}
