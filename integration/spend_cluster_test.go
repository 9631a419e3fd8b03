package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
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

// skipNearMidnight skips a test of chat's daily budget that could run over midnight UTC, when
// the budget resets.
func skipNearMidnight(t *testing.T) {
	t.Helper()
	if now := time.Now().UTC(); now.Add(2*time.Minute).Day() != now.Day() {
		t.Skip("too close to midnight UTC: chat's daily spend budget would reset during the test")
	}
}

// spendFleet is a Redis server and the mock LLM for replicas sharing spend budgets.
type spendFleet struct {
	rd *redistest.Server
	up *envoysim.HTTPUpstream
}

func newSpendFleet(t *testing.T) spendFleet {
	t.Helper()
	return spendFleet{rd: redistest.Standalone(t), up: startMockLLM(t, mock.Options{TimeScale: 0.01})}
}

// start starts one replica per id serving policy with cfg's cluster section (its address set
// to the fleet's Redis, and cluster.timeout to timeout unless 0).
func (f spendFleet) start(t *testing.T, policy string, cfg clusterConfig, timeout time.Duration, ids ...string) []*harness.Replica {
	t.Helper()
	cfg.addrs = []string{f.rd.Addr()}
	cl := cfg.yaml()
	if timeout > 0 {
		cl = strings.Replace(cl, "timeout: 1s", "timeout: "+timeout.String(), 1)
	}
	return startReplicas(t, writePolicy(t, policy+cl), ids...)
}

// startSpendFleet starts a spend fleet and its replicas serving spendClusterPolicy.
func startSpendFleet(t *testing.T, cfg clusterConfig, ids ...string) (*redistest.Server, *envoysim.HTTPUpstream, []*harness.Replica) {
	t.Helper()
	f := newSpendFleet(t)
	return f.rd, f.up, f.start(t, spendClusterPolicy, cfg, 0, ids...)
}

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
	skipNearMidnight(t)
	eachSpendClusterMode(t, func(t *testing.T, mode string) {
		prefix := "spend-" + mode
		rd, up, reps := startSpendFleet(t, clusterConfig{prefix: prefix, admission: mode}, "spend-a", "spend-b")

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
		spent, err := rd.Do("HGET", chatDay(prefix, time.Now().UTC()), "s")
		if want := fmt.Sprint(admitted * 150000); err != nil || spent != want {
			t.Errorf("Redis holds %q micro-units spent (%v), want %s", spent, err, want)
		}
		if ttl, err := rd.Do("PTTL", chatDay(prefix, time.Now().UTC())); err != nil || strings.HasPrefix(ttl, "-") {
			t.Errorf("the window's key has no expiry: PTTL %q (%v)", ttl, err)
		}

	})
}

