package policy_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

const identityPolicy = `
admin: {tenant_label: true}
classification:
  feature:
    rules:
      - header: x-llm-feature
      - body: metadata.feature
  tenant:
    rules:
      - metadata: {namespace: envoy.filters.http.jwt_authn, key: payload.tenant}
      - header: x-tenant-id
        trusted: true
  tier:
    rules: [{tenant_directory: true}]
  model:
    rules: [{body: model}]
tenants:
  directory:
    - {id: acme, tier: enterprise}
    - {id: globex, tier: pro}
features:
  default: {max_concurrent: 50}
  chat: {max_concurrent: 50}
tiers:
  enterprise: {max_concurrent: 30}
  pro: {max_concurrent: 15}
  free: {max_concurrent: 5}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
`

// TestValuesThatCannotBeHeaderValuesAreSkipped: a value a rule reads with a control character
// (CR, LF, NUL, tab, DEL, C1), bytes that are not UTF-8 or more than 256 bytes is skipped as if
// the rule had read nothing — the next rule or the default decides — for every dimension, and
// counted by dimension. The server writes these values into x-bulkhead-compartment, Envoy's
// dynamic metadata and (with tenant_label) metric labels: a tenant id with CR/LF from a trusted
// source failed every request of it at Envoy, and one that is not UTF-8 broke /metrics.
func TestValuesThatCannotBeHeaderValuesAreSkipped(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(identityPolicy), nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	clk := newClock()
	e, err := observe.NewEngine(p, policy.Options{Clock: clk, Logger: slog.New(slog.NewJSONHandler(&logs, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	s := e.Snapshot()
	jwt := func(tenant string) map[string]map[string]string {
		return map[string]map[string]string{"envoy.filters.http.jwt_authn": {"payload.tenant": tenant}}
	}
	long := strings.Repeat("t", config.MaxIdentityBytes)
	tests := []struct {
		name string
		in   input
		want policy.Names
		bad  string // the dimension counted, if any
	}{
		{"CR LF inside a trusted claim: the next rule decides",
			input{md: jwt("acme\r\nx-injected: 1"), headers: map[string]string{"x-tenant-id": "globex"}},
			policy.Names{Feature: "default", Tenant: "globex", Tier: "pro", Provider: "default", Model: "unknown"}, "tenant"},
		{"NUL: the default decides",
			input{md: jwt("ac\x00me")},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "tenant"},
		{"not UTF-8", input{headers: map[string]string{"x-tenant-id": "\xffacme"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "tenant"},
		{"tab inside", input{headers: map[string]string{"x-tenant-id": "ac\tme"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "tenant"},
		{"C1 control (CSI)", input{headers: map[string]string{"x-tenant-id": "acme\u009b[2J"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "tenant"},
		{"DEL", input{headers: map[string]string{"x-tenant-id": "acme\x7f"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "tenant"},
		{"257 bytes", input{headers: map[string]string{"x-tenant-id": long + "x"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "tenant"},
		{"256 bytes are kept", input{headers: map[string]string{"x-tenant-id": long}},
			policy.Names{Feature: "default", Tenant: long, Tier: "free", Provider: "default", Model: "unknown"}, ""},
		{"CR LF around a value are trimmed like spaces", input{headers: map[string]string{"x-tenant-id": " acme\r\n"}},
			policy.Names{Feature: "default", Tenant: "acme", Tier: "enterprise", Provider: "default", Model: "unknown"}, ""},
		{"unicode ids are kept", input{headers: map[string]string{"x-tenant-id": "müller-gmbh"}},
			policy.Names{Feature: "default", Tenant: "müller-gmbh", Tier: "free", Provider: "default", Model: "unknown"}, ""},
		{"model with LF", input{body: map[string]string{"model": "gpt-4o\nx"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "model"},
		{"model not UTF-8 (lower-casing would have hidden it)", input{body: map[string]string{"model": "GPT-4O\xff"}},
			policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "model"},
		{"feature with a control character: the next rule decides",
			input{headers: map[string]string{"x-llm-feature": "ch\x01at"}, body: map[string]string{"metadata.feature": "chat"}},
			policy.Names{Feature: "chat", Tenant: "anonymous", Tier: "free", Provider: "default", Model: "unknown"}, "feature"},
	}
	want := map[string]float64{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := s.Classify(tt.in)
			if got := s.Names(d); got != tt.want {
				t.Errorf("Classify = %+v\nwant        %+v", got, tt.want)
			}
			if tt.bad != "" {
				want[tt.bad]++
			}
			// Admitted, the request's tenant compartment is named after the value kept.
			r := policy.Request{Dims: d, Now: clk.Now()}
			tk := &policy.Ticket{}
			if dec := e.Admit(context.Background(), s, &r, tk, nil); dec.Verdict != policy.Admit {
				t.Fatalf("refused: %+v", dec)
			}
			if got := tk.JoinCompartments(); !strings.HasSuffix(got, ",tenant/"+tt.want.Tenant) {
				t.Errorf("compartments %q", got)
			}
			tk.Done(policy.Outcome{Status: 200})
		})
	}
	for _, dim := range []string{"feature", "tenant", "tier", "provider", "model"} {
		if got := max(metricValue(t, reg, "llm_bulkhead_classify_errors_total", map[string]string{"reason": "invalid_" + dim}), 0); got != want[dim] {
			t.Errorf("classify_errors_total{reason=invalid_%s} = %v, want %v", dim, got, want[dim])
		}
	}
	// Every metric series can be gathered: tenant labels are UTF-8.
	if _, err := reg.Gather(); err != nil {
		t.Fatalf("gather: %v", err)
	}

	// One log line a minute names the rule and the problem, never the value (a rule may read a
	// header holding a secret).
	lines := strings.Count(logs.String(), "classification skipped a value")
	if lines != 1 || !strings.Contains(logs.String(), `"rule":"classification.tenant.rules[0]"`) ||
		!strings.Contains(logs.String(), "control character U+000D at byte 4") || strings.Contains(logs.String(), "x-injected") {
		t.Fatalf("%d log lines:\n%s", lines, logs.String())
	}
	clk.Advance(time.Minute)
	s.Classify(input{headers: map[string]string{"x-tenant-id": "a\x00"}})
	if n := strings.Count(logs.String(), "classification skipped a value"); n != 2 || !strings.Contains(logs.String(), `"source":"header x-tenant-id"`) {
		t.Fatalf("a minute later: %d lines:\n%s", n, logs.String())
	}
}

// TestPolicyValuesThatCannotBeHeaderValuesAreRefused: the values a policy gives the open
// dimensions (tenant, model) directly — defaults, path rule values, map targets, tenant ids —
// are checked like classified ones when the policy loads.
func TestPolicyValuesThatCannotBeHeaderValuesAreRefused(t *testing.T) {
	_, err := config.Load("p.yaml", []byte(`
classification:
  tenant:
    default: "any\none"
    rules:
      - path_prefix: /team/
        value: "team\u0000"
      - header: x-tenant-id
        trusted: true
        map: {"a\tb": acme, legacy: "acme\r\n"}
  model:
    default: "\x7f"
tenants:
  directory:
    - {id: "acme\u009b", tier: free}
features:
  default: {max_concurrent: 1}
`), nil)
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{
		"classification.tenant.default", "classification.model.default", "classification.tenant.rules[0].value",
		`classification.tenant.rules[1].map.a	b`, "classification.tenant.rules[1].map.legacy", "tenants.directory[0].id",
		"control character U+000A at byte 3",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("problems lack %q:\n%v", want, err)
		}
	}
}
