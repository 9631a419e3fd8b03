package mock

import (
	"strconv"
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