// TestClusterSpendWithoutRedis: with Redis gone, on_unavailable: local enforces this replica's
// share of the spend budget (half of $1.00 with two replicas) and closed refuses every request.
// When Redis is back (restarted empty) what the replica spent on its own is added to it, so the
// other replica counts it too and the budget is not spent twice.
func TestClusterSpendWithoutRedis(t *testing.T) {
	skipNearMidnight(t)
	eachSpendClusterMode(t, func(t *testing.T, mode string) {
		f := newSpendFleet(t)
		rd, up := f.rd, f.up
		cfg := clusterConfig{leaseTTL: 2 * time.Second, heartbeat: 250 * time.Millisecond, admission: mode}
		cfg.prefix, cfg.onUnavailable = "spend-local-"+mode, "local"
		local := f.start(t, spendClusterPolicy, cfg, 0, "local-a", "local-b")
		cfg.prefix, cfg.onUnavailable = "spend-closed-"+mode, "closed"
		closed := f.start(t, spendClusterPolicy, cfg, 0, "closed-a")

		rd.Kill()
		for _, r := range append(local, closed...) {
			clusterWait(t, r.Name+" to notice Redis is gone", func() bool { return replicaMetric(t, r, "llm_bulkhead_cluster_available") == 0 })
		}
		r := local[0]
		if v := replicaSpend(t, r, "feature/chat", "day"); v.Local == nil || !near(v.Local.Limit, 0.5) || !near(v.Limit, 1) {
			t.Fatalf("%s without Redis: %+v (local %+v), want the $1.00 budget and a local share of $0.50", r.Name, v, v.Local)
		}
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
		spentHere := float64(admitted) * chatCost
		if v := replicaMetric(t, r, "llm_bulkhead_spend_local_pending"); !near(v, spentHere) {
			t.Errorf("%s: $%v pending for Redis, want the $%.2f it spent", r.Name, v, spentHere)
		}

		res, err := closed[0].Do(context.Background(), pricedChat(), up)
		if err != nil {
			t.Fatal(err)
		}
		if res.Status != 503 || header(res, "x-bulkhead-reason") != "cluster_unavailable" {
			t.Errorf("closed replica without Redis answered %d %s, want 503 cluster_unavailable", res.Status, header(res, "x-bulkhead-reason"))
		}

		// Redis comes back empty: the spend counted locally is added to it, once.
		rd.Restart()
		for _, x := range local {
			clusterWait(t, x.Name+" to see the spend made without Redis", func() bool {
				v := replicaSpend(t, x, "feature/chat", "day")
				return replicaMetric(t, x, "llm_bulkhead_cluster_available") == 1 && near(v.Spent, spentHere) && v.Reserved == 0
			})
		}
		if spent, err := rd.Do("HGET", chatDay("spend-local-"+mode, time.Now().UTC()), "s"); err != nil || spent != fmt.Sprint(int(spentHere*1e6+0.5)) {
			t.Errorf("Redis holds %q micro-units spent (%v), want the $%.2f spent without it", spent, err, spentHere)
		}
		if v := replicaMetric(t, r, "llm_bulkhead_spend_local_pending"); v != 0 {
			t.Errorf("$%v still pending once Redis is back", v)
		}
	})
}

// eachSpendClusterMode runs f once per cluster admission mode (clusterAdmissions), as a subtest
// named after it.
func eachSpendClusterMode(t *testing.T, f func(t *testing.T, mode string)) {
	for _, m := range clusterAdmissions {
		t.Run(m, func(t *testing.T) { f(t, m) })
	}
}

// dollarPolicy gives chat $10 an hour at $1 an output token (prompts are free), for requests
// asking for one token: each reserves and costs exactly $1.
const dollarPolicy = `
envoy: {max_message_timeout: 30s}
classification:
  feature: {rules: [{header: x-llm-feature}]}
  provider: {default: p}
  model: {rules: [{body: model}]}
models:
  - {match: "*", provider: p}
prices:
  - {match: default, input_per_mtok: 0, output_per_mtok: 1000000}
features:
  chat: {max_concurrent: 200, spend_per_hour: 10}
  default: {max_concurrent: 10}
providers:
  p: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
`

// dollarChat asks for one output token: $1 at worst, and the mock LLM writes and reports one.
func dollarChat() *envoysim.Request {
	return &envoysim.Request{
		Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: "chat"},
			{Key: mock.HeaderCompletionTokens, Value: "1"}},
		Body: []byte(`{"model":"m-1","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`),
	}
}

// spendView is one budget of a replica's GET /admin/spend.
type spendView struct {
	Budget, Period         string
	Limit, Spent, Reserved float64
	Local                  *struct{ Limit, Spent, Reserved, Pending float64 }
}

