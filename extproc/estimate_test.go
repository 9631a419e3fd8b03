package extproc_test

import (
	"context"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// estimateCases are the same request — the prompt "hello there" (11 bytes: 3 tokens at 4
// bytes a token) and an output limit of 8 tokens — in every API whose body carries both.
var estimateCases = []struct{ name, path, body string }{
	{"openai chat", "/v1/chat/completions", `{"model":"m","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hello there"}]}`},
	{"openai completions", "/v1/completions", `{"model":"m","max_tokens":8,"prompt":"hello there"}`},
	{"openai responses", "/v1/responses", `{"model":"m","max_output_tokens":8,"stream":true,"input":"hello there"}`},
	{"anthropic messages", "/v1/messages", `{"model":"claude","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hello there"}]}`},
	{"azure chat", "/openai/deployments/prod/chat/completions?api-version=2024-10-21", `{"max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hello there"}]}`},
	{"gemini stream", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", `{"contents":[{"role":"user","parts":[{"text":"hello there"}]}],"generationConfig":{"maxOutputTokens":8}}`},
	{"gemini generate", "/v1beta/models/gemini-2.5-flash:generateContent", `{"contents":[{"role":"user","parts":[{"text":"hello there"}]}],"generationConfig":{"maxOutputTokens":8}}`},
	{"bedrock converse stream", "/model/anthropic.claude-3-5-haiku-20241022-v1:0/converse-stream", `{"messages":[{"role":"user","content":[{"text":"hello there"}]}],"inferenceConfig":{"maxTokens":8}}`},
	{"bedrock invoke", "/model/anthropic.claude-3-5-haiku-20241022-v1:0/invoke", `{"anthropic_version":"bedrock-2023-05-31","max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}`},
}

// TestEveryAPIIsEstimatedFromItsBody: whenever the estimate counts — against a provider quota
// that follows the provider's headers — or a classification rule reads the body, each API's
// request is estimated from its body (3 prompt tokens plus its 8 of output: 11), not at the
// default output (estimation.default_max_tokens) as if it had none. (A policy that needs neither
// decides at the headers without the body: TestDecisionWithoutBody in integration.)
func TestEveryAPIIsEstimatedFromItsBody(t *testing.T) {
	policies := map[string]string{
		"provider quota": `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  provider: {default: openai}
features:
  default: {max_concurrent: 5}
providers:
  openai: {quota: {mode: enforce}}
`,
		"model rule": `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  model:
    rules: [{body: model}]
features:
  default: {max_concurrent: 5}
`,
	}
	cfg := bufferedWithMetadata()
	cfg.AllowModeOverride = true
	for pname, yaml := range policies {
		s := serve(t, yaml, cfg)
		for _, tc := range estimateCases {
			req := &envoysim.Request{Method: "POST", Path: tc.path,
				Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(tc.body)}
			r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}}, `{}`))
			if err != nil || r.Status != 200 {
				t.Fatalf("%s, %s: %v %v", pname, tc.name, r, err)
			}
			if got := r.DynamicMetadata["llm_bulkhead"].GetFields()["estimated_tokens"].GetNumberValue(); got != 11 {
				t.Errorf("%s, %s: estimated %v tokens, want 11 (3 of prompt, 8 of output)", pname, tc.name, got)
			}
		}
	}
}
