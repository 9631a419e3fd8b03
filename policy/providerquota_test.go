package policy_test

import (
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

// quotaPolicy: openai follows its quota (enforce, 20 % of each limit kept for interactive
// traffic) and falls back to local; direct enforces without a fallback; watched only watches.
const quotaPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  provider:
    default: openai
    rules: [{header: x-llm-provider}]
  priority:
    rules: [{header: x-llm-priority, trusted: true}]
    levels: {interactive: 10, batch: 1}
features:
  default: {max_concurrent: 100}
providers:
  openai: {fallback: local, quota: {mode: enforce, reserve: 0.2}}
  local: {}
  direct: {quota: {mode: enforce}}
  watched: {quota: {mode: shadow}}
`

func quotaEngine(t *testing.T) (*policy.Engine, *clock, *prometheus.Registry) {
	t.Helper()
	return meteredEngine(t, quotaPolicy)
}

// meteredEngine is an engine for the policy src on a test clock, its metrics on a registry of
// its own.
func meteredEngine(t *testing.T, src string) (*policy.Engine, *clock, *prometheus.Registry) {
	t.Helper()
	p, err := config.Load("test.yaml", []byte(src), nil)
	if err != nil {
		t.Fatal(err)
	}
	c := newClock()
	reg := prometheus.NewRegistry()
	e, err := observe.NewEngine(p, policy.Options{Clock: c, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	return e, c, reg
}

// quotaAdmit admits a 1 000-token request to provider with priority ("" for none).
func quotaAdmit(t *testing.T, e *policy.Engine, provider, priority string) (policy.Decision, *policy.Ticket) {
	t.Helper()
	h := map[string]string{"x-llm-provider": provider}
	if priority != "" {
		h["x-llm-priority"] = priority
	}
	return admit(t, e, input{headers: h}, 1000)
}

// requestsLeft is a reading of n requests left of limit, reset after reset.
func requestsLeft(n, limit int64, reset time.Time) *quota.Reading {
	r := &quota.Reading{}
	r.Windows[quota.Requests] = quota.Window{Limit: limit, Remaining: n, Reset: reset, Has: quota.HasLimit | quota.HasRemaining | quota.HasReset}
	return r
}

// TestProviderQuotaReroutesInPriorityOrder: openai said 3 requests are left of 10 (2 kept for
// the highest priority): one batch request goes, the next batch one is re-routed to local,
// interactive ones take the last two, and then they too are re-routed.
func TestProviderQuotaReroutesInPriorityOrder(t *testing.T) {
	e, c, reg := quotaEngine(t)
	d, first := quotaAdmit(t, e, "openai", "")
	if d.Verdict != policy.Admit || d.Rerouted {
		t.Fatalf("before any reading: %+v", d)
	}
	first.ObserveQuota(requestsLeft(3, 10, c.Now().Add(2*time.Second)), 0, c.Now())

	provider := func(d policy.Decision) string { return e.Snapshot().Names(d.Dims).Provider }
	for i, tc := range []struct{ priority, want string }{
		{"batch", "openai"}, {"batch", "local"}, {"interactive", "openai"}, {"interactive", "openai"}, {"interactive", "local"},
	} {
		d, _ := quotaAdmit(t, e, "openai", tc.priority)
		if d.Verdict != policy.Admit || provider(d) != tc.want {
			t.Fatalf("request %d (%s): %v on %s, want admitted on %s", i+1, tc.priority, d.Verdict, provider(d), tc.want)
		}
		if tc.want == "local" && (!d.Rerouted || d.Reason != policy.ReasonProviderQuota) {
			t.Errorf("request %d: re-routed %v for %q, want re-routed for provider_quota", i+1, d.Rerouted, d.Reason)
		}
	}
	if got := metricValue(t, reg, "llm_bulkhead_provider_quota_short_total", map[string]string{"provider": "openai", "quota": "requests", "mode": "enforce"}); got != 2 {
		t.Errorf("short counted %v, want 2", got)
	}
	// At the reset the quota is full again.
	c.Advance(2 * time.Second)
	if d, _ := quotaAdmit(t, e, "openai", "batch"); provider(d) != "openai" {
		t.Errorf("after the reset: sent to %s", provider(d))
	}
}

// TestProviderQuotaRefusesWithoutFallback: a provider with no fallback refuses provider_quota
// with the provider's reset as retry-after; the hold of a request that ends without a reading
// is charged at its real use; shadow mode counts and sends.
func TestProviderQuotaRefusesWithoutFallback(t *testing.T) {
	e, c, reg := quotaEngine(t)
	_, first := quotaAdmit(t, e, "direct", "")
	r := &quota.Reading{}
	r.Windows[quota.Tokens] = quota.Window{Limit: 100000, Remaining: 2500, Reset: c.Now().Add(90 * time.Second), Has: quota.HasLimit | quota.HasRemaining | quota.HasReset}
	first.ObserveQuota(r, 2, c.Now())

	d, held := quotaAdmit(t, e, "direct", "")
	if d.Verdict != policy.Admit {
		t.Fatalf("1 000 tokens of 2 500 left: %v", d.Err())
	}
	d, _ = quotaAdmit(t, e, "direct", "")
	if d.Verdict != policy.Admit {
		t.Fatalf("1 000 more tokens, 1 500 left after the one in flight: %v", d.Err())
	}
	d, _ = quotaAdmit(t, e, "direct", "")
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonProviderQuota || d.RetryAfter != 90*time.Second || d.Compartment != "provider/direct" {
		t.Fatalf("a third: %+v, want refused provider_quota for 90s", d)
	}
	// The held request ends without a reading, having used 200 tokens: it holds those until a
	// reading counts them, 800 come back.
	held.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 100, Completion: 100, Total: 200, Known: true, PromptKnown: true}})
	if d, _ := quotaAdmit(t, e, "direct", ""); d.Verdict != policy.Admit {
		t.Fatalf("after the request ended using 200 of its 1 000: %v", d.Err())
	}
	var got []quota.State
	for _, v := range e.ProviderQuotas() {
		if v.Provider == "direct" {
			got = v.Quotas
		}
	}
	if len(got) != 1 || got[0].Kind != "tokens" || got[0].Remaining != 2500 || got[0].Pending != 2200 || got[0].Limit != 100000 {
		t.Errorf("direct's quota: %+v, want 2 500 left with 2 200 held (two in flight, 200 used by the one that ended)", got)
	}
	if v := metricValue(t, reg, "llm_bulkhead_provider_quota_headers_invalid_total", map[string]string{"provider": "direct"}); v != 2 {
		t.Errorf("invalid headers counted %v, want 2", v)
	}
	if v := metricValue(t, reg, "llm_bulkhead_provider_quota_remaining", map[string]string{"provider": "direct", "quota": "tokens"}); v != 2500 {
		t.Errorf("remaining gauge %v, want 2500", v)
	}

	// Shadow: nothing left, yet sent, and counted.
	_, w := quotaAdmit(t, e, "watched", "")
	w.ObserveQuota(requestsLeft(0, 10, c.Now().Add(time.Minute)), 0, c.Now())
	if d, _ := quotaAdmit(t, e, "watched", ""); d.Verdict != policy.Admit {
		t.Fatalf("shadow mode refused: %v", d.Err())
	}
	if v := metricValue(t, reg, "llm_bulkhead_provider_quota_short_total", map[string]string{"provider": "watched", "mode": "shadow"}); v != 1 {
		t.Errorf("shadow short counted %v, want 1", v)
	}
}

// quotaFleet starts replicas a and b of the policy src on one new Redis, with admission mode and
// keys under prefix, and waits until both reach it.
func quotaFleet(t *testing.T, src, prefix, mode string) (a, b *policy.Engine) {
	t.Helper()
	rd := redistest.Standalone(t)
	section := fmt.Sprintf("cluster:\n  backend: redis\n  addresses: [%q]\n  key_prefix: %s\n  timeout: 500ms\n  lease_ttl: 2s\n  heartbeat: 250ms\n", rd.Addr(), prefix)
	a = clusterEngine(t, src+section+"  replica_id: a\n"+modeSection(t, mode))
	b = clusterEngine(t, src+section+"  replica_id: b\n"+modeSection(t, mode))
	for _, e := range []*policy.Engine{a, b} {
		waitFor(t, "the shared state to be available", func() bool { return e.Cluster().Available() })
	}
	return a, b
}

// TestProviderQuotaSharedAcrossTheFleet: a provider's account is one for the fleet. Replica a
// heard openai's direct account say 2 requests are left and holds one request in flight;
// replica b, which never had an answer from the provider, learns both within an interval:
// it admits the one request left and refuses the next provider_quota. A request that ended
// without a reading goes on holding, at its replica and at the others, until a reading of a
// request sent after it counts it.
func TestProviderQuotaSharedAcrossTheFleet(t *testing.T) {
	forModes(t, func(t *testing.T, mode string) {
		a, b := quotaFleet(t, quotaPolicy, "pq", mode)
		direct := func(e *policy.Engine) (policy.Decision, *policy.Ticket) { return quotaAdmit(t, e, "direct", "") }
		requests := func(e *policy.Engine) quota.State {
			for _, v := range e.ProviderQuotas() {
				if v.Provider == "direct" {
					for _, q := range v.Quotas {
						if q.Kind == "requests" {
							return q
						}
					}
				}
			}
			return quota.State{}
		}

		// Given a heard that 2 requests are left, and holds one in flight
		d, first := direct(a)
		if d.Verdict != policy.Admit {
			t.Fatalf("a, before any reading: %+v", d)
		}
		first.ObserveQuota(requestsLeft(2, 10, a.Now().Add(time.Minute)), 0, a.Now())
		first.Done(policy.Outcome{Status: 200})
		d, held := direct(a)
		if d.Verdict != policy.Admit {
			t.Fatalf("a, 2 left: %+v", d)
		}
		// Then b learns the reading and a's request in flight
		waitFor(t, "b to learn a's reading and holding", func() bool {
			q := requests(b)
			return q.Remaining == 2 && q.Remote == 1
		})
		// And admits the one request left, then refuses
		d, other := direct(b)
		if d.Verdict != policy.Admit {
			t.Fatalf("b, 2 left and 1 held at a: %+v", d)
		}
		if d, _ := direct(b); d.Verdict != policy.Reject || d.Reason != policy.ReasonProviderQuota {
			t.Fatalf("b, 2 left and 1 held here and 1 at a: %+v, want provider_quota", d)
		}
		// When a's request ends without a reading it goes on holding, and b's answer, sent
		// before a's request ended, says none is left: both replicas have that reading, and
		// a's request holds at b until a reading of a request sent after it counts it.
		held.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 500, Completion: 500, Known: true}})
		other.ObserveQuota(requestsLeft(0, 10, b.Now().Add(time.Minute)), 0, b.Now())
		waitFor(t, "a to learn b's reading", func() bool {
			q := requests(a)
			return q.Remaining == 0 && q.Pending == 1
		})
		waitFor(t, "b to learn what a's ended request holds", func() bool {
			q := requests(b)
			return q.Remaining == 0 && q.Pending == 0 && q.Remote == 1
		})
		if d, _ := direct(b); d.Verdict != policy.Reject || d.Reason != policy.ReasonProviderQuota {
			t.Fatalf("b, none left: %+v, want provider_quota", d)
		}
		other.Done(policy.Outcome{Status: 200})
	})
}