func replicaSpend(t *testing.T, r *harness.Replica, budget, period string) spendView {
	t.Helper()
	var out struct {
		Budgets []struct {
			Budget   string      `json:"budget"`
			Period   string      `json:"period"`
			Limit    json.Number `json:"limit"`
			Spent    json.Number `json:"spent"`
			Reserved json.Number `json:"reserved"`
			Local    *struct {
				Limit    json.Number `json:"limit"`
				Spent    json.Number `json:"spent"`
				Reserved json.Number `json:"reserved"`
				Pending  json.Number `json:"pending"`
			} `json:"local"`
		} `json:"budgets"`
	}
	if err := r.Get("/admin/spend", &out); err != nil {
		t.Fatal(err)
	}
	f := func(n json.Number) float64 { v, _ := n.Float64(); return v }
	for _, b := range out.Budgets {
		if b.Budget == budget && b.Period == period {
			v := spendView{Budget: b.Budget, Period: b.Period, Limit: f(b.Limit), Spent: f(b.Spent), Reserved: f(b.Reserved)}
			if b.Local != nil {
				v.Local = &struct{ Limit, Spent, Reserved, Pending float64 }{f(b.Local.Limit), f(b.Local.Spent), f(b.Local.Reserved), f(b.Local.Pending)}
			}
			return v
		}
	}
	t.Fatalf("%s has no %s budget of %s", r.Name, period, budget)
	return spendView{}
}

// TestClusterSpendTimeoutsAreNotFreeMoney: three replicas share chat's $10 an hour while Redis
// answers, but too slowly for cluster.timeout (a CLIENT PAUSE as 60 requests arrive at once, 20
// on each replica). A reservation that times out is decided on its replica only within its
// share of what Redis last showed left ($10 ÷ 3: three $1 requests each), and everything spent
// so reaches Redis once it answers: the fleet never admits more than the $10, every replica's
// /admin/spend and Redis count every dollar, and the budget then refuses exactly as if every
// reservation had been answered.
func TestClusterSpendTimeoutsAreNotFreeMoney(t *testing.T) {
	if now := time.Now(); now.Add(2*time.Minute).Hour() != now.Hour() {
		t.Skip("too close to the end of the hour: chat's hourly spend budget would reset during the test")
	}
	eachSpendClusterMode(t, func(t *testing.T, mode string) {
		fleet := newSpendFleet(t)
		rd, up, prefix := fleet.rd, fleet.up, "timeouts-"+mode
		cfg := clusterConfig{prefix: prefix, leaseTTL: 5 * time.Second, heartbeat: 250 * time.Millisecond, admission: mode}
		// Reservations wait 50 ms for Redis: the pause below is far longer.
		// chat's spend is its only shared limit: slots would be decided by Redis too (a replica
		// cut off by unanswered admissions keeps to the slots Redis counts for it), and the test
		// is about the money.
		policy := strings.Replace(dollarPolicy, "max_concurrent: 200, ", "", 1)
		reps := fleet.start(t, policy, cfg, 50*time.Millisecond, "money-a", "money-b", "money-c")

		if _, err := rd.Do("CLIENT", "PAUSE", "1500", "ALL"); err != nil {
			t.Fatal(err)
		}
		f := newFlight(60)
		for i := range reps {
			for range 20 {
				f.send(reps, i, "burst", dollarChat(), up)
			}
		}
		burst := 0
		for _, o := range f.collect(t) {
			switch {
			case o.what() == "200":
				burst++
			case o.what() == "429 spend_budget":
			default:
				t.Errorf("%s answered %s", reps[o.replica].Name, o.what())
			}
		}
		fellBack := 0.0
		for _, r := range reps {
			fellBack += replicaMetric(t, r, "llm_bulkhead_spend_store_fallbacks_total")
		}
		if fellBack == 0 {
			t.Fatal("no reservation timed out: the test did not exercise the fallback")
		}
		t.Logf("%d of 60 admitted while Redis was paused, %v reservations decided locally", burst, fellBack)
		if burst > 9 {
			t.Errorf("%d admitted while Redis did not answer: each replica's share is three $1 requests of $10", burst)
		}
		for _, r := range reps {
			clusterWait(t, r.Name+" to add what it spent to Redis", func() bool {
				return replicaMetric(t, r, "llm_bulkhead_spend_local_pending") == 0 && replicaMetric(t, r, "llm_bulkhead_cluster_available") == 1
			})
		}
		hour := time.Now().UTC().Truncate(time.Hour).Unix()
		key := fmt.Sprintf("{%s}:sp:feature/chat|hour|%d", prefix, hour)
		clusterWait(t, "Redis to count every dollar spent", func() bool {
			s, _ := rd.Do("HGET", key, "s")
			r, _ := rd.Do("HGET", key, "r")
			return s == fmt.Sprint(burst*1_000_000) && (r == "0" || r == "")
		})
		local := 0.0
		for _, r := range reps {
			v := replicaSpend(t, r, "feature/chat", "hour")
			if !near(v.Spent, float64(burst)) || v.Reserved != 0 || v.Local == nil || v.Local.Pending != 0 || v.Local.Spent > 10.0/3 {
				t.Errorf("%s /admin/spend: %+v (local %+v), want $%d spent, at most $3.33 of it counted locally, nothing pending", r.Name, v, v.Local, burst)
			}
			if v.Local != nil {
				local += v.Local.Spent
			}
		}
		if !near(local, float64(burst)) {
			t.Errorf("replicas counted $%v locally, want the $%d admitted while Redis was paused", local, burst)
		}
		// Redis answers again: the budget admits what is left of the $10, then refuses.
		var after []string
		for i := range 12 {
			res, err := reps[i%3].Do(context.Background(), dollarChat(), up)
			if err != nil {
				t.Fatal(err)
			}
			after = append(after, fmt.Sprintf("%d %s", res.Status, header(res, "x-bulkhead-reason")))
		}
		if n := strings.Count(strings.Join(after, ","), "200"); burst+n != 10 {
			t.Errorf("after the pause %d more admitted (%q): the fleet admitted $%d of $10", n, strings.Join(after, ","), burst+n)
		}
	})
}

