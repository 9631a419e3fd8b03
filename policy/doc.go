// Package policy is llm-bulkhead's runtime: classification, token estimates, compartments,
// budgets and breakers, combined by an Engine into one admission decision per request and one
// settlement per outcome. It knows nothing of Envoy, gRPC or Prometheus.
//
// The boundary between configuration and runtime is the Snapshot: Engine.Apply compiles a
// validated config.Policy into plain typed data (resolved limit sets, compiled classification
// rules and breaker verdicts, the compartment instances) and the request path reads only
// that — one Snapshot per request, taken once. Building a snapshot changes no live state: the
// changes it finds (budgets and breakers reconfigured, compartments re-limited, tenant stores
// re-bounded) are collected and applied only after every step has succeeded, then the snapshot
// is swapped in. State that outlives a reload — compartments, budget windows, breakers,
// learned estimates — is owned by the Engine and carried over by identity; tenant compartments
// are owned by their family's store (dynstore.go), which creates, leases and evicts them.
// Admission takes a Ticket whose Done releases everything once. The Engine owns the clock:
// budget windows and breakers take the time as a parameter, and the scheduler reads the
// engine's clock. A caller that has read the clock for a message hands the reading down
// (Request.Now, Outcome.At, Ticket.Remaining's now) instead of having admission and settlement
// read it again.
//
// The runtime is watched, never watches itself: it tells a Recorder what it does (record.go)
// and offers read accessors of its live state (livestate.go, views.go, shared_views.go); package
// policy/observe turns both into metrics and logs of state changes.
//
// Where each thing lives:
//
//   - engine.go: Options, the Engine, Apply and the Snapshot it builds; diff.go: what a reload
//     changed.
//   - classify.go, estimate.go: a request's dimensions (a tenant from its API key too) and its
//     token estimate.
//   - family.go, dynstore.go: compartment families, their instances and the stores of
//     tenant-keyed ones.
//   - breakers.go, adaptive.go, spendbudget.go, providerquota.go: providers' breakers, adaptive
//     limits, spend budgets and prices, and providers' own quotas (their rate-limit headers).
//   - decision.go (reasons and the Decision), ticket.go, admit.go (the admission pipeline),
//     settle.go (outcome and settlement), refusal.go (what a refusal tells the client),
//     attempts.go (the retried attempts of an admitted request, reported to its breaker and
//     quota).
//   - shared.go, share.go, exact.go, leased.go: cluster mode — the shared store, a replica's
//     part while it cannot count the others, exact and leased admission.
//   - record.go: the Recorder the engine tells what it does; livestate.go, views.go,
//     shared_views.go: what observers and the admin API read; clientquota.go: what a client
//     may read of its own limits (quota_endpoint).
//   - state.go: the windows a state file keeps across restarts (the engine is its Source).
//   - usagetrack.go: usage by tenant and model, recorded at settlement and refusal into the
//     engine's usage.Tracker.
//
// Imports: the standard library, its domain packages (adaptive, breaker, budget, bulkhead,
// cluster, quota, spend, usage), config, apikey, glob and statefile, and internal/throttle and
// internal/stall (the meter of the process's stalls, for adaptive limits); never extproc, observe, Prometheus
// or anything of Envoy. The domain packages import none of policy, extproc or observe, and
// config is a leaf (see its doc). Imported by: extproc (the Envoy adapter), policy/observe,
// the app and the commands.
package policy
