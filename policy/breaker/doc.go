// Package breaker is a circuit breaker for one upstream LLM provider, with the semantics of
// Resilience4j's CircuitBreaker: a COUNT_BASED or TIME_BASED sliding window of call outcomes,
// failure-rate and slow-call-rate thresholds evaluated once a minimum number of calls is
// buffered, a wait in OPEN before a limited number of HALF_OPEN probes, and the operator states
// DISABLED, FORCED_OPEN and METRICS_ONLY.
//
// Admission and outcome arrive in different ext_proc messages, so the breaker works in two
// steps: [Breaker.Acquire] returns a [Permit] and the caller later hands it back with
// [Breaker.Record] (the provider answered) or [Breaker.Release] (the request was refused later
// in admission and never reached the provider). Every state change starts a new generation; a
// Permit remembers the generation it was granted in, so results of calls admitted before the
// breaker changed state cannot be mistaken for evidence about the new state.
//
// The package is pure domain code. It starts no goroutines and arms no timers: time is a
// parameter (every method takes now), and the timed transitions of Resilience4j (OPEN to
// HALF_OPEN when the wait has elapsed, HALF_OPEN to OPEN when probes take too long) are applied
// lazily by the next call that observes the breaker. A clock that jumps backwards is treated as
// if no time had passed.
//
// Imports: only the standard library. Imported by: package policy (the providers' breakers),
// policy/config (the breaker's own rules, to validate a policy) and policy/observe and the app
// (which read snapshots and histories).
package breaker
