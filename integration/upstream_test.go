package integration_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// upstreamPolicy has two providers chosen by x-llm-provider, each with a breaker that judges
// six calls: half of them slow (first token after 300ms) or failed opens it.
const upstreamPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: steady
    rules: [{header: x-llm-provider}]
features:
  chat: {max_concurrent: 50}
  default: {max_concurrent: 10}
providers:
  steady: {breaker: watch}
  flaky: {breaker: watch}
breakers:
  watch:
    sliding_window_size: 6
    minimum_calls: 6
    failure_rate_threshold: 50
    slow_call_rate_threshold: 50
    slow_call_duration: 300ms
    wait_in_open: 1m
`

// streamRequest is a streamed call of api to provider.
func streamRequest(api, provider string) *envoysim.Request {
	req := &envoysim.Request{
		Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: "chat"},
			{Key: "x-llm-provider", Value: provider}},
		Body: []byte(`{"model":"m","max_tokens":8,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello there"}]}`),
	}
	switch api {
	case "anthropic":
		req.Path = "/v1/messages"
		req.Body = []byte(`{"model":"claude","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hello there"}]}`)
	case "azure":
		req.Path = "/openai/deployments/prod/chat/completions?api-version=2024-10-21"
		req.Body = []byte(`{"max_tokens":8,"stream":true,"messages":[{"role":"user","content":"hello there"}]}`)
	case "gemini", "gemini-array", "gemini-json":
		req.Path = map[string]string{"gemini": "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
			"gemini-array": "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
			"gemini-json":  "/v1beta/models/gemini-2.5-flash:generateContent"}[api]
		req.Body = []byte(geminiChat)
	case "bedrock":
		req.Path = bedrockClaude + "/converse-stream"
		req.Body = []byte(converseChat)
	case "bedrock-invoke":
		req.Path = bedrockClaude + "/invoke-with-response-stream"
		req.Body = []byte(invokeChat)
	}
	return req
}

// doConcurrently sends n copies of req at once and returns their statuses.
func doConcurrently(t *testing.T, s *harness.Stack, n int, req func() *envoysim.Request) []int {
	t.Helper()
	statuses := make([]int, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			r, err := s.Do(context.Background(), req())
			if err != nil {
				t.Error(err)
				return
			}
			statuses[i] = r.Status
		})
	}
	wg.Wait()
	return statuses
}

// histogram returns the sample count and sum of the series of histogram name for provider, and
// its cumulative count at the bucket bound le.
func histogram(t *testing.T, s *harness.Stack, name, provider string, le float64) (count uint64, sum float64, below uint64) {
	t.Helper()
	mfs, err := s.App.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() != "provider" || l.GetValue() != provider {
					continue
				}
				h := m.GetHistogram()
				for _, b := range h.GetBucket() {
					if b.GetUpperBound() == le {
						below = b.GetCumulativeCount()
					}
				}
				return h.GetSampleCount(), h.GetSampleSum(), below
			}
		}
	}
	return 0, 0, 0
}

// TestSlowFirstTokenOpensBreaker: a provider that answers 200 at once and sends its first
// token after slow_call_duration is slow — its breaker opens on the slow-call rate — while the
// time to its response headers stays fast. A provider whose tokens come at once stays closed.
func TestSlowFirstTokenOpensBreaker(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, upstreamPolicy), Mock: mock.Options{TimeScale: 0.01}})
	// 50s scaled by 0.01: the first token comes half a second after the headers.
	if err := s.Mock.SetFaults([]mock.FaultRule{{Provider: "flaky", Fault: mock.Fault{FirstTokenDelay: mock.Duration(50 * time.Second)}}}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"flaky", "steady"} {
		for i, st := range doConcurrently(t, s, 6, func() *envoysim.Request { return streamRequest("openai", p) }) {
			if st != 200 {
				t.Fatalf("%s call %d: status %d", p, i, st)
			}
		}
	}
	if st := breakerState(t, s, "flaky"); st != "OPEN" {
		t.Errorf("flaky breaker %s, want OPEN on slow first tokens", st)
	}
	if n := metricSum(t, s, "llm_bulkhead_breaker_calls_total", "breaker", "flaky", "kind", "slow_success"); n != 6 {
		t.Errorf("flaky slow successes %v, want 6", n)
	}
	if st := breakerState(t, s, "steady"); st != "CLOSED" {
		t.Errorf("steady breaker %s", st)
	}
	if n := metricSum(t, s, "llm_bulkhead_breaker_calls_total", "breaker", "steady", "kind", "slow_success"); n != 0 {
		t.Errorf("steady slow successes %v, want 0", n)
	}

	// The headers were fast, the first token was not.
	if n, _, fast := histogram(t, s, "llm_bulkhead_upstream_headers_seconds", "flaky", 0.25); n != 6 || fast != 6 {
		t.Errorf("flaky headers: %d samples, %d under 250ms; want 6 and 6", n, fast)
	}
	if n, sum, fast := histogram(t, s, "llm_bulkhead_upstream_first_token_seconds", "flaky", 0.25); n != 6 || fast != 0 || sum < 6*0.45 {
		t.Errorf("flaky first token: %d samples, %d under 250ms, sum %.2fs; want 6, 0, ≥ 2.7s", n, fast, sum)
	}
	if n, _, fast := histogram(t, s, "llm_bulkhead_upstream_first_token_seconds", "steady", 0.25); n != 6 || fast != 6 {
		t.Errorf("steady first token: %d samples, %d under 250ms; want 6 and 6", n, fast)
	}
	if n, _, _ := histogram(t, s, "llm_bulkhead_upstream_duration_seconds", "flaky", 0.25); n != 6 {
		t.Errorf("flaky total: %d samples, want 6", n)
	}
	if n := metricSum(t, s, "llm_bulkhead_upstream_responses_total", "provider", "flaky", "class", "2xx"); n != 6 {
		t.Errorf("flaky 2xx responses %v, want 6", n)
	}
}

