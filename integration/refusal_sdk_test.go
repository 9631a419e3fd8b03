package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	anthropicoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// refusalSDKPolicy: "budget" refuses with a wait of about a minute once its 10 tokens are
// spent (above no_retry_above), "full" with a short predicted wait while its one slot is held.
const refusalSDKPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  full: {max_concurrent: 1, max_wait: 0s}
  budget: {tokens_per_minute: 10, max_concurrent: 100}
  default: {max_concurrent: 100}
refusals: {no_retry_above: 10s}
`

// startRefusalStack starts the stack with "budget" spent and returns the simulator's URL.
func startRefusalStack(t *testing.T) (*harness.Stack, string) {
	t.Helper()
	s := start(t, harness.Options{PolicyPath: writePolicy(t, refusalSDKPolicy), Mock: mock.Options{TimeScale: 0.01}})
	url, err := s.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	if r, err := s.Do(context.Background(), chatRequest("budget")); err != nil || r.Status != 200 {
		t.Fatalf("spending the budget: %v %v", r, err)
	}
	return s, url
}

// attempts counts the HTTP requests an SDK sends (each retry is one more) and keeps the last
// response's headers.
type attempts struct {
	n    atomic.Int32
	last atomic.Pointer[http.Header]
}

func (a *attempts) openai(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
	a.n.Add(1)
	res, err := next(req)
	if res != nil {
		h := res.Header.Clone()
		a.last.Store(&h)
	}
	return res, err
}

func (a *attempts) anthropic(req *http.Request, next anthropicoption.MiddlewareNext) (*http.Response, error) {
	a.n.Add(1)
	res, err := next(req)
	if res != nil {
		h := res.Header.Clone()
		a.last.Store(&h)
	}
	return res, err
}

// TestAnthropicSDKGetsTheRequestID: a refusal's request id reaches the Anthropic SDK's
// Error.RequestID (from the request-id header), and is the x-request-id Envoy gave the request,
// the body's request_id and the one the rate-limit headers come with.
func TestAnthropicSDKGetsTheRequestID(t *testing.T) {
	_, url := startRefusalStack(t)
	c := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey("k"), anthropicoption.WithMaxRetries(0),
		anthropicoption.WithHeader("x-llm-feature", "budget"))
	_, err := c.Messages.New(context.Background(), anthropic.MessageNewParams{Model: "claude-sonnet-4-5", MaxTokens: 50,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hello there"))}})
	var e *anthropic.Error
	if !errors.As(err, &e) {
		t.Fatalf("err %v", err)
	}
	var body struct {
		RequestID string `json:"request_id"`
	}
	if err := json.Unmarshal([]byte(e.RawJSON()), &body); err != nil {
		t.Fatal(err)
	}
	h := e.Response.Header
	if e.StatusCode != 429 || e.RequestID == "" || e.RequestID != h.Get("x-request-id") || body.RequestID != e.RequestID {
		t.Errorf("status %d RequestID %q x-request-id %q body %s", e.StatusCode, e.RequestID, h.Get("x-request-id"), e.RawJSON())
	}
	if h.Get("anthropic-ratelimit-tokens-limit") != "10" || h.Get("anthropic-ratelimit-tokens-remaining") == "" {
		t.Errorf("rate-limit headers %v", h)
	}
	if _, err := time.Parse(time.RFC3339, h.Get("anthropic-ratelimit-tokens-reset")); err != nil {
		t.Errorf("anthropic-ratelimit-tokens-reset %q: %v", h.Get("anthropic-ratelimit-tokens-reset"), err)
	}
}

// TestSDKsFailFastWhenToldNotToRetry: a refusal whose wait (about a minute) is above
// no_retry_above says x-should-retry: false, and both SDKs, with their default two retries,
// make one attempt and return the 429 at once instead of sleeping through retry-after.
func TestSDKsFailFastWhenToldNotToRetry(t *testing.T) {
	_, url := startRefusalStack(t)
	// A bound for a broken build, not a timing assertion: a retry would sleep about a minute.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	t.Run("openai", func(t *testing.T) {
		var a attempts
		c := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("k"), option.WithHeader("x-llm-feature", "budget"),
			option.WithMiddleware(a.openai))
		_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "gpt-4o", MaxTokens: openai.Int(50),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there")}})
		var e *openai.Error
		if !errors.As(err, &e) || e.StatusCode != 429 {
			t.Fatalf("err %v", err)
		}
		if n := a.n.Load(); n != 1 {
			t.Errorf("%d attempts, want 1", n)
		}
		h := e.Response.Header
		ms, _ := strconv.Atoi(h.Get("retry-after-ms"))
		if h.Get("x-should-retry") != "false" || ms <= 10000 || h.Get("x-ratelimit-limit-tokens") != "10" ||
			h.Get("x-ratelimit-reset-tokens") == "" || h.Get("x-request-id") == "" {
			t.Errorf("headers %v", h)
		}
		if id, ok := e.JSON.ExtraFields["request_id"]; !ok || id.Raw() != strconv.Quote(h.Get("x-request-id")) {
			t.Errorf("error body %s: request_id %v", e.RawJSON(), id)
		}
	})
	t.Run("anthropic", func(t *testing.T) {
		var a attempts
		c := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey("k"),
			anthropicoption.WithHeader("x-llm-feature", "budget"), anthropicoption.WithMiddleware(a.anthropic))
		_, err := c.Messages.New(ctx, anthropic.MessageNewParams{Model: "claude-sonnet-4-5", MaxTokens: 50,
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("hello there"))}})
		var e *anthropic.Error
		if !errors.As(err, &e) || e.StatusCode != 429 {
			t.Fatalf("err %v", err)
		}
		if n := a.n.Load(); n != 1 {
			t.Errorf("%d attempts, want 1", n)
		}
	})
}

// TestOpenAISDKRetriesAShortWait: a refusal whose wait is under no_retry_above has no
// x-should-retry, and openai-go retries it after retry-after-ms: the only "full" slot is held
// for the first attempt and freed before the retry, which gets through.
func TestOpenAISDKRetriesAShortWait(t *testing.T) {
	s, url := startRefusalStack(t)
	g := newGate()
	held := hold(s, g, "full")
	var a attempts
	first := true
	var refused http.Header
	mw := func(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
		res, err := a.openai(req, next)
		if first {
			first = false
			if res != nil {
				refused = res.Header.Clone()
			}
			// Free the slot before the SDK waits and retries.
			g.release <- struct{}{}
			<-held
			waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
		}
		return res, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("k"), option.WithHeader("x-llm-feature", "full"),
		option.WithMiddleware(mw))
	_, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "gpt-4o", MaxTokens: openai.Int(5),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
	if err != nil {
		t.Fatalf("the retry did not get through: %v", err)
	}
	if n := a.n.Load(); n != 2 {
		t.Errorf("%d attempts, want 2 (one refusal, one retry)", n)
	}
	if refused.Get("x-bulkhead-reason") != "bulkhead_full" || refused.Get("retry-after-ms") == "" || refused.Get("x-should-retry") != "" {
		t.Errorf("first response %v", refused)
	}
}
