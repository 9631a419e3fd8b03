package integration_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// usagePolicy gives every request a per-minute budget so what each request settled to can be
// read back from the budget, even when the stream ended without a final reply.
const usagePolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
features:
  default: {max_concurrent: 100, tokens_per_minute: 100000000}
`

type apiCase struct {
	name   string
	path   string
	body   func(stream bool) string
	stream bool // the API supports streaming
	// streamPath, when set, is the path of the streamed call: Gemini and Bedrock name a
	// streaming method in the path, not in the body.
	streamPath string
	// onlyStream: the path streams whatever the body says (Gemini's streamGenerateContent
	// without alt=sse, a streamed JSON array).
	onlyStream bool
}

// pathFor is the path of a call, streamed or not.
func (a apiCase) pathFor(stream bool) string {
	if stream && a.streamPath != "" {
		return a.streamPath
	}
	return a.path
}

const (
	geminiChat    = `{"contents":[{"role":"user","parts":[{"text":"Why do ships have bulkheads? Keep it short."}]}],"systemInstruction":{"parts":[{"text":"Be brief."}]},"generationConfig":{"maxOutputTokens":14}}`
	converseChat  = `{"messages":[{"role":"user","content":[{"text":"Why do ships have bulkheads?"}]}],"system":[{"text":"Be brief."}],"inferenceConfig":{"maxTokens":10}}`
	invokeChat    = `{"anthropic_version":"bedrock-2023-05-31","max_tokens":8,"system":"Be brief.","messages":[{"role":"user","content":"Why do ships have bulkheads?"}]}`
	bedrockClaude = "/model/anthropic.claude-3-5-haiku-20241022-v1%3A0"
)

var apis = []apiCase{
	{name: "openai.chat", path: "/v1/chat/completions", body: func(s bool) string {
		return fmt.Sprintf(`{"model":"gpt-4o-mini","stream":%v,"max_tokens":12,"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Summarise the incident of the batch export that filled the pool."}]}`, s)
	}, stream: true},
	{name: "openai.completions", path: "/v1/completions", body: func(s bool) string {
		return fmt.Sprintf(`{"model":"gpt-3.5-turbo-instruct","stream":%v,"max_tokens":9,"prompt":"Once upon a time, a batch export"}`, s)
	}, stream: true},
	{name: "openai.embeddings", path: "/v1/embeddings", body: func(bool) string {
		return `{"model":"text-embedding-3-small","input":["bulkheads keep compartments apart","tokens are not requests"]}`
	}},
	{name: "openai.responses", path: "/v1/responses", body: func(s bool) string {
		return fmt.Sprintf(`{"model":"gpt-4o-mini","stream":%v,"max_output_tokens":11,"instructions":"Answer in one line.","input":"What is a bulkhead?"}`, s)
	}, stream: true},
	{name: "anthropic.messages", path: "/v1/messages", body: func(s bool) string {
		return fmt.Sprintf(`{"model":"claude-sonnet-4","stream":%v,"max_tokens":13,"system":"Be brief.","messages":[{"role":"user","content":[{"type":"text","text":"Why do ships have bulkheads?"}]}]}`, s)
	}, stream: true},
	{name: "azure.deployment.chat", path: "/openai/deployments/prod-gpt-4o/chat/completions?api-version=2024-10-21", body: func(s bool) string {
		return fmt.Sprintf(`{"stream":%v,"max_tokens":12,"messages":[{"role":"user","content":"Summarise the incident of the batch export."}]}`, s)
	}, stream: true},
	{name: "azure.v1.completions", path: "/openai/v1/completions", body: func(s bool) string {
		return fmt.Sprintf(`{"model":"gpt-35-turbo-instruct","stream":%v,"max_tokens":9,"prompt":["Once upon a time","a batch export"],"n":2}`, s)
	}, stream: true},
	{name: "gemini.generate_content", path: "/v1beta/models/gemini-2.5-flash:generateContent",
		streamPath: "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
		body:       func(bool) string { return geminiChat }, stream: true},
	{name: "gemini.stream_array", path: "/v1beta/models/gemini-2.5-pro:streamGenerateContent",
		body: func(bool) string { return geminiChat }, stream: true, onlyStream: true},
	{name: "gemini.embed_content", path: "/v1beta/models/text-embedding-004:embedContent", body: func(bool) string {
		return `{"content":{"parts":[{"text":"bulkheads keep compartments apart"}]}}`
	}},
	{name: "bedrock.converse", path: bedrockClaude + "/converse", streamPath: bedrockClaude + "/converse-stream",
		body: func(bool) string { return converseChat }, stream: true},
	{name: "bedrock.invoke", path: bedrockClaude + "/invoke", streamPath: bedrockClaude + "/invoke-with-response-stream",
		body: func(bool) string { return invokeChat }, stream: true},
}

func metadataNumber(t *testing.T, r *envoysim.Result, key string) float64 {
	t.Helper()
	md := r.DynamicMetadata["llm_bulkhead"]
	if md == nil {
		t.Fatalf("no llm_bulkhead dynamic metadata")
	}
	v := md.GetFields()[key]
	if v == nil {
		t.Fatalf("metadata has no %s: %v", key, md)
	}
	return v.GetNumberValue()
}

func mockHeader(t *testing.T, r *envoysim.Result, name string) int64 {
	t.Helper()
	v, err := strconv.ParseInt(header(r, name), 10, 64)
	if err != nil {
		t.Fatalf("response header %s = %q", name, header(r, name))
	}
	return v
}

func budgetUsed(t *testing.T, s *harness.Stack) int64 {
	t.Helper()
	c := compartment(t, s, "feature/default")
	for _, b := range c.Budgets {
		if b.Kind == "tokens_per_minute" {
			return b.Used
		}
	}
	t.Fatal("no budget")
	return 0
}

// TestUsageForEveryAPI: for every API we accept, JSON and SSE, a normal response settles to
// exactly the usage the provider reported; a stream the client cancels settles to a partial
// estimate (not zero, not the full estimate); an error settles to nothing.
func TestUsageForEveryAPI(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, usagePolicy), Mock: mock.Options{TimeScale: 0.01, Seed: 1, DefaultCompletionTokens: 40}})
	ctx := context.Background()
	for _, api := range apis {
		for _, stream := range []bool{false, true} {
			if (stream && !api.stream) || (!stream && api.onlyStream) {
				continue
			}
			mode := "json"
			if stream {
				mode = "sse"
			}
			req := func(extra ...envoysim.Header) *envoysim.Request {
				h := append(envoysim.Headers{{Key: "content-type", Value: "application/json"}}, extra...)
				return &envoysim.Request{Method: "POST", Path: api.pathFor(stream), Headers: h, Body: []byte(api.body(stream))}
			}
			t.Run(api.name+"/"+mode+"/normal", func(t *testing.T) {
				before := budgetUsed(t, s)
				r, err := s.Do(ctx, req())
				if err != nil {
					t.Fatal(err)
				}
				if r.Status != 200 {
					t.Fatalf("status %d: %s", r.Status, r.Body)
				}
				prompt, completion := mockHeader(t, r, "x-mockllm-prompt-tokens"), mockHeader(t, r, "x-mockllm-completion-tokens")
				if got := metadataNumber(t, r, "prompt_tokens"); int64(got) != prompt {
					t.Errorf("settled prompt %v, mockllm reported %d", got, prompt)
				}
				if got := metadataNumber(t, r, "completion_tokens"); int64(got) != completion {
					t.Errorf("settled completion %v, mockllm reported %d", got, completion)
				}
				if got := metadataNumber(t, r, "total_tokens"); int64(got) != prompt+completion {
					t.Errorf("settled total %v, want %d", got, prompt+completion)
				}
				if !r.DynamicMetadata["llm_bulkhead"].GetFields()["usage_reported"].GetBoolValue() {
					t.Error("usage_reported is false")
				}
				waitFor(t, func() bool { return budgetUsed(t, s)-before == prompt+completion })
			})
			t.Run(api.name+"/"+mode+"/error", func(t *testing.T) {
				before := budgetUsed(t, s)
				r, err := s.Do(ctx, req(envoysim.Header{Key: "x-mockllm-status", Value: "503"}))
				if err != nil {
					t.Fatal(err)
				}
				if r.Status != 503 {
					t.Fatalf("status %d", r.Status)
				}
				waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
				if used := budgetUsed(t, s) - before; used != 0 {
					t.Errorf("a failed request settled to %d tokens, want 0 (refunded)", used)
				}
			})
			if !stream {
				continue
			}
			t.Run(api.name+"/"+mode+"/cancelled", func(t *testing.T) {
				before := budgetUsed(t, s)
				// A long answer, so the client can leave in the middle of it however the
				// upstream's bytes are split into chunks.
				rq := req(envoysim.Header{Key: "x-mockllm-completion-tokens", Value: "3000"})
				rq.OnEvent = envoysim.CancelAfterDownstreamChunks(1)
				r, err := s.Do(ctx, rq)
				if err != nil && !strings.Contains(err.Error(), "cancel") {
					t.Fatal(err)
				}
				if r != nil && !r.Canceled {
					t.Fatalf("not cancelled: %d", r.Status)
				}
				waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
				used := budgetUsed(t, s) - before
				if used <= 0 {
					t.Errorf("a cancelled stream settled to %d tokens: the prompt was read and some output produced", used)
				}
			})
		}
	}
}

// TestIncludeUsageInjected: a streamed chat request without stream_options gets
// include_usage added on its way upstream (so its usage is reported), and nothing else in the
// body changes.
func TestIncludeUsageInjected(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, usagePolicy), Mock: mock.Options{TimeScale: 0.01}})
	body := `{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}],"temperature":0.25}`
	r, err := s.Do(context.Background(), &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(body)})
	if err != nil || r.Status != 200 {
		t.Fatalf("status %v, %v", r, err)
	}
	reqs := s.Mock.Requests()
	got := reqs[len(reqs)-1].Body
	if !strings.Contains(got, `"stream_options":{"include_usage":true}`) || !strings.Contains(got, `"temperature":0.25`) ||
		!strings.HasPrefix(got, `{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}]`) {
		t.Errorf("upstream body %s", got)
	}
	if int64(metadataNumber(t, r, "total_tokens")) != mockHeader(t, r, "x-mockllm-prompt-tokens")+mockHeader(t, r, "x-mockllm-completion-tokens") {
		t.Error("the injected include_usage did not make the stream's usage settle")
	}
	if h := reqs[len(reqs)-1].Header.Get("Accept-Encoding"); h != "" {
		t.Errorf("accept-encoding %q reached the upstream: a compressed response would hide usage", h)
	}
}

// TestGzipResponseUsage: when the policy lets accept-encoding through and the provider
// compresses, usage is still read, decoding the stream on the fly.
func TestGzipResponseUsage(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, usagePolicy+"body: {strip_accept_encoding: false}\n"), Mock: mock.Options{TimeScale: 0.01}})
	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"gpt-4o-mini","stream":%v,"max_tokens":30,"messages":[{"role":"user","content":"compress this answer"}]}`, stream)
		r, err := s.Do(context.Background(), &envoysim.Request{Method: "POST", Path: "/v1/chat/completions",
			Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "accept-encoding", Value: "gzip"}, {Key: "x-mockllm-gzip", Value: "1"}},
			Body:    []byte(body)})
		if err != nil || r.Status != 200 {
			t.Fatalf("%v %v", r, err)
		}
		if header(r, "content-encoding") != "gzip" {
			t.Fatalf("the response was not compressed: %v", r.Headers)
		}
		want := mockHeader(t, r, "x-mockllm-prompt-tokens") + mockHeader(t, r, "x-mockllm-completion-tokens")
		if got := int64(metadataNumber(t, r, "total_tokens")); got != want {
			t.Errorf("stream=%v: settled %d from a gzip body, mockllm reported %d", stream, got, want)
		}
	}
}

// TestRateLimitHeaders: admitted responses tell the client its compartments and the tightest
// token budget left, as OpenAI's own headers do.
func TestRateLimitHeaders(t *testing.T) {
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.01}})
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "globex"})
	r, err := s.Do(context.Background(), req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	// globex is pro: tier_feature/pro/chat has 150 000 × 0.4 = 60 000 tokens a minute, the
	// tightest of its budgets.
	left, err := strconv.ParseInt(header(r, "x-ratelimit-remaining-tokens"), 10, 64)
	if err != nil || left <= 0 || left >= 60000 {
		t.Errorf("x-ratelimit-remaining-tokens %q", header(r, "x-ratelimit-remaining-tokens"))
	}
	if header(r, "x-ratelimit-reset-tokens") == "" || !strings.Contains(header(r, "x-bulkhead-compartment"), "tier_feature/pro/chat") {
		t.Errorf("headers %v", r.Headers)
	}
}
