package examples_test

import (
	"os"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/examples"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// TestPooledPolicyIsTheExamplePlusAPool keeps examples/policy-pooled.yaml in step with
// examples/policy.yaml: the same policy, a different title, and a pools section at the end.
func TestPooledPolicyIsTheExamplePlusAPool(t *testing.T) {
	pooled, err := os.ReadFile("policy-pooled.yaml")
	if err != nil {
		t.Fatal(err)
	}
	base := string(examples.DefaultPolicy)
	const pointer = "# Pools let compartments lend each other idle capacity: see examples/policy-pooled.yaml.\n"
	if !strings.HasSuffix(base, pointer) {
		t.Fatal("examples/policy.yaml no longer ends with its pointer to the pooled variant")
	}
	const (
		title       = "# llm-bulkhead example policy: chat, a batch export and more sharing one LLM pool.\n"
		pooledTitle = "# llm-bulkhead example policy: chat, a batch export and more sharing one LLM pool, with borrowing.\n#\n# This is examples/policy.yaml plus the pool at the end (a test keeps the two in step).\n"
	)
	body, ok := strings.CutPrefix(string(pooled), pooledTitle)
	if !ok {
		t.Fatal("policy-pooled.yaml lost its title")
	}
	want := strings.TrimPrefix(strings.TrimSuffix(base, pointer), title)
	if !strings.HasPrefix(body, want) {
		t.Fatal("policy-pooled.yaml differs from policy.yaml before its pool: copy the change across")
	}
	p, err := config.Load("policy-pooled.yaml", pooled, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Pools) != 1 || !strings.Contains(body[len(want):], "pools:") {
		t.Fatalf("policy-pooled.yaml should add exactly one pool, has %d", len(p.Pools))
	}
}
