package policy

import (
	"slices"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// Recorder hears what the runtime does as it does it — decisions, settlements, re-routes, waits
// in queues, breaker events — so that something else can count and log it. Package
// policy/observe implements it with the Prometheus metrics and the logs of state changes; the
// runtime never reads anything back from it. Calls come from the request path: an
// implementation must be safe for concurrent use, cheap and never block.
type Recorder interface {
	// Feature returns the recorder of one feature's requests. It is called when a policy that
	// names the feature goes live, never per request, and may be called again for the same
	// name after a reload.
	Feature(name string) FeatureRecorder
	// Spend returns the recorder of one feature's spend. It is called only when a policy with
	// spend budgets goes live (a policy without them records no spend).
	Spend(feature string) SpendRecorder
	// Rerouted hears of a request of feature admitted by provider to after provider from
	// refused it for reason.
	Rerouted(feature, from, to string, reason Reason)
	// RerouteUnmapped hears of a re-route from one provider to another not made because the
	// target's models map names no model for the request.
	RerouteUnmapped(feature, from, to string)
	// ShadowRefusal hears of a refusal for reason that a shadow-mode compartment, budget or
	// provider (labelled compartment) would have made.
	ShadowRefusal(compartment string, reason Reason)
	// QueueWait hears of a request that waited in the queue of the named compartment, and
	// whether it got a slot.
	QueueWait(compartment string, waited time.Duration, admitted bool)
	// ClassifyErrors hears of n requests classified from headers and defaults because of
	// reason ("invalid_json", "unknown_feature", "invalid_<dimension>"…).
	ClassifyErrors(reason string, n int)
	// BreakerEvent hears of a breaker's transition or threshold breach at now; shadowed says
	// the breaker is a provider's in shadow mode (its openings refuse nothing).
	BreakerEvent(ev breaker.Event, shadowed bool, now time.Time)
	// BreakerRefused hears that breaker b refused a call at now, for retry; fallback is the
	// provider the request is re-routed to ("" when it is refused).
	BreakerRefused(b *breaker.Breaker, retry time.Duration, fallback string, now time.Time)
	// ClusterUnavailable hears of an admission decided while the shared state was
	// unavailable: "local" (this replica's share enforced here) or "refused".
	ClusterUnavailable(action string)
	// QuotaShort hears of a request the named provider's quota (as its rate-limit headers last
	// told it, less the requests in flight) could not cover: quota is the quota's kind
	// (requests, tokens, input_tokens, output_tokens), mode the provider's quota mode (enforce:
	// the request was re-routed or refused provider_quota; shadow: it went as before).
	QuotaShort(provider, quota, mode string)
	// QuotaHeadersInvalid hears of n rate-limit headers of the named provider's response whose
	// value was malformed or absurd and changed nothing.
	QuotaHeadersInvalid(provider string, n int)
	// QuotaAccountOverflow hears of a request of the named provider whose account found no
	// tracker of its own (beyond quota.max_accounts): it shares the _other account's quota.
	QuotaAccountOverflow(provider string)
}

// FeatureRecorder hears of one feature's requests.
type FeatureRecorder interface {
	// Admitted and Rejected hear of a decision.
	Admitted()
	Rejected(reason Reason)
	// TokensReserved hears of the estimate an admitted request reserved.
	TokensReserved(tokens int64)
	// Settled hears of the tokens a finished request settled, and whether the reported usage
	// was clamped to what the request could cost.
	Settled(prompt, completion int64, clamped bool)
	// UsageUnknown hears of a response that reported no usage.
	UsageUnknown()
	// EstimateRatio hears of actual tokens divided by the estimate, for a reported usage.
	EstimateRatio(ratio float64)
}

// SpendRecorder hears of one feature's spend.
type SpendRecorder interface {
	// Reserved, Settled and Refunded hear of a worst-case cost reserved at admission, a real
	// cost settled, and a reservation given back whole.
	Reserved(amount spend.Micros)
	Settled(amount spend.Micros)
	Refunded(amount spend.Micros)
}

// Reasons returns every refusal reason, in the order the metrics list them.
func Reasons() []Reason { return slices.Clone(reasons[:]) }

// DimensionNames returns the classification dimensions' names (feature, tenant, tier, provider,
// model).
func DimensionNames() []string { return slices.Clone(dimNames[:]) }

// reasons are the refusal reasons, in the order the metrics list them.
var reasons = [...]Reason{ReasonTokenBudget, ReasonRateLimit, ReasonBulkheadFull, ReasonCircuitOpen, ReasonBadRequest, ReasonServerBusy, ReasonCancelled, ReasonSpendBudget, ReasonUnknownKey, ReasonProviderQuota, ReasonClusterUnavailable}

// ClassifyError counts a request classified from headers and defaults because of reason
// (e.g. "invalid_json", "field_type").
func (e *Engine) ClassifyError(reason string) { e.rec.ClassifyErrors(reason, 1) }

// nopRecorder records nothing: the recorder of an engine built without one (validation,
// tests that read no metrics).
type nopRecorder struct{}

type nopFeature struct{}

type nopSpend struct{}

func (nopRecorder) Feature(string) FeatureRecorder                                    { return nopFeature{} }
func (nopRecorder) Spend(string) SpendRecorder                                        { return nopSpend{} }
func (nopRecorder) Rerouted(string, string, string, Reason)                           {}
func (nopRecorder) RerouteUnmapped(string, string, string)                            {}
func (nopRecorder) ShadowRefusal(string, Reason)                                      {}
func (nopRecorder) QueueWait(string, time.Duration, bool)                             {}
func (nopRecorder) ClassifyErrors(string, int)                                        {}
func (nopRecorder) BreakerEvent(breaker.Event, bool, time.Time)                       {}
func (nopRecorder) BreakerRefused(*breaker.Breaker, time.Duration, string, time.Time) {}
func (nopRecorder) ClusterUnavailable(string)                                         {}
func (nopRecorder) QuotaShort(string, string, string)                                 {}
func (nopRecorder) QuotaHeadersInvalid(string, int)                                   {}
func (nopRecorder) QuotaAccountOverflow(string)                                       {}
func (nopFeature) Admitted()                                                          {}
func (nopFeature) Rejected(Reason)                                                    {}
func (nopFeature) TokensReserved(int64)                                               {}
func (nopFeature) Settled(int64, int64, bool)                                         {}
func (nopFeature) UsageUnknown()                                                      {}
func (nopFeature) EstimateRatio(float64)                                              {}
func (nopSpend) Reserved(spend.Micros)                                                {}
func (nopSpend) Settled(spend.Micros)                                                 {}
func (nopSpend) Refunded(spend.Micros)                                                {}
