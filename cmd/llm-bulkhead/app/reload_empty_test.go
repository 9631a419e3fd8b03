package app_test

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/llm-bulkhead/app"
	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// headerInput is a policy.Input of request headers only.
type headerInput map[string]string

func (h headerInput) Header(n string) (string, bool)           { v, ok := h[n]; return v, ok }
func (h headerInput) Path() string                             { return "/v1/chat/completions" }
func (h headerInput) BodyField(string) (string, bool)          { return "", false }
func (h headerInput) Metadata(string, []string) (string, bool) { return "", false }
func (h headerInput) Attribute(string) (string, bool)          { return "", false }

// TestReloadToAnEmptyPolicyIsRefusedAndKeepsState is the regression test for an empty or
// comment-only policy file validating, and a reload to it dropping every compartment and all
// budget state.
func TestReloadToAnEmptyPolicyIsRefusedAndKeepsState(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(path, examples.DefaultPolicy, 0o644); err != nil {
		t.Fatal(err)
	}
	a, err := app.New(app.Options{ConfigPath: path, Env: []string{}, LogOutput: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	e := a.Engine()
	// Given chat has spent 5 000 tokens of its budget
	s := e.Snapshot()
	tk := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(headerInput{"x-llm-feature": "chat", "x-tenant-id": "acme"}),
		Estimate: policy.Estimate{Prompt: 2500, Output: 2500, Total: 5000, BytesPerToken: 4}}
	if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
		t.Fatalf("chat: %+v", d)
	}
	tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 2500, Completion: 2500, Known: true}})
	before := e.Compartments()
	chatUsed := func(views []policy.CompartmentView) int64 {
		for _, c := range views {
			if c.Name == "feature/chat" {
				return c.Budgets[0].Used
			}
		}
		t.Fatal("no feature/chat compartment")
		return 0
	}
	if chatUsed(before) != 5000 {
		t.Fatalf("chat used %d before the reload", chatUsed(before))
	}
	for _, content := range []string{"", "# everything commented out\n# features:\n#   chat: {max_concurrent: 20}\n"} {
		// When the file is emptied (or commented out) and reloaded
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		// Then the reload is refused and nothing changed
		if err := a.Reload("test"); err == nil {
			t.Fatalf("reload to %q was accepted", content)
		}
		after := e.Compartments()
		if len(after) != len(before) || chatUsed(after) != 5000 || e.Snapshot().Gen() != 1 {
			t.Fatalf("after a refused reload: %d compartments (was %d), chat used %d, generation %d",
				len(after), len(before), chatUsed(after), e.Snapshot().Gen())
		}
	}
	// A file that says it means to limit nothing is accepted.
	if err := os.WriteFile(path, []byte("allow_empty: true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload("test"); err != nil {
		t.Fatalf("allow_empty: %v", err)
	}
}
