package config

import "time"

// DefaultNoRetryAbove is refusals.no_retry_above when the policy does not set it: a client told
// to wait longer than this is better off failing at once (an interactive caller shows an error
// or falls back) than sleeping inside its SDK, while shorter waits are still worth a retry.
const DefaultNoRetryAbove = 10 * time.Second

// Refusals sets what refused requests tell their clients, beyond the status, the error body,
// retry-after and retry-after-ms, which every refusal gets.
type Refusals struct {
	// NoRetryAbove adds x-should-retry: false to a refusal whose retry-after is longer than
	// this, so the official OpenAI and Anthropic SDKs give up at once instead of sleeping
	// through the wait (and retrying twice more); 0 never sends it. Default 10s.
	NoRetryAbove *Duration `koanf:"no_retry_above" json:"no_retry_above,omitempty"`
	// RateLimitHeaders adds the refusing window's limit, remaining and reset to 429 refusals
	// by a request rate or token budget: OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}
	// on OpenAI routes, Anthropic's anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}
	// on /v1/messages. Turn it off when a shared compartment's numbers should stay internal.
	// Default true.
	RateLimitHeaders *bool `koanf:"ratelimit_headers" json:"ratelimit_headers,omitempty"`
}

func (r *Refusals) applyDefaults() {
	if r.NoRetryAbove == nil {
		r.NoRetryAbove = ptr(Duration(DefaultNoRetryAbove))
	}
	if r.RateLimitHeaders == nil {
		r.RateLimitHeaders = ptr(true)
	}
}

// NoRetryAboveOrDefault is no_retry_above, or its default when the policy was not loaded
// (defaults not applied).
func (r Refusals) NoRetryAboveOrDefault() time.Duration {
	if r.NoRetryAbove == nil {
		return DefaultNoRetryAbove
	}
	return r.NoRetryAbove.D()
}

// RateLimitHeadersOrDefault is ratelimit_headers, or its default (true) when unset.
func (r Refusals) RateLimitHeadersOrDefault() bool {
	return r.RateLimitHeaders == nil || *r.RateLimitHeaders
}

// refusals checks the refusals section.
func (v *validator) refusals() {
	if d := v.p.Refusals.NoRetryAbove; d != nil && *d < 0 {
		v.add("refusals.no_retry_above", "must not be negative (0 never sends x-should-retry), got %s", d)
	}
}
