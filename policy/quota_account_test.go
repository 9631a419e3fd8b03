package policy_test

import (
	"context"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// accountPolicy: openai is reached with one key per team, named by the trusted x-llm-account
// header, and falls back to azure, whose accounts come from Envoy metadata; direct tracks at
// most two accounts.
const accountPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  provider:
    default: openai
    rules: [{header: x-llm-provider}]
features:
  default: {max_concurrent: 100}
providers:
  openai:
    fallback: azure
    quota: {mode: enforce, account: {header: x-llm-account, trusted: true}}
  azure:
    quota: {mode: enforce, account: {metadata: {namespace: envoy.lb, key: azure.key}, default: shared}}
  direct:
    quota: {mode: enforce, account: {header: x-llm-account, trusted: true}, max_accounts: 2}
`

// accountAdmit admits a 1 000-token request to provider for account (header; azureKey the
// Envoy metadata azure's accounts come from, "" for none).
func accountAdmit(t *testing.T, e *policy.Engine, provider, account, azureKey string) (policy.Decision, *policy.Ticket) {
	t.Helper()
	in := input{headers: map[string]string{"x-llm-provider": provider}}
	if account != "" {
		in.headers["x-llm-account"] = account
	}
	if azureKey != "" {
		in.md = map[string]map[string]string{"envoy.lb": {"azure.key": azureKey}}
	}
	return admit(t, e, in, 1000)
}

// TestProviderQuotaPerAccount: team-a's key has no request left at openai: its requests are
// re-routed to azure (under azure's own account, read from metadata) while team-b's still go
// to openai; once azure's account is out too, team-a's are refused and team-b's still pass.
// /admin/quotas and the gauges show each account.
func TestProviderQuotaPerAccount(t *testing.T) {
	e, c, reg := meteredEngine(t, accountPolicy)
	provider := func(d policy.Decision) string { return e.Snapshot().Names(d.Dims).Provider }
	reset := c.Now().Add(30 * time.Second)

	_, a := accountAdmit(t, e, "openai", "team-a", "pool-1")
	a.ObserveQuota(requestsLeft(0, 10, reset), 0, c.Now())
	_, b := accountAdmit(t, e, "openai", "team-b", "pool-1")
	b.ObserveQuota(requestsLeft(5, 10, reset), 0, c.Now())

	d, rerouted := accountAdmit(t, e, "openai", "team-a", "pool-1")
	if d.Verdict != policy.Admit || provider(d) != "azure" || !d.Rerouted || d.Reason != policy.ReasonProviderQuota {
		t.Fatalf("team-a with its openai key used up: %v on %s (rerouted %v for %q), want re-routed to azure", d.Verdict, provider(d), d.Rerouted, d.Reason)
	}
	for i := range 3 {
		if d, _ := accountAdmit(t, e, "openai", "team-b", "pool-1"); d.Verdict != policy.Admit || provider(d) != "openai" {
			t.Fatalf("team-b request %d: %v on %s, want openai", i+1, d.Verdict, provider(d))
		}
	}
	// azure's account pool-1 is out as well: team-a is refused at azure; pool-2 still admits.
	rerouted.ObserveQuota(requestsLeft(0, 4, reset), 0, c.Now())
	d, _ = accountAdmit(t, e, "openai", "team-a", "pool-1")
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonProviderQuota || d.Compartment != "provider/azure" || d.RetryAfter != 30*time.Second {
		t.Fatalf("team-a with both accounts used up: %+v, want refused provider_quota at azure for 30s", d)
	}
	if d, _ := accountAdmit(t, e, "openai", "team-a", "pool-2"); d.Verdict != policy.Admit || provider(d) != "azure" {
		t.Fatalf("team-a through azure's pool-2: %v on %s", d.Verdict, provider(d))
	}
	if d, _ := accountAdmit(t, e, "openai", "team-b", "pool-1"); d.Verdict != policy.Admit || provider(d) != "openai" {
		t.Fatalf("team-b after team-a was refused: %v on %s", d.Verdict, provider(d))
	}

	left := map[string]int64{}
	for _, v := range e.ProviderQuotas() {
		left[v.Provider+"/"+v.Account] = -1
		for _, q := range v.Quotas {
			left[v.Provider+"/"+v.Account] = q.Remaining
		}
	}
	if len(left) != 4 || left["openai/team-a"] != 0 || left["openai/team-b"] != 5 || left["azure/pool-1"] != 0 || left["azure/pool-2"] != -1 {
		t.Errorf("/admin/quotas: %v, want openai team-a 0 and team-b 5 left, azure pool-1 0 (and pool-2 unknown)", left)
	}
	if got := metricValue(t, reg, "llm_bulkhead_provider_quota_remaining", map[string]string{"provider": "openai", "account": "team-b", "quota": "requests"}); got != 5 {
		t.Errorf("team-b's remaining gauge %v, want 5", got)
	}

	// At the reset every account is full again.
	c.Advance(30 * time.Second)
	if d, _ := accountAdmit(t, e, "openai", "team-a", "pool-1"); provider(d) != "openai" {
		t.Errorf("team-a after the reset: sent to %s", provider(d))
	}
}

// TestProviderQuotaAccountDefaultAndOverflow: a request without the header uses the default
// account; accounts beyond max_accounts share _other, counted.
func TestProviderQuotaAccountDefaultAndOverflow(t *testing.T) {
	e, c, reg := meteredEngine(t, accountPolicy)
	reset := c.Now().Add(time.Minute)
	_, none := accountAdmit(t, e, "direct", "", "")
	none.ObserveQuota(requestsLeft(0, 10, reset), 0, c.Now())
	if d, _ := accountAdmit(t, e, "direct", "default", ""); d.Verdict != policy.Reject {
		t.Fatalf("the default account's request with none left: %v", d.Verdict)
	}
	_, x := accountAdmit(t, e, "direct", "team-x", "")
	_, y := accountAdmit(t, e, "direct", "team-y", "")
	y.ObserveQuota(requestsLeft(0, 10, reset), 0, c.Now())
	if d, _ := accountAdmit(t, e, "direct", "team-z", ""); d.Verdict != policy.Reject {
		t.Fatalf("team-z, sharing _other with team-y whose quota is out: %v", d.Verdict)
	}
	if d, _ := accountAdmit(t, e, "direct", "team-x", ""); d.Verdict != policy.Admit {
		t.Fatalf("team-x, tracked apart: %v", d.Err())
	}
	x.Done(policy.Outcome{Status: 200})
	var accounts []string
	for _, v := range e.ProviderQuotas() {
		if v.Provider == "direct" {
			accounts = append(accounts, v.Account)
		}
	}
	if len(accounts) != 3 || accounts[0] != "_other" || accounts[1] != "default" || accounts[2] != "team-x" {
		t.Errorf("direct's accounts %v, want _other, default, team-x", accounts)
	}
	if got := metricValue(t, reg, "llm_bulkhead_provider_quota_account_overflow_total", map[string]string{"provider": "direct"}); got != 2 {
		t.Errorf("overflow counted %v, want 2 (team-y, team-z)", got)
	}
}

// TestProviderQuotaAccountsSurviveAReload: a reload that keeps a provider's account source
// keeps what each account's responses said; one that changes it starts afresh.
func TestProviderQuotaAccountsSurviveAReload(t *testing.T) {
	e, c, _ := meteredEngine(t, accountPolicy)
	_, a := accountAdmit(t, e, "direct", "team-a", "")
	a.ObserveQuota(requestsLeft(0, 10, c.Now().Add(time.Minute)), 0, c.Now())
	reload := func(src string) {
		t.Helper()
		p, err := config.Load("v2.yaml", []byte(src), nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Apply(p); err != nil {
			t.Fatal(err)
		}
	}
	reload(accountPolicy + "  other: {}\n")
	if d, _ := accountAdmit(t, e, "direct", "team-a", ""); d.Verdict != policy.Reject {
		t.Fatalf("after a reload keeping the accounts: %v, want still out", d.Verdict)
	}
	changed := accountPolicy[:len(accountPolicy)-len("    quota: {mode: enforce, account: {header: x-llm-account, trusted: true}, max_accounts: 2}\n")] +
		"    quota: {mode: enforce, account: {header: x-team, trusted: true}, max_accounts: 2}\n"
	reload(changed)
	if d, _ := accountAdmit(t, e, "direct", "team-a", ""); d.Verdict != policy.Admit {
		t.Fatalf("after the account source changed: %v, want a fresh quota", d.Err())
	}
}

// TestProviderQuotaAccountsSharedAcrossTheFleet: replica a hears that team-a's key at direct
// has no request left; replica b, which had only sent team-a one request, learns it within an
// interval and refuses team-a's next request, while team-b's key (its own quota at the fleet)
// still admits.
func TestProviderQuotaAccountsSharedAcrossTheFleet(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		a, b := quotaFleet(t, accountPolicy, "pqa", mode)
		if d, tk := accountAdmit(t, b, "direct", "team-a", ""); d.Verdict != policy.Admit {
			t.Fatalf("b, team-a before any reading: %+v", d)
		} else {
			tk.Done(policy.Outcome{Status: 200})
		}
		d, first := accountAdmit(t, a, "direct", "team-a", "")
		if d.Verdict != policy.Admit {
			t.Fatalf("a, team-a before any reading: %+v", d)
		}
		first.ObserveQuota(requestsLeft(0, 10, a.Now().Add(time.Minute)), 0, a.Now())
		first.Done(policy.Outcome{Status: 200})
		waitFor(t, "b to learn team-a's reading", func() bool {
			for _, v := range b.ProviderQuotas() {
				if v.Provider == "direct" && v.Account == "team-a" && len(v.Quotas) == 1 && v.Quotas[0].Remaining == 0 {
					return true
				}
			}
			return false
		})
		if d, _ := accountAdmit(t, b, "direct", "team-a", ""); d.Verdict != policy.Reject || d.Reason != policy.ReasonProviderQuota {
			t.Fatalf("b, team-a with none left at the fleet: %+v, want provider_quota", d)
		}
		d, other := accountAdmit(t, b, "direct", "team-b", "")
		if d.Verdict != policy.Admit {
			t.Fatalf("b, team-b: %+v", d)
		}
		other.Done(policy.Outcome{Status: 200})
	})
}

// BenchmarkAdmitDoneQuotaAccount measures admission to a provider whose quota is tracked per
// account: classify (reading the account), find the account's tracker, hold and release; with
// one account source (no allocation) and with two (their values joined once).
func BenchmarkAdmitDoneQuotaAccount(b *testing.B) {
	oneSource := `
classification:
  provider: {default: openai}
features:
  default: {max_concurrent: 100}
providers:
  openai: {quota: {mode: enforce, account: {header: x-llm-account, trusted: true}}}
`
	for _, bc := range []struct{ name, policy string }{{"one_source", oneSource}, {"two_sources", accountPolicy}} {
		b.Run(bc.name, func(b *testing.B) {
			e, _ := engine(b, bc.policy)
			s := e.Snapshot()
			in := &input{headers: map[string]string{"x-llm-provider": "openai", "x-llm-account": "team-a"}}
			tk := &policy.Ticket{}
			ctx := context.Background()
			o := policy.Outcome{Status: 200, Usage: policy.Usage{Known: true, PromptKnown: true}}
			b.ReportAllocs()
			for b.Loop() {
				r := policy.Request{Dims: s.Classify(in), Estimate: policy.Estimate{Prompt: 500, Output: 500, Total: 1000}}
				if dec := e.Admit(ctx, s, &r, tk, nil); dec.Verdict != policy.Admit {
					b.Fatal(dec.Err())
				}
				tk.Done(o)
			}
		})
	}
}

// TestProviderQuotaAccountValueWithControlCharacters: an account value that cannot be an
// account (a control character) is skipped as classification skips such values: the request
// uses the default account, and it is counted.
func TestProviderQuotaAccountValueWithControlCharacters(t *testing.T) {
	e, c, reg := meteredEngine(t, accountPolicy)
	_, none := accountAdmit(t, e, "direct", "", "")
	none.ObserveQuota(requestsLeft(0, 10, c.Now().Add(time.Minute)), 0, c.Now())
	if d, _ := accountAdmit(t, e, "direct", "team\x01a", ""); d.Verdict != policy.Reject {
		t.Fatalf("an account value with a control character: %v, want the default account's refusal", d.Verdict)
	}
	if got := metricValue(t, reg, "llm_bulkhead_classify_errors_total", map[string]string{"reason": "invalid_account"}); got != 1 {
		t.Errorf("invalid_account counted %v, want 1", got)
	}
	for _, v := range e.ProviderQuotas() {
		if v.Provider == "direct" && v.Account != "default" {
			t.Errorf("direct has account %q", v.Account)
		}
	}
}
