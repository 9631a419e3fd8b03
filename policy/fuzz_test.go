package policy_test

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// FuzzClassify runs the rule evaluator on arbitrary header, path, body and metadata values: it
// never panics, and every dimension comes out as one of the configured values.
func FuzzClassify(f *testing.F) {
	e, _ := engine(f, strings.Replace(classifyPolicy, "classification_defaults_unused: null\n", `
  default: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
  - {name: provider, key: [provider], limits_from: provider}
`, 1)+`
`)
	s := e.Snapshot()
	f.Add("chat", "/v1/embeddings", "summarise", "acme", "globex", "deepseek", "deepseek-chat")
	f.Add(" CHAT ", "/v1/chat/completions?x=1", "", "", "", "QWEN", "qwen-2-x")
	f.Add("\x00", "", "\xff", "\t", "", "", "*")
	f.Add("chat", "/", "", "acme\r\nx-injected: 1", "glo\x00bex", "", "gpt-4o\n")
	f.Add("", "", "", "\xff", "\u009b", "", strings.Repeat("\u023a", 100))
	f.Fuzz(func(t *testing.T, feature, path, bodyFeature, jwtTenant, headerTenant, provider, model string) {
		in := input{
			headers: map[string]string{"x-llm-feature": feature, "x-tenant-id": headerTenant, "x-llm-provider": provider},
			path:    path,
			body:    map[string]string{"metadata.feature": bodyFeature, "model": model},
			md:      map[string]map[string]string{"envoy.filters.http.jwt_authn": {"payload.tenant": jwtTenant}},
		}
		d := s.Classify(in)
		n := s.Names(d)
		switch n.Feature {
		case "default", "chat", "embedding", "batch_summarize":
		default:
			t.Fatalf("feature %q is not configured", n.Feature)
		}
		switch n.Tier {
		case "enterprise", "pro", "free":
		default:
			t.Fatalf("tier %q", n.Tier)
		}
		switch n.Provider {
		case "deepseek", "qwen", "local":
		default:
			t.Fatalf("provider %q", n.Provider)
		}
		if n.Tier == "enterprise" && n.Tenant != "acme" {
			t.Fatalf("tenant %q got enterprise", n.Tenant)
		}
		// Open dimensions take what requests send, but only what can be written into a header.
		if config.CheckIdentity(n.Tenant) != nil || config.CheckIdentity(n.Model) != nil {
			t.Fatalf("tenant %q, model %q cannot be header values", n.Tenant, n.Model)
		}
	})
}

// FuzzEngine: any policy that loads builds an engine (or is refused with an error), and a
// request through it is admitted or refused and released without a panic.
func FuzzEngine(f *testing.F) {
	f.Add([]byte(seedPolicy), "chat", "acme")
	f.Add([]byte(breakerPolicy), "default", "")
	f.Add([]byte(modelFamilyPolicy), "default", "acme")
	f.Add([]byte(rerouteModelPolicy), "batch", "acme")
	f.Add([]byte("features: {default: {max_concurrent: 1, tokens_per_minute: 5}}\ncompartments: [{name: t, key: [tenant, feature], limits: {max_concurrent: 2}}]\n"), "x", "t1")
	f.Fuzz(func(t *testing.T, yaml []byte, feature, tenant string) {
		p, err := config.Load("fuzz.yaml", yaml, nil)
		if err != nil {
			return
		}
		e, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			return
		}
		s := e.Snapshot()
		in := input{headers: map[string]string{"x-llm-feature": feature, "x-tenant-id": tenant}, path: "/v1/chat/completions"}
		d := s.Classify(in)
		r := policy.Request{Dims: d, Estimate: s.Estimate(d.Model, policy.RequestSize{Scanned: true, PromptBytes: 100, N: 1})}
		var tk policy.Ticket
		if dec := e.Admit(context.Background(), s, &r, &tk, nil); dec.Verdict == policy.Admit {
			tk.Done(policy.Outcome{Status: 200})
		}
		if e.InFlight() != 0 {
			t.Fatalf("in flight %d after release", e.InFlight())
		}
		_ = e.Compartments()
	})
}
