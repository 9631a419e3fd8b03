package policy

import (
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

func TestJudgeOutcome(t *testing.T) {
	str := func(s string) *string { return &s }
	defaults := (&config.Policy{Breakers: map[string]config.Breaker{"b": {}}}).ResolveBreaker("b")
	custom := (&config.Policy{Breakers: map[string]config.Breaker{"b": {
		RateLimitedAs: str("failure"), NoResponseAs: str("ignore"), SlowCallMeasure: str("total"),
		FailureStatuses: []string{"502", "4xx"}, IgnoreStatuses: []string{"5xx"},
	}}}).ResolveBreaker("b")
	ms := time.Millisecond
	tests := []struct {
		name     string
		s        config.BreakerSettings
		o        Outcome
		want     breaker.Outcome
		wantD    time.Duration
		wantHold time.Duration
	}{
		{"200 succeeds, judged on ttfb", defaults, Outcome{Status: 200, TTFB: 5 * ms, Duration: 90 * ms}, breaker.Success, 5 * ms, 0},
		{"4xx is the client's fault: ignored", defaults, Outcome{Status: 404, TTFB: ms}, breaker.Ignored, ms, 0},
		{"5xx fails", defaults, Outcome{Status: 500, TTFB: ms}, breaker.Failure, ms, 0},
		{"503 with retry-after fails and asks for a hold", defaults, Outcome{Status: 503, RetryAfter: 7 * time.Second}, breaker.Failure, 0, 7 * time.Second},
		{"429 is neutral by default", defaults, Outcome{Status: 429, RetryAfter: time.Second}, breaker.Success, 0, time.Second},
		{"no response headers fail, judged on duration", defaults, Outcome{Duration: 3 * ms}, breaker.Failure, 3 * ms, 0},
		{"a client cancel is ignored", defaults, Outcome{Status: 500, Cancelled: true}, breaker.Ignored, 0, 0},
		{"custom: 429 fails", custom, Outcome{Status: 429}, breaker.Failure, 0, 0},
		{"custom: no response ignored", custom, Outcome{}, breaker.Ignored, 0, 0},
		{"custom: failure list wins over ignore list", custom, Outcome{Status: 502}, breaker.Failure, 0, 0},
		{"custom: other 5xx ignored", custom, Outcome{Status: 500}, breaker.Ignored, 0, 0},
		{"custom: 4xx fails", custom, Outcome{Status: 404}, breaker.Failure, 0, 0},
		{"custom: slow calls measured on the total", custom, Outcome{Status: 200, TTFB: ms, Duration: 9 * ms}, breaker.Success, 9 * ms, 0},
		{"status outside HTTP's range succeeds", defaults, Outcome{Status: 999}, breaker.Success, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			j := newJudge(tt.s)
			got, d, hold := j.outcome(tt.o)
			if got != tt.want || d != tt.wantD || hold != tt.wantHold {
				t.Errorf("outcome = %v, %s, hold %s; want %v, %s, hold %s", got, d, hold, tt.want, tt.wantD, tt.wantHold)
			}
		})
	}
}
