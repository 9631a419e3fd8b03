package policy_test

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
	spendpkg "github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// The prices make the arithmetic easy to follow: 10 000 prompt tokens of gpt-x cost 0.10 and
// 10 000 completion tokens 0.30, so a request estimated at 10 000 + 10 000 reserves 0.40.
const spendEnginePolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  tier:
    rules: [{tenant_directory: true}]
  provider:
    default: openai
    rules: [{header: x-llm-provider}, {model_map: true}]
  model:
    rules: [{header: x-model}]
models:
  - {match: "gpt-?", provider: openai}
  - {match: "local-*", provider: local}
prices:
  - {match: "gpt-x", input_per_mtok: 10, output_per_mtok: 30, cached_input_per_mtok: 1}
  - {match: "gpt-y", input_per_mtok: 1, output_per_mtok: 2, reasoning_per_mtok: 50}
  - {match: "gpt-?", input_per_mtok: 20, output_per_mtok: 60}
  - {match: "local-*", input_per_mtok: 0, output_per_mtok: 0}
tenants:
  directory:
    - {id: acme, tier: free, limits: {spend_per_day: 1.00}}
features:
  chat: {max_concurrent: 20, ratio: 0.4}
  batch: {max_concurrent: 20, ratio: 0.5, degrade: {provider: local}}
  default: {max_concurrent: 10}
tiers:
  free: {max_concurrent: 50, spend_per_month: 5}
providers:
  openai:
    max_concurrent: 50
    models: [{match: "*", model: gpt-x}]
  local:
    max_concurrent: 50
    models: [{match: "*", model: local-llama}]
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tier_feature, key: [tier, feature], limits_from: tier, scale_by: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
  - {name: provider, key: [provider], limits_from: provider}
