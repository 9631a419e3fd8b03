package policy_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// Regression tests for ways a client or a provider could leak a slot, mint budget or take the
// limits away. Each is named after the defect it pins.

const tenantBudgetPolicy = `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
tiers:
  free: {%s: 1000}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 10, idle_ttl: 1m}
`

func tenant(id string) input { return input{headers: map[string]string{"x-tenant-id": id}} }

// spend admits tokens for in and settles exactly that much.
func spend(t testing.TB, e *policy.Engine, in input, tokens int64) policy.Decision {
	t.Helper()
	d, tk := admit(t, e, in, tokens)
	if d.Verdict == policy.Admit {
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: tokens / 2, Completion: tokens - tokens/2, Known: true}})
	}
	return d
}

func TestTenantFloodDoesNotResetAnEvictedTenantsBudget(t *testing.T) {
	e, clk := engine(t, fmt.Sprintf(tenantBudgetPolicy, "tokens_per_minute"))
	// Given initech has spent 900 of its 1000 tokens this minute
	if d := spend(t, e, tenant("initech"), 900); d.Verdict != policy.Admit {
		t.Fatalf("initech: %+v", d)
	}
	// When 100 new tenant ids arrive, far more than max_instances (10)
	overflowed := 0
	for i := 0; i < 100; i++ {
		clk.Advance(10 * time.Millisecond)
		d, tk := admit(t, e, tenant(fmt.Sprintf("flood-%d", i)), 10)
		if d.Verdict != policy.Admit {
			t.Fatalf("flood-%d: %+v", i, d)
		}
		if tk.Compartments()[0] == "tenant/_overflow" {
			overflowed++
		}
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 5, Completion: 5, Known: true}})
	}
	// Then initech was not pushed out with its budget: 900 more tokens are still refused
	if d := spend(t, e, tenant("initech"), 900); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("initech after the flood: %+v, want token_budget", d)
	}
	if overflowed < 90 {
		t.Errorf("%d of 100 flood tenants shared the overflow compartment, want at least 90 (the store holds 10)", overflowed)
	}
	if n := len(e.Compartments()); n > 11 {
		t.Errorf("%d compartments, want at most max_instances + overflow = 11", n)
	}
	// Once its minute has passed, initech's budget is whole again (and it may be evicted).
	clk.Advance(61 * time.Second)
	if d := spend(t, e, tenant("initech"), 900); d.Verdict != policy.Admit {
		t.Fatalf("initech a minute later: %+v", d)
	}
}

func TestIdleEvictionDoesNotGiveAFreshDailyBudget(t *testing.T) {
	e, clk := engine(t, fmt.Sprintf(tenantBudgetPolicy, "tokens_per_day"))
	if d := spend(t, e, tenant("initech"), 900); d.Verdict != policy.Admit {
		t.Fatalf("initech: %+v", d)
	}
	// initech stays idle well past idle_ttl (1m) while other tenants come and go, which sweeps
	// idle compartments.
	for i := 0; i < 5; i++ {
		clk.Advance(10 * time.Minute)
		spend(t, e, tenant(fmt.Sprintf("other-%d", i)), 1)
	}
	if d := spend(t, e, tenant("initech"), 900); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("initech after idling: %+v, want token_budget (900 of 1000 spent today)", d)
	}
	// A day later everything it charged has aged out: it may go, and it gets its new day.
	clk.Advance(25 * time.Hour)
	spend(t, e, tenant("newcomer"), 1)
	if d := spend(t, e, tenant("initech"), 900); d.Verdict != policy.Admit {
		t.Fatalf("initech the next day: %+v", d)
	}
}

func TestNewTenantsWithAFullStoreLookAtABoundedNumberOfCompartments(t *testing.T) {
	e, _ := engine(t, `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
tiers:
  free: {tokens_per_minute: 1000000}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 2000, idle_ttl: 1m}
`)
	// 2000 tenants fill the store, each holding budget state, so none can be evicted.
	for i := 0; i < 2000; i++ {
		spend(t, e, tenant(fmt.Sprintf("t%d", i)), 10)
	}
	before := policy.EvictionExamined(e)
	// 1000 new tenants find it full.
	for i := 0; i < 1000; i++ {
		if d := spend(t, e, tenant(fmt.Sprintf("new%d", i)), 10); d.Verdict != policy.Admit {
			t.Fatalf("new%d: %+v", i, d)
		}
	}
	// A scan of the whole store per new tenant would look at 2 000 000 entries; the bound is
	// a constant per new tenant (evictScan + sweepScan = 20).
	if got := policy.EvictionExamined(e) - before; got > 1000*20 {
		t.Errorf("eviction looked at %d compartments for 1000 new tenants, want at most %d", got, 1000*20)
	}
}

