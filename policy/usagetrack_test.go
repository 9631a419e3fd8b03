package policy_test

import (
	"context"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	usagetab "github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// usagePolicy prices gpt-x (no spend budget applies) and lets each tenant send two requests a
// minute.
const usagePolicy = `
envoy: {max_message_timeout: 10s}
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  model:
    rules: [{header: x-model}]
prices:
  - {match: "gpt-x", input_per_mtok: 2.00, output_per_mtok: 10.00, cached_input_per_mtok: 0.50}
  - {match: default, input_per_mtok: 1.00, output_per_mtok: 1.00}
tiers:
  free: {requests_per_minute: 2}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant}
`

func usageRow(t *testing.T, e *policy.Engine, by usagetab.By, k usagetab.Key) usagetab.Row {
	t.Helper()
	r, ok := e.Usage().Report(e.Now(), usagetab.Query{By: by, Window: usagetab.Hour, Top: 100})
	if !ok {
		t.Fatal("usage is off")
	}
	for _, row := range r.Rows {
		if row.Key == k {
			return row
		}
	}
	t.Fatalf("no row for %+v in %+v", k, r.Rows)
	return usagetab.Row{}
}

// TestUsageCountsSettlementsAndRefusals: what each request settled at, the cached tokens its
// response reported and what the prices say it cost (no spend budget applies) are counted for
// its tenant, its model and both; a refusal counts for the tenant and model it was refused for,
// by reason.
func TestUsageCountsSettlementsAndRefusals(t *testing.T) {
	e, _ := engine(t, usagePolicy)
	req := func(tenant, model string) input {
		return input{headers: map[string]string{"x-tenant-id": tenant, "x-model": model}}
	}
	for range 2 {
		d, tk := admitTokens(e, req("acme", "gpt-x"), 1000, 100)
		if d.Verdict != policy.Admit {
			t.Fatal(d)
		}
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 1000, Completion: 200, Total: 1200, Cached: 400, Known: true}})
	}
	if d, _ := admitTokens(e, req("acme", "gpt-x"), 1000, 100); d.Verdict != policy.Reject || d.Reason != policy.ReasonRateLimit {
		t.Fatalf("third request: %+v", d)
	}
	_, tk := admitTokens(e, req("initech", "other"), 10, 10)
	tk.Done(policy.Outcome{Status: 503})

	// 600 × 2.00 + 400 × 0.50 + 200 × 10.00 = 3400 millionths each.
	acme := usageRow(t, e, usagetab.ByTenantModel, usagetab.Key{Tenant: "acme", Model: "gpt-x"})
	want := usagetab.Counts{Requests: 2, Prompt: 2000, Completion: 400, Cached: 800, Spend: 6800}
	want.Refusals[refusalIndex(t, e, policy.ReasonRateLimit)] = 1
	if acme.Counts != want || acme.Overcount != 0 {
		t.Fatalf("acme on gpt-x: %+v, want %+v", acme, want)
	}
	if row := usageRow(t, e, usagetab.ByTenant, usagetab.Key{Tenant: "acme"}); row.Counts != want {
		t.Fatalf("acme: %+v", row.Counts)
	}
	// A failure without usage settled nothing and cost nothing, but was a request.
	if row := usageRow(t, e, usagetab.ByModel, usagetab.Key{Model: "other"}); row.Counts != (usagetab.Counts{Requests: 1}) {
		t.Fatalf("other: %+v", row.Counts)
	}
}

func refusalIndex(t *testing.T, e *policy.Engine, r policy.Reason) int {
	t.Helper()
	for i, name := range e.Usage().Reasons() {
		if name == string(r) {
			return i
		}
	}
	t.Fatalf("usage does not count %s", r)
	return -1
}

// TestUsageSpendIsWhatBudgetsCharged: with a spend budget, a request's spend in usage is what
// its budgets were charged.
func TestUsageSpendIsWhatBudgetsCharged(t *testing.T) {
	e, _ := spendEngine(t, spendEnginePolicy, nil)
	_, tk := admitTokens(e, spendRequest("acme", "default", "gpt-x"), 1000, 1000)
	st := tk.Done(usage(1000, 500))
	if !st.HasCost || st.Cost == 0 {
		t.Fatalf("settled %+v", st)
	}
	if row := usageRow(t, e, usagetab.ByTenant, usagetab.Key{Tenant: "acme"}); row.Counts.Spend != st.Cost {
		t.Fatalf("usage spend %s, charged %s", row.Counts.Spend, st.Cost)
	}
}

// TestUsageFollowsReloads: usage.enabled false stops counting and drops the tables; a reload
// that turns it on starts empty; the table size follows the policy.
func TestUsageFollowsReloads(t *testing.T) {
	e, clk := engine(t, usagePolicy)
	reload := func(yaml string) {
		t.Helper()
		p, err := config.Load("test.yaml", []byte(yaml), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Apply(p); err != nil {
			t.Fatal(err)
		}
	}
	in := input{headers: map[string]string{"x-tenant-id": "acme", "x-model": "gpt-x"}}
	_, tk := admitTokens(e, in, 10, 10)
	reload(usagePolicy + "usage: {enabled: false}\n")
	tk.Done(usage(10, 10)) // admitted under a policy that counted usage, settled after
	if _, ok := e.Usage().Report(e.Now(), usagetab.Query{Top: 1}); ok {
		t.Fatal("usage reports while off")
	}
	clk.Advance(time.Minute)
	reload(usagePolicy + "usage: {table_size: 10}\n")
	for i := range 12 {
		s := e.Snapshot()
		r := policy.Request{Dims: s.Classify(input{headers: map[string]string{"x-tenant-id": string(rune('a' + i)), "x-model": "m"}}), Estimate: policy.Estimate{Total: 1}}
		tk := &policy.Ticket{}
		if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
			t.Fatal(d)
		}
		tk.Done(usage(1, 1))
	}
	r, ok := e.Usage().Report(e.Now(), usagetab.Query{By: usagetab.ByTenant, Window: usagetab.Hour, Top: 100})
	if !ok || len(r.Rows) != 10 || r.Total.Requests != 12 || r.TableSize != 10 {
		t.Fatalf("after the reload: %d rows, %+v, size %d", len(r.Rows), r.Total, r.TableSize)
	}
}

// TestUsageDefaultSizeIsTheConfigs: the policy's default table size is the tracker's.
func TestUsageDefaultSizeIsTheConfigs(t *testing.T) {
	if config.DefaultUsageTableSize != usagetab.DefaultTableSize {
		t.Fatalf("config %d, usage %d", config.DefaultUsageTableSize, usagetab.DefaultTableSize)
	}
}
