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
	verdicts := func(b config.Breaker) config.BreakerSettings {
		return (&config.Policy{Breakers: map[string]config.Breaker{"b": b}}).ResolveBreaker("b")
	}
	recordIgnore := verdicts(config.Breaker{Record: []string{"5xx", "timeout"}, Ignore: []string{"4xx", "stream_error"}})
	ignoreTimeout := verdicts(config.Breaker{Ignore: []string{"timeout"}})
	recordStreamOnly := verdicts(config.Breaker{Record: []string{"stream_error"}})
	overBase := (&config.Policy{Breakers: map[string]config.Breaker{
		"base": {FailureStatuses: []string{"502"}, NoResponseAs: str("ignore")},
		"b":    {Base: "base", Record: []string{"503"}},
	}}).ResolveBreaker("b")
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
		{"slow calls are judged on the first token, not the headers", defaults, Outcome{Status: 200, Headers: ms, TTFB: 20 * time.Second, Duration: 30 * time.Second}, breaker.Success, 20 * time.Second, 0},
		{"an error inside a 200 stream fails", defaults, Outcome{Status: 200, StreamError: StreamErrorServer, TTFB: ms}, breaker.Failure, ms, 0},
		{"an error inside a 200 stream fails even when the stream was then cut", defaults, Outcome{Status: 200, StreamError: StreamErrorServer, Cancelled: true}, breaker.Failure, 0, 0},
		{"a rate-limit error inside a 200 stream is a 429: neutral by default", defaults, Outcome{Status: 200, StreamError: StreamErrorRateLimited}, breaker.Success, 0, 0},
		{"custom: a rate-limit error inside a 200 stream fails like a 429", custom, Outcome{Status: 200, StreamError: StreamErrorRateLimited}, breaker.Failure, 0, 0},
		{"a client error inside a 200 stream is a 400: ignored by default", defaults, Outcome{Status: 200, StreamError: StreamErrorClient}, breaker.Ignored, 0, 0},
		{"custom: a client error inside a 200 stream fails like a 4xx", custom, Outcome{Status: 200, StreamError: StreamErrorClient}, breaker.Failure, 0, 0},
		{"record/ignore: stream_error ignored", recordIgnore, Outcome{Status: 200, StreamError: StreamErrorServer}, breaker.Ignored, 0, 0},
		{"record/ignore: timeout recorded", recordIgnore, Outcome{Duration: ms}, breaker.Failure, ms, 0},
		{"record/ignore: 5xx recorded", recordIgnore, Outcome{Status: 503}, breaker.Failure, 0, 0},
		{"record/ignore: 4xx ignored", recordIgnore, Outcome{Status: 400}, breaker.Ignored, 0, 0},
		{"ignore [timeout]: no response ignored", ignoreTimeout, Outcome{Duration: ms}, breaker.Ignored, ms, 0},
		{"ignore [timeout]: 4xx still ignored (no status listed keeps the default)", ignoreTimeout, Outcome{Status: 404}, breaker.Ignored, 0, 0},
		{"ignore [timeout]: 5xx still fails", ignoreTimeout, Outcome{Status: 500}, breaker.Failure, 0, 0},
		{"record [stream_error]: 5xx still fails (no status listed keeps the default)", recordStreamOnly, Outcome{Status: 502}, breaker.Failure, 0, 0},
		{"record over a base's failure_statuses: the child's statuses replace them", overBase, Outcome{Status: 502}, breaker.Success, 0, 0},
		{"record over a base's failure_statuses: 503 fails", overBase, Outcome{Status: 503}, breaker.Failure, 0, 0},
		{"record over a base's failure_statuses: no_response_as inherited", overBase, Outcome{}, breaker.Ignored, 0, 0},
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
