package policy_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const modelFamilyPolicy = `
classification:
  tenant: {rules: [{header: x-tenant-id, trusted: true}]}
  model: {rules: [{body: model}]}
models:
  - {match: "gpt-4o*"}
  - {match: "claude-*"}
features: {default: {}}
compartments:
  - {name: tenant_model, key: [tenant, model], limits: {max_concurrent: 2}}
  - {name: model, key: [model], limits: {tokens_per_minute: 100000}}
  - {name: gpt_only, key: [tenant], where: {model: [gpt-4o*]}, limits: {requests_per_minute: 1000}}
`

func tenantModel(t *testing.T, e *policy.Engine, tenant, model string, tokens int64) (policy.Decision, *policy.Ticket) {
	t.Helper()
	return admit(t, e, input{headers: map[string]string{"x-tenant-id": tenant}, body: map[string]string{"model": model}}, tokens)
}

// TestModelKeyedCompartments: a family keyed by tenant and model limits each tenant per model
// glob; models no glob matches share "other"; where filters by model glob.
func TestModelKeyedCompartments(t *testing.T) {
	e, _ := engine(t, modelFamilyPolicy)
	var held []*policy.Ticket
	want := func(tenant, model string, admitted bool, compartments string) {
		t.Helper()
		d, tk := tenantModel(t, e, tenant, model, 10)
		if (d.Verdict == policy.Admit) != admitted {
			t.Fatalf("%s %s: %+v", tenant, model, d)
		}
		if admitted {
			held = append(held, tk)
			if got := strings.Join(tk.Compartments(), ","); got != compartments {
				t.Errorf("%s %s in %s, want %s", tenant, model, got, compartments)
			}
		} else if d.Reason != policy.ReasonBulkheadFull || d.Compartment != compartments {
			t.Errorf("%s %s refused by %s (%s), want bulkhead_full in %s", tenant, model, d.Compartment, d.Reason, compartments)
		}
	}
	want("acme", "gpt-4o", true, "tenant_model/acme/gpt-4o*,model/gpt-4o*,gpt_only/acme")
	want("acme", "gpt-4o-mini", true, "tenant_model/acme/gpt-4o*,model/gpt-4o*,gpt_only/acme")
	want("acme", "gpt-4o", false, "tenant_model/acme/gpt-4o*")
	want("acme", "claude-sonnet-4", true, "tenant_model/acme/claude-*,model/claude-*")
	want("globex", "gpt-4o", true, "tenant_model/globex/gpt-4o*,model/gpt-4o*,gpt_only/globex")
	want("acme", "llama-3", true, "tenant_model/acme/other,model/other")
	want("acme", "mistral", true, "tenant_model/acme/other,model/other")
	want("acme", "qwen", false, "tenant_model/acme/other")
	for _, tk := range held {
		tk.Done(policy.Outcome{Status: 200})
	}
	if e.InFlight() != 0 {
		t.Fatalf("%d in flight after every ticket is done", e.InFlight())
	}
}

// TestRandomModelFloodCreatesNoCompartments: clients choosing thousands of model names create
// no compartment beyond the policy's globs and other, and every admission is settled and
// released exactly once.
func TestRandomModelFloodCreatesNoCompartments(t *testing.T) {
	e, _ := engine(t, modelFamilyPolicy)
	before := names(e)
	var settled int64
	for i := range 2000 {
		model := fmt.Sprintf("made-up-%d", i)
		if i%3 == 0 {
			model = fmt.Sprintf("gpt-4o-%d", i)
		}
		d, tk := tenantModel(t, e, "acme", model, 10)
		if d.Verdict != policy.Admit {
			t.Fatalf("%s: %+v", model, d)
		}
		usage := policy.Usage{Prompt: 3, Completion: 4, Total: 7, Known: true, PromptKnown: true}
		st := tk.Done(policy.Outcome{Status: 200, Usage: usage})
		settled += st.Total
		if again := tk.Done(policy.Outcome{Status: 200, Usage: usage}); again != (policy.Settled{}) {
			t.Fatalf("a second Done settled again: %+v", again)
		}
	}
	got := names(e)
	wantNames := []string{
		"model/gpt-4o*", "model/claude-*", "model/other", "tenant_model/_overflow", "gpt_only/_overflow",
		"tenant_model/acme/gpt-4o*", "tenant_model/acme/other", "gpt_only/acme",
	}
	slices.Sort(wantNames)
	if !slices.Equal(got, wantNames) {
		t.Errorf("compartments after the flood: %v (before %v), want %v", got, before, wantNames)
	}
	var used int64
	for _, c := range e.Compartments() {
		if c.InFlight != 0 || c.Queued != 0 {
			t.Errorf("%s still holds %d, queues %d", c.Name, c.InFlight, c.Queued)
		}
		if strings.HasPrefix(c.Name, "model/") {
			for _, b := range c.Budgets {
				used += b.Used
			}
		}
	}
	if used != settled || settled != 2000*7 {
		t.Errorf("model budgets used %d, settled %d, want %d each", used, settled, 2000*7)
	}
	if e.InFlight() != 0 {
		t.Errorf("%d still in flight", e.InFlight())
	}
}

