// Package cluster shares llm-bulkhead's limits across replicas through Redis: token budgets and
// request rates as sliding windows, concurrency as leases that belong to a replica and expire
// with it. Every admission is one atomic Lua script (all or nothing across the request's
// compartments, timed by Redis's clock so replicas' clocks never matter); settlements and
// releases are queued and sent in batches; one heartbeat per replica renews all its leases and
// drops the leases of replicas that stopped beating. Changes to slot counts are published, so a
// replica's queued requests wake when a slot frees anywhere. Spend budgets (money, in calendar
// windows the caller names) are reserved all or nothing by a script of their own and settled in
// the same batches; SpendStore keeps a spend.Ledger's sums there. With leased admission a Leaser
// instead holds, per compartment, a lease of its limits and chunks of its windows, spend windows
// included (spend_lease.go), renewed every lease interval, so that admissions ask Redis nothing.
// A UsageStore adds what each replica's usage tracker counted to the fleet's usage tables every
// few seconds, in the background, and reads the fleet's windows back (usage.go).
//
// The Store knows nothing of policies: the caller names compartments and windows and gives their
// limits with every call, so replicas on different policy versions apply their own limits to the
// same counters, and a window's key includes its length so that no two versions read its slots
// differently. When Redis is slow or gone the Store reports itself unavailable and the caller
// decides (enforce a share locally, or refuse); it reconnects, rewrites its leases from its own
// record of them and reports itself available again by itself.
//
// Imports: the standard library, budget, spend and usage (what it keeps), go-redis, and
// Prometheus for what the Store counts (registered by whoever runs it, through Collectors).
// Imported by: package policy (cluster mode), the app (its admin view) and the cluster demo;
// never by config, which stays free of Redis.
package cluster
