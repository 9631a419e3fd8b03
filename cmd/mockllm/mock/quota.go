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

// OutcomeQuota: refused with 429 because the provider's request or token quota was used up.
const OutcomeQuota = "quota"

// RequestQuota is a provider account's rate limits as hosted APIs enforce them: Limit requests
// and Tokens tokens per Window (simulated time: scaled by Options.TimeScale), counted from the
// window's first request. A request takes one request and its prompt tokens plus the completion
// it asks for (max_tokens, or the default), as OpenAI counts them when it admits a request.
// Every response of a provider with a quota says what is left in the API's own headers —
// x-ratelimit-{limit,remaining,reset}-{requests,tokens} (OpenAI, Azure and compatible servers;
// the reset as a Go duration such as 1.5s) or anthropic-ratelimit-{requests,tokens}-{limit,
// remaining,reset} (Anthropic's Messages API; the reset an RFC 3339 instant) — and a request
// beyond either limit is answered 429 in the API's error format, with retry-after.
type RequestQuota struct {
	// Limit is the requests allowed per window (0: no request limit).
	Limit int
	// Tokens is the tokens allowed per window (0: no token limit).
	Tokens int64
	Window time.Duration
}

// quotas holds the quotas of each provider that has one: one per account (the value of the
// account header) when accounts are kept apart.
type quotas struct {
	mu    sync.Mutex
	scale float64
	cfg   map[string]RequestQuota
	by    map[quotaKey]*quotaState
}

// quotaKey is a provider's account ("" when accounts are not kept apart).
type quotaKey struct{ provider, account string }

type quotaState struct {
	RequestQuota
	start  time.Time
	used   int
	tokens int64
}

// quotaLeft is what a provider's quota says after a request: the limits and what is left of
// them until reset (real time).
type quotaLeft struct {
	requests, limit int
	tokens, tokLim  int64
	reset           time.Duration
}

func newQuotas(by map[string]RequestQuota, scale float64) *quotas {
	return &quotas{scale: scale, cfg: by, by: map[quotaKey]*quotaState{}}
}

// take counts a request of provider's account needing tokens against its quota: ok false
// when the request or the token quota cannot cover it (then nothing is taken). has is false
// when the provider has no quota.
func (q *quotas) take(provider, account string, tokens int64, now time.Time) (has, ok bool, left quotaLeft) {
	q.mu.Lock()
	defer q.mu.Unlock()
	rq, has := q.cfg[provider]
	if !has {
		return false, true, quotaLeft{}
	}
	k := quotaKey{provider, account}
	st := q.by[k]
	if st == nil {
		if len(q.by) >= maxTrackedLabels {
			k.account = overflowLabel
		}
		if st = q.by[k]; st == nil {
			st = &quotaState{RequestQuota: rq}
			q.by[k] = st
		}
	}
	window := time.Duration(float64(st.Window) * q.scale)
	if st.start.IsZero() || now.Sub(st.start) >= window || now.Before(st.start) {
		st.start, st.used, st.tokens = now, 0, 0
	}
	ok = (st.Limit == 0 || st.used < st.Limit) && (st.Tokens == 0 || st.tokens+tokens <= st.Tokens)
	if ok {
		st.used++
		st.tokens += tokens
	}
	return true, ok, quotaLeft{requests: max(st.Limit-st.used, 0), limit: st.Limit, tokens: max(st.Tokens-st.tokens, 0),
		tokLim: st.Tokens, reset: st.start.Add(window).Sub(now)}
}

// reset starts every quota's window again with the next request.
func (q *quotas) reset() {
	q.mu.Lock()
	defer q.mu.Unlock()
	clear(q.by)
}

// setQuotaHeaders writes what is left of the quota in the API's own rate-limit headers; now
// dates Anthropic's reset instants.
func (e *exchange) setQuotaHeaders(l quotaLeft, now time.Time, malformed bool) {
	h := e.w.Header()
	set := func(kind, limit, left string) {
		if e.rt.dialect == dialectAnthropic {
			at := now.Add(l.reset).UTC().Format(time.RFC3339Nano)
			if malformed {
				left, at = "plenty", "tomorrow"
			}
			h.Set("anthropic-ratelimit-"+kind+"-limit", limit)
			h.Set("anthropic-ratelimit-"+kind+"-remaining", left)
			h.Set("anthropic-ratelimit-"+kind+"-reset", at)
			return
		}
		rs := l.reset.Round(time.Millisecond).String()
		if malformed {
			left, rs = "plenty", "-5s"
		}
		h.Set("x-ratelimit-limit-"+kind, limit)
		h.Set("x-ratelimit-remaining-"+kind, left)
		h.Set("x-ratelimit-reset-"+kind, rs)
	}
	if l.limit > 0 {
		set("requests", strconv.Itoa(l.limit), strconv.Itoa(l.requests))
	}
	if l.tokLim > 0 {
		set("tokens", strconv.FormatInt(l.tokLim, 10), strconv.FormatInt(l.tokens, 10))
	}
}

// quotaRefusal answers a request beyond its provider's quota.
func (e *exchange) quotaRefusal(out *output, reset time.Duration) {
	e.w.Header().Set("Retry-After", strconv.Itoa(int(max(reset.Round(time.Second), time.Second)/time.Second)))
	e.fail(out, http.StatusTooManyRequests, "Rate limit reached for requests.", OutcomeQuota)
}
