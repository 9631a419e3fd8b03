package extproc

import (
	"encoding/json"
	"math"
	"regexp"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// replyHeaders returns an immediate reply's headers by name, failing on a name set twice.
func replyHeaders(t *testing.T, resp *extprocv3.ProcessingResponse) (int, map[string]string, []byte) {
	t.Helper()
	ir := resp.GetImmediateResponse()
	if ir == nil {
		t.Fatalf("not an immediate response: %v", resp)
	}
	h := map[string]string{}
	for _, o := range ir.Headers.SetHeaders {
		k := o.Header.Key
		if _, dup := h[k]; dup {
			t.Errorf("header %s set twice", k)
		}
		h[k] = string(o.Header.RawValue)
	}
	return int(ir.Status.Code), h, ir.Body
}

var refusedAt = time.Date(2026, 6, 1, 10, 0, 0, 0, time.UTC)

func budgetRefusal() policy.Decision {
	return policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonTokenBudget, Compartment: "tenant/acme",
		RetryAfter: 1500 * time.Millisecond,
		Limits: policy.RefusalLimits{HasTokens: true,
			Tokens: policy.RateWindow{Limit: 20000, Remaining: 1200, Reset: 6 * time.Minute}}}
}

func TestOpenAIRefusalCarriesRateLimitsRetryAndRequestID(t *testing.T) {
	r := refusal{requestID: "req-42", now: refusedAt, noRetryAbove: 10 * time.Second, rateLimitHeaders: true}
	status, h, body := replyHeaders(t, immediateReply(budgetRefusal(), llmapi.DialectOpenAI, r))
	want := map[string]string{
		"content-type":                 "application/json",
		"x-bulkhead-reason":            "token_budget",
		"x-bulkhead-compartment":       "tenant/acme",
		"retry-after":                  "2",
		"retry-after-ms":               "1500",
		"x-request-id":                 "req-42",
		"x-ratelimit-limit-tokens":     "20000",
		"x-ratelimit-remaining-tokens": "1200",
		"x-ratelimit-reset-tokens":     "6m0s",
	}
	if status != 429 {
		t.Errorf("status %d", status)
	}
	for k, v := range want {
		if h[k] != v {
			t.Errorf("%s = %q, want %q", k, h[k], v)
		}
	}
	if len(h) != len(want) {
		t.Errorf("headers %v, want exactly %v (no request headers for a token refusal, no x-should-retry under the bound, no Anthropic names)", h, want)
	}
	var raw map[string]map[string]any
	if err := json.Unmarshal(body, &raw); err != nil {
		t.Fatalf("body %s: %v", body, err)
	}
	got := raw["error"]
	if got["type"] != "rate_limit_exceeded" || got["code"] != "token_budget" || got["request_id"] != "req-42" || got["param"] != nil || got["message"] == "" {
		t.Errorf("body %s", body)
	}
}

func TestAnthropicRefusalUsesAnthropicNames(t *testing.T) {
	d := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonRateLimit, Compartment: "tenant/acme", RetryAfter: 120 * time.Millisecond,
		Limits: policy.RefusalLimits{HasRequests: true, Requests: policy.RateWindow{Limit: 60, Remaining: 0, Reset: 59*time.Second + 300*time.Millisecond}}}
	r := refusal{requestID: "7f1c", now: refusedAt.Add(200 * time.Millisecond), noRetryAbove: 10 * time.Second, rateLimitHeaders: true}
	status, h, body := replyHeaders(t, immediateReply(d, llmapi.DialectAnthropic, r))
	want := map[string]string{
		"retry-after":                            "1",
		"retry-after-ms":                         "120",
		"x-request-id":                           "7f1c",
		"request-id":                             "7f1c",
		"anthropic-ratelimit-requests-limit":     "60",
		"anthropic-ratelimit-requests-remaining": "0",
		// 10:00:00.2 + 59.3 s = 10:00:59.5, rounded up to the second.
		"anthropic-ratelimit-requests-reset": "2026-06-01T10:01:00Z",
	}
	if status != 429 {
		t.Errorf("status %d", status)
	}
	for k, v := range want {
		if h[k] != v {
			t.Errorf("%s = %q, want %q", k, h[k], v)
		}
	}
	for k := range h {
		if regexp.MustCompile(`^x-ratelimit-|^anthropic-ratelimit-tokens-|^x-should-retry$`).MatchString(k) {
			t.Errorf("unexpected header %s: %s", k, h[k])
		}
	}
	var e struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
		RequestID string `json:"request_id"`
	}
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("body %s: %v", body, err)
	}
	if e.Type != "error" || e.Error.Type != "rate_limit_error" || e.Error.Message == "" || e.RequestID != "7f1c" {
		t.Errorf("body %s", body)
	}
}

