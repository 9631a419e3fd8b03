package extproc_test

import (
	"context"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// TestSpendMetadata: an admitted request under a spend budget leaves in the access-log metadata
// what it reserved, what it was charged and the model that answered, which prices it: here the
// provider answered with another model than the one asked for, at its own price.
func TestSpendMetadata(t *testing.T) {
	const pol = `
envoy: {max_message_timeout: 10s}
classification:
  model: {rules: [{body: model}]}
prices:
  - {match: "m", input_per_mtok: 1, output_per_mtok: 2}
  - {match: "m-2024", input_per_mtok: 10, output_per_mtok: 20, cached_input_per_mtok: 5}
features:
  default: {max_concurrent: 1, spend_per_day: 10}
`
	cfg := buffered
	cfg.ReceivingNamespaces = []string{"llm_bulkhead"}
	s := serve(t, pol, cfg)
	body := `{"id":"x","model":"m-2024","usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}`
	r, err := s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(200, nil, body))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	md := r.DynamicMetadata["llm_bulkhead"].GetFields()
	// The reservation is the estimate at m's price; the cost 4 × 10 + 3 × 5 + 5 × 20 = 155
	// millionths, rounded up once: 0.000155.
	if v := md["spend_reserved"].GetNumberValue(); v <= 0 {
		t.Errorf("spend_reserved %v", md["spend_reserved"])
	}
	if v := md["spend"].GetNumberValue(); v < 0.0001549 || v > 0.0001551 {
		t.Errorf("spend %v, want 0.000155", md["spend"])
	}
	if v := md["response_model"].GetStringValue(); v != "m-2024" {
		t.Errorf("response_model %q", v)
	}
}
