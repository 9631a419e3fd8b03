package policy_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// liveState is everything a reload could change, as the admin API shows it.
func liveState(t *testing.T, e *policy.Engine) string {
	t.Helper()
	b, err := json.Marshal(map[string]any{"gen": e.Snapshot().Gen(), "compartments": e.Compartments(), "breakers": e.Breakers()})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestFailedReloadLeavesEveryLiveObjectAsItWas injects a failure after each step of building
// the new snapshot: whichever step fails, compartments, budgets, tenant compartments, breakers
// and the generation stay exactly as they were; only a build that succeeds changes them.
func TestFailedReloadLeavesEveryLiveObjectAsItWas(t *testing.T) {
	e, clk := engine(t, string(examples.DefaultPolicy))
	// Some state worth keeping: budgets spent, tenant compartments created, breaker calls.
	for _, h := range []map[string]string{
		{"x-llm-feature": "chat", "x-tenant-id": "acme"},
		{"x-llm-feature": "batch_summarize", "x-tenant-id": "initech", "x-llm-provider": "deepseek"},
		{"x-llm-feature": "background_analysis", "x-tenant-id": "globex", "x-llm-provider": "qwen"},
	} {
		d, tk := admit(t, e, input{headers: h, path: "/v1/chat/completions"}, 3000)
		if d.Verdict != policy.Admit {
			t.Fatalf("%v: %+v", h, d)
		}
		tk.Done(policy.Outcome{Status: 200, TTFB: time.Millisecond, Usage: policy.Usage{Prompt: 1000, Completion: 1000, Known: true}})
	}
	clk.Advance(time.Second)
	// A new policy that changes nearly everything: limits, budgets, tenant store bounds, breakers.
	changed := strings.NewReplacer(
		"max_concurrent: 20", "max_concurrent: 7",
		"tokens_per_minute: 200000", "tokens_per_minute: 1000",
		"max_instances:", "max_instances: 3 #",
		"sliding_window_size:", "sliding_window_size: 12 #",
		"wait_in_open:", "wait_in_open: 3s #",
	).Replace(string(examples.DefaultPolicy))
	p, err := config.Load("changed.yaml", []byte(changed), nil)
	if err != nil {
		t.Fatalf("changed policy: %v", err)
	}
	before := liveState(t, e)
	for _, step := range policy.BuildSteps {
		t.Run("fail after "+step, func(t *testing.T) {
			policy.FailBuildAt(e, step)
			defer policy.FailBuildAt(e, "")
			if _, err := e.Apply(p); err == nil {
				t.Fatal("the injected failure did not fail the reload")
			}
			if after := liveState(t, e); after != before {
				t.Errorf("a failed reload changed live state:\nbefore %s\nafter  %s", before, after)
			}
		})
	}
	// The same reload without a failure does change them (so the comparison above can fail).
	if _, err := e.Apply(p); err != nil {
		t.Fatal(err)
	}
	if liveState(t, e) == before {
		t.Fatal("the changed policy changed nothing: the test proves nothing")
	}
}
