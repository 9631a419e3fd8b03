// Package spend implements spend limits in money: exact amounts, per-model prices, calendar
// windows (hour, day, month in a configured time zone) and a ledger that reserves a request's
// worst-case cost in every budget that applies to it before the request runs, and settles the
// real cost after.
//
// Amounts are integers of millionths of the currency unit (Micros, from package money): prices, budgets and costs
// never pass through floating point, so no error accumulates. A request's cost is rounded up
// to the next millionth once, after every part of it has been added up.
//
// The ledger keeps no sums itself: a Store does. MemoryStore keeps them in this process (and
// can hand out and take back its State, so that a persister can save it); another Store can
// share them between processes (cluster.SpendStore keeps them in Redis). A window is identified by its budget, its period and the
// instant it starts, so that a restored or shared sum lands in exactly one window, and a
// window that has ended is simply forgotten: its budget has reset.
//
// The package knows nothing of compartments, requests or configuration files; the policy
// package names the budgets (after its compartments) and decides what a request may cost.
//
// Imports: the standard library, money and glob. Imported by: package policy,
// policy/cluster (SpendStore), policy/statefile (the state file keeps the ledger's windows),
// policy/observe and the app (/admin/spend).
package spend