// TestClusterSpendRequestLargerThanBudget: in cluster mode too, a request whose worst case is
// more than the whole budget ($2.10 against chat's $1.00 a day) is refused by a window nothing
// was spent in, whichever replica it reaches, and charges nothing.
func TestClusterSpendRequestLargerThanBudget(t *testing.T) {
	skipNearMidnight(t)
	eachSpendClusterMode(t, func(t *testing.T, mode string) {
		prefix := "spend-large-" + mode
		rd, up, reps := startSpendFleet(t, clusterConfig{prefix: prefix, admission: mode}, "large-a", "large-b")
		for _, r := range reps {
			req := pricedChat()
			req.Body = []byte(strings.Replace(string(req.Body), `"max_tokens":100`, `"max_tokens":2000`, 1))
			res, err := r.Do(context.Background(), req, up)
			if err != nil {
				t.Fatal(err)
			}
			if res.Status != 429 || header(res, "x-bulkhead-reason") != "spend_budget" || !strings.Contains(string(res.Body), "more than the whole spend budget") {
				t.Errorf("%s: %d %s %s, want 429 spend_budget saying the request is larger than the budget", r.Name, res.Status, header(res, "x-bulkhead-reason"), res.Body)
			}
		}
		if n, err := rd.Do("EXISTS", chatDay(prefix, time.Now().UTC())); err != nil || n != "0" {
			t.Errorf("the refused requests created chat's window in Redis (EXISTS %q, %v)", n, err)
		}
	})
}

// spendLeases returns what a replica's chunks of spend windows hold unused, in dollars, from
// GET /admin/cluster.
func spendLeases(t *testing.T, r *harness.Replica) float64 {
	t.Helper()
	var v struct {
		SpendLeases []struct {
			Unused json.Number `json:"unused"`
		} `json:"spend_leases"`
	}
	if err := r.Get("/admin/cluster", &v); err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, s := range v.SpendLeases {
		f, _ := s.Unused.Float64()
		sum += f
	}
	return sum
}