// TestStreamErrorsOpenBreaker: a provider that answers 200 and then streams an overloaded
// error (OpenAI's and Azure's error chunk, Anthropic's error event, Google's error object in
// SSE, in a streamed JSON array or as a whole body, an AWS exception in Bedrock's event
// stream) fails its calls and its breaker opens; rate-limit errors count like a 429, neutral
// by default, and leave it closed.
func TestStreamErrorsOpenBreaker(t *testing.T) {
	tests := []struct {
		name     string
		api      string
		status   int
		wantOpen bool
	}{
		{"openai overloaded", "openai", 503, true},
		{"anthropic overloaded", "anthropic", 529, true},
		{"openai rate limited", "openai", 429, false},
		{"anthropic rate limited", "anthropic", 429, false},
		{"azure overloaded", "azure", 503, true},
		{"azure rate limited", "azure", 429, false},
		{"gemini sse overloaded", "gemini", 503, true},
		{"gemini sse rate limited", "gemini", 429, false},
		{"gemini array overloaded", "gemini-array", 500, true},
		{"gemini array rate limited", "gemini-array", 429, false},
		{"gemini json overloaded", "gemini-json", 503, true},
		{"bedrock converse overloaded", "bedrock", 503, true},
		{"bedrock converse throttled", "bedrock", 429, false},
		{"bedrock invoke failed", "bedrock-invoke", 500, true},
		{"bedrock invoke throttled", "bedrock-invoke", 429, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := start(t, harness.Options{PolicyPath: writePolicy(t, upstreamPolicy), Mock: mock.Options{TimeScale: 0.001}})
			if err := s.Mock.SetFaults([]mock.FaultRule{{Provider: "flaky", Fault: mock.Fault{StreamError: tt.status}}}); err != nil {
				t.Fatal(err)
			}
			for i, st := range doConcurrently(t, s, 6, func() *envoysim.Request { return streamRequest(tt.api, "flaky") }) {
				if st != 200 {
					t.Fatalf("call %d: status %d, want the provider's 200", i, st)
				}
			}
			want, failures := "CLOSED", 0.0
			if tt.wantOpen {
				want, failures = "OPEN", 6
			}
			if st := breakerState(t, s, "flaky"); st != want {
				t.Errorf("flaky breaker %s, want %s", st, want)
			}
			if n := metricSum(t, s, "llm_bulkhead_breaker_calls_total", "breaker", "flaky", "kind", "failure"); n != failures {
				t.Errorf("flaky failures %v, want %v", n, failures)
			}
			if !tt.wantOpen {
				if n := metricSum(t, s, "llm_bulkhead_breaker_calls_total", "breaker", "flaky", "kind", "success"); n != 6 {
					t.Errorf("flaky successes %v, want 6 (a rate limit is neutral)", n)
				}
			}
		})
	}
}

// TestStreamErrorIgnoredByPolicy: a breaker that lists stream_error under ignore records
// nothing for error events inside 200 responses.
func TestStreamErrorIgnoredByPolicy(t *testing.T) {
	policy := upstreamPolicy + "    ignore: [4xx, stream_error]\n"
	s := start(t, harness.Options{PolicyPath: writePolicy(t, policy), Mock: mock.Options{TimeScale: 0.001}})
	if err := s.Mock.SetFaults([]mock.FaultRule{{Provider: "flaky", Fault: mock.Fault{StreamError: 529}}}); err != nil {
		t.Fatal(err)
	}
	doConcurrently(t, s, 6, func() *envoysim.Request { return streamRequest("anthropic", "flaky") })
	if st := breakerState(t, s, "flaky"); st != "CLOSED" {
		t.Errorf("flaky breaker %s, want CLOSED", st)
	}
	if n := metricSum(t, s, "llm_bulkhead_breaker_calls_total", "breaker", "flaky", "kind", "ignored"); n != 6 {
		t.Errorf("flaky ignored calls %v, want 6", n)
	}
}
