// Package observe is how llm-bulkhead's runtime is watched: the Prometheus metrics of the
// policy engine (decisions, settlements, re-routes, queue waits, breaker transitions, spend,
// providers' quotas, and the state of compartments, budgets, adaptive limits, breakers, pools,
// spend budgets, provider quotas and the usage tables — with the usage of the tenants
// usage.tenant_metrics names — read at scrape time), the admissions and refusals per
// feature that /admin/decisions shows (Decisions), and the logs of breaker state changes and
// refusals.
//
// It reads the runtime and is never read by it. The engine (package policy) records what it
// does through the small policy.Recorder interface, which Metrics implements, and offers read
// accessors (CompartmentStates, PoolStats, Breakers, SpendBudgets, ProviderQuotas, Usage…) that the
// collectors call at scrape time; package policy imports neither this package nor Prometheus.
// Whoever runs the engine owns the registry: it builds Metrics, passes them as
// policy.Options.Recorder, and registers Metrics.Collectors (the process's one place is
// cmd/llm-bulkhead/app).
//
// Imports: policy and its domain packages (breaker, bulkhead, adaptive, spend, cluster,
// usage), and Prometheus. Imported by: the app, and tests and benchmarks that read metrics.
package observe