func TestShouldRetryFalseAboveTheBound(t *testing.T) {
	tests := []struct {
		retry, bound time.Duration
		want         bool
	}{
		{30 * time.Second, 10 * time.Second, true},
		{10 * time.Second, 10 * time.Second, false},
		{10*time.Second + time.Millisecond, 10 * time.Second, true},
		{2 * time.Second, 10 * time.Second, false},
		{time.Hour, 0, false},             // 0: never
		{0, 500 * time.Millisecond, true}, // an unknown wait is 1000 ms, as retry-after's floor says
	}
	for _, tt := range tests {
		d := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBulkheadFull, Compartment: "feature/chat", RetryAfter: tt.retry}
		status, h, _ := replyHeaders(t, immediateReply(d, llmapi.DialectOpenAI, refusal{requestID: "x", noRetryAbove: tt.bound}))
		_, got := h["x-should-retry"]
		if got != tt.want || (got && h["x-should-retry"] != "false") {
			t.Errorf("retry %s bound %s: x-should-retry %q, want set %v", tt.retry, tt.bound, h["x-should-retry"], tt.want)
		}
		if status != 503 {
			t.Errorf("status %d", status)
		}
	}
}

func TestRateLimitHeadersOnlyOn429sAndWhenEnabled(t *testing.T) {
	d := budgetRefusal()
	_, h, _ := replyHeaders(t, immediateReply(d, llmapi.DialectOpenAI, refusal{requestID: "x", rateLimitHeaders: false}))
	if _, ok := h["x-ratelimit-limit-tokens"]; ok {
		t.Errorf("rate-limit headers with refusals.ratelimit_headers off: %v", h)
	}
	// A 503 never carries them, whatever the decision holds.
	d.Reason = policy.ReasonBulkheadFull
	_, h, _ = replyHeaders(t, immediateReply(d, llmapi.DialectOpenAI, refusal{requestID: "x", rateLimitHeaders: true}))
	if _, ok := h["x-ratelimit-limit-tokens"]; ok {
		t.Errorf("rate-limit headers on a 503: %v", h)
	}
}

func TestBadRequestRefusalHasNoRetryHeaders(t *testing.T) {
	d := policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonBadRequest}
	status, h, body := replyHeaders(t, immediateReply(d, llmapi.DialectAnthropic, refusal{requestID: "id", noRetryAbove: time.Nanosecond, rateLimitHeaders: true}))
	for _, k := range []string{"retry-after", "retry-after-ms", "x-should-retry", "x-bulkhead-compartment"} {
		if _, ok := h[k]; ok {
			t.Errorf("bad_request has %s", k)
		}
	}
	if status != 400 || h["request-id"] != "id" || !json.Valid(body) {
		t.Errorf("status %d headers %v body %s", status, h, body)
	}
}

func TestRetryAfterMillis(t *testing.T) {
	for in, want := range map[time.Duration]int64{
		0:                         1000,
		-time.Second:              1000,
		time.Microsecond:          1,
		120 * time.Millisecond:    120,
		1500*time.Millisecond + 1: 1501,
		time.Minute:               60000,
	} {
		if got := retryAfterMillis(policy.Decision{RetryAfter: in}); got != want {
			t.Errorf("retryAfterMillis(%s) = %d, want %d", in, got, want)
		}
	}
}

