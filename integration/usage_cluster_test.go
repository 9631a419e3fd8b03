package integration_test

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// fleetUsage returns GET /admin/usage?query of r once its totals count requests.
func fleetUsage(t *testing.T, r *harness.Replica, query string, requests uint64) usageReport {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		var u usageReport
		if err := r.Get("/admin/usage?"+query, &u); err != nil {
			t.Fatal(err)
		}
		if u.Totals.Requests == requests {
			return u
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s never counted %d requests (%s): %+v", r.Name, requests, query, u)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestClusterUsageIsTheFleetsAndSurvivesRestarts: two replicas share their usage through Redis.
// /admin/usage on either answers for the fleet (scope fleet: the requests both served), with
// scope=replica for what it served itself; after both replicas restart (each sending what it
// counted as it stops), the fleet's answer is the same, row for row.
func TestClusterUsageIsTheFleetsAndSurvivesRestarts(t *testing.T) {
	f := newSpendFleet(t)
	cfg := clusterConfig{prefix: "usage-fleet", leaseTTL: 2 * time.Second}
	reps := f.start(t, usageReportPolicy, cfg, 0, "a", "b")
	ctx := context.Background()
	send := func(r *harness.Replica, tenant, model string) {
		t.Helper()
		res, err := r.Do(ctx, usageRequest(tenant, model, false, 0), f.up)
		if err != nil || res.Status != 200 {
			t.Fatalf("%s for %s: %v %+v", r.Name, tenant, err, res)
		}
	}
	for range 3 {
		send(reps[0], "acme", "gpt-4o")
	}
	send(reps[1], "acme", "gpt-4o")
	send(reps[1], "initech", "claude-sonnet-4")

	const query = "by=tenant,model&window=24h"
	fleet := fleetUsage(t, reps[0], query, 5)
	if fleet.Scope != "fleet" || len(fleet.Rows) != 2 || fleet.Rows[0].Tenant != "acme" || fleet.Rows[0].Requests != 4 {
		t.Fatalf("the fleet's usage on a: %+v", fleet)
	}
	if own := fleetUsage(t, reps[0], query+"&scope=replica", 3); own.Scope != "replica" || len(own.Rows) != 1 {
		t.Fatalf("a's own usage: %+v", own)
	}
	for _, r := range reps {
		if err := r.Stop(20 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	again := f.start(t, usageReportPolicy, cfg, 0, "a", "b")
	for _, r := range again {
		after := fleetUsage(t, r, query, 5)
		after.Totals.Spend, fleet.Totals.Spend = 0, 0
		if !reflect.DeepEqual(after.Rows, fleet.Rows) || !reflect.DeepEqual(after.Totals, fleet.Totals) {
			t.Fatalf("after the restarts %s answers %+v, before %+v", r.Name, after, fleet)
		}
	}
}
