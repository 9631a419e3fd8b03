package integration_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	anthropicoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy/money"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// spendSDKPolicy gives every tenant 1.00 a day. A gpt-4o request with max_tokens 10 000
// reserves 10 000 × 10.00 / 10⁶ = 0.10 plus its prompt; a claude-sonnet one with 8 000 reserves
// 0.12 plus its prompt.
const spendSDKPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  model:
    rules: [{body: model}]
prices:
  - {match: "gpt-4o", input_per_mtok: 2.50, output_per_mtok: 10.00, cached_input_per_mtok: 1.25}
  - {match: "claude-sonnet-*", input_per_mtok: 3.00, output_per_mtok: 15.00, cached_input_per_mtok: 0.30}
  - {match: default, input_per_mtok: 100, output_per_mtok: 100}
tiers:
  free: {spend_per_day: 1.00}
features:
  default: {max_concurrent: 100}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
`

type spendWindow struct {
	Budget   string  `json:"budget"`
	Period   string  `json:"period"`
	End      string  `json:"window_end"`
	ResetIn  int64   `json:"reset_in_seconds"`
	Limit    float64 `json:"limit"`
	Spent    float64 `json:"spent"`
	Reserved float64 `json:"reserved"`
}

// tenantSpend returns the tenant's day window from /admin/spend once nothing is reserved in
// it (the last response has been settled).
func tenantSpend(t *testing.T, s *harness.Stack, tenant string) spendWindow {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var out struct {
			Currency string        `json:"currency"`
			Budgets  []spendWindow `json:"budgets"`
		}
		if err := s.Get("/admin/spend", &out); err != nil {
			t.Fatal(err)
		}
		for _, b := range out.Budgets {
			if b.Budget == "tenant/"+tenant && b.Period == "day" && b.Reserved == 0 {
				return b
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("tenant/%s: no settled day window in %+v", tenant, out)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// cost is what tokens cost at prices per million (in millionths), rounded up as the server
// rounds.
func cost(t *testing.T, prices map[string]string, tok map[string]int64) spend.Micros {
	t.Helper()
	var sum int64
	for kind, n := range tok {
		p, err := money.ParseAmount(prices[kind])
		if err != nil {
			t.Fatal(err)
		}
		sum += n * int64(p)
	}
	return spend.Micros((sum + 999_999) / 1_000_000)
}

// checkSpendRefusal checks the headers of the refusal of a tenant's spend budget at the
// stack's clock (2026-06-01 10:00 UTC): the day resets at midnight UTC, 14 hours on.
func checkSpendRefusal(t *testing.T, h http.Header, tenant string) {
	t.Helper()
	for k, v := range map[string]string{
		"x-bulkhead-reason":      "spend_budget",
		"x-bulkhead-compartment": "tenant/" + tenant,
		"x-bulkhead-spend-reset": "2026-06-02T00:00:00Z",
		"retry-after":            "50400",
		"x-should-retry":         "false",
	} {
		if got := h.Get(k); got != v {
			t.Errorf("%s = %q, want %q", k, got, v)
		}
	}
}

// TestSpendBudgetWithSDKs: a tenant with 1.00 a day sends expensive requests through the
// official SDKs; each is reserved at its worst case and settled at the usage the response
// reported. The request whose worst case no longer fits is refused with 429 spend_budget, the
// reset time and a retry-after until midnight, and what was settled is within one request's
// cost of 1.00 — never above it. (The guarantee is one request's worst case; these requests use
// most of their max_tokens, so their real cost is close to it.)
func TestSpendBudgetWithSDKs(t *testing.T) {
	clk := newManualClock()
	// The streams carry 8 000 completion tokens each, 100 to an event: what is settled comes
	// from the usage event at the end, and 80 events a stream cross ext_proc as a streamed body
	// does, where one event a token (8 000) made this the slowest test of the suite.
	s := start(t, harness.Options{Clock: clk, PolicyPath: writePolicy(t, spendSDKPolicy), Mock: mock.Options{TimeScale: 0.001, ChunkTokens: 100}})
	url, err := s.ProxyURL()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const limit = spend.Micros(1_000_000)

	// run sends requests until one is refused; send returns the request's cost (as its
	// response reported it), or the refusal's headers.
	run := func(t *testing.T, tenant string, maxReserve, minReserve spend.Micros, send func() (spend.Micros, http.Header, error)) {
		var settled spend.Micros
		var last spend.Micros
		for i := 1; i <= 40; i++ {
			c, refusal, err := send()
			if err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
			if refusal != nil {
				// Refused at the right request: the worst case of this one no longer fits, that
				// of the one before still did.
				if settled+minReserve <= limit {
					t.Fatalf("request %d refused with %s spent: its worst case (at least %s) fits the 1.00", i, settled, minReserve)
				}
				checkSpendRefusal(t, refusal, tenant)
				w := tenantSpend(t, s, tenant)
				if spend.Micros(w.Spent*1e6+0.5) != settled {
					t.Fatalf("/admin/spend says %v spent, the responses %s", w.Spent, settled)
				}
				if settled > limit || limit-settled >= last {
					t.Fatalf("settled %s: not within one request's cost (%s) of 1.00", settled, last)
				}
				if w.Limit != 1 || w.ResetIn != 50400 || w.End != "2026-06-02T00:00:00Z" {
					t.Fatalf("window %+v", w)
				}
				return
			}
			if settled+maxReserve > limit {
				t.Fatalf("request %d admitted with %s spent and a worst case of up to %s", i, settled, maxReserve)
			}
			settled += c
			last = c
			if w := tenantSpend(t, s, tenant); spend.Micros(w.Spent*1e6+0.5) != settled {
				t.Fatalf("after request %d: /admin/spend says %v spent, the responses %s", i, w.Spent, settled)
			}
		}
		t.Fatal("never refused")
	}

	t.Run("openai streaming", func(t *testing.T) {
		var last http.Header
		c := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey("k"),
			option.WithHeader("x-tenant-id", "team-openai"), option.WithHeader(mock.HeaderCompletionTokens, "8000"),
			option.WithMiddleware(func(req *http.Request, next option.MiddlewareNext) (*http.Response, error) {
				res, err := next(req)
				if res != nil {
					last = res.Header.Clone()
				}
				return res, err
			}))
		prices := map[string]string{"input": "2.50", "output": "10.00"}
		// The worst case: 10 000 output tokens (0.10) and a prompt of a few tokens.
		run(t, "team-openai", 100_000+2_500, 100_000, func() (spend.Micros, http.Header, error) {
			stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{Model: "gpt-4o", MaxTokens: openai.Int(10_000),
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Summarise the quarter in one line.")}})
			var usage openai.CompletionUsage
			for stream.Next() {
				if ch := stream.Current(); ch.Usage.TotalTokens > 0 {
					usage = ch.Usage
				}
			}
			var e *openai.Error
			if err := stream.Err(); errors.As(err, &e) && e.StatusCode == 429 {
				return 0, last, nil
			} else if err != nil {
				return 0, nil, err
			}
			if usage.CompletionTokens != 8000 {
				return 0, nil, errors.New("no usage in the stream")
			}
			return cost(t, prices, map[string]int64{"input": usage.PromptTokens, "output": usage.CompletionTokens}), nil, nil
		})
	})

	t.Run("anthropic with cached prompt", func(t *testing.T) {
		c := anthropic.NewClient(anthropicoption.WithBaseURL(url), anthropicoption.WithAPIKey("k"),
			anthropicoption.WithHeader("x-tenant-id", "team-anthropic"), anthropicoption.WithHeader(mock.HeaderCompletionTokens, "7000"),
			anthropicoption.WithHeader(mock.HeaderCachedTokens, "600"))
		prompt := strings.Repeat("The quarterly numbers are in the attached report. ", 60)
		prices := map[string]string{"input": "3.00", "cached": "0.30", "output": "15.00"}
		// The worst case: 8 000 output tokens (0.12) and a prompt of some 750 tokens.
		run(t, "team-anthropic", 120_000+6_000, 120_000, func() (spend.Micros, http.Header, error) {
			m, err := c.Messages.New(ctx, anthropic.MessageNewParams{Model: "claude-sonnet-4-5", MaxTokens: 8000,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(prompt))}})
			var e *anthropic.Error
			if errors.As(err, &e) && e.StatusCode == 429 {
				if !strings.Contains(e.RawJSON(), `"rate_limit_error"`) || !strings.Contains(e.RawJSON(), "Spend budget of tenant/team-anthropic") {
					t.Errorf("error body %s", e.RawJSON())
				}
				return 0, e.Response.Header, nil
			} else if err != nil {
				return 0, nil, err
			}
			if m.Usage.CacheReadInputTokens != 600 || m.Usage.OutputTokens != 7000 {
				return 0, nil, errors.New("unexpected usage")
			}
			return cost(t, prices, map[string]int64{"input": m.Usage.InputTokens, "cached": m.Usage.CacheReadInputTokens, "output": m.Usage.OutputTokens}), nil, nil
		})
	})

	// The next day both tenants have their 1.00 again.
	clk.Advance(14 * time.Hour)
	w := tenantSpend(t, s, "team-openai")
	if w.Spent != 0 || w.End != "2026-06-03T00:00:00Z" {
		t.Fatalf("the next day: %+v", w)
	}
}