func names(e *policy.Engine) []string {
	var out []string
	for _, c := range e.Compartments() {
		out = append(out, c.Name)
	}
	slices.Sort(out)
	return out
}

// BenchmarkAdmitDoneModelKeyed is BenchmarkAdmitDone through families keyed by tenant and model
// glob and by model glob: finding the glob costs a scan of the models list, and no allocation.
func BenchmarkAdmitDoneModelKeyed(b *testing.B) {
	e, _ := engine(b, modelFamilyPolicy)
	s := e.Snapshot()
	in := &input{headers: map[string]string{"x-tenant-id": "acme"}, body: map[string]string{"model": "claude-sonnet-4"}}
	size := policy.RequestSize{Scanned: true, PromptBytes: 4000, MaxTokens: 500, HasMaxTokens: true, N: 1}
	tk := &policy.Ticket{}
	ctx := context.Background()
	o := policy.Outcome{Status: 200, Usage: policy.Usage{Known: true, PromptKnown: true}}
	b.ReportAllocs()
	for b.Loop() {
		d := s.Classify(in)
		r := policy.Request{Dims: d, Estimate: s.Estimate(d.Model, size), PromptBytes: 4000}
		if dec := e.Admit(ctx, s, &r, tk, nil); dec.Verdict != policy.Admit {
			b.Fatal(dec.Err())
		}
		tk.Done(o)
	}
}

// TestModelCompartmentsKeepTheirStateAcrossAReloadThatAddsAGlob: compartments are keyed by the
// glob's name, not its position, so a reload that puts a new glob first finds acme's gpt-4o*
// compartment with its two requests still in flight.
func TestModelCompartmentsKeepTheirStateAcrossAReloadThatAddsAGlob(t *testing.T) {
	e, _ := engine(t, modelFamilyPolicy)
	_, a := tenantModel(t, e, "acme", "gpt-4o", 10)
	_, b := tenantModel(t, e, "acme", "gpt-4o", 10)
	p, err := config.Load("v2.yaml", []byte(strings.Replace(modelFamilyPolicy, `  - {match: "gpt-4o*"}`, `  - {match: "o1*"}
  - {match: "gpt-4o*"}`, 1)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Apply(p); err != nil {
		t.Fatal(err)
	}
	if d, _ := tenantModel(t, e, "acme", "gpt-4o", 10); d.Verdict != policy.Reject || d.Compartment != "tenant_model/acme/gpt-4o*" {
		t.Fatalf("third gpt-4o after the reload: %+v, want bulkhead_full in tenant_model/acme/gpt-4o*", d)
	}
	d, tk := tenantModel(t, e, "acme", "o1-mini", 10)
	if d.Verdict != policy.Admit || strings.Join(tk.Compartments(), ",") != "tenant_model/acme/o1*,model/o1*" {
		t.Fatalf("o1-mini: %+v in %v", d, tk.Compartments())
	}
	for _, tk := range []*policy.Ticket{a, b, tk} {
		tk.Done(policy.Outcome{Status: 200})
	}
	for _, c := range e.Compartments() {
		if c.InFlight != 0 {
			t.Errorf("%s holds %d after every request ended", c.Name, c.InFlight)
		}
	}
}
