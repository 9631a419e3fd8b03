package mock

import (
	"strconv"
	"sync"
	"testing"
	"time"
)

// TestRequestQuota: a provider with a quota of 2 requests a window answers the first two with
// what is left in its API's headers, the third with 429 and retry-after; a provider without a
// quota sends no such headers; Anthropic's Messages API says it in its own headers.
func TestRequestQuota(t *testing.T) {
	_, url, client := startServer(t, Options{TimeScale: 1, Quotas: map[string]RequestQuota{"openai": {Limit: 2, Window: time.Hour}, "anthropic": {Limit: 1, Window: time.Hour}}})
	chat := `{"model":"gpt-4o","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
	for i, want := range []string{"1", "0"} {
		resp, _, _ := call(t, client, "POST", url+"/v1/chat/completions", chat, map[string]string{ProviderHeader: "openai"})
		h := resp.Header
		if resp.StatusCode != 200 || h.Get("x-ratelimit-limit-requests") != "2" || h.Get("x-ratelimit-remaining-requests") != want {
			t.Fatalf("request %d: %d, headers %v", i+1, resp.StatusCode, h)
		}
		if d, err := time.ParseDuration(h.Get("x-ratelimit-reset-requests")); err != nil || d <= 0 || d > time.Hour {
			t.Fatalf("request %d: reset %q", i+1, h.Get("x-ratelimit-reset-requests"))
		}
	}
	resp, body, _ := call(t, client, "POST", url+"/v1/chat/completions", chat, map[string]string{ProviderHeader: "openai"})
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != 429 || resp.Header.Get("x-ratelimit-remaining-requests") != "0" || ra < 3500 {
		t.Fatalf("beyond the quota: %d, retry-after %q, body %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	resp, _, _ = call(t, client, "POST", url+"/v1/chat/completions", chat, map[string]string{ProviderHeader: "other"})
	if resp.StatusCode != 200 || resp.Header.Get("x-ratelimit-remaining-requests") != "" {
		t.Fatalf("a provider without a quota: %d, %v", resp.StatusCode, resp.Header)
	}

	msg := `{"model":"claude-sonnet-4-5","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
	resp, _, _ = call(t, client, "POST", url+"/v1/messages", msg, map[string]string{ProviderHeader: "anthropic", HeaderRateLimitMalformed: "false"})
	at, err := time.Parse(time.RFC3339Nano, resp.Header.Get("anthropic-ratelimit-requests-reset"))
	if resp.StatusCode != 200 || resp.Header.Get("anthropic-ratelimit-requests-remaining") != "0" || err != nil || time.Until(at) <= 0 {
		t.Fatalf("anthropic: %d, %v", resp.StatusCode, resp.Header)
	}
	resp, _, _ = call(t, client, "POST", url+"/v1/messages", msg, map[string]string{ProviderHeader: "anthropic", HeaderRateLimitMalformed: "true"})
	if resp.StatusCode != 429 || resp.Header.Get("anthropic-ratelimit-requests-remaining") != "plenty" {
		t.Fatalf("anthropic, malformed: %d, %v", resp.StatusCode, resp.Header)
	}
	if _, err := New(Options{Quotas: map[string]RequestQuota{"x": {Limit: 0, Window: time.Second}}}); err == nil {
		t.Fatal("a quota of 0 requests was accepted")
	}
}

// TestTokenQuotaRefillsAtReset: with a quota of 5 requests and 100 tokens a window, two
// requests of 50 tokens (1 prompt, 49 completion) use up the tokens: the third is refused
// 429 while requests are left, and takes nothing. The headers count both quotas down and say
// when the window resets, by the quota clock; once that instant passes, the quota is full again.
// Anthropic's Messages API says the same in its own headers, its reset an instant.
func TestTokenQuotaRefillsAtReset(t *testing.T) {
	start := time.Date(2026, 6, 1, 10, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	now := start
	clock := func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}
	advance := func(d time.Duration) {
		mu.Lock()
		now = now.Add(d)
		mu.Unlock()
	}
	// At time scale 0.001 an hour's window is 3.6 s of the quota clock.
	q := RequestQuota{Limit: 5, Tokens: 100, Window: time.Hour}
	_, url, client := startServer(t, Options{TimeScale: 0.001, QuotaClock: clock, Quotas: map[string]RequestQuota{"openai": q, "anthropic": q}})
	chat := `{"model":"gpt-4o","max_tokens":49,"messages":[{"role":"user","content":"hi"}]}`
	headers := map[string]string{ProviderHeader: "openai"}
	type want struct {
		status           int
		requests, tokens string
		reset            string
	}
	for i, w := range []want{{200, "4", "50", "3.6s"}, {200, "3", "0", "3.6s"}, {429, "3", "0", "3.6s"}} {
		resp, _, _ := call(t, client, "POST", url+"/v1/chat/completions", chat, headers)
		h := resp.Header
		got := want{resp.StatusCode, h.Get("x-ratelimit-remaining-requests"), h.Get("x-ratelimit-remaining-tokens"), h.Get("x-ratelimit-reset-tokens")}
		if got != w || h.Get("x-ratelimit-limit-tokens") != "100" || h.Get("x-ratelimit-reset-requests") != w.reset {
			t.Fatalf("request %d: %+v, headers %v; want %+v", i+1, got, h, w)
		}
	}
	advance(1600 * time.Millisecond)
	resp, _, _ := call(t, client, "POST", url+"/v1/chat/completions", chat, headers)
	if resp.StatusCode != 429 || resp.Header.Get("x-ratelimit-reset-tokens") != "2s" || resp.Header.Get("Retry-After") != "2" {
		t.Fatalf("1.6 s later: %d, %v; want 429 resetting in 2s", resp.StatusCode, resp.Header)
	}
	advance(2 * time.Second)
	resp, _, _ = call(t, client, "POST", url+"/v1/chat/completions", chat, headers)
	if resp.StatusCode != 200 || resp.Header.Get("x-ratelimit-remaining-tokens") != "50" || resp.Header.Get("x-ratelimit-remaining-requests") != "4" {
		t.Fatalf("after the reset: %d, %v; want the quota full again less this request", resp.StatusCode, resp.Header)
	}

	msg := `{"model":"claude-sonnet-4-5","max_tokens":49,"messages":[{"role":"user","content":"hi"}]}`
	resp, _, _ = call(t, client, "POST", url+"/v1/messages", msg, map[string]string{ProviderHeader: "anthropic"})
	h := resp.Header
	if resp.StatusCode != 200 || h.Get("anthropic-ratelimit-tokens-limit") != "100" || h.Get("anthropic-ratelimit-tokens-remaining") != "50" ||
		h.Get("anthropic-ratelimit-requests-remaining") != "4" || h.Get("anthropic-ratelimit-tokens-reset") != clock().Add(3600*time.Millisecond).Format(time.RFC3339Nano) {
		t.Fatalf("anthropic: %d, %v", resp.StatusCode, h)
	}
	if _, err := New(Options{Quotas: map[string]RequestQuota{"x": {Tokens: -1, Limit: 3, Window: time.Second}}}); err == nil {
		t.Fatal("a negative token quota was accepted")
	}
}

// TestQuotaResetStartsTheWindowAgain: Server.Reset gives every quota its full limit back.
func TestQuotaResetStartsTheWindowAgain(t *testing.T) {
	s, url, client := startServer(t, Options{TimeScale: 1, Quotas: map[string]RequestQuota{"openai": {Limit: 1, Window: time.Hour}}})
	chat := `{"model":"gpt-4o","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
	for i, want := range []int{200, 429} {
		if resp, _, _ := call(t, client, "POST", url+"/v1/chat/completions", chat, map[string]string{ProviderHeader: "openai"}); resp.StatusCode != want {
			t.Fatalf("request %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}
	s.Reset()
	if resp, _, _ := call(t, client, "POST", url+"/v1/chat/completions", chat, map[string]string{ProviderHeader: "openai"}); resp.StatusCode != 200 {
		t.Fatalf("after Reset: %d, want 200", resp.StatusCode)
	}
}