func TestSettleNeverChargesNegativeTokens(t *testing.T) {
	e, _ := engine(t, "allow_empty: true\nfeatures: {default: {}}\n")
	s := e.Snapshot()
	tk := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Prompt: 1000, Output: 500, Total: 1500, BytesPerToken: 4}}
	if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	tests := []struct {
		name string
		u    policy.Usage
		want policy.Settled
	}{
		{"total below the prompt", policy.Usage{Prompt: 1000, Total: 10, Known: true}, policy.Settled{Prompt: 1000, Total: 1000}},
		{"total below its parts", policy.Usage{Prompt: 100, Completion: 50, Total: 20, Known: true}, policy.Settled{Prompt: 100, Completion: 50, Total: 150}},
		{"total above its parts is charged", policy.Usage{Prompt: 100, Completion: 50, Total: 400, Known: true}, policy.Settled{Prompt: 100, Completion: 300, Total: 400}},
		{"negative counts", policy.Usage{Prompt: -5, Completion: -7, Total: -100, Known: true}, policy.Settled{}},
		{"negative prompt, partial", policy.Usage{Prompt: -5, PromptKnown: true, ContentBytes: -40}, policy.Settled{Estimated: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tk.Settle(policy.Outcome{Status: 200, Usage: tt.u}); got != tt.want {
				t.Errorf("Settle = %+v, want %+v", got, tt.want)
			}
		})
	}
	// The shape that used to panic in settlement (a counter asked to decrease) now settles.
	got := tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 1000, Completion: 0, Total: 10, Known: true}})
	if got.Total != 1000 || e.InFlight() != 0 {
		t.Fatalf("Done = %+v, in flight %d", got, e.InFlight())
	}
}

// panicHandler is a slog handler that panics on warnings: a stand-in for any failure inside
// settlement.
type panicHandler struct{ slog.Handler }

func (panicHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h panicHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		panic("log sink failed: " + r.Message)
	}
	return nil
}

func TestPanicInSettlementStillReleasesExactlyOnce(t *testing.T) {
	p, err := config.Load("p.yaml", []byte("features: {default: {max_concurrent: 1, tokens_per_minute: 100000}}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	e, err := policy.NewEngine(p, policy.Options{Clock: newClock(), Logger: slog.New(panicHandler{slog.DiscardHandler})})
	if err != nil {
		t.Fatal(err)
	}
	s := e.Snapshot()
	tk := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Prompt: 100, Output: 100, Total: 200, BytesPerToken: 4, MaxPrompt: 1000, MaxCompletion: 100, Bounded: true}}
	if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	// Absurd usage is clamped and logged; the log sink panics half way through settlement.
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("settlement did not reach the panicking logger")
			}
		}()
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 1 << 40, Completion: 1 << 40, Total: 5, Known: true}})
	}()
	if e.InFlight() != 0 || e.Compartments()[0].InFlight != 0 {
		t.Fatalf("after a panic in settlement: engine in flight %d, compartment %+v", e.InFlight(), e.Compartments()[0])
	}
	// Released once: a second Done does nothing, and the one slot is free for the next request.
	tk.Done(policy.Outcome{Status: 200})
	if e.InFlight() != 0 {
		t.Fatalf("second Done changed in flight to %d", e.InFlight())
	}
	if d, _ := admit(t, e, input{}, 10); d.Verdict != policy.Admit {
		t.Fatalf("the slot did not come back: %+v", d)
	}
}

