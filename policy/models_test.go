package policy_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

const rerouteModelPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature: {rules: [{header: x-llm-feature}]}
  provider: {default: local, rules: [{header: x-llm-provider}, {model_map: true}]}
  model: {rules: [{body: model}]}
models:
  - {match: "deepseek-*", provider: deepseek}
  - {match: "qwen-*", provider: qwen}
  - {match: "*", provider: local}
features:
  default: {}
  batch:
    degrade: {provider: local}
providers:
  deepseek: {breaker: std, fallback: qwen, tokens_per_minute: 10000}
  qwen:
    breaker: lenient
    models:
      - {match: "deepseek-r*", model: qwen-max}
      - {match: "deepseek-*", model: qwen-plus}
      - {match: "qwen-*", model: "*"}
  local:
    models:
      - {match: "*", model: local-llama}
breakers:
  std: {sliding_window_size: 2, minimum_calls: 2, failure_rate_threshold: 50, wait_in_open: 10s}
  lenient: {minimum_calls: 100}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`

// modelRequest admits a request for model under feature, sent to provider when it is not
// empty; rewrite says whether the caller holds a body it can rewrite.
func modelRequest(t *testing.T, e *policy.Engine, feature, provider, model string, tokens int64, rewrite bool) (policy.Decision, *policy.Ticket) {
	t.Helper()
	in := input{headers: map[string]string{"x-llm-feature": feature}, body: map[string]string{"model": model}}
	if provider != "" {
		in.headers["x-llm-provider"] = provider
	}
	s := e.Snapshot()
	tk := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(in), CanRewriteModel: rewrite,
		Estimate: policy.Estimate{Prompt: tokens / 2, Output: tokens - tokens/2, Total: tokens, BytesPerToken: 4}}
	return e.Admit(context.Background(), s, &r, tk, nil), tk
}

// TestRerouteSendsTheTargetsModel: a degrade and a breaker fallback send the model the target's
// models map names (first match wins), and say which model the client asked for; a model the
// map does not cover, or a body that cannot be rewritten, is not re-routed.
func TestRerouteSendsTheTargetsModel(t *testing.T) {
	e, _ := engine(t, rerouteModelPolicy)
	s := e.Snapshot()
	ok := policy.Outcome{Status: 200, TTFB: time.Millisecond}

	// Degrade: over deepseek's budget, batch goes to local as local-llama.
	d, tk := modelRequest(t, e, "batch", "", "deepseek-chat", 8000, true)
	if d.Verdict != policy.Admit || d.Rerouted || d.Dims.Model != "deepseek-chat" || d.OriginalModel != "" {
		t.Fatalf("within budget: %+v", d)
	}
	tk.Done(ok)
	d, _ = modelRequest(t, e, "batch", "", "deepseek-chat", 8000, false)
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget || s.ProviderName(d.Dims.Provider) != "deepseek" {
		t.Fatalf("over budget, body not rewritable: %+v, want the token_budget refusal", d)
	}
	d, tk = modelRequest(t, e, "batch", "", "deepseek-chat", 8000, true)
	if d.Verdict != policy.Admit || !d.Rerouted || s.ProviderName(d.Dims.Provider) != "local" ||
		d.Dims.Model != "local-llama" || d.OriginalModel != "deepseek-chat" || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("over budget: %+v, want local-llama on local", d)
	}
	tk.Done(ok)

	// Fallback: deepseek's breaker opens; its models move to qwen's names for them.
	for opened := false; !opened; {
		d, tk := modelRequest(t, e, "default", "", "deepseek-chat", 10, true)
		if opened = d.Rerouted; opened {
			tk.Done(ok)
		} else {
			tk.Done(policy.Outcome{Status: 503, TTFB: time.Millisecond})
		}
	}
	for _, c := range []struct{ asked, sent string }{
		{"deepseek-chat", "qwen-plus"}, {"deepseek-reasoner", "qwen-max"}, {"DeepSeek-Chat", "qwen-plus"},
	} {
		d, tk := modelRequest(t, e, "default", "", c.asked, 10, true)
		if d.Verdict != policy.Admit || !d.Rerouted || s.ProviderName(d.Dims.Provider) != "qwen" || d.Reason != policy.ReasonCircuitOpen ||
			d.Dims.Model != c.sent || d.OriginalModel != strings.ToLower(c.asked) {
			t.Errorf("%s with deepseek open: %+v, want %s on qwen", c.asked, d, c.sent)
		}
		tk.Done(ok)
	}
	// "*" keeps a model qwen serves itself: re-routed, nothing to rewrite.
	d, tk = modelRequest(t, e, "default", "deepseek", "qwen-max", 10, false)
	if d.Verdict != policy.Admit || !d.Rerouted || d.Dims.Model != "qwen-max" || d.OriginalModel != "" {
		t.Errorf("qwen-max sent to deepseek while open: %+v, want qwen-max on qwen unchanged", d)
	}
	tk.Done(ok)
	// A model qwen's map does not cover is refused as deepseek refused it, never sent unchanged.
	d, _ = modelRequest(t, e, "default", "deepseek", "gpt-4o", 10, true)
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonCircuitOpen || s.ProviderName(d.Dims.Provider) != "deepseek" || d.Dims.Model != "gpt-4o" {
		t.Errorf("gpt-4o with deepseek open: %+v, want circuit_open from deepseek", d)
	}
	if e.InFlight() != 0 {
		t.Errorf("%d requests still in flight", e.InFlight())
	}
}
