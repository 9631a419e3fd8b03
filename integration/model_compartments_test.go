package integration_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// modelPolicy allows each tenant one request at a time per model glob, refused at once beyond.
const modelPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  model:
    rules: [{body: model}]
models:
  - {match: "gpt-4o-mini"}
  - {match: "gpt-4o*"}
features:
  chat: {max_concurrent: 50}
  default: {max_concurrent: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant_model, key: [tenant, model], limits: {max_concurrent: 1, max_wait: 0s}}
`

// tenantModelRequest is tenant's chat request for model.
func tenantModelRequest(tenant, model string) *envoysim.Request {
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: tenant})
	req.Body = []byte(fmt.Sprintf(`{"model":%q,"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`, model))
	return req
}

// TestPerTenantPerModelConcurrency: a family keyed by tenant and model holds each tenant to its
// limit per model glob, end to end: a second gpt-4o request of acme is refused while its first
// runs, its gpt-4o-mini request and globex's gpt-4o are not, models no glob matches share one
// "other" compartment per tenant, and no client-chosen model name becomes a compartment.
func TestPerTenantPerModelConcurrency(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, modelPolicy), NoMock: true})
	g := newGate()
	ctx := context.Background()
	var held []<-chan *envoysim.Result
	admit := func(tenant, model string) {
		t.Helper()
		out := make(chan *envoysim.Result, 1)
		go func() { r, _ := s.Sim.RoundTrip(ctx, tenantModelRequest(tenant, model), g); out <- r }()
		<-g.arrived
		held = append(held, out)
	}
	refused := func(tenant, model, compartment string) {
		t.Helper()
		r, err := s.Sim.RoundTrip(ctx, tenantModelRequest(tenant, model), g)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != 503 || r.Upstream != nil || header(r, "x-bulkhead-reason") != "bulkhead_full" || header(r, "x-bulkhead-compartment") != compartment {
			t.Fatalf("%s %s: status %d, reason %q, compartment %q, upstream called %v; want bulkhead_full from %s",
				tenant, model, r.Status, header(r, "x-bulkhead-reason"), header(r, "x-bulkhead-compartment"), r.Upstream != nil, compartment)
		}
	}

	admit("acme", "gpt-4o")
	refused("acme", "gpt-4o-2024-08-06", "tenant_model/acme/gpt-4o*") // same glob, same compartment
	admit("acme", "gpt-4o-mini")                                      // its own glob
	admit("globex", "gpt-4o")                                         // another tenant
	admit("acme", "made-up-1")                                        // no glob: acme's "other"
	refused("acme", "made-up-2", "tenant_model/acme/other")

	var names []string
	for _, c := range compartments(t, s) {
		names = append(names, c.Name)
		if strings.Contains(c.Name, "made-up") || strings.Contains(c.Name, "2024") {
			t.Errorf("a client's model name became compartment %s", c.Name)
		}
	}
	for _, want := range []string{"tenant_model/acme/gpt-4o*", "tenant_model/acme/gpt-4o-mini", "tenant_model/globex/gpt-4o*", "tenant_model/acme/other"} {
		if c := compartment(t, s, want); c.InFlight != 1 {
			t.Errorf("%s holds %d, want 1 (compartments: %v)", want, c.InFlight, names)
		}
	}

	for range held {
		g.release <- struct{}{}
	}
	for _, out := range held {
		if r := <-out; r.Status != 200 {
			t.Errorf("held request ended %d", r.Status)
		}
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	for _, c := range compartments(t, s) {
		if c.InFlight != 0 || c.Queued != 0 {
			t.Errorf("%s still holds %d (queued %d)", c.Name, c.InFlight, c.Queued)
		}
	}
}

// compartments lists every compartment from /admin/compartments.
func compartments(t *testing.T, s *harness.Stack) []policy.CompartmentView {
	t.Helper()
	var out struct {
		Compartments []policy.CompartmentView `json:"compartments"`
	}
	if err := s.Get("/admin/compartments", &out); err != nil {
		t.Fatal(err)
	}
	return out.Compartments
}
