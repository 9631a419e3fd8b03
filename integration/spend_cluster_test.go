package integration_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
)

// spendClusterPolicy is spendStatePolicy's prices and chat feature with a $1.00 daily budget,
// no state file, to be shared through Redis.
const spendClusterPolicy = `
envoy: {max_message_timeout: 30s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: deepseek
    rules: [{model_map: true}]
  model:
    rules: [{body: model}]
models:
  - {match: "deepseek-*", provider: deepseek}
prices:
  - {match: "deepseek-*", input_per_mtok: 1000, output_per_mtok: 1000}
features:
  chat:
    max_concurrent: 20
    spend_per_day: 1.00
  default: {max_concurrent: 10}
providers:
  deepseek: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`

// chatDay is the key of chat's daily spend window in Redis, for the day now falls in (UTC).
func chatDay(prefix string, now time.Time) string {
	start := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC)
	return fmt.Sprintf("{%s}:sp:feature/chat|day|%d", prefix, start.Unix())
}

// expectedOutcomes is what n requests, one after the other, each reserving reserve and settling
// at cost, get from a budget of limit: admitted while what is spent leaves room for the
// reservation, then refused with spend_budget.
func expectedOutcomes(n int, limit, reserve, cost float64) string {
	out := make([]string, n)
	used := 0.0
	for i := range out {
		if used+reserve <= limit+1e-9 {
			out[i] = "200 "
			used += cost
		} else {
			out[i] = "429 spend_budget"
		}
	}
	return strings.Join(out, ",")
}

// reservedEach is what each admitted chat request reserved on r (admitted requests so far).
func reservedEach(t *testing.T, r *harness.Replica, admitted int) float64 {
	t.Helper()
	return replicaMetric(t, r, "llm_bulkhead_spend_reserved_total", "feature", "chat") / float64(admitted)
}

// TestClusterSharedSpendBudget: two replicas share chat's $1.00 a day through Redis. Requests
// alternate between them; each reserves its worst case (about $0.20: 100 prompt tokens
// estimated, max_tokens 100) and settles at $0.15, so the budget admits exactly what one
// process would, whichever replica each request reaches. Both replicas then report the same
// spend, and Redis holds it.
func TestClusterSharedSpendBudget(t *testing.T) {
	if now := time.Now().UTC(); now.Add(2*time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: chat's daily spend budget would reset during the test")
	}
	rd := redistest.Standalone(t)
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	cfg := clusterConfig{addrs: []string{rd.Addr()}, prefix: "spend"}
	reps := startReplicas(t, writePolicy(t, spendClusterPolicy+cfg.yaml()), "spend-a", "spend-b")

	var got []string
	for i := range 8 {
		r := reps[i%2]
		res, err := r.Do(context.Background(), pricedChat(), up)
		if err != nil {
			t.Fatalf("request %d on %s: %v", i+1, r.Name, err)
		}
		got = append(got, fmt.Sprintf("%d %s", res.Status, header(res, "x-bulkhead-reason")))
		// Settlements reach Redis in the background: wait for this one before the next.
		if res.Status == 200 {
			want := float64(strings.Count(strings.Join(got, ","), "200")) * chatCost
			clusterWait(t, fmt.Sprintf("$%.2f settled in Redis", want), func() bool {
				return near(replicaMetric(t, reps[(i+1)%2], "llm_bulkhead_spend_budget_used", "compartment", "feature/chat", "period", "day"), want)
			})
		}
	}
	admitted := strings.Count(strings.Join(got, ","), "200")
	reserve := reservedEach(t, reps[0], (admitted+1)/2)
	if reserve < chatCost || reserve > 0.5 {
		t.Fatalf("each request reserved $%v: want its worst case, more than its $%.2f cost", reserve, chatCost)
	}
	if want := expectedOutcomes(8, 1.00, reserve, chatCost); strings.Join(got, ",") != want {
		t.Fatalf("outcomes %q, want %q (reserving $%v each)", strings.Join(got, ","), want, reserve)
	}
	t.Logf("outcomes %q, reserving $%v each", strings.Join(got, ","), reserve)
	if admitted < 2 || admitted == 8 {
		t.Fatalf("%d of 8 admitted: the test must reach the budget with both replicas", admitted)
	}
	used := float64(admitted) * chatCost
	for _, r := range reps {
		if v := replicaMetric(t, r, "llm_bulkhead_spend_budget_used", "compartment", "feature/chat", "period", "day"); !near(v, used) {
			t.Errorf("%s reports $%v used, want $%.2f", r.Name, v, used)
		}
	}
	spent, err := rd.Do("HGET", chatDay("spend", time.Now().UTC()), "s")
	if want := fmt.Sprint(admitted * 150000); err != nil || spent != want {
		t.Errorf("Redis holds %q micro-units spent (%v), want %s", spent, err, want)
	}
	if ttl, err := rd.Do("PTTL", chatDay("spend", time.Now().UTC())); err != nil || strings.HasPrefix(ttl, "-") {
		t.Errorf("the window's key has no expiry: PTTL %q (%v)", ttl, err)
	}
}