// TestClusterLeasedSpendThroughOutage: with leased admission, two replicas hold chunks of chat's
// hourly spend window when Redis stops (SIGSTOP: their reports go unanswered, and run when it
// continues). They go on admitting from their chunks, settling each $1 request here, until a
// chunk runs short: its replica then reports at once (the report Redis will run late, carrying
// what was spent) and decides the request on its own. Once Redis continues, the window counts
// every dollar spent, before and during the outage, exactly once, and keeps doing so after
// further rounds.
func TestClusterLeasedSpendThroughOutage(t *testing.T) {
	if now := time.Now(); now.Add(2*time.Minute).Hour() != now.Hour() {
		t.Skip("too close to the end of the hour: chat's hourly spend budget would reset during the test")
	}
	fleet := newSpendFleet(t)
	rd, up, prefix := fleet.rd, fleet.up, "chunks"
	cfg := clusterConfig{prefix: prefix, leaseTTL: 10 * time.Second, heartbeat: 250 * time.Millisecond, admission: "leased"}
	policy := strings.Replace(dollarPolicy, "spend_per_hour: 10", "spend_per_hour: 10000", 1)
	// Reports wait 200 ms for Redis: the pause below outlasts them, so Redis runs them once it
	// continues, and the replicas send them again.
	reps := fleet.start(t, policy, cfg, 200*time.Millisecond, "chunk-a", "chunk-b")
	admitted := 0
	send := func(r *harness.Replica) {
		t.Helper()
		res, err := r.Do(context.Background(), dollarChat(), up)
		if err != nil {
			t.Fatal(err)
		}
		if res.Status != 200 {
			t.Fatalf("%s: %d %s", r.Name, res.Status, header(res, "x-bulkhead-reason"))
		}
		admitted++
	}
	// Requests one after the other on each replica until each holds at least $10 unused.
	for _, r := range reps {
		clusterWait(t, r.Name+" to hold a chunk of $10", func() bool {
			for range 5 {
				send(r)
			}
			return spendLeases(t, r) >= 10
		})
	}
	rd.Pause(0)
	for range 3 {
		for _, r := range reps {
			send(r)
		}
	}
	for _, r := range reps {
		if v := replicaMetric(t, r, "llm_bulkhead_spend_store_fallbacks_total"); v != 0 {
			t.Fatalf("%s decided %v reservations outside its chunk: the test must spend from chunks", r.Name, v)
		}
	}
	// a spends on until its chunk runs short. That request waits for the report (for
	// cluster.timeout) and may then find its lease of chat's slots unusable as well: it may be
	// refused, and then costs nothing.
	clusterWait(t, reps[0].Name+"'s chunk to run short", func() bool {
		res, err := reps[0].Do(context.Background(), dollarChat(), up)
		if err != nil {
			t.Fatal(err)
		}
		if res.Status == 200 {
			admitted++
		} else {
			t.Logf("%s while its chunk ran short: %d %s", reps[0].Name, res.Status, header(res, "x-bulkhead-reason"))
		}
		return replicaMetric(t, reps[0], "llm_bulkhead_spend_store_fallbacks_total") > 0
	})
	for _, r := range reps {
		clusterWait(t, r.Name+" to notice Redis does not answer", func() bool { return replicaMetric(t, r, "llm_bulkhead_cluster_available") == 0 })
	}
	rd.Resume()
	key := fmt.Sprintf("{%s}:sp:feature/chat|hour|%d", prefix, time.Now().UTC().Truncate(time.Hour).Unix())
	want := fmt.Sprint(admitted * 1_000_000)
	clusterWait(t, fmt.Sprintf("Redis to count the $%d spent", admitted), func() bool {
		s, _ := rd.Do("HGET", key, "s")
		return s == want
	})
	// Further rounds (the replicas report every 50 ms, a steady chunk every 250 ms) add nothing.
	time.Sleep(time.Second)
	if s, _ := rd.Do("HGET", key, "s"); s != want {
		t.Fatalf("Redis counts %s micro-dollars spent, want %s: the outage's spend counted more than once", s, want)
	}
	for _, r := range reps {
		if v := replicaSpend(t, r, "feature/chat", "hour"); !near(v.Spent, float64(admitted)) {
			t.Errorf("%s /admin/spend: $%v spent, want $%d", r.Name, v.Spent, admitted)
		}
	}
}