func TestFormatResetTime(t *testing.T) {
	now := time.Date(2026, 6, 1, 10, 0, 0, 0, time.FixedZone("CEST", 2*3600))
	for reset, want := range map[time.Duration]string{
		0:                       "2026-06-01T08:00:00Z",
		time.Second:             "2026-06-01T08:00:01Z",
		1001 * time.Millisecond: "2026-06-01T08:00:02Z",
		24 * time.Hour:          "2026-06-02T08:00:00Z",
	} {
		if got := formatResetTime(now, reset); got != want {
			t.Errorf("formatResetTime(+%s) = %s, want %s", reset, got, want)
		}
	}
}

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestRefusalRequestID(t *testing.T) {
	if got := refusalRequestID("3c9a2f6e-envoy"); got != "3c9a2f6e-envoy" {
		t.Errorf("Envoy's id replaced: %q", got)
	}
	seen := map[string]bool{}
	for _, bad := range []string{"", "with space", "line\nbreak", "ünïcode", string(make([]byte, 201))} {
		got := refusalRequestID(bad)
		if !uuidRE.MatchString(got) || seen[got] {
			t.Errorf("refusalRequestID(%q) = %q, want a fresh UUID", bad, got)
		}
		seen[got] = true
	}
}

// BenchmarkRefusalRequestID: the id made for a refused request Envoy sent without one.
func BenchmarkRefusalRequestID(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		_ = refusalRequestID("")
	}
}

// FuzzRefusalRequestID: whatever Envoy sent, the id sent back is a valid header value that
// also passes through unchanged when it already was one.
func FuzzRefusalRequestID(f *testing.F) {
	for _, s := range []string{"", "abc", "a b", "\x00", "req_01", "\xff\xfe"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := refusalRequestID(s)
		if !validRequestID(got) {
			t.Fatalf("refusalRequestID(%q) = %q: not a header value", s, got)
		}
		if validRequestID(s) != (got == s) {
			t.Fatalf("refusalRequestID(%q) = %q", s, got)
		}
	})
}

// TestFormatReset pins the form of x-ratelimit-reset-tokens: OpenAI's, which is Go's Duration
// text at millisecond precision.
func TestFormatReset(t *testing.T) {
	for d, want := range map[time.Duration]string{
		0:                                 "0s",
		400 * time.Microsecond:            "0s",
		500 * time.Microsecond:            "1ms",
		250 * time.Millisecond:            "250ms",
		1500 * time.Millisecond:           "1.5s",
		time.Minute + 30*time.Millisecond: "1m0.03s",
		6 * time.Minute:                   "6m0s",
		25*time.Hour + 61*time.Second:     "25h1m1s",
		-1500 * time.Millisecond:          "-1.5s",
	} {
		if got := formatReset(d); got != want {
			t.Errorf("formatReset(%v) = %q, want %q", d, got, want)
		}
	}
}

// TestAppendResetDoesNotAllocate: the reset header of an admitted response is formatted into
// the stream's reply memory, with no allocation for the text (the standard library's, built
// on the stack).
func TestAppendResetDoesNotAllocate(t *testing.T) {
	var m replyMem
	var h *corev3.HeaderValueOption
	allocs := testing.AllocsPerRun(100, func() {
		m.begin()
		h = m.setReset(HeaderResetTokens, 90*time.Second+250*time.Millisecond)
	})
	if allocs != 0 {
		t.Errorf("setReset allocates %v times", allocs)
	}
	if got := string(h.GetHeader().GetRawValue()); got != "1m30.25s" {
		t.Errorf("%s = %q, want 1m30.25s", HeaderResetTokens, got)
	}
}

// FuzzAppendReset checks the formatting into a buffer against formatReset, for every duration,
// including the extremes Round saturates at.
func FuzzAppendReset(f *testing.F) {
	for _, d := range []int64{0, 1, 999, 1000, 1500, 999_999, 1_000_000, 1_234_567, 59_999_999_999,
		3_600_000_000_000, -1, -1_500_000_000, math.MaxInt64, math.MinInt64} {
		f.Add(d)
	}
	f.Fuzz(func(t *testing.T, n int64) {
		d := time.Duration(n)
		want := d.Round(time.Millisecond).String()
		if got := string(appendReset([]byte("x"), d)); got != "x"+want {
			t.Fatalf("appendReset(%d) = %q, want %q", n, got[1:], want)
		}
	})
}