func TestAbsurdReportedUsageIsClampedAndCounted(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(`
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  default: {max_concurrent: 10}
  chat: {max_concurrent: 10, tokens_per_minute: 200000}
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := observe.NewEngine(p, policy.Options{Clock: newClock(), Logger: slog.New(slog.DiscardHandler)}, reg)
	if err != nil {
		t.Fatal(err)
	}
	s := e.Snapshot()
	chat := func() (policy.Decision, *policy.Ticket) {
		dims := s.Classify(feature("chat"))
		est := s.Estimate("deepseek-chat", policy.RequestSize{Scanned: true, BodyBytes: 2000, PromptBytes: 1800, MaxTokens: 100, HasMaxTokens: true, N: 1})
		tk := &policy.Ticket{}
		r := policy.Request{Dims: dims, Estimate: est, PromptBytes: 1800}
		return e.Admit(context.Background(), s, &r, tk, nil), tk
	}
	// Given one response that claims 999 999 999 999 tokens of each kind
	d, tk := chat()
	if d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	got := tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 999_999_999_999, Completion: 999_999_999_999, Total: 1_999_999_999_998, Known: true}})
	// Then it is settled at what the request could cost: 2000 body bytes + 1024, and max_tokens
	if want := (policy.Settled{Prompt: 3024, Completion: 100, Total: 3124, Clamped: true}); got != want {
		t.Fatalf("settled %+v, want %+v", got, want)
	}
	// and chat is not pushed into debt: the next requests are admitted.
	for i := 0; i < 10; i++ {
		d, tk := chat()
		if d.Verdict != policy.Admit {
			t.Fatalf("chat %d after the absurd response: %+v", i, d)
		}
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 450, Completion: 50, Known: true}})
	}
	if n := counterValue(t, reg, "llm_bulkhead_usage_clamped_total", "chat"); n != 1 {
		t.Errorf("usage_clamped_total{feature=chat} = %v, want 1", n)
	}
}

// counterValue returns the value of a counter with the given feature label.
func counterValue(t *testing.T, reg *prometheus.Registry, name, feature string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "feature" && l.GetValue() == feature {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

const retryAfterPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  provider:
    rules: [{header: x-llm-provider}]
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
features:
  default: {max_concurrent: 100}
providers:
  deepseek: {breaker: std, fallback: qwen}
  qwen: {breaker: std}
  default: {}
breakers:
  std:
    sliding_window_size: 4
    minimum_calls: 4
    wait_in_open: 10s
    %s
`

func on(provider, tenant string) input {
	return input{headers: map[string]string{"x-llm-provider": provider, "x-tenant-id": tenant}}
}

func TestUpstream429RetryAfterHoldsOnlyThatTenantAndOnlyBriefly(t *testing.T) {
	e, clk := engine(t, fmt.Sprintf(retryAfterPolicy, ""))
	// Given acme's request gets a 429 asking to retry after a day (a per-key limit at deepseek)
	_, tk := admit(t, e, on("deepseek", "acme"), 10)
	tk.Done(policy.Outcome{Status: 429, TTFB: time.Millisecond, RetryAfter: 24 * time.Hour})
	// Then acme is held back from deepseek with rate_limit, for wait_in_open (10s) at most
	d, _ := admit(t, e, on("deepseek", "acme"), 10)
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonRateLimit || d.RetryAfter != 10*time.Second {
		t.Fatalf("acme: %+v, want rate_limit for 10s", d)
	}
	// and globex still reaches deepseek: one tenant's 429 does not ground everyone.
	d, tk = admit(t, e, on("deepseek", "globex"), 10)
	if d.Verdict != policy.Admit || d.Rerouted {
		t.Fatalf("globex: %+v", d)
	}
	tk.Done(policy.Outcome{Status: 200, TTFB: time.Millisecond})
	clk.Advance(10 * time.Second)
	if d, _ := admit(t, e, on("deepseek", "acme"), 10); d.Verdict != policy.Admit || d.Rerouted {
		t.Fatalf("acme after the capped hold: %+v", d)
	}
}

func TestRetryAfterOpensTheBreakerNoLongerThanMaxWaitInOpen(t *testing.T) {
	tests := []struct {
		name   string
		extra  string
		status int
		want   time.Duration
	}{
		{"provider-scoped 429", "retry_after_scope: provider\n    max_wait_in_open: 30s", 429, 30 * time.Second},
		{"503 opens for everyone, capped at wait_in_open", "", 503, 10 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, clk := engine(t, fmt.Sprintf(retryAfterPolicy, tt.extra))
			_, tk := admit(t, e, on("deepseek", "acme"), 10)
			tk.Done(policy.Outcome{Status: tt.status, TTFB: time.Millisecond, RetryAfter: 24 * time.Hour})
			// Open for everyone: another tenant is moved to the fallback.
			d, tk := admit(t, e, on("deepseek", "globex"), 10)
			if !d.Rerouted || d.Reason != policy.ReasonCircuitOpen {
				t.Fatalf("globex right after: %+v, want re-routed for circuit_open", d)
			}
			tk.Done(policy.Outcome{Status: 200, TTFB: time.Millisecond})
			clk.Advance(tt.want + time.Millisecond) // OPEN moves to HALF_OPEN strictly after the wait
			if d, _ := admit(t, e, on("deepseek", "globex"), 10); d.Verdict != policy.Admit || d.Rerouted {
				t.Fatalf("globex after %s: %+v, want deepseek again (a probe)", tt.want, d)
			}
		})
	}
}

// TestCircuitOpenRetryAfterAtTheEndOfTheWait: at the very instant an OPEN breaker's wait ends it
// still refuses (probes start strictly after the wait), and its refusal says to retry in a
// second, not after a whole new wait_in_open.
func TestCircuitOpenRetryAfterAtTheEndOfTheWait(t *testing.T) {
	e, clk := engine(t, fmt.Sprintf(retryAfterPolicy, ""))
	for range 4 {
		_, tk := admit(t, e, on("qwen", "acme"), 10)
		tk.Done(policy.Outcome{Status: 503, TTFB: time.Millisecond})
	}
	for _, step := range []struct {
		advance time.Duration
		want    int64
	}{{0, 10}, {9 * time.Second, 1}, {time.Second, 1}} {
		clk.Advance(step.advance)
		d, _ := admit(t, e, on("qwen", "acme"), 10)
		if d.Verdict != policy.Reject || d.Reason != policy.ReasonCircuitOpen || d.RetryAfterSeconds() != step.want {
			t.Fatalf("%v after opening: %+v (retry-after %ds), want circuit_open with retry-after %ds", step.advance, d, d.RetryAfterSeconds(), step.want)
		}
	}
	clk.Advance(time.Millisecond)
	if d, _ := admit(t, e, on("qwen", "acme"), 10); d.Verdict != policy.Admit {
		t.Fatalf("just after the wait: %+v, want a probe admitted", d)
	}
}

func TestPerModelBreakersOnlyForThePolicysModelGlobs(t *testing.T) {
	e, _ := engine(t, `
classification:
  provider:
    default: deepseek
    rules: [{model_map: true}]
  model:
    rules: [{body: model}]
models:
  - {match: "deepseek-chat", provider: deepseek}
  - {match: "deepseek-r*", provider: deepseek}
features:
  default: {max_concurrent: 1000}
providers:
  deepseek: {breaker: std, breaker_per_model: true}
  default: {}
breakers:
  std: {sliding_window_size: 10, minimum_calls: 10}
`)
	models := []string{"deepseek-chat", "deepseek-reasoner", "deepseek-r2"}
	for i := 0; i < 400; i++ {
		models = append(models, fmt.Sprintf("made-up-%d", i))
	}
	for _, m := range models {
		_, tk := admit(t, e, input{body: map[string]string{"model": m}}, 10)
		tk.Done(policy.Outcome{Status: 200, TTFB: time.Millisecond})
	}
	var names []string
	for _, b := range e.Breakers() {
		names = append(names, b.Name)
	}
	// Client-chosen names never become breakers (nor metric series): each of the policy's model
	// globs has one, and models matching none share the provider-wide breaker.
	if got := strings.Join(names, ","); got != "deepseek,deepseek/deepseek-chat,deepseek/deepseek-r*" {
		t.Errorf("breakers = %s", got)
	}
}

func TestReloadThatRemovesACompartmentAndBringsItBackKeepsItsBudget(t *testing.T) {
	const withChat = `
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  default: {max_concurrent: 10}
  chat: {max_concurrent: 10, tokens_per_minute: 1000}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
tiers:
  free: {tokens_per_minute: 5000}
`
	const withoutChat = `
features:
  default: {max_concurrent: 10}
`
	e, clk := engine(t, withChat)
	apply := func(y string) {
		t.Helper()
		p, err := config.Load("p.yaml", []byte(y), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Apply(p); err != nil {
			t.Fatal(err)
		}
	}
	// Given chat and the anonymous tenant have spent 900 and 4000 of their minute
	if d := spend(t, e, feature("chat"), 900); d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	if d := spend(t, e, input{}, 3100); d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	// When a reload drops chat and the tenant family, and the next one brings them back
	apply(withoutChat)
	clk.Advance(time.Second)
	apply(withChat)
	// Then their budgets are as they were, not fresh
	if d := spend(t, e, feature("chat"), 900); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget || d.Compartment != "feature/chat" {
		t.Fatalf("chat after the round trip: %+v, want token_budget from feature/chat", d)
	}
	if d := spend(t, e, input{}, 1500); d.Verdict != policy.Reject || d.Compartment != "tenant/anonymous" {
		t.Fatalf("tenant after the round trip: %+v, want token_budget from tenant/anonymous", d)
	}
}

func TestTenantDirectoryOverridesLimitTheirTenantOnly(t *testing.T) {
	e, _ := engine(t, `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  tier:
    rules: [{tenant_directory: true}]
tenants:
  directory:
    - {id: big, tier: free, limits: {max_concurrent: 3}}
tiers:
  free: {max_concurrent: 1, tokens_per_minute: 1000}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
`)
	for _, c := range []struct {
		tenant string
		slots  int
	}{{"big", 3}, {"small", 1}} {
		got := 0
		for i := 0; i < 5; i++ {
			if d, _ := admit(t, e, tenant(c.tenant), 10); d.Verdict == policy.Admit {
				got++
			}
		}
		if got != c.slots {
			t.Errorf("%s got %d slots, want %d", c.tenant, got, c.slots)
		}
	}
	for _, v := range e.Compartments() {
		if v.Name == "tenant/big" && (len(v.Budgets) != 1 || v.Budgets[0].Capacity != 1000) {
			t.Errorf("tenant/big budgets %+v: the override keeps the tier's token budget", v.Budgets)
		}
	}
}
