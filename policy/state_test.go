package policy_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/statefile"
	usagetab "github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// restartPolicy gives every tenant 1000 tokens a day and 10 requests a minute, and the chat
// feature 5000 tokens a minute, in compartments keyed by tenant and by feature.
const restartPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
features:
  chat: {max_concurrent: 20, tokens_per_minute: 5000}
  default: {max_concurrent: 10}
tiers:
  free: {tokens_per_day: 1000, requests_per_minute: 10}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 100}
`

func tenantChat(id string) input {
	return input{headers: map[string]string{"x-tenant-id": id, "x-llm-feature": "chat"}}
}

// restart saves e's state at its clock's time, and returns a new engine running yaml (restart
// policy when empty) whose clock is down later, with the state restored, and what it restored.
func restart(t *testing.T, e *policy.Engine, clk *clock, yaml string, down time.Duration) (*policy.Engine, *clock, statefile.Restored) {
	t.Helper()
	st := e.SaveState(clk.Now())
	// Through the file's bytes, as a restart would.
	data, err := statefile.Encode(st)
	if err != nil {
		t.Fatal(err)
	}
	if st, err = statefile.Parse(data); err != nil {
		t.Fatal(err)
	}
	if yaml == "" {
		yaml = restartPolicy
	}
	e2, clk2 := engine(t, yaml)
	clk2.Advance(clk.Now().Sub(clk2.Now()) + down)
	n, err := e2.RestoreState(st, clk2.Now())
	if err != nil {
		t.Fatal(err)
	}
	return e2, clk2, n
}

// budgetUsed returns what compartment name's window of kind counts now (-1: no such window).
func budgetUsed(e *policy.Engine, name, kind string) int64 {
	for _, c := range e.Compartments() {
		if c.Name != name {
			continue
		}
		for _, b := range c.Budgets {
			if b.Kind == kind {
				return b.Used
			}
		}
	}
	return -1
}

// TestTokenBudgetsSurviveARestart: what a tenant spent of its tokens_per_day, the requests it
// made this minute and what a feature spent of its tokens_per_minute still count after a
// restart, and age out when they would have without one.
func TestTokenBudgetsSurviveARestart(t *testing.T) {
	e, clk := engine(t, restartPolicy)
	if d := spend(t, e, tenantChat("acme"), 900); d.Verdict != policy.Admit {
		t.Fatalf("acme: %+v", d)
	}
	for range 9 {
		clk.Advance(time.Second)
		if d := spend(t, e, tenantChat("initech"), 1); d.Verdict != policy.Admit {
			t.Fatalf("initech: %+v", d)
		}
	}
	chatBefore := budgetUsed(e, "feature/chat", "tokens_per_minute")

	e, clk, n := restart(t, e, clk, "", 20*time.Second)
	if n[statefile.KindTokensPerDay] != 2 || n[statefile.KindRequestsPerMinute] != 2 || n[statefile.KindTokensPerMinute] != 1 {
		t.Fatalf("restored %v, want the two tenants' days and minutes and chat's minute", n)
	}
	if got := budgetUsed(e, "feature/chat", "tokens_per_minute"); got != chatBefore {
		t.Fatalf("chat's tokens_per_minute counts %d after the restart, %d before", got, chatBefore)
	}
	// acme spent 900 of 1000 today: 200 more is refused, as it was before the restart.
	if d := spend(t, e, tenantChat("acme"), 200); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("acme after the restart: %+v, want token_budget (900 of 1000 spent today)", d)
	}
	if d := spend(t, e, tenantChat("acme"), 100); d.Verdict != policy.Admit {
		t.Fatalf("acme's last 100 tokens: %+v", d)
	}
	// initech made 9 of its 10 requests this minute.
	if d := spend(t, e, tenantChat("initech"), 1); d.Verdict != policy.Admit {
		t.Fatalf("initech's 10th request: %+v", d)
	}
	if d := spend(t, e, tenantChat("initech"), 1); d.Verdict != policy.Reject || d.Reason != policy.ReasonRateLimit {
		t.Fatalf("initech's 11th request this minute: %+v, want rate_limit", d)
	}
	// A tenant the file does not know starts with its whole budget.
	if d := spend(t, e, tenantChat("globex"), 1000); d.Verdict != policy.Admit {
		t.Fatalf("globex: %+v", d)
	}
	// The first minute's charges age out a minute after they were made, restart or not.
	clk.Advance(40 * time.Second)
	if got := budgetUsed(e, "feature/chat", "tokens_per_minute"); got != 100+1+1000 {
		t.Fatalf("chat counts %d a minute after the first requests, want the 1101 charged since the restart", got)
	}
}

// TestRestoredTenantsSurviveAnotherRestart: a tenant that did not come back between two
// restarts keeps what it spent; after a day nothing is kept.
func TestRestoredTenantsSurviveAnotherRestart(t *testing.T) {
	e, clk := engine(t, restartPolicy)
	spend(t, e, tenantChat("acme"), 900)
	e, clk, _ = restart(t, e, clk, "", time.Hour)
	e, clk, n := restart(t, e, clk, "", time.Hour)
	if n[statefile.KindTokensPerDay] != 1 {
		t.Fatalf("second restart restored %v, want acme's day", n)
	}
	if d := spend(t, e, tenantChat("acme"), 200); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("acme after two restarts: %+v, want token_budget", d)
	}
	// Down for a day: acme's day has passed.
	e, clk, _ = restart(t, e, clk, "", 24*time.Hour)
	if got := e.SaveState(clk.Now()).Windows; len(got) != 0 {
		t.Fatalf("a day later the state still holds %+v", got)
	}
	if d := spend(t, e, tenantChat("acme"), 1000); d.Verdict != policy.Admit {
		t.Fatalf("acme a day later: %+v", d)
	}
}

// TestRestoreUnderAChangedPolicy: a window whose compartment or limit the new policy no longer
// has is dropped; one whose capacity changed counts what it counted, under the new capacity.
func TestRestoreUnderAChangedPolicy(t *testing.T) {
	e, clk := engine(t, restartPolicy)
	spend(t, e, tenantChat("acme"), 900)

	// The tenant family is keyed by tenant and feature now: another compartment, dropped; chat
	// has no tokens_per_minute any more: dropped too.
	rekeyed := strings.Replace(restartPolicy, "key: [tenant]", "key: [tenant, feature]", 1)
	rekeyed = strings.Replace(rekeyed, "chat: {max_concurrent: 20, tokens_per_minute: 5000}", "chat: {max_concurrent: 20}", 1)
	e2, _, n := restart(t, e, clk, rekeyed, time.Minute)
	if total := n[statefile.KindTokensPerDay] + n[statefile.KindTokensPerMinute] + n[statefile.KindRequestsPerMinute]; total != 0 {
		t.Fatalf("restored %v into compartments the policy no longer has", n)
	}
	if d := spend(t, e2, tenantChat("acme"), 1000); d.Verdict != policy.Admit {
		t.Fatalf("acme in a compartment of another key: %+v, want a whole budget", d)
	}
	if got := e2.SaveState(clk.Now()).Windows; len(got) != 2 {
		t.Fatalf("the new process saves %d windows, want acme's day and minute (of its new compartment) only: %+v", len(got), got)
	}

	// Half the daily budget: the 900 acme spent is more than it has now, until it ages out.
	halved := strings.Replace(restartPolicy, "tokens_per_day: 1000", "tokens_per_day: 500", 1)
	e3, clk3, _ := restart(t, e, clk, halved, time.Minute)
	if d := spend(t, e3, tenantChat("acme"), 1); d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("acme under a halved budget: %+v, want token_budget (900 spent of 500)", d)
	}
	clk3.Advance(24 * time.Hour)
	if d := spend(t, e3, tenantChat("acme"), 500); d.Verdict != policy.Admit {
		t.Fatalf("acme a day later: %+v", d)
	}

	// A feature the policy no longer has: its compartment's window is dropped.
	renamed := strings.Replace(restartPolicy, "chat:", "conversation:", 1)
	_, _, n = restart(t, e, clk, renamed, time.Minute)
	if n[statefile.KindTokensPerMinute] != 0 {
		t.Fatalf("restored %v, want chat's tokens_per_minute dropped", n)
	}
}

// TestRestoreOverflowAndFilteredTenants: the overflow compartment of a tenant family keeps its
// windows; a tenant the family's filter no longer admits is not restored.
func TestRestoreOverflowAndFilteredTenants(t *testing.T) {
	small := strings.Replace(restartPolicy, "max_instances: 100", "max_instances: 1", 1)
	e, clk := engine(t, small)
	spend(t, e, tenantChat("acme"), 900) // holds the one place: later tenants share the overflow
	d, tk := admit(t, e, tenantChat("initech"), 300)
	if d.Verdict != policy.Admit || tk.Compartments()[1] != "tenant/_overflow" {
		t.Fatalf("initech: %+v in %v, want the overflow compartment", d, tk.Compartments())
	}
	tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 150, Completion: 150, Known: true}})

	e2, _, _ := restart(t, e, clk, small, time.Minute)
	if got := budgetUsed(e2, "tenant/_overflow", "tokens_per_day"); got != 300 {
		t.Fatalf("the overflow compartment counts %d after the restart, want 300", got)
	}

	filtered := strings.Replace(small, "max_instances: 1}", "max_instances: 1, where: {tenant: [initech]}}", 1)
	_, _, n := restart(t, e, clk, filtered, time.Minute)
	if n[statefile.KindTokensPerDay] != 1 {
		t.Fatalf("restored %v, want only the overflow's day (acme is filtered out)", n)
	}
}

// FuzzRestoreState: whatever a state file that passes its checks holds — windows of any slot
// length, amounts, places in time, compartments the policy has or not — restoring it never
// panics, fails only over spend in another currency, leaves an engine that admits and settles,
// and one whose own state a state file can always hold.
func FuzzRestoreState(f *testing.F) {
	e, clk := engine(f, restartPolicy)
	spend(f, e, tenantChat("acme"), 900)
	clk.Advance(time.Second)
	spend(f, e, tenantChat("initech"), 3)
	seed, err := json.Marshal(e.SaveState(clk.Now()))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(seed, int64(0))
	f.Add(seed, int64(time.Hour))
	f.Add(seed, int64(-time.Minute))
	// Slots a nanosecond long, each as large as a file's slot may be: restored, they fall in one
	// slot of a minute's window.
	ns := clk.Now().UnixNano()
	f.Add([]byte(fmt.Sprintf(`{"currency":"USD","windows":[{"compartment":"feature/chat","family":"feature","key":["feature"],"values":["chat"],`+
		`"kind":"tokens_per_minute","slot_ns":1,"slots":[[%d,9007199254740992],[%d,9007199254740992]]}]}`, ns-2, ns-1)), int64(0))
	f.Add([]byte(`{"currency":"EUR","windows":[{"compartment":"x","family":"feature","key":["feature"],"values":["chat"],`+
		`"kind":"requests_per_minute","slot_ns":86400000000000,"slots":[[20000,5]]}]}`), int64(0))
	f.Fuzz(func(t *testing.T, data []byte, shift int64) {
		var st statefile.State
		if json.Unmarshal(data, &st) != nil {
			return
		}
		file, err := statefile.Encode(st)
		if err != nil {
			return // a file no process writes, which Parse refuses
		}
		if st, err = statefile.Parse(file); err != nil {
			t.Fatalf("Parse refuses what Encode wrote: %v", err)
		}
		e, clk := engine(t, restartPolicy)
		clk.Advance(time.Duration(shift % int64(48*time.Hour)))
		if _, err := e.RestoreState(st, clk.Now()); err != nil {
			var se *statefile.StateError
			if !errors.As(err, &se) || se.Reason != statefile.ReasonCurrency {
				t.Fatalf("RestoreState: %v", err)
			}
		}
		for _, who := range []string{"acme", "initech", "globex"} {
			spend(t, e, tenantChat(who), 10)
		}
		if _, err := statefile.Encode(e.SaveState(clk.Now())); err != nil {
			t.Fatalf("the restored engine's state cannot be written: %v", err)
		}
	})
}

// BenchmarkSaveState: what one write of the state file costs, off the request path, with 10 000
// tenants that each spent tokens this minute.
func BenchmarkSaveState(b *testing.B) {
	pol := strings.Replace(restartPolicy, "max_instances: 100", "max_instances: 10000", 1)
	e, clk := engine(b, strings.Replace(pol, "tokens_per_minute: 5000", "tokens_per_minute: 1000000", 1))
	for i := range 10000 {
		if d := spend(b, e, tenantChat(fmt.Sprintf("tenant-%05d", i)), 10); d.Verdict != policy.Admit {
			b.Fatalf("tenant %d: %+v", i, d)
		}
	}
	if n := len(e.SaveState(clk.Now()).Windows); n != 2*10000+1 {
		b.Fatalf("%d windows, want every tenant's day and minute and chat's minute", n)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := statefile.Encode(e.SaveState(clk.Now())); err != nil {
			b.Fatal(err)
		}
	}
}

// TestUsageSurvivesARestart: usage is saved with the budgets and restored by a restart; after
// one at the same instant every window reports as before, and the usage of the last hour is
// still there a minute later. A policy without usage restores none.
func TestUsageSurvivesARestart(t *testing.T) {
	e, clk := engine(t, usagePolicy)
	for i, tenant := range []string{"acme", "acme", "initech"} {
		_, tk := admitTokens(e, input{headers: map[string]string{"x-tenant-id": tenant, "x-model": "gpt-x"}}, 10, 10)
		tk.Done(usage(int64(100*(i+1)), 10))
		clk.Advance(20 * time.Minute)
	}
	before := map[string]usagetab.Report{}
	for _, w := range []usagetab.Window{usagetab.Hour, usagetab.Day, usagetab.Month} {
		r, _ := e.Usage().Report(clk.Now(), usagetab.Query{By: usagetab.ByTenantModel, Window: w, Top: 10})
		before[w.String()] = r
	}
	e2, clk2, n := restart(t, e, clk, usagePolicy, 0)
	if n[statefile.KindUsage] == 0 {
		t.Fatalf("restored %v", n)
	}
	for _, w := range []usagetab.Window{usagetab.Hour, usagetab.Day, usagetab.Month} {
		r, _ := e2.Usage().Report(clk2.Now(), usagetab.Query{By: usagetab.ByTenantModel, Window: w, Top: 10})
		if r.Total != before[w.String()].Total || len(r.Rows) != 2 || r.Rows[0] != before[w.String()].Rows[0] {
			t.Errorf("%s after a restart: %+v, before %+v", w, r.Rows, before[w.String()].Rows)
		}
	}
	e3, clk3, _ := restart(t, e, clk, usagePolicy, time.Minute)
	if row := usageRow(t, e3, usagetab.ByTenant, usagetab.Key{Tenant: "acme"}); row.Counts.Prompt != 300 || !clk3.Now().After(clk.Now()) {
		t.Errorf("acme a minute after: %+v", row.Counts)
	}
	_, _, n = restart(t, e, clk, usagePolicy+"usage: {enabled: false}\n", 0)
	if n[statefile.KindUsage] != 0 {
		t.Errorf("a policy without usage restored %d tables", n[statefile.KindUsage])
	}
}
