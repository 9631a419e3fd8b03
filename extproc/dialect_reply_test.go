package extproc

import (
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// TestRefusalInEachDialect: a refusal answers in the error shape of the API called, with the
// status and headers its SDKs read, for each reason's kind.
func TestRefusalInEachDialect(t *testing.T) {
	budget := budgetRefusal()
	full := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBulkheadFull, Compartment: "feature/chat", RetryAfter: 250 * time.Millisecond}
	bad := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBadRequest}
	key := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonUnknownKey}
	noRetry := map[string]string{"retry-after": "", "retry-after-ms": "", "x-should-retry": ""}
	r := refusal{requestID: "req-7", now: refusedAt, rateLimitHeaders: true}
	tests := []struct {
		name    string
		d       policy.Decision
		dialect llmapi.Dialect
		status  int
		headers map[string]string // "" : must be absent
		body    string
	}{
		{"azure budget", budget, llmapi.DialectAzure, 429, map[string]string{"x-ratelimit-remaining-tokens": "1200", "x-amzn-errortype": ""},
			`{"error":{"message":"` + budget.Message() + `","type":"rate_limit_exceeded","code":"429","param":null,"innererror":{"code":"token_budget"},"request_id":"req-7"}}`},
		{"azure full", full, llmapi.DialectAzure, 503, nil,
			`{"error":{"message":"` + full.Message() + `","type":"server_overloaded","code":"ServiceUnavailable","param":null,"innererror":{"code":"bulkhead_full"},"request_id":"req-7"}}`},
		{"gemini budget", budget, llmapi.DialectGemini, 429, map[string]string{"x-ratelimit-remaining-tokens": "", "retry-after": "2"},
			`{"error":{"code":429,"message":"` + budget.Message() + `","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"token_budget","domain":"llm-bulkhead","metadata":{"request_id":"req-7"}},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"1.5s"}]}}`},
		{"gemini full", full, llmapi.DialectGemini, 503, nil,
			`{"error":{"code":503,"message":"` + full.Message() + `","status":"UNAVAILABLE","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"bulkhead_full","domain":"llm-bulkhead","metadata":{"request_id":"req-7"}},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"0.25s"}]}}`},
		{"gemini bad request", bad, llmapi.DialectGemini, 400, nil,
			`{"error":{"code":400,"message":"` + bad.Message() + `","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"bad_request","domain":"llm-bulkhead","metadata":{"request_id":"req-7"}}]}}`},
		{"bedrock budget", budget, llmapi.DialectBedrock, 429, map[string]string{"x-amzn-errortype": "ThrottlingException", "x-amzn-requestid": "req-7", "x-ratelimit-remaining-tokens": ""},
			`{"message":"` + budget.Message() + `"}`},
		{"bedrock full", full, llmapi.DialectBedrock, 503, map[string]string{"x-amzn-errortype": "ServiceUnavailableException"},
			`{"message":"` + full.Message() + `"}`},
		{"bedrock bad request", bad, llmapi.DialectBedrock, 400, map[string]string{"x-amzn-errortype": "ValidationException"},
			`{"message":"` + bad.Message() + `"}`},
		{"openai unknown key", key, llmapi.DialectOpenAI, 401, noRetry,
			`{"error":{"message":"The API key is missing or not known.","type":"invalid_request_error","code":"unknown_key","param":null,"request_id":"req-7"}}`},
		{"azure unknown key", key, llmapi.DialectAzure, 401, noRetry,
			`{"error":{"message":"The API key is missing or not known.","type":"invalid_request_error","code":"401","param":null,"innererror":{"code":"unknown_key"},"request_id":"req-7"}}`},
		{"anthropic unknown key", key, llmapi.DialectAnthropic, 401, map[string]string{"retry-after": "", "request-id": "req-7"},
			`{"type":"error","error":{"type":"authentication_error","message":"The API key is missing or not known."},"request_id":"req-7"}`},
		{"gemini unknown key", key, llmapi.DialectGemini, 401, noRetry,
			`{"error":{"code":401,"message":"The API key is missing or not known.","status":"UNAUTHENTICATED","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"unknown_key","domain":"llm-bulkhead","metadata":{"request_id":"req-7"}}]}}`},
		{"bedrock unknown key", key, llmapi.DialectBedrock, 401, map[string]string{"x-amzn-errortype": "UnrecognizedClientException", "retry-after": ""},
			`{"message":"The API key is missing or not known."}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, h, body := replyHeaders(t, immediateReply(tc.d, tc.dialect, r))
			if status != tc.status {
				t.Errorf("status %d, want %d", status, tc.status)
			}
			if string(body) != tc.body {
				t.Errorf("body\n%s\nwant\n%s", body, tc.body)
			}
			for k, v := range tc.headers {
				if h[k] != v {
					t.Errorf("%s = %q, want %q", k, h[k], v)
				}
			}
			if h["x-bulkhead-reason"] != string(tc.d.Reason) || h["x-request-id"] != "req-7" {
				t.Errorf("headers %v", h)
			}
		})
	}
}

func TestAppendProtoDuration(t *testing.T) {
	for d, want := range map[time.Duration]string{0: "0s", time.Second: "1s", 1500 * time.Millisecond: "1.5s",
		7*time.Second + time.Nanosecond: "7.000000001s", 250 * time.Millisecond: "0.25s", 90 * time.Second: "90s"} {
		if got := string(appendProtoDuration(nil, d)); got != want {
			t.Errorf("%v: %q, want %q", d, got, want)
		}
	}
}
