package policy

import (
	"context"
	"strings"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// Spend budgets (spend_per_hour, spend_per_day, spend_per_month) are kept by the engine's
// ledger, which outlives reloads: each compartment instance names its budgets after itself, and
// a request reserves its worst-case cost in every budget of its compartments at once, after
// its token budgets and before it may queue for a slot. Done settles the reservation at the
// cost the response reported, priced by the model that answered; a request that never reached
// the provider is refunded. A policy without spend budgets skips all of this.

// A reservation holds the budgets of every compartment a request is in.
var _ [spend.MaxWindows - len(spend.Periods)*maxCompartments]struct{}

// buildSpend compiles the prices and, once the snapshot goes live, sets the ledger's currency
// and calendar and resolves the features' spend counters.
func (s *Snapshot) buildSpend() {
	p, e := s.policy, s.engine
	s.prices = priceTable(p)
	s.SpendLimits = p.AnySpendLimits()
	if !s.SpendLimits {
		return
	}
	settings := spend.Settings{Currency: p.Currency, Calendar: spend.NewCalendar(p.Location()), AllowSingleOverrun: p.Spend.AllowSingleOverrun}
	s.onCommit(func() {
		n, err := e.ledger.Configure(settings, e.clock.Now())
		s.spendCarried, s.spendCarryErr = n, err
		if err != nil {
			e.log.Error("the spend of the current windows could not be carried into the new time zone's windows yet; it is carried once the spend store answers",
				"time_zone", p.TimeZone, "error", err)
		}
	})
	for _, f := range s.features {
		s.onCommit(func() { f.spend = e.rec.Spend(f.name) })
	}
}

// priceTable compiles the policy's prices list: the entries in order, the default entry, and
// the highest price of each kind (what a model no entry prices is charged when there is no
// default entry).
func priceTable(p *config.Policy) *spend.Prices {
	var rules []spend.PriceRule
	var def *spend.Price
	var highest spend.Price
	for _, pr := range p.Prices {
		price := priceOf(pr)
		highest.Input = max(highest.Input, price.Input)
		highest.Output = max(highest.Output, price.Output)
		highest.CachedInput = max(highest.CachedInput, price.CachedInput)
		highest.Reasoning = max(highest.Reasoning, price.Reasoning)
		highest.PerSecond = max(highest.PerSecond, price.PerSecond)
		highest.PerRequest = max(highest.PerRequest, price.PerRequest)
		highest.PerImage = max(highest.PerImage, price.PerImage)
		if pr.Match == config.DefaultPrice {
			def = &price
			continue
		}
		rules = append(rules, spend.PriceRule{Match: pr.Match, Price: price})
	}
	if def == nil && len(p.Prices) > 0 {
		// Every kind is priced explicitly: the highest cached price may be below the highest
		// input price, and so on.
		highest.HasCachedInput, highest.HasReasoning = true, true
		def = &highest
	}
	return spend.NewPrices(rules, def, !p.Classification.Model.CaseSensitive)
}

// priceOf is the price one prices entry says: a cached (reasoning) token costs an input
// (output) token unless the entry prices it, and what the entry leaves out costs nothing.
func priceOf(r config.PriceRule) spend.Price {
	amount := func(a *config.Amount) spend.Micros {
		if a == nil {
			return 0
		}
		return *a
	}
	pr := spend.Price{Input: amount(r.InputPerMtok), Output: amount(r.OutputPerMtok)}
	pr.CachedInput, pr.HasCachedInput = pr.Input, false
	if r.CachedInputPerMtok != nil {
		pr.CachedInput, pr.HasCachedInput = *r.CachedInputPerMtok, true
	}
	pr.Reasoning = pr.Output
	if r.ReasoningPerMtok != nil {
		pr.Reasoning, pr.HasReasoning = *r.ReasoningPerMtok, true
	}
	pr.PerSecond, pr.PerRequest, pr.PerImage = amount(r.PerSecond), amount(r.PerRequest), amount(r.PerImage)
	return pr
}

// carryForeignSpend carries into the current windows the spend of windows another time zone
// made current (see spend.Ledger.CarryForeign): windows replicas that still use another zone
// keep in the shared store, or that a reload could not carry while the store did not answer.
// The cluster calls it whenever the shared store is available again (and at start).
func (e *Engine) carryForeignSpend() {
	if s := e.Snapshot(); s == nil || !s.SpendLimits {
		return
	}
	n, err := e.ledger.CarryForeign(e.clock.Now())
	switch {
	case err != nil:
		e.log.Warn("could not carry spend of another time zone's windows into the current ones; trying again when the spend store is available again", "error", err)
	case n > 0:
		e.log.Info("spend of windows of another time zone carried into the current windows", "windows", n)
	}
}

// spendBudgets returns the spend budgets of an instance with limits r, named after it.
func spendBudgets(name string, r config.Resolved) []spend.Budget {
	if !r.AnySpend() {
		return nil
	}
	var out []spend.Budget
	for i, limit := range r.Spend {
		if limit > 0 {
			out = append(out, spend.Budget{Name: name, Period: spend.Periods[i], Limit: limit, Shadow: r.Shadow})
		}
	}
	return out
}

// Ledger returns the engine's spend ledger: the windows of every spend budget. A persister
// restores it at start and saves it while the server runs.
func (e *Engine) Ledger() *spend.Ledger { return e.ledger }

// reserveSpend reserves the request's worst-case cost in every spend budget of t's
// compartments: its estimated prompt at the input price plus its output allowance (max_tokens
// or the default, times n) at the output price of the model it is sent as. On a refusal it
// undoes everything t holds and returns the decision. A ticket that reserved already (a
// cluster admission that fell back to local limits) keeps its reservation.
func (e *Engine) reserveSpend(ctx context.Context, s *Snapshot, r *Request, dims Dims, t *Ticket, now time.Time, d *Decision) (refused bool) {
	if t.spend != nil {
		if t.spend.Active() {
			return false
		}
		t.spend.Reset(now) // what an earlier attempt reserved was given back by its undo
	}
	if !s.SpendLimits {
		return false
	}
	found := false
	for i := 0; i < t.n && !found; i++ {
		found = len(t.insts[i].spend) > 0
	}
	if !found {
		return false
	}
	if t.spend == nil {
		t.spend = &spend.Reservation{}
	}
	res := t.spend
	for i := 0; i < t.n; i++ {
		for _, b := range t.insts[i].spend {
			res.Add(b)
		}
	}
	price, _ := s.prices.Lookup(dims.Model)
	amount := price.Cost(spend.Tokens{Prompt: r.Estimate.Prompt, Completion: r.Estimate.Output,
		AudioMillis: r.Estimate.AudioMillis, Requests: 1, Images: r.Estimate.OutputImages})
	rf, ok := e.ledger.Reserve(ctx, res, amount, now)
	if !ok && rf.Unavailable {
		// Redis did not answer and on_unavailable is closed.
		t.undo(now)
		e.rec.ClusterUnavailable("refused")
		refuseInto(d, ReasonClusterUnavailable, "cluster", e.cluster.retryAfter(), &dims)
		return true
	}
	if !ok {
		t.undo(now)
		refuseInto(d, ReasonSpendBudget, rf.Budget.Name, max(rf.Window.End.Sub(now), 0), &dims)
		d.SpendReset, d.SpendOverLimit = rf.Window.End, amount > rf.Window.Limit
		return true
	}
	if over := res.Over(); over != 0 {
		k := 0
		for i := 0; i < t.n; i++ {
			for range t.insts[i].spend {
				if over&(1<<uint(k)) != 0 {
					e.rec.ShadowRefusal(s.label(t.insts[i]), ReasonSpendBudget)
				}
				k++
			}
		}
	}
	if c := s.features[dims.Feature].spend; c != nil {
		c.Reserved(amount)
	}
	return false
}

// SpendReserved returns what the ticket reserved in its spend budgets; ok is false when no
// spend budget applied.
func (t *Ticket) SpendReserved() (spend.Micros, bool) {
	if t.spend == nil || t.spend.Len() == 0 {
		return 0, false
	}
	return t.spend.Amount(), true
}

// settleSpend settles the ticket's spend reservation at the cost of settled, priced by the
// model that answered (o.Model) when the prices list names it, else by the model the request
// was sent as. Cached and reasoning tokens count only when usage was reported, and never beyond
// the settled prompt and completion. A request the provider served (a 2xx) also pays its
// per_request price, per_image for the images it asked for, and per_second for the audio the
// response reported, or, when it reported no usage, the audio it was reserved for. A request
// that cost nothing because it never reached the provider gets its reservation back. It
// returns the cost charged, and false when no spend budget applied.
func (t *Ticket) settleSpend(o Outcome, settled Settled, now time.Time) (spend.Micros, bool) {
	res := t.spend
	if res == nil || !res.Active() {
		return 0, false
	}
	s := t.snap
	c := s.features[t.dims.Feature].spend
	served := o.Status >= 200 && o.Status < 300
	if settled.Total == 0 && !o.Usage.Known && !served {
		res.Release(now)
		if c != nil {
			c.Refunded(res.Amount())
		}
		return 0, true
	}
	cost := t.price(o, settled, served)
	res.Settle(cost, now)
	if c != nil {
		c.Settled(cost)
	}
	return cost, true
}

// price is what the ticket's request costs at outcome o settled as settled (served: the
// provider served it, a 2xx), priced by the model that answered when the prices list names it,
// else by the model it was sent as.
func (t *Ticket) price(o Outcome, settled Settled, served bool) spend.Micros {
	s := t.snap
	price, ok := s.prices.LookupRule(o.Model)
	if o.Model == "" || !ok {
		price, _ = s.prices.Lookup(t.dims.Model)
	}
	tok := spend.Tokens{Prompt: settled.Prompt, Completion: settled.Completion}
	if o.Usage.Known {
		tok.Cached = min(max(o.Usage.Cached, 0), settled.Prompt)
		tok.Reasoning = min(max(o.Usage.Reasoning, 0), settled.Completion)
	}
	if served {
		tok.Requests, tok.Images = 1, t.est.OutputImages
		switch {
		case o.Usage.AudioMillis > 0:
			// Never more than the upload can hold: a provider's claim beyond it is not believed.
			tok.AudioMillis = o.Usage.AudioMillis
			if t.est.AudioMillis > 0 {
				tok.AudioMillis = min(tok.AudioMillis, t.est.AudioMillis)
			}
		case !o.Usage.Known:
			tok.AudioMillis = t.est.AudioMillis
		}
	}
	return price.Cost(tok)
}

// SpendBudgetView is one spend budget's current window.
type SpendBudgetView struct {
	// Budget is the compartment the budget belongs to; Label its metrics label.
	Budget, Label string
	Period        string
	Start, End    time.Time
	Limit         spend.Micros
	Spent         spend.Micros
	Reserved      spend.Micros
	// Leased is what replicas' chunks of a shared window hold unused (leased admission).
	Leased spend.Micros
	// Tenant marks a budget of a tenant-keyed compartment (its overflow compartment aside).
	Tenant bool
	// Aggregate marks the line that stands for every tenant of a tenant-keyed family in
	// metrics without tenant labels (<family>/*): its numbers are those of the tenant closest
	// to its limit.
	Aggregate bool
	// Shared marks a budget kept in the cluster's shared store (Redis). Spent and Reserved then
	// include what this replica counted in its own memory that Redis has not applied yet.
	Shared bool
	// LocalLimit is, for a shared budget, what this replica may count on its own while Redis
	// does not answer: its share (the limit divided by the live replicas) of what Redis last
	// showed left. Local is what it counted so (Local.Pending: not applied by Redis yet).
	LocalLimit spend.Micros
	Local      spend.Local
}

// UsedRatio is used (spent and reserved) divided by the limit; 0 without a limit.
func (b SpendBudgetView) UsedRatio() float64 {
	if b.Limit <= 0 {
		return 0
	}
	return float64(b.Spent+b.Reserved) / float64(b.Limit)
}

// SpendView is the state of every spend budget, for /admin/spend.
type SpendView struct {
	Currency string
	TimeZone string
	// Budgets lists the current window of every spend budget of a compartment the policy has
	// (even one nothing was spent in yet) and of every tenant compartment with spend in its
	// current window (evicted tenants included), by budget, then period.
	Budgets []SpendBudgetView
}

// Spend returns the state of every spend budget at now.
func (s *Snapshot) Spend(now time.Time) SpendView {
	v := SpendView{Currency: s.policy.Currency, TimeZone: s.policy.TimeZone}
	if !s.SpendLimits {
		return v
	}
	for _, b := range s.SpendBudgets(now) {
		if !b.Aggregate {
			v.Budgets = append(v.Budgets, b)
		}
	}
	return v
}

// SpendBudgets lists the current windows of every spend budget: static instances' from their
// limits, tenant instances' from the ledger (an evicted tenant keeps its spend there), plus one
// aggregate per tenant-keyed family and period for metrics without tenant labels.
func (s *Snapshot) SpendBudgets(now time.Time) []SpendBudgetView {
	e := s.engine
	l := e.ledger
	type key struct{ name, period string }
	seen := map[key]bool{}
	var out []SpendBudgetView
	// One listing of the store for every budget (a shared store answers it in one call).
	usage := l.Usage(now)
	byID := make(map[spend.WindowID]spend.Usage, len(usage))
	for _, u := range usage {
		byID[u.ID] = u
	}
	view := func(b spend.Budget, label string) SpendBudgetView {
		w := l.Window(b, now)
		v := SpendBudgetView{Budget: b.Name, Label: label, Period: b.Period.String(), Start: time.Unix(w.ID.Start, 0).In(l.Calendar().Location()),
			End: w.End, Limit: b.Limit}
		if u, ok := byID[w.ID]; ok {
			v.Spent, v.Reserved, v.Leased, v.Local = u.Spent, u.Reserved, u.Leased, u.Local
		}
		v.LocalLimit, v.Shared = l.LocalLimit(b, now)
		return v
	}
	for _, in := range s.staticInstances() {
		for _, b := range in.spend {
			out = append(out, view(b, in.name))
			seen[key{in.name, b.Period.String()}] = true
		}
	}
	dyn := map[string]*family{}
	for _, f := range s.families {
		if f.dyn == nil {
			continue
		}
		dyn[f.name] = f
		f.dyn.mu.Lock()
		ov := f.dyn.overflow
		f.dyn.mu.Unlock()
		if ov == nil {
			continue
		}
		for _, b := range ov.spend {
			if k := (key{ov.name, b.Period.String()}); !seen[k] {
				out = append(out, view(b, ov.name))
				seen[k] = true
			}
		}
	}
	for _, in := range s.dynamicInstances() {
		for _, b := range in.spend {
			if !seen[key{in.name, b.Period.String()}] {
				v := view(b, in.name)
				v.Tenant = true
				out = append(out, v)
				seen[key{in.name, b.Period.String()}] = true
			}
		}
	}
	// Tenants evicted from memory (or restored from a saved state) still have spend in the
	// ledger: they are listed with the limit their window was last reserved with.
	cal := l.Calendar()
	for _, u := range usage {
		fam, _, _ := strings.Cut(u.ID.Budget, "/")
		f := dyn[fam]
		k := key{u.ID.Budget, u.ID.Period.String()}
		if f == nil || seen[k] || u.ID.Start != cal.Start(u.ID.Period, now).Unix() {
			// Not a tenant's budget, listed already, or a window of another time zone (whose
			// spend the current window carries).
			continue
		}
		seen[k] = true
		v := SpendBudgetView{Budget: u.ID.Budget, Label: u.ID.Budget, Period: u.ID.Period.String(), Tenant: true,
			Start: time.Unix(u.ID.Start, 0).In(cal.Location()), End: u.End, Limit: u.Limit, Spent: u.Spent, Reserved: u.Reserved, Leased: u.Leased,
			Local: u.Local}
		v.LocalLimit, v.Shared = l.LocalLimit(spend.Budget{Name: u.ID.Budget, Period: u.ID.Period, Limit: u.Limit}, now)
		out = append(out, v)
	}
	if !s.tenantLabel {
		agg := map[key]int{}
		n := len(out)
		for i := 0; i < n; i++ {
			b := out[i]
			fam, _, _ := strings.Cut(b.Budget, "/")
			if !b.Tenant {
				continue
			}
			k := key{fam + "/*", b.Period}
			j, ok := agg[k]
			if !ok {
				a := b
				a.Budget, a.Label, a.Aggregate = fam+"/*", fam+"/*", true
				out = append(out, a)
				agg[k] = len(out) - 1
				continue
			}
			if b.UsedRatio() > out[j].UsedRatio() {
				a := b
				a.Budget, a.Label, a.Aggregate = fam+"/*", fam+"/*", true
				out[j] = a
			}
		}
	}
	return out
}