// TestClusterSpendWithoutRedis: with Redis gone, on_unavailable: local enforces this replica's
// share of the spend budget (half of $1.00 with two replicas), and closed refuses every request.
func TestClusterSpendWithoutRedis(t *testing.T) {
	if now := time.Now().UTC(); now.Add(2*time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: chat's daily spend budget would reset during the test")
	}
	rd := redistest.Standalone(t)
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	cfg := clusterConfig{addrs: []string{rd.Addr()}, leaseTTL: 2 * time.Second, heartbeat: 250 * time.Millisecond}
	cfg.prefix, cfg.onUnavailable = "spend-local", "local"
	local := startReplicas(t, writePolicy(t, spendClusterPolicy+cfg.yaml()), "local-a", "local-b")
	cfg.prefix, cfg.onUnavailable = "spend-closed", "closed"
	closed := startReplicas(t, writePolicy(t, spendClusterPolicy+cfg.yaml()), "closed-a")

	rd.Kill()
	for _, r := range append(local, closed...) {
		clusterWait(t, r.Name+" to notice Redis is gone", func() bool { return replicaMetric(t, r, "llm_bulkhead_cluster_available") == 0 })
	}
	r := local[0]
	clusterWait(t, r.Name+" to enforce its share", func() bool {
		return near(replicaMetric(t, r, "llm_bulkhead_spend_budget_limit", "compartment", "feature/chat", "period", "day"), 0.5)
	})
	// Requests reserving about $0.20 and costing $0.15, against $0.50.
	var got []string
	for range 4 {
		res, err := r.Do(context.Background(), pricedChat(), up)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%d %s", res.Status, header(res, "x-bulkhead-reason")))
	}
	admitted := strings.Count(strings.Join(got, ","), "200")
	reserve := reservedEach(t, r, admitted)
	t.Logf("%s without Redis: %q, reserving $%v each", r.Name, strings.Join(got, ","), reserve)
	if want := expectedOutcomes(4, 0.50, reserve, chatCost); strings.Join(got, ",") != want || admitted == 4 {
		t.Errorf("%s without Redis: %q, want %q (its half of the budget, reserving $%v each)", r.Name, strings.Join(got, ","), want, reserve)
	}
	if v := replicaMetric(t, r, "llm_bulkhead_spend_store_fallbacks_total"); v < float64(admitted) {
		t.Errorf("spend reservations made locally: %v, want at least %d", v, admitted)
	}

	res, err := closed[0].Do(context.Background(), pricedChat(), up)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != 503 || header(res, "x-bulkhead-reason") != "cluster_unavailable" {
		t.Errorf("closed replica without Redis answered %d %s, want 503 cluster_unavailable", res.Status, header(res, "x-bulkhead-reason"))
	}
}
