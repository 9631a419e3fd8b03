package extproc

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/extproc/llmapi"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

func spendRefusal(t *testing.T) policy.Decision {
	berlin, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Fatal(err)
	}
	reset := time.Date(2026, 6, 2, 0, 0, 0, 0, berlin)
	return policy.Decision{Verdict: policy.Reject, Reason: policy.ReasonSpendBudget, Compartment: "tenant/acme",
		RetryAfter: reset.Sub(refusedAt), SpendReset: reset}
}

// A spend refusal is a 429 with the reason, a retry-after until the window resets, the reset
// instant in RFC 3339 (in the policy's zone), and — the wait being long — x-should-retry:
// false, in the body format of the API called.
func TestSpendRefusal(t *testing.T) {
	d := spendRefusal(t)
	r := refusal{requestID: "req-7", now: refusedAt, noRetryAbove: 10 * time.Second, rateLimitHeaders: true}
	for _, api := range []llmapi.Dialect{llmapi.DialectOpenAI, llmapi.DialectAnthropic} {
		status, h, body := replyHeaders(t, immediateReply(d, api, r))
		if status != 429 {
			t.Errorf("%v: status %d", api, status)
		}
		secs := int64((d.RetryAfter + time.Second - 1) / time.Second)
		for k, v := range map[string]string{
			"x-bulkhead-reason":      "spend_budget",
			"x-bulkhead-compartment": "tenant/acme",
			"x-bulkhead-spend-reset": "2026-06-02T00:00:00+02:00",
			"retry-after":            strings.TrimSpace(jsonInt(secs)),
			"x-should-retry":         "false",
		} {
			if h[k] != v {
				t.Errorf("%v: %s = %q, want %q", api, k, h[k], v)
			}
		}
		for k := range h {
			if strings.Contains(k, "ratelimit") {
				t.Errorf("%v: %s: a spend refusal has no token or request window to report", api, k)
			}
		}
		var raw map[string]any
		if err := json.Unmarshal(body, &raw); err != nil {
			t.Fatalf("body %s: %v", body, err)
		}
		e := raw["error"].(map[string]any)
		wantType := "insufficient_quota"
		if api == llmapi.DialectAnthropic {
			wantType = "rate_limit_error"
		}
		if e["type"] != wantType || !strings.Contains(e["message"].(string), "Spend budget of tenant/acme is used up until 2026-06-01T22:00:00Z") {
			t.Errorf("%v: body %s", api, body)
		}
	}
}

func jsonInt(n int64) string { b, _ := json.Marshal(n); return string(b) }
