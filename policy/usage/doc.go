// Package usage counts what tenants and models used — tokens, requests, refusals by reason and
// spend — for reports of the last hour, 24 hours, 7 days and the calendar month, in memory that
// does not grow with the number of tenants or models.
//
// # Tables
//
// Each grouping (by tenant, by model, by tenant and model) keeps a table per bucket of time. A
// table holds at most size groups (usage.table_size), as a Space-Saving summary (Metwally,
// Agrawal and El Abbadi, "Efficient computation of frequent and top-k elements in data
// streams", 2005): a group without a row takes a free one, or else the row of the group with
// the smallest estimate, whose estimate it inherits as its error. Groups are ranked by weight:
// prompt plus completion tokens, plus one for each request and each refusal (so that a group
// refused without using a token still ranks). A row counts exactly what its group did since it
// took the row; its estimate is that weight plus the inherited error. For every group of a
// table of N weight with a row, the estimate is never below its true weight and at most its
// error above; a group without a row weighed at most the table's slack (the largest estimate a
// displaced group had), which is at most N/size.
//
// # Buckets and windows
//
// The live tables count the current 5-minute bucket. When it ends they are frozen; when an
// hour ends its 5-minute tables are merged into an hour table, and when a day ends (midnight in
// the time zone of the policy, the one spend budgets use) its hours into a day table. A merge
// sums a group's rows and, for each table without a row for it, adds that table's slack to its
// estimate and error; cut back to size, the largest estimate cut becomes the merged slack. So
// an hour's slack is at most 2N/size and a day's 3N/size, N the weight of the bucket.
//
// A window is the closed buckets of its level from the bucket that holds now minus the window,
// then the finer buckets since, then the live one: 1h is 5-minute buckets (it spans 60 to 65
// minutes), 24h hour buckets (24 to 25 hours), 7d day buckets (7 to 8 days) and month the day
// buckets since the 1st of the month. A report merges the window's tables without cutting and
// ranks every group by estimate; a row's overcount is its merged error, and every overcount is
// at most the window's N/size for 1h, 2N/size for 24h and 3N/size for 7d and month (N the
// window's total weight). The window's totals are exact: what the top rows do not count is the
// rest (_other), never negative. A group's counts are what it counted while it had rows: exact
// when its overcount is 0, else short of the truth by at most the overcount (in weight).
//
// # Memory
//
// A grouping keeps at most TablesPerGroup tables (the live one, 13 closed 5-minute buckets,
// 25 hours and 30 days: what the longest of the windows of each level needs, on a day of 25
// hours), each of at most size rows of EntryBytes plus their names; MaxBytes bounds the whole.
// With the default size of 200 and names of 8 bytes, that is under 10 MiB, reached only when
// every table of every grouping is full.
//
// The tracker is safe for concurrent use: recording takes one lock for three table updates and
// allocates only when a group takes a row (its names are copied). It reads no clock: every call
// takes the engine's now. Save and Restore keep it in a state file (Saved).
//
// Imports: the standard library and the domain's money and spend (for its calendar). Imported
// by: package policy (the engine owns a Tracker), statefile, observe (the metrics) and the app
// (GET /admin/usage).
package usage
