package extproc_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// boundPolicy sets a context window far above every output limit below, so the completion
// bound of each request is its output limit times its choices.
const boundPolicy = `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 5, tokens_per_minute: 100000000}
`

// boundCase is a request of one API whose reported completion may be at most bound tokens:
// usage builds the response body that reports prompt and completion tokens.
type boundCase struct {
	name, path, body string
	bound            int64
	contentType      string
	usage            func(prompt, completion int64) string
}

func openAIUsage(prompt, completion int64) string {
	return `{"object":"x","usage":{"prompt_tokens":` + itoa(prompt) + `,"completion_tokens":` + itoa(completion) +
		`,"total_tokens":` + itoa(prompt+completion) + `}}`
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// bufferedWithMetadata is buffered with the server's dynamic metadata sent back to Envoy.
func bufferedWithMetadata() envoysim.FilterConfig {
	cfg := buffered
	cfg.ReceivingNamespaces = []string{"llm_bulkhead"}
	return cfg
}

var boundCases = []boundCase{
	{name: "completions: 2 prompts × n 2 × max_tokens 25", path: "/v1/completions",
		body:  `{"model":"gpt-3.5-turbo-instruct","prompt":["Say this is a test","Say this is another test"],"max_tokens":25,"n":2}`,
		bound: 100, usage: openAIUsage},
	{name: "completions: token-id batch × best_of 3 × max_tokens 10", path: "/v1/completions",
		body:  `{"model":"m","prompt":[[1,2,3],[4,5],[6]],"max_tokens":10,"n":2,"best_of":3}`,
		bound: 90, usage: openAIUsage},
	{name: "completions: one token-id prompt × n 3", path: "/v1/completions",
		body:  `{"model":"m","prompt":[1,2,3],"max_tokens":10,"n":3}`,
		bound: 30, usage: openAIUsage},
	{name: "chat: n 3 × max_completion_tokens 20", path: "/v1/chat/completions",
		body:  `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":20,"n":3}`,
		bound: 60, usage: openAIUsage},
	{name: "responses: max_output_tokens 40, no choices", path: "/v1/responses",
		body:  `{"model":"m","input":"hi","max_output_tokens":40,"n":5}`,
		bound: 40, usage: func(p, c int64) string {
			return `{"usage":{"input_tokens":` + itoa(p) + `,"output_tokens":` + itoa(c) + `,"total_tokens":` + itoa(p+c) + `}}`
		}},
	{name: "azure completions: 3 prompts × best_of 2 × max_tokens 10", path: "/openai/deployments/instruct/completions?api-version=2024-10-21",
		body:  `{"prompt":["a","b","c"],"max_tokens":10,"best_of":2}`,
		bound: 60, usage: openAIUsage},
	{name: "gemini: candidateCount 2 × maxOutputTokens 30", path: "/v1beta/models/gemini-2.5-flash:generateContent",
		body:  `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":30,"candidateCount":2}}`,
		bound: 60, usage: func(p, c int64) string {
			return `{"candidates":[],"usageMetadata":{"promptTokenCount":` + itoa(p) + `,"candidatesTokenCount":` + itoa(c) + `,"totalTokenCount":` + itoa(p+c) + `}}`
		}},
	{name: "bedrock converse: maxTokens 40", path: "/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse",
		body:  `{"messages":[{"role":"user","content":[{"text":"hi"}]}],"inferenceConfig":{"maxTokens":40}}`,
		bound: 40, usage: func(p, c int64) string {
			return `{"output":{},"usage":{"inputTokens":` + itoa(p) + `,"outputTokens":` + itoa(c) + `,"totalTokens":` + itoa(p+c) + `}}`
		}},
	{name: "bedrock invoke: max_tokens 30", path: "/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke",
		body:  `{"anthropic_version":"bedrock-2023-05-31","max_tokens":30,"messages":[{"role":"user","content":"hi"}]}`,
		bound: 30, usage: func(p, c int64) string {
			return `{"type":"message","usage":{"input_tokens":` + itoa(p) + `,"output_tokens":` + itoa(c) + `}}`
		}},
	{name: "anthropic: max_tokens 50, no choices", path: "/v1/messages",
		body:  `{"model":"claude","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}`,
		bound: 50, usage: func(p, c int64) string {
			return `{"type":"message","usage":{"input_tokens":` + itoa(p) + `,"output_tokens":` + itoa(c) + `}}`
		}},
}

// TestChoicesBoundTheCompletion pins, for each API, the most completion tokens a response may
// report before it is clamped: usage at the bound settles as reported and counts nothing,
// one token more is settled at the bound and counted. The first case is the batched
// completions request that OpenAI answers with 4 choices and 57 completion tokens: it was
// bounded at max_tokens × n = 50 and settled 99 tokens instead of 107.
func TestChoicesBoundTheCompletion(t *testing.T) {
	for _, tc := range boundCases {
		t.Run(tc.name, func(t *testing.T) {
			s := serve(t, boundPolicy, bufferedWithMetadata())
			for _, over := range []int64{0, 1} {
				completion := tc.bound + over
				req := &envoysim.Request{Method: "POST", Path: tc.path,
					Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(tc.body)}
				ct := tc.contentType
				if ct == "" {
					ct = "application/json"
				}
				r, err := s.sim.RoundTrip(context.Background(), req,
					envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: ct}}, tc.usage(7, completion)))
				if err != nil || r.Status != 200 {
					t.Fatalf("%v %v", r, err)
				}
				md := r.DynamicMetadata["llm_bulkhead"].GetFields()
				if got := int64(md["completion_tokens"].GetNumberValue()); got != tc.bound {
					t.Errorf("completion %d reported: settled %d, want %d", completion, got, tc.bound)
				}
				if got := int64(counter(t, s.reg, "llm_bulkhead_usage_clamped_total")); got != over {
					t.Errorf("completion %d reported: usage_clamped_total %d, want %d", completion, got, over)
				}
			}
		})
	}
}

// TestBatchedCompletionsSettleTheirUsage: the batched request of the report settles to the
// 107 tokens OpenAI reported, and reserved its 4 choices' output up front.
func TestBatchedCompletionsSettleTheirUsage(t *testing.T) {
	s := serve(t, boundPolicy, bufferedWithMetadata())
	req := &envoysim.Request{Method: "POST", Path: "/v1/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		Body:    []byte(`{"model":"gpt-3.5-turbo-instruct","prompt":["Say this is a test","Say this is another test"],"max_tokens":25,"n":2}`)}
	r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		`{"object":"text_completion","model":"gpt-3.5-turbo-instruct:20230824-v2","choices":[],"usage":{"prompt_tokens":50,"completion_tokens":57,"total_tokens":107}}`))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	md := r.DynamicMetadata["llm_bulkhead"].GetFields()
	if got := md["total_tokens"].GetNumberValue(); got != 107 {
		t.Errorf("settled %v tokens, want 107", got)
	}
	// The estimate: 42 bytes of prompts at 4 bytes a token, plus 4 choices × 25.
	if got := md["estimated_tokens"].GetNumberValue(); got != 11+100 {
		t.Errorf("estimated %v tokens, want %d", got, 11+100)
	}
	if got := counter(t, s.reg, "llm_bulkhead_usage_clamped_total"); got != 0 {
		t.Errorf("usage_clamped_total %v", got)
	}
}
