package policy_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// orderPolicy puts every limit of the pipeline on one compartment: a request rate of 1 a minute,
// a token budget of 100 a minute, a spend budget of $10 an hour at $1 a token, 2 slots, and the
// provider's breaker.
const orderPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: openai
  model:
    default: gpt-x
prices:
  - {match: "*", input_per_mtok: 1000000, output_per_mtok: 1000000}
features:
  chat: {max_concurrent: 2, requests_per_minute: %d, tokens_per_minute: %d, spend_per_hour: %d}
  default: {max_concurrent: 10}
providers:
  openai: {breaker: std}
breakers:
  std: {sliding_window_size: 4, minimum_calls: 4, failure_rate_threshold: 50, wait_in_open: 10s}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`

// TestEveryModeRefusesInTheSameOrder: one pipeline, whichever place a compartment's counters
// are kept in — this process, a lease of the fleet's, or Redis per request — refuses a request
// that several steps would refuse for the first of them: request rates, then the provider's
// breaker, then token budgets, then spend budgets.
func TestEveryModeRefusesInTheSameOrder(t *testing.T) {
	cases := []struct {
		name string
		// rpm, tpm and spend per hour; the first request (of 10 tokens, $10) uses them up as
		// far as they are small.
		rpm, tpm, spend int
		open            bool // the breaker forced open after the first request
		want            policy.Reason
	}{
		{"rate before breaker", 1, 1000, 1000, true, policy.ReasonRateLimit},
		{"breaker before budget", 100, 10, 1000, true, policy.ReasonCircuitOpen},
		{"budget before spend", 100, 10, 10, false, policy.ReasonTokenBudget},
		{"spend alone", 100, 1000, 10, false, policy.ReasonSpendBudget},
	}
	modes := append([]string{"local"}, clusterModes...)
	rd := redistest.Standalone(t)
	for _, mode := range modes {
		for _, c := range cases {
			t.Run(mode+"/"+c.name, func(t *testing.T) {
				yaml := fmt.Sprintf(orderPolicy, c.rpm, c.tpm, c.spend)
				var e *policy.Engine
				if mode == "local" {
					e, _ = engine(t, yaml)
				} else {
					prefix := fmt.Sprintf("order-%s-%d", mode, time.Now().UnixNano())
					e = clusterEngine(t, yaml+fmt.Sprintf(`cluster:
  backend: redis
  addresses: [%q]
  replica_id: a
  key_prefix: %s
  timeout: 1s
  lease_ttl: 10s
`, rd.Addr(), prefix)+modeSection(t, mode))
					waitFor(t, "the shared state", func() bool { return e.Cluster().Available() })
				}
				chat := feature("chat")
				d, tk := admit(t, e, chat, 10)
				if d.Verdict != policy.Admit {
					t.Fatalf("the first request: %+v", d)
				}
				chatDone(tk, 10)
				if c.open {
					if err := e.ForceBreaker("openai", "FORCED_OPEN"); err != nil {
						t.Fatal(err)
					}
				}
				d, _ = admit(t, e, chat, 10)
				if d.Verdict != policy.Reject || d.Reason != c.want {
					t.Fatalf("the second request: %s (%+v), want %s", d.Reason, d, c.want)
				}
			})
		}
	}
}
