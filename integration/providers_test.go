package integration_test

import (
	"context"
	"encoding/json"
	"math"
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

// TestExamplePolicyRoutesGeminiAndBedrock: the built-in example policy sends Gemini and
// Bedrock calls, whose model is in the path, to providers of their own — through their own
// provider compartment to the upstream Envoy routes by x-llm-provider, for Bedrock whether the
// model id names the model, an inference profile or Amazon's own models, percent-encoded as the
// AWS SDKs send it — and charges a tenant's spend budget at that model's example price.
func TestExamplePolicyRoutesGeminiAndBedrock(t *testing.T) {
	// CheckModels: the mock answers 404 to a model sent to a provider the policy does not map
	// it to, as a real provider would.
	s := start(t, harness.Options{CheckModels: true, Mock: mock.Options{TimeScale: 0.001}})
	tests := []struct {
		path, body, provider, model string
		input, cachedInput, output  float64 // the example's prices per million tokens
	}{
		{"/v1beta/models/gemini-2.5-flash:generateContent", geminiChat, "gemini", "gemini-2.5-flash", 0.30, 0.075, 2.50},
		{"/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", geminiChat, "gemini", "gemini-2.5-pro", 1.25, 0.31, 10.00},
		{bedrockClaude + "/converse", converseChat, "bedrock", "anthropic.claude-3-5-haiku-20241022-v1:0", 0.80, 0.08, 4.00},
		{"/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse-stream", converseChat, "bedrock",
			"us.anthropic.claude-sonnet-4-20250514-v1:0", 3.00, 0.30, 15.00},
		{"/model/amazon.nova-pro-v1%3A0/converse", converseChat, "bedrock", "amazon.nova-pro-v1:0", 0.80, 0.20, 3.20},
	}
	for _, tt := range tests {
		t.Run(tt.model, func(t *testing.T) {
			req := providerRequest(tt.path, tt.body, "chat")
			// initech has a spend budget, so its requests are priced.
			req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "initech"})
			r, err := s.Do(context.Background(), req)
			if err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			if p := upstreamHeader(r, "x-llm-provider"); p != tt.provider {
				t.Errorf("went upstream with x-llm-provider %q, want %s", p, tt.provider)
			}
			md := r.DynamicMetadata["llm_bulkhead"].GetFields()
			if md["provider"].GetStringValue() != tt.provider || md["model"].GetStringValue() != tt.model ||
				!strings.Contains(md["compartment"].GetStringValue(), "provider/"+tt.provider) {
				t.Errorf("metadata %v", md)
			}
			if !md["usage_reported"].GetBoolValue() {
				t.Fatalf("no usage read: %v", md)
			}
			prompt, cached := md["prompt_tokens"].GetNumberValue(), md["cached_tokens"].GetNumberValue()
			micros := (prompt-cached)*tt.input + cached*tt.cachedInput + md["completion_tokens"].GetNumberValue()*tt.output
			if want, got := math.Ceil(micros-1e-9)/1e6, md["spend"].GetNumberValue(); math.Abs(got-want) > 1e-12 {
				t.Errorf("spend %v, want %v at the example's %s prices (metadata %v)", got, want, tt.model, md)
			}
		})
	}
}
