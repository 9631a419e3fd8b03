package integration_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// providerRequest is a call of one of the providers' own APIs, as its SDK sends it.
func providerRequest(path, body, feature string) *envoysim.Request {
	return &envoysim.Request{Method: "POST", Path: path, Body: []byte(body),
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: feature}}}
}

// TestRefusalInEachProviderShape: a refusal of an Azure OpenAI, Gemini or Bedrock call, end to
// end, answers in that provider's own error shape with the status and headers its SDK reads.
func TestRefusalInEachProviderShape(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, refusalSDKPolicy), Mock: mock.Options{TimeScale: 0.01}})
	ctx := context.Background()
	if r, err := s.Do(ctx, chatRequest("budget")); err != nil || r.Status != 200 {
		t.Fatalf("spending the budget: %v %v", r, err)
	}
	g := newGate()
	hold(s, g, "full")
	defer func() { g.release <- struct{}{} }()

	tests := []struct {
		name, path, body string
		check            func(t *testing.T, status int, r *envoysim.Result, body map[string]any)
	}{
		{"azure", "/openai/deployments/prod-gpt-4o/chat/completions?api-version=2024-10-21",
			`{"max_tokens":50,"messages":[{"role":"user","content":"hello there"}]}`,
			func(t *testing.T, status int, r *envoysim.Result, body map[string]any) {
				e, _ := body["error"].(map[string]any)
				want := map[int]string{429: "429", 503: "ServiceUnavailable"}[status]
				if e["code"] != want || e["message"] == "" {
					t.Errorf("body %v", body)
				}
			}},
		{"gemini", "/v1beta/models/gemini-2.5-flash:generateContent", geminiChat,
			func(t *testing.T, status int, r *envoysim.Result, body map[string]any) {
				e, _ := body["error"].(map[string]any)
				want := map[int]string{429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}[status]
				if e["status"] != want || e["code"] != float64(status) || e["message"] == "" {
					t.Errorf("body %v", body)
				}
			}},
		{"gemini stream", "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", geminiChat,
			func(t *testing.T, status int, r *envoysim.Result, body map[string]any) {
				if e, _ := body["error"].(map[string]any); e["code"] != float64(status) {
					t.Errorf("body %v", body)
				}
			}},
		{"bedrock converse", bedrockClaude + "/converse", converseChat,
			func(t *testing.T, status int, r *envoysim.Result, body map[string]any) {
				want := map[int]string{429: "ThrottlingException", 503: "ServiceUnavailableException"}[status]
				if header(r, "x-amzn-errortype") != want || header(r, "x-amzn-requestid") == "" || len(body) != 1 || body["message"] == "" {
					t.Errorf("x-amzn-errortype %q, body %v", header(r, "x-amzn-errortype"), body)
				}
			}},
		{"bedrock invoke stream", bedrockClaude + "/invoke-with-response-stream", invokeChat,
			func(t *testing.T, status int, r *envoysim.Result, body map[string]any) {
				if header(r, "x-amzn-errortype") == "" || body["message"] == "" {
					t.Errorf("headers %v body %v", r.Headers, body)
				}
			}},
	}
	for _, tt := range tests {
		for feature, status := range map[string]int{"budget": 429, "full": 503} {
			t.Run(tt.name+"/"+feature, func(t *testing.T) {
				before := len(s.Mock.Requests())
				r, err := s.Do(ctx, providerRequest(tt.path, tt.body, feature))
				if err != nil {
					t.Fatal(err)
				}
				if r.Status != status || header(r, "retry-after") == "" || header(r, "content-type") != "application/json" {
					t.Fatalf("status %d headers %v", r.Status, r.Headers)
				}
				var body map[string]any
				if err := json.Unmarshal(r.Body, &body); err != nil {
					t.Fatalf("%s: %v", r.Body, err)
				}
				tt.check(t, status, r, body)
				if len(s.Mock.Requests()) != before {
					t.Error("a refused request reached the provider")
				}
			})
		}
	}
}

// TestGeminiCountTokensIsFree: countTokens is admitted and counted as a request, and charges
// no token budget.
func TestGeminiCountTokensIsFree(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, usagePolicy), Mock: mock.Options{TimeScale: 0.01}})
	before := budgetUsed(t, s)
	r, err := s.Do(context.Background(), providerRequest("/v1beta/models/gemini-2.5-flash:countTokens", geminiChat, "default"))
	if err != nil || r.Status != 200 || !strings.HasPrefix(string(r.Body), `{"totalTokens":`) {
		t.Fatalf("%v %v", r, err)
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	if used := budgetUsed(t, s) - before; used != 0 {
		t.Errorf("countTokens charged %d tokens", used)
	}
	if n := metricSum(t, s, "llm_bulkhead_admitted_total"); n != 1 {
		t.Errorf("admitted %v, want 1", n)
	}
}