`

func spendEngine(t *testing.T, yaml string, reg prometheus.Registerer) (*policy.Engine, *clock) {
	t.Helper()
	p, err := config.Load("test.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatalf("policy:\n%v", err)
	}
	c := newClock()
	o := policy.Options{Clock: c, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	var e *policy.Engine
	if reg != nil {
		e, err = observe.NewEngine(p, o, reg)
	} else {
		e, err = policy.NewEngine(p, o)
	}
	if err != nil {
		t.Fatal(err)
	}
	return e, c
}

func spendRequest(tenant, feat, model string) input {
	return input{headers: map[string]string{"x-tenant-id": tenant, "x-llm-feature": feat, "x-model": model}}
}

// admitTokens admits in with an estimate of prompt and output tokens.
func admitTokens(e *policy.Engine, in input, prompt, output int64) (policy.Decision, *policy.Ticket) {
	s := e.Snapshot()
	tk := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(in), Estimate: policy.Estimate{Prompt: prompt, Output: output, Total: prompt + output, BytesPerToken: 4}, CanRewriteModel: true}
	return e.Admit(context.Background(), s, &r, tk, nil), tk
}

// spent returns the budget's spent and reserved amounts in its current window.
func spent(t *testing.T, e *policy.Engine, budget, period string) (spendpkg.Micros, spendpkg.Micros, policy.SpendBudgetView) {
	t.Helper()
	for _, b := range e.Snapshot().Spend(e.Now()).Budgets {
		if b.Budget == budget && b.Period == period {
			return b.Spent, b.Reserved, b
		}
	}
	t.Fatalf("no %s budget of %s", period, budget)
	return 0, 0, policy.SpendBudgetView{}
}

func usage(prompt, completion int64) policy.Outcome {
	return policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: prompt, Completion: completion, Total: prompt + completion, Known: true}}
}

func TestSpendBudgetReservesSettlesAndRefuses(t *testing.T) {
	reg := prometheus.NewRegistry()
	e, c := spendEngine(t, spendEnginePolicy, reg)
	acme := spendRequest("acme", "default", "gpt-x")

	d1, t1 := admitTokens(e, acme, 10_000, 10_000)
	d2, t2 := admitTokens(e, acme, 10_000, 10_000)
	if d1.Verdict != policy.Admit || d2.Verdict != policy.Admit {
		t.Fatalf("first two: %+v / %+v", d1, d2)
	}
	if got, ok := t1.SpendReserved(); !ok || got != 400_000 {
		t.Fatalf("reserved %s, %v; want 0.40", got, ok)
	}
	// 0.80 reserved: a third 0.40 does not fit the tenant's 1.00 a day.
	d3, _ := admitTokens(e, acme, 10_000, 10_000)
	if d3.Verdict != policy.Reject || d3.Reason != policy.ReasonSpendBudget || d3.Compartment != "tenant/acme" {
		t.Fatalf("third: %+v, want spend_budget by tenant/acme", d3)
	}
	if want := time.Date(2026, 5, 2, 0, 0, 0, 0, time.UTC); !d3.SpendReset.Equal(want) || d3.RetryAfter != 15*time.Hour {
		t.Fatalf("third resets %s after %s, want %s after 15h", d3.SpendReset, d3.RetryAfter, want)
	}
	if !strings.Contains(d3.Message(), "Spend budget of tenant/acme is used up until 2026-05-02T00:00:00Z") {
		t.Fatalf("message %q", d3.Message())
	}
	if _, reserved, _ := spent(t, e, "tenant/acme", "day"); reserved != 800_000 {
		t.Fatalf("a refused request left %s reserved, want 0.80", reserved)
	}

	// The first settles at its real use: 10 000 prompt tokens, 4 000 of them cached, and 2 000
	// completion tokens cost 6 000 × 10 + 4 000 × 1 + 2 000 × 30 = 124 000 millionths.
	o := usage(10_000, 2_000)
	o.Usage.Cached = 4_000
	st := t1.Done(o)
	if !st.HasCost || st.Cost != 124_000 {
		t.Fatalf("settled %+v, want cost 0.124", st)
	}
	if again := t1.Done(o); again.HasCost {
		t.Fatal("a second Done settled again")
	}
	s, r, _ := spent(t, e, "tenant/acme", "day")
	if s != 124_000 || r != 400_000 {
		t.Fatalf("after settling: spent %s reserved %s, want 0.124 and 0.40", s, r)
	}
	// 0.124 + 0.40 + 0.40 fits now.
	d4, t4 := admitTokens(e, acme, 10_000, 10_000)
	if d4.Verdict != policy.Admit {
		t.Fatalf("fourth: %+v", d4)
	}
	// A request that never reached the provider gets its reservation back whole.
	if st := t2.Done(policy.Outcome{}); !st.HasCost || st.Cost != 0 {
		t.Fatalf("unserved request settled %+v", st)
	}
	// The model that answered prices the response: gpt-y's reasoning tokens cost 50 a million.
	o = usage(1_000, 3_000)
	o.Usage.Reasoning, o.Model = 2_000, "gpt-y"
	if st := t4.Done(o); st.Cost != 1_000*1+1_000*2+2_000*50 {
		t.Fatalf("gpt-y settled at %s", st.Cost)
	}
	s, r, view := spent(t, e, "tenant/acme", "day")
	if s != 124_000+103_000 || r != 0 {
		t.Fatalf("spent %s reserved %s", s, r)
	}
	if view.Limit != 1_000_000 || !view.Tenant || !view.End.Equal(time.Date(2026, 5, 2, 0, 0, 0, 0, time.UTC)) {
		t.Fatalf("view %+v", view)
	}
	// The tier's monthly budget counted the same requests.
	if s, _, _ := spent(t, e, "tier_feature/free/default", "month"); s != 227_000 {
		t.Fatalf("tier month spent %s", s)
	}

	// Metrics: reserved and settled counters, and the tenant family's aggregate ratio.
	if got := spendMetric(t, reg, "llm_bulkhead_spend_settled_total", "feature", "default"); got < 0.2269 || got > 0.2271 {
		t.Fatalf("spend_settled_total = %v, want 0.227", got)
	}
	if got := spendMetric(t, reg, "llm_bulkhead_spend_reserved_total", "feature", "default"); got < 1.199 || got > 1.201 {
		t.Fatalf("spend_reserved_total = %v, want 1.20", got)
	}
	if got := spendMetric(t, reg, "llm_bulkhead_spend_refunded_total", "feature", "default"); got < 0.399 || got > 0.401 {
		t.Fatalf("spend_refunded_total = %v, want 0.40", got)
	}
	if got := spendMetric(t, reg, "llm_bulkhead_spend_budget_used_ratio", "compartment", "tenant/*"); got < 0.2269 || got > 0.2271 {
		t.Fatalf("tenant/* used ratio = %v, want 0.227", got)
	}
	if got := spendMetric(t, reg, "llm_bulkhead_spend_budget_remaining", "compartment", "tier_feature/free/default"); got < 4.7729 || got > 4.7731 {
		t.Fatalf("tier_feature/free/default remaining = %v, want 4.773", got)
	}
	if n := seriesCount(t, reg, "llm_bulkhead_spend_budget_limit"); n != 4 {
		t.Fatalf("%d limit series, want the 3 tier × feature ones and tenant/_overflow's (tenants are unbounded)", n)
	}

	// The next day the tenant's budget is whole again; the month's is not.
	c.Advance(15 * time.Hour)
	if s, _, _ := spent(t, e, "tenant/acme", "day"); s != 0 {
		t.Fatalf("new day spent %s", s)
	}
	if s, _, _ := spent(t, e, "tier_feature/free/default", "month"); s != 227_000 {
		t.Fatalf("month spent %s after a day", s)
	}
}

// spendMetric returns the value of the series of name whose label has value.
func spendMetric(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.Metric {
			for _, l := range m.Label {
				if l.GetName() == label && l.GetValue() == value {
					if m.Counter != nil {
						return m.Counter.GetValue()
					}
					return m.Gauge.GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{%s=%q}", name, label, value)
	return 0
}

func seriesCount(t *testing.T, reg *prometheus.Registry, name string) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return len(mf.Metric)
		}
	}
	return 0
}

// Tiers' spend scales by the feature's ratio in tier × feature compartments, and a feature's
// degrade rule sends a request over budget to a cheaper provider instead of refusing it.
func TestSpendBudgetScalesAndDegrades(t *testing.T) {
	e, _ := spendEngine(t, spendEnginePolicy, nil)
	// The free tier's 5.00 a month × chat's 0.4 = 2.00 for tier_feature/free/chat.
	_, _, view := spent(t, e, "tier_feature/free/chat", "month")
	if view.Limit != 2_000_000 || !view.Start.Equal(time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)) || !view.End.Equal(time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)) {
		t.Fatalf("tier_feature/free/chat: %+v", view)
	}
	// Tenants not in the directory have only the tier's budgets: 1.20 each.
	chat := spendRequest("someone", "chat", "gpt-x")
	for i := range 1 {
		if d, _ := admitTokens(e, chat, 30_000, 30_000); d.Verdict != policy.Admit {
			t.Fatalf("chat %d: %+v", i, d)
		}
	}
	if d, _ := admitTokens(e, chat, 30_000, 30_000); d.Verdict != policy.Reject || d.Compartment != "tier_feature/free/chat" || d.Reason != policy.ReasonSpendBudget {
		t.Fatalf("over the scaled budget: %+v", d)
	}
	// batch (ratio 0.5: 2.50) degrades to the local provider, whose model costs nothing.
	batch := spendRequest("someone", "batch", "gpt-x")
	for range 2 {
		if d, _ := admitTokens(e, batch, 30_000, 30_000); d.Verdict != policy.Admit || d.Rerouted {
			t.Fatalf("batch: %+v", d)
		}
	}
	d, tk := admitTokens(e, batch, 30_000, 30_000)
	if d.Verdict != policy.Admit || !d.Rerouted || d.Reason != policy.ReasonSpendBudget || d.Dims.Model != "local-llama" {
		t.Fatalf("over budget: %+v, want re-routed to local-llama", d)
	}
	if amount, _ := tk.SpendReserved(); amount != 0 {
		t.Fatalf("the degraded request reserved %s at the local model's price 0", amount)
	}
}

func TestSpendShadowBudgetAdmits(t *testing.T) {
	e, _ := spendEngine(t, strings.Replace(spendEnginePolicy, "free: {max_concurrent: 50, spend_per_month: 5}",
		"free: {max_concurrent: 50, spend_per_month: 0.50, mode: shadow}", 1), nil)
	in := spendRequest("someone", "default", "gpt-x")
	for i := range 3 {
		if d, _ := admitTokens(e, in, 10_000, 10_000); d.Verdict != policy.Admit {
			t.Fatalf("request %d refused by a shadow budget: %+v", i, d)
		}
	}
	if _, r, _ := spent(t, e, "tier_feature/free/default", "month"); r != 1_200_000 {
		t.Fatalf("shadow budget counted %s, want 1.20", r)
	}
}

// Windows follow time_zone: a New York day ends at 04:00 UTC in May.
func TestSpendWindowsFollowTheTimeZone(t *testing.T) {
	e, c := spendEngine(t, strings.Replace(spendEnginePolicy, "prices:", "time_zone: America/New_York\nprices:", 1), nil)
	acme := spendRequest("acme", "default", "gpt-x")
	c.Advance(18*time.Hour + 59*time.Minute) // 2026-05-02 03:59 UTC, 23:59 in New York
	for range 2 {
		admitTokens(e, acme, 10_000, 10_000)
	}
	d, _ := admitTokens(e, acme, 10_000, 10_000)
	if d.Verdict != policy.Reject || d.RetryAfter != time.Minute {
		t.Fatalf("at 23:59: %+v, want refused for a minute", d)
	}
	if got := d.SpendReset.Format(time.RFC3339); got != "2026-05-02T00:00:00-04:00" {
		t.Fatalf("reset %s", got)
	}
	c.Advance(time.Minute)
	if d, _ := admitTokens(e, acme, 10_000, 10_000); d.Verdict != policy.Admit {
		t.Fatalf("after midnight in New York: %+v", d)
	}
}

// Spend survives a reload, and a new engine restored from the old one's state carries on where
// it was, without counting anything twice.
func TestSpendSurvivesReloadAndRestore(t *testing.T) {
	e, c := spendEngine(t, spendEnginePolicy, nil)
	acme := spendRequest("acme", "default", "gpt-x")
	_, tk := admitTokens(e, acme, 10_000, 10_000)
	tk.Done(usage(10_000, 20_000)) // 0.10 + 0.60
	p, err := config.Load("test.yaml", []byte(spendEnginePolicy), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Apply(p); err != nil {
		t.Fatal(err)
	}
	if s, _, _ := spent(t, e, "tenant/acme", "day"); s != 700_000 {
		t.Fatalf("after reload: %s", s)
	}
	st := e.Ledger().SaveState(c.Now())

	e2, c2 := spendEngine(t, spendEnginePolicy, nil)
	c2.Advance(time.Hour)
	if n, err := e2.Ledger().RestoreState(st, c2.Now()); err != nil || n == 0 {
		t.Fatalf("restore: %d, %v", n, err)
	}
	if n, err := e2.Ledger().RestoreState(st, c2.Now()); err != nil || n == 0 {
		t.Fatalf("second restore: %d, %v", n, err)
	}
	if s, _, _ := spent(t, e2, "tenant/acme", "day"); s != 700_000 {
		t.Fatalf("restored: %s, want 0.70 once", s)
	}
	// 0.70 + 0.40 is over the 1.00 of the day.
	if d, _ := admitTokens(e2, acme, 10_000, 10_000); d.Verdict != policy.Reject || d.Reason != policy.ReasonSpendBudget {
		t.Fatalf("after restart: %+v, want spend_budget", d)
	}
}

// A policy without spend budgets adds nothing to a request: no reservation, no series.
func TestNoSpendBudgetsNoSpend(t *testing.T) {
	reg := prometheus.NewRegistry()
	e, _ := spendEngine(t, seedPolicy, reg)
	d, tk := admitTokens(e, input{headers: map[string]string{"x-llm-feature": "chat"}}, 100, 100)
	if d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	if _, ok := tk.SpendReserved(); ok {
		t.Fatal("a reservation without spend budgets")
	}
	if st := tk.Done(usage(100, 100)); st.HasCost {
		t.Fatalf("settled a cost: %+v", st)
	}
	if n := seriesCount(t, reg, "llm_bulkhead_spend_reserved_total") + seriesCount(t, reg, "llm_bulkhead_spend_budget_used_ratio"); n != 0 {
		t.Fatalf("%d spend series without spend budgets", n)
	}
	if v := e.Snapshot().Spend(e.Now()); len(v.Budgets) != 0 || v.Currency != "USD" {
		t.Fatalf("view %+v", v)
	}
}

// BenchmarkAdmitDoneSpend is BenchmarkAdmitDone with a tenant spend budget and a tier × feature
// one: the cost of reserving and settling spend in two windows. A ticket reused for its next
// request reuses its reservation.
func BenchmarkAdmitDoneSpend(b *testing.B) {
	p, err := config.Load("test.yaml", []byte(strings.NewReplacer("spend_per_day: 1.00", "spend_per_day: 1000000", "spend_per_month: 5", "spend_per_month: 1000000").Replace(spendEnginePolicy)), nil)
	if err != nil {
		b.Fatal(err)
	}
	e, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	s := e.Snapshot()
	r := policy.Request{Dims: s.Classify(spendRequest("acme", "chat", "gpt-x")), Estimate: policy.Estimate{Prompt: 100, Output: 100, Total: 200, BytesPerToken: 4}}
	o := usage(100, 10)
	var tk policy.Ticket
	b.ReportAllocs()
	for b.Loop() {
		if d := e.Admit(context.Background(), s, &r, &tk, nil); d.Verdict != policy.Admit {
			b.Fatal(d)
		}
		tk.Done(o)
	}
}

// TestSpendRequestLargerThanBudgetRefused: a request whose worst case is more than the whole
// budget is refused even when nothing was spent in the window yet (the hour and the day alike),
// with a message that says why waiting will not help; spend.allow_single_overrun lets one such
// request run in an untouched window, and nothing after it.
func TestSpendRequestLargerThanBudgetRefused(t *testing.T) {
	for _, period := range []string{"hour", "day"} {
		t.Run(period, func(t *testing.T) {
			yaml := strings.Replace(spendEnginePolicy, "spend_per_day: 1.00", "spend_per_"+period+": 1.00", 1)
			e, _ := spendEngine(t, yaml, nil)
			// 1 000 prompt and 60 000 completion tokens of gpt-x cost at worst 0.01 + 1.80.
			d, _ := admitTokens(e, spendRequest("acme", "default", "gpt-x"), 1_000, 60_000)
			if d.Verdict != policy.Reject || d.Reason != policy.ReasonSpendBudget || d.Compartment != "tenant/acme" || !d.SpendOverLimit {
				t.Fatalf("a $1.81 request against an untouched $1.00 %s: %+v, want spend_budget by tenant/acme", period, d)
			}
			if !strings.Contains(d.Message(), "more than the whole spend budget of tenant/acme") {
				t.Fatalf("message %q", d.Message())
			}
			if s, r, _ := spent(t, e, "tenant/acme", period); s != 0 || r != 0 {
				t.Fatalf("the refused request left spent %s reserved %s", s, r)
			}
			// A request that fits the whole budget exactly is admitted.
			if d, _ := admitTokens(e, spendRequest("acme", "default", "gpt-x"), 10_000, 30_000); d.Verdict != policy.Admit {
				t.Fatalf("a request of exactly $1.00: %+v", d)
			}

			e, _ = spendEngine(t, yaml+"spend: {allow_single_overrun: true}\n", nil)
			d, tk := admitTokens(e, spendRequest("acme", "default", "gpt-x"), 1_000, 60_000)
			if d.Verdict != policy.Admit {
				t.Fatalf("with allow_single_overrun, into an untouched window: %+v", d)
			}
			tk.Done(usage(1_000, 50_000))
			if s, _, _ := spent(t, e, "tenant/acme", period); s != 1_510_000 {
				t.Fatalf("spent %s, want 1.51", s)
			}
			if d, _ := admitTokens(e, spendRequest("acme", "default", "gpt-x"), 1, 1); d.Verdict != policy.Reject || d.SpendOverLimit {
				t.Fatalf("after the overrun: %+v, want refused (used up, not too large)", d)
			}
		})
	}
}

// TestSpendReloadChangingTimeZoneCarriesSpend: $0.80 spent of acme's $1.00 UTC day, a reload
// changes time_zone to Asia/Kathmandu (whose day started at 18:15 UTC the day before). The new
// day starts with the $0.80: a $0.40 request is refused, a $0.10 one admitted, and the reload's
// diff says what changed. Changing back counts the $0.90 once.
func TestSpendReloadChangingTimeZoneCarriesSpend(t *testing.T) {
	e, _ := spendEngine(t, spendEnginePolicy, nil)
	acme := spendRequest("acme", "default", "gpt-x")
	for range 2 {
		_, tk := admitTokens(e, acme, 10_000, 10_000)
		tk.Done(usage(10_000, 10_000)) // 0.40
	}
	reload := func(zone string) policy.Diff {
		t.Helper()
		p, err := config.Load("test.yaml", []byte(strings.Replace(spendEnginePolicy, "prices:", "time_zone: "+zone+"\nprices:", 1)), nil)
		if err != nil {
			t.Fatal(err)
		}
		d, err := e.Apply(p)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	d := reload("Asia/Kathmandu")
	if want := "settings: time_zone UTC → Asia/Kathmandu (spend of the current windows carried into the new zone's: 3 windows changed)"; !strings.Contains(d.String(), want) {
		t.Fatalf("diff %q, want it to contain %q", d.String(), want)
	}
	s, _, view := spent(t, e, "tenant/acme", "day")
	if s != 800_000 || !view.Start.Equal(time.Date(2026, 4, 30, 18, 15, 0, 0, time.UTC)) {
		t.Fatalf("Kathmandu day from %s: spent %s, want 0.80 from 2026-04-30 18:15 UTC", view.Start.UTC(), s)
	}
	if d, _ := admitTokens(e, acme, 10_000, 10_000); d.Verdict != policy.Reject || d.Reason != policy.ReasonSpendBudget {
		t.Fatalf("$0.40 more after the zone change: %+v, want spend_budget", d)
	}
	d2, tk := admitTokens(e, acme, 10_000, 0)
	if d2.Verdict != policy.Admit {
		t.Fatalf("$0.10 more after the zone change: %+v", d2)
	}
	tk.Done(usage(10_000, 0))
	if d := reload("UTC"); !strings.Contains(d.String(), "time_zone Asia/Kathmandu → UTC") {
		t.Fatalf("diff %q", d.String())
	}
	if s, _, _ := spent(t, e, "tenant/acme", "day"); s != 900_000 {
		t.Fatalf("UTC day after changing back: spent %s, want 0.90", s)
	}
	if d := reload("UTC"); d.Settings != nil {
		t.Fatalf("a reload that changes nothing lists settings %q", d.Settings)
	}
}
