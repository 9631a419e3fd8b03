package policy

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

// Reason is a stable refusal code, used alike in the x-bulkhead-reason header, metrics and
// logs.
type Reason string

// Refusal reasons.
const (
	ReasonTokenBudget  Reason = "token_budget"
	ReasonRateLimit    Reason = "rate_limit"
	ReasonBulkheadFull Reason = "bulkhead_full"
	ReasonCircuitOpen  Reason = "circuit_open"
	ReasonBadRequest   Reason = "bad_request"
	// ReasonServerBusy: the server holds as many request bodies as it may
	// (server.max_buffered_body_bytes); the request was refused before it was classified.
	ReasonServerBusy Reason = "server_busy"
	// ReasonCancelled: the client went away while the request was queued; nobody is left to
	// answer.
	ReasonCancelled Reason = "cancelled"
	// ReasonClusterUnavailable: limits are shared through Redis, Redis is slow or gone, and
	// cluster.on_unavailable is closed.
	ReasonClusterUnavailable Reason = "cluster_unavailable"
	// ReasonSpendBudget: a spend budget (spend_per_hour, spend_per_day, spend_per_month) cannot
	// cover the request's worst-case cost until its window resets.
	ReasonSpendBudget Reason = "spend_budget"
	// ReasonUnknownKey: an api_key tenant rule found no known API key in the request and
	// tenants.unknown_key is reject.
	ReasonUnknownKey Reason = "unknown_key"
	// ReasonProviderQuota: the provider's own rate limits, as its responses last told them,
	// cannot cover the request before they reset (providers.<name>.quota.mode enforce), and it
	// has no fallback that can.
	ReasonProviderQuota Reason = "provider_quota"
)

// Sentinel errors for each refusal reason; Decision.Err wraps one, for errors.Is.
var (
	ErrTokenBudget  = errors.New("token budget exhausted")
	ErrRateLimit    = errors.New("request rate exceeded")
	ErrBulkheadFull = bulkhead.ErrFull
	ErrCircuitOpen  = breaker.ErrOpen
	ErrBadRequest   = errors.New("bad request")
	ErrServerBusy   = errors.New("server busy")
	ErrCancelled    = context.Canceled
	// ErrClusterUnavailable: the shared state could not be reached and the policy refuses then.
	ErrClusterUnavailable = errors.New("cluster state unavailable")
	ErrSpendBudget        = errors.New("spend budget exhausted")
	ErrUnknownKey         = errors.New("unknown API key")
	ErrProviderQuota      = errors.New("provider quota exhausted")
)

// Verdict is what to do with a request.
type Verdict uint8

// Verdicts.
const (
	// Reject refuses the request (ImmediateResponse).
	Reject Verdict = iota
	// Admit lets it through, possibly re-routed to another provider.
	Admit
)

// Decision is the outcome of admission.
type Decision struct {
	Verdict Verdict
	// Reason says why a request was refused, or why it was re-routed.
	Reason Reason
	// Compartment names the compartment (or provider breaker) that refused, or that made the
	// request re-route.
	Compartment string
	// RetryAfter is when a retry can succeed: refill time, predicted queue wait or remaining
	// open time.
	RetryAfter time.Duration
	// Dims are the request's final dimensions (Provider changes on re-route, and Model when the
	// target's models map names another model).
	Dims Dims
	// Rerouted reports that Dims.Provider differs from the classified provider.
	Rerouted bool
	// OriginalModel is the classified model when a re-route changed Dims.Model to the model
	// the target's models map names (an admitted request's body must then be rewritten to
	// Dims.Model); empty otherwise.
	OriginalModel string
	// Limits are the refusing compartment's window that had no room, for a rate_limit or
	// token_budget refusal by a request rate or token budget; empty otherwise.
	Limits RefusalLimits
	// SpendReset is when the refusing spend budget's window ends (a spend_budget refusal).
	SpendReset time.Time
	// SpendOverLimit says the request's worst-case cost is more than the refusing spend
	// budget's whole limit: it would be refused even by an untouched window.
	SpendOverLimit bool
}

// Err returns nil for an admission, else an error wrapping the reason's sentinel.
func (d Decision) Err() error {
	if d.Verdict == Admit {
		return nil
	}
	var base error
	switch d.Reason {
	case ReasonTokenBudget:
		base = ErrTokenBudget
	case ReasonRateLimit:
		base = ErrRateLimit
	case ReasonCircuitOpen:
		base = ErrCircuitOpen
	case ReasonBadRequest:
		base = ErrBadRequest
	case ReasonServerBusy:
		base = ErrServerBusy
	case ReasonCancelled:
		base = ErrCancelled
	case ReasonClusterUnavailable:
		base = ErrClusterUnavailable
	case ReasonSpendBudget:
		base = ErrSpendBudget
	case ReasonUnknownKey:
		base = ErrUnknownKey
	case ReasonProviderQuota:
		base = ErrProviderQuota
	default:
		base = ErrBulkheadFull
	}
	return fmt.Errorf("%s: %w", d.Compartment, base)
}

// RetryAfterSeconds is RetryAfter rounded up to whole seconds, at least 1.
func (d Decision) RetryAfterSeconds() int64 { return bulkhead.RetryAfterSeconds(d.RetryAfter) }

// Message is the human sentence for a refusal: what happened and when to retry. It names only
// the caller's own compartment and never another tenant or internal numbers.
func (d Decision) Message() string {
	secs := d.RetryAfterSeconds()
	unit := "seconds"
	if secs == 1 {
		unit = "second"
	}
	switch d.Reason {
	case ReasonTokenBudget:
		return fmt.Sprintf("Token budget of %s is used up for now. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonRateLimit:
		return fmt.Sprintf("Too many requests for %s. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonCircuitOpen:
		return fmt.Sprintf("The upstream provider (%s) is failing and calls to it are paused. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonBadRequest:
		return "The request body is not a valid JSON object."
	case ReasonServerBusy:
		return fmt.Sprintf("The server is busy. Retry after %d %s.", secs, unit)
	case ReasonCancelled:
		return "The client went away while the request was queued."
	case ReasonUnknownKey:
		return "The API key is missing or not known."
	case ReasonClusterUnavailable:
		return fmt.Sprintf("The service cannot check its shared limits right now. Retry after %d %s.", secs, unit)
	case ReasonProviderQuota:
		return fmt.Sprintf("The upstream provider's rate limit (%s) is used up until it resets. Retry after %d %s.", d.Compartment, secs, unit)
	case ReasonSpendBudget:
		if d.SpendOverLimit {
			return fmt.Sprintf("The worst-case cost of this request is more than the whole spend budget of %s: ask for fewer output tokens (max_tokens).", d.Compartment)
		}
		return fmt.Sprintf("Spend budget of %s is used up until %s. Retry after %d %s.", d.Compartment, d.SpendReset.UTC().Format(time.RFC3339), secs, unit)
	}
	return fmt.Sprintf("Compartment %s is at capacity. Retry after %d %s.", d.Compartment, secs, unit)
}
