package mock

import (
	"net/http"
	"strconv"
	"sync"
	"time"
)

// HeaderRateLimitMalformed, set to true on a request, makes its response's rate-limit headers
// unreadable (a word for a count, a negative reset), as a broken proxy might send them.
const HeaderRateLimitMalformed = "x-mockllm-ratelimit-malformed"

// OutcomeQuota: refused with 429 because the provider's request quota was used up.
const OutcomeQuota = "quota"

// RequestQuota is a provider account's request rate limit as hosted APIs enforce it: Limit
// requests per Window (simulated time: scaled by Options.TimeScale), counted from the window's
// first request. Every response of a provider with a quota says what is left in the API's own
// headers — x-ratelimit-{limit,remaining,reset}-requests (OpenAI, Azure and compatible
// servers; the reset as a Go duration such as 1.5s) or anthropic-ratelimit-requests-{limit,
// remaining,reset} (Anthropic's Messages API; the reset an RFC 3339 instant) — and a request
// beyond the limit is answered 429 in the API's error format, with retry-after.
type RequestQuota struct {
	Limit  int
	Window time.Duration
}

// quotas holds the request quota of each provider that has one.
type quotas struct {
	mu    sync.Mutex
	scale float64
	by    map[string]*quotaState
}

type quotaState struct {
	RequestQuota
	start time.Time
	used  int
}

func newQuotas(by map[string]RequestQuota, scale float64) *quotas {
	q := &quotas{scale: scale, by: map[string]*quotaState{}}
	for p, rq := range by {
		q.by[p] = &quotaState{RequestQuota: rq}
	}
	return q
}

// take counts a request of provider against its quota: ok false when the quota is used up.
// left and reset are what the headers say (has false: the provider has no quota).
func (q *quotas) take(provider string, now time.Time) (has, ok bool, limit, left int, reset time.Duration) {
	q.mu.Lock()
	defer q.mu.Unlock()
	st := q.by[provider]
	if st == nil {
		return false, true, 0, 0, 0
	}
	window := time.Duration(float64(st.Window) * q.scale)
	if st.start.IsZero() || now.Sub(st.start) >= window {
		st.start, st.used = now, 0
	}
	reset = st.start.Add(window).Sub(now)
	if st.used >= st.Limit {
		return true, false, st.Limit, 0, reset
	}
	st.used++
	return true, true, st.Limit, st.Limit - st.used, reset
}

// setQuotaHeaders writes what is left of the quota in the API's own rate-limit headers.
func (e *exchange) setQuotaHeaders(limit, left int, reset time.Duration, malformed bool) {
	h := e.w.Header()
	lim, rem := strconv.Itoa(limit), strconv.Itoa(left)
	if e.rt.dialect == dialectAnthropic {
		at := time.Now().Add(reset).UTC().Format(time.RFC3339Nano)
		if malformed {
			rem, at = "plenty", "tomorrow"
		}
		h.Set("anthropic-ratelimit-requests-limit", lim)
		h.Set("anthropic-ratelimit-requests-remaining", rem)
		h.Set("anthropic-ratelimit-requests-reset", at)
		return
	}
	rs := reset.Round(time.Millisecond).String()
	if malformed {
		rem, rs = "plenty", "-5s"
	}
	h.Set("x-ratelimit-limit-requests", lim)
	h.Set("x-ratelimit-remaining-requests", rem)
	h.Set("x-ratelimit-reset-requests", rs)
}

// quotaRefusal answers a request beyond its provider's quota.
func (e *exchange) quotaRefusal(out *output, reset time.Duration) {
	e.w.Header().Set("Retry-After", strconv.Itoa(int(max(reset.Round(time.Second), time.Second)/time.Second)))
	e.fail(out, http.StatusTooManyRequests, "Rate limit reached for requests.", OutcomeQuota)
}
