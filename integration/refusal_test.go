package integration_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	anthropicoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// manualClock is the server's clock in tests that step time.
type manualClock struct {
	mu  sync.Mutex
	now time.Time
}

func newManualClock() *manualClock {
	return &manualClock{now: time.Date(2026, 6, 1, 10, 0, 0, 0, time.UTC)}
}

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *manualClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func batchRequest(tenant string, promptBytes, maxTokens int) *envoysim.Request {
	return &envoysim.Request{
		Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: "batch_summarize"},
			{Key: "x-tenant-id", Value: tenant}},
		Body: []byte(fmt.Sprintf(`{"model":"qwen-max","max_tokens":%d,"messages":[{"role":"user","content":"%s"}]}`, maxTokens, strings.Repeat("a", promptBytes))),
	}
}

func backgroundRequest(tenant string) *envoysim.Request {
	r := batchRequest(tenant, 18000, 500)
	r.Headers[1] = envoysim.Header{Key: "x-llm-feature", Value: "background_analysis"}
	return r
}

// TestBudgetRetryAfterIsHonest: background_analysis's 20 000 tokens a minute hold a storm of
// 5 000-token requests to four a minute, and a refusal's retry-after is when the next request
// is really admitted (± 1 s). Chat is untouched.
func TestBudgetRetryAfterIsHonest(t *testing.T) {
	clk := newManualClock()
	s := start(t, harness.Options{Clock: clk, Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()
	// 5 000-token requests: 18 000 prompt bytes ≈ 4 500 tokens + 500 max_tokens.
	for i := 0; i < 4; i++ {
		r, err := s.Do(ctx, backgroundRequest("acme"))
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != 200 {
			t.Fatalf("request %d: %d %s", i, r.Status, r.Body)
		}
		clk.Advance(time.Second)
	}
	r, err := s.Do(ctx, backgroundRequest("acme"))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 429 || header(r, "x-bulkhead-reason") != "token_budget" || header(r, "x-bulkhead-compartment") != "feature/background_analysis" {
		t.Fatalf("5th: %d %v %s", r.Status, r.Headers, r.Body)
	}
	retry, _ := strconv.Atoi(header(r, "retry-after"))
	if retry < 1 {
		t.Fatalf("retry-after %q", header(r, "retry-after"))
	}
	// One second before retry-after: still refused. At retry-after: admitted.
	clk.Advance(time.Duration(retry-1)*time.Second - 500*time.Millisecond)
	if r, _ := s.Do(ctx, backgroundRequest("acme")); r.Status != 429 {
		t.Errorf("admitted 1s before the retry-after of %ds", retry)
	}
	clk.Advance(1500 * time.Millisecond)
	if r, _ := s.Do(ctx, backgroundRequest("acme")); r.Status != 200 {
		t.Errorf("still refused at retry-after %ds: %d %s", retry, r.Status, r.Body)
	}
	// Chat is untouched by the other feature's budget.
	chat := chatRequest("chat")
	chat.Headers = append(chat.Headers, envoysim.Header{Key: "x-tenant-id", Value: "acme"})
	if r, _ := s.Do(ctx, chat); r.Status != 200 {
		t.Errorf("chat refused during the storm: %d %s", r.Status, r.Body)
	}
}

// TestDegradeToLocal: with the example policy, batch_summarize over its 50 000 tokens a minute
// on paid providers is not refused but re-routed to the local model.
func TestDegradeToLocal(t *testing.T) {
	clk := newManualClock()
	s := start(t, harness.Options{Clock: clk, Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()
	doc := func() *envoysim.Request {
		r := batchRequest("acme", 18000, 500)
		r.Body = []byte(strings.Replace(string(r.Body), `"qwen-max"`, `"deepseek-chat"`, 1))
		return r
	}
	for i := 0; i < 10; i++ {
		r, err := s.Do(ctx, doc())
		if err != nil || r.Status != 200 || upstreamHeader(r, "x-llm-provider") != "deepseek" {
			t.Fatalf("document %d: %v %v", i, r, err)
		}
		clk.Advance(time.Second)
	}
	r, err := s.Do(ctx, doc())
	if err != nil || r.Status != 200 {
		t.Fatalf("11th: %v %v", r, err)
	}
	md := r.DynamicMetadata["llm_bulkhead"].GetFields()
	if upstreamHeader(r, "x-llm-provider") != "local" || md["decision"].GetStringValue() != "rerouted" || md["reason"].GetStringValue() != "token_budget" {
		t.Errorf("11th went to %q, metadata %v", upstreamHeader(r, "x-llm-provider"), md)
	}
}

const sdkPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  full: {max_concurrent: 1, max_wait: 0s}
  budget: {tokens_per_minute: 10, max_concurrent: 100}
  rate: {requests_per_minute: 60, max_concurrent: 100}
  default: {max_concurrent: 100}
`

// TestSDKErrorTypes: each refusal surfaces in the official OpenAI and Anthropic SDKs as the
// error their users already handle: status, type and our message.
func TestSDKErrorTypes(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, sdkPolicy), Mock: mock.Options{TimeScale: 0.01}})
	url, err := s.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// Use up the tiny token budget, and hold the only "full" slot.
	if r, err := s.Do(ctx, chatRequest("budget")); err != nil || r.Status != 200 {
		t.Fatalf("first budget request: %v %v", r, err)
	}
	g := newGate()
	hold(s, g, "full")
	defer func() { g.release <- struct{}{} }()

	tests := []struct {
		feature    string
		wantStatus int
		oaiType    string
		antType    string
		reason     string
	}{
		{"full", 503, "server_overloaded", "overloaded_error", "bulkhead_full"},
		{"budget", 429, "rate_limit_exceeded", "rate_limit_error", "token_budget"},
	}
	for _, tt := range tests {
		t.Run("openai/"+tt.feature, func(t *testing.T) {
			c := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(0), option.WithHeader("x-llm-feature", tt.feature))
			_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "gpt-4o", MaxTokens: openai.Int(50),
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there")}})
			var e *openai.Error
			if !errors.As(err, &e) {
				t.Fatalf("err %v", err)
			}
			if e.StatusCode != tt.wantStatus || e.Type != tt.oaiType || e.Code != tt.reason || e.Message == "" {
				t.Errorf("status %d type %q code %q message %q", e.StatusCode, e.Type, e.Code, e.Message)
			}
			if e.Response.Header.Get("x-bulkhead-reason") != tt.reason || e.Response.Header.Get("retry-after") == "" {
				t.Errorf("headers %v", e.Response.Header)
			}
		})
		t.Run("anthropic/"+tt.feature, func(t *testing.T) {
			c := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey("k"), anthropicoption.WithMaxRetries(0),
				anthropicoption.WithHeader("x-llm-feature", tt.feature))
			_, err := c.Messages.New(ctx, anthropic.MessageNewParams{Model: "claude-sonnet-4-5", MaxTokens: 50,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hello there"))}})
			var e *anthropic.Error
			if !errors.As(err, &e) {
				t.Fatalf("err %v", err)
			}
			want := tt.wantStatus
			if want == 503 {
				want = 529 // Anthropic's overloaded
			}
			if e.StatusCode != want || !strings.Contains(e.RawJSON(), `"type":"`+tt.antType+`"`) {
				t.Errorf("status %d body %s", e.StatusCode, e.RawJSON())
			}
		})
	}
}

// TestSDKRetryHonoursRetryAfter: the SDKs' own retry waits for our retry-after. With the only
// slot held and a slot held 2 s on average, a refusal says retry-after: 2; the SDK must not
// retry before then (its own backoff would retry after about half a second), and its retry
// after 2 s gets through: one refusal, one admission.
func TestSDKRetryHonoursRetryAfter(t *testing.T) {
	sdks := map[string]func(ctx context.Context, url string) error{
		"openai": func(ctx context.Context, url string) error {
			c := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("k"), option.WithMaxRetries(3), option.WithHeader("x-llm-feature", "full"))
			_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "gpt-4o", MaxTokens: openai.Int(5),
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
			return err
		},
		"anthropic": func(ctx context.Context, url string) error {
			c := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey("k"), anthropicoption.WithMaxRetries(3),
				anthropicoption.WithHeader("x-llm-feature", "full"))
			_, err := c.Messages.New(ctx, anthropic.MessageNewParams{Model: "claude-sonnet-4-5", MaxTokens: 5,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hi"))}})
			return err
		},
	}
	for name, call := range sdks {
		t.Run(name, func(t *testing.T) {
			clk := newManualClock()
			s := start(t, harness.Options{PolicyPath: writePolicy(t, sdkPolicy), Clock: clk, Mock: mock.Options{TimeScale: 0.01}})
			url, err := s.ProxyURL()
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			holdFull := func() *gate {
				g := newGate()
				hold(s, g, "full")
				return g
			}
			// Teach the compartment that a slot is held 2 s.
			g := holdFull()
			clk.Advance(2 * time.Second)
			g.release <- struct{}{}
			waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })

			g = holdFull()
			before := decisions(t, s, "full")
			done := make(chan error, 1)
			go func() { done <- call(ctx, url) }()
			waitFor(t, func() bool { return decisions(t, s, "full").rejected == before.rejected+1 })
			time.Sleep(1200 * time.Millisecond)
			if n := decisions(t, s, "full").rejected - before.rejected; n != 1 {
				t.Fatalf("%d refusals within 1.2 s: the SDK retried before retry-after", n)
			}
			g.release <- struct{}{}
			if err := <-done; err != nil {
				t.Fatalf("the SDK's retry did not get through: %v", err)
			}
			after := decisions(t, s, "full")
			if after.rejected-before.rejected != 1 || after.admitted-before.admitted != 1 {
				t.Errorf("refused %d, admitted %d; want 1 and 1 (the retry)", after.rejected-before.rejected, after.admitted-before.admitted)
			}
		})
	}
}

type featureCounts struct{ admitted, rejected uint64 }

func decisions(t *testing.T, s *harness.Stack, feature string) featureCounts {
	t.Helper()
	var out struct {
		Features []struct {
			Feature  string            `json:"feature"`
			Admitted uint64            `json:"admitted"`
			Rejected map[string]uint64 `json:"rejected"`
		} `json:"features"`
	}
	if err := s.Get("/admin/decisions", &out); err != nil {
		t.Fatal(err)
	}
	for _, f := range out.Features {
		if f.Feature == feature {
			var r uint64
			for _, n := range f.Rejected {
				r += n
			}
			return featureCounts{f.Admitted, r}
		}
	}
	return featureCounts{}
}

// TestSeedIncident: one tenant's batch export sends 60 concurrent batch_summarize requests;
// chat requests of that tenant and of others are admitted at once, never queued behind the
// batch, while the batch is held to its own compartments.
func TestSeedIncident(t *testing.T) {
	s := start(t, harness.Options{NoMock: true})
	ctx := context.Background()
	g := newGate()
	answer := envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		`{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":10,"total_tokens":20}}`)
	up := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		for _, h := range req.Headers {
			if h.Key == "x-bulkhead-feature" && h.Value == "batch_summarize" {
				return g.Serve(ctx, req)
			}
		}
		return answer.Serve(ctx, req)
	})
	batch := make(chan *envoysim.Result, 60)
	for i := 0; i < 60; i++ {
		go func() {
			r, err := s.Sim.RoundTrip(ctx, batchRequest("acme", 18000, 500), up)
			if err != nil {
				t.Error(err)
			}
			batch <- r
		}()
	}
	// The batch holds every slot it can get.
	for i := 0; i < 4; i++ {
		<-g.arrived
	}
	for _, tenant := range []string{"acme", "globex"} {
		for i := 0; i < 5; i++ {
			req := chatRequest("chat")
			req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: tenant})
			r, err := s.Sim.RoundTrip(ctx, req, up)
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != 200 {
				t.Fatalf("%s chat during the storm: %d %s", tenant, r.Status, r.Body)
			}
			for _, rec := range r.Exchange {
				if rec.Received != nil && rec.Received.GetOverrideMessageTimeout() != nil {
					t.Errorf("%s chat was queued during the batch storm", tenant)
				}
			}
		}
	}
	if extra := len(g.arrived); extra != 0 {
		t.Errorf("%d more batch requests reached the upstream: enterprise × batch_summarize allows 4 (30 × 0.15)", extra)
	}
	// Release the batch; count how it fared. The 50 000 tokens-per-minute budget pays for ten
	// 5 000-token requests and refuses the other fifty at once; of the ten, four ran and six
	// waited up to batch_summarize's 100 ms for a slot.
	refused := map[string]int{}
	admitted := 0
	for i := 0; i < 60; i++ {
		g.release <- struct{}{}
	}
	for i := 0; i < 60; i++ {
		r := <-batch
		if r.Status == 200 {
			admitted++
			continue
		}
		key := header(r, "x-bulkhead-reason") + " " + header(r, "x-bulkhead-compartment")
		if key == " " {
			key = fmt.Sprintf("status %d %s", r.Status, r.Body)
		}
		refused[key]++
	}
	// The paid-provider budget pays for ten documents; the rest degrade to the local model,
	// where the enterprise tier's batch share (75 000 tokens a minute, 4 slots) holds them.
	// Which request ends on which refusal depends on timing; that only batch compartments
	// refuse does not.
	total := admitted
	for k, v := range refused {
		reason, comp, _ := strings.Cut(k, " ")
		if (reason != "token_budget" && reason != "bulkhead_full") || !strings.Contains(comp, "batch_summarize") {
			t.Errorf("batch refused as %q ×%d", k, v)
		}
		total += v
	}
	if admitted < 4 || total != 60 {
		t.Errorf("batch: %d admitted, refused %v", admitted, refused)
	}
}
