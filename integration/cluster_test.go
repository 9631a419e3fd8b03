package integration_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/redistest"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// Cluster mode end to end: llm-bulkhead replicas in processes of their own (the test binary run
// again, see harness.StartReplica) sharing their limits through a real redis-server, each
// behind its own Envoy simulator. Every test fails if the replicas did not share: without the
// cluster section each replica would admit its own full limit.

func init() { harness.ServeReplicaIfAsked() }

// clusterConfig is the cluster section of a test policy.
type clusterConfig struct {
	mode          string // standalone, cluster or sentinel
	addrs         []string
	masterName    string
	prefix        string
	leaseTTL      time.Duration
	heartbeat     time.Duration // 0: the default, lease_ttl / 4
	onUnavailable string        // "": the default, local
	// admission is cluster.admission: exact or leased ("": exact, which the tests that look at
	// Redis's per-request state need).
	admission string
}

// clusterAdmissions are the cluster admission modes the tests of both run in.
var clusterAdmissions = []string{"exact", "leased"}

func (c clusterConfig) yaml() string {
	var b strings.Builder
	quoted := make([]string, len(c.addrs))
	for i, a := range c.addrs {
		quoted[i] = strconv.Quote(a)
	}
	mode := c.mode
	if mode == "" {
		mode = "standalone"
	}
	fmt.Fprintf(&b, "cluster:\n  backend: redis\n  mode: %s\n  addresses: [%s]\n  key_prefix: %s\n",
		mode, strings.Join(quoted, ", "), c.prefix)
	if c.masterName != "" {
		fmt.Fprintf(&b, "  master_name: %s\n", c.masterName)
	}
	// An admission waits for Redis 20 ms by default. Under -race, on a busy two-core machine
	// running several replicas, an answer can take longer, and a replica would then enforce
	// its share locally: a test of what is shared must not depend on that. Redis being gone
	// (connection refused) is noticed at once whatever this says.
	b.WriteString("  timeout: 1s\n")
	if c.leaseTTL > 0 {
		fmt.Fprintf(&b, "  lease_ttl: %s\n", c.leaseTTL)
	}
	if c.heartbeat > 0 {
		fmt.Fprintf(&b, "  heartbeat: %s\n", c.heartbeat)
	}
	if c.onUnavailable != "" {
		fmt.Fprintf(&b, "  on_unavailable: %s\n", c.onUnavailable)
	}
	switch c.admission {
	case "", "exact":
		b.WriteString("  admission: exact\n")
	case "leased":
		// Reports every 50 ms: the tests' fleets follow their demand within a fraction of a
		// second.
		b.WriteString("  admission: leased\n  lease_interval: 50ms\n")
	}
	return b.String()
}

// startReplicas starts one replica per id, all serving the policy at path (replica_id set
// through the environment, as a deployment would), and waits until each shares its limits and
// sees all of them live. They are stopped with SIGTERM when the test ends; a replica that then
// does not exit cleanly, or reported a data race, fails the test.
func startReplicas(t *testing.T, path string, ids ...string) []*harness.Replica {
	t.Helper()
	reps := make([]*harness.Replica, len(ids))
	errs := make([]error, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Go(func() {
			reps[i], errs[i] = harness.StartReplica(harness.ReplicaOptions{Name: id, PolicyPath: path,
				Env: []string{"LLM_BULKHEAD_CLUSTER__REPLICA_ID=" + id},
				// As in start: the simulator's own message timer is generous under -race; the
				// server still plans its waits against the policy's.
				Filter: func(f *envoysim.FilterConfig) { f.MessageTimeout = 30 * time.Second }})
		})
	}
	wg.Wait()
	for _, r := range reps {
		if r != nil {
			t.Cleanup(func() {
				if err := r.Close(); err != nil {
					t.Errorf("stopping %s: %v", r.Name, err)
				}
				if n := r.Races(); n > 0 {
					t.Errorf("replica %s reported %d data races:\n%s", r.Name, n, r.Tail())
				} else if t.Failed() {
					t.Logf("replica %s, last log lines:\n%s", r.Name, r.Tail())
				}
			})
		}
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("replica %s: %v", ids[i], err)
		}
	}
	for _, r := range reps {
		clusterWait(t, r.Name+" to share its limits with all replicas", func() bool {
			return replicaMetric(t, r, "llm_bulkhead_cluster_available") == 1 &&
				replicaMetric(t, r, "llm_bulkhead_cluster_live_replicas") == float64(len(ids))
		})
	}
	return reps
}

// clusterWait polls cond for up to 20 s: a bound for a broken build, not a timing assertion.
func clusterWait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out (20s) waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// replicaMetric returns the sum of a replica's series named name with the given labels (0 if none).
func replicaMetric(t *testing.T, r *harness.Replica, name string, labels ...string) float64 {
	t.Helper()
	ss, err := r.Metrics()
	if err != nil {
		t.Fatalf("%s: %v", r.Name, err)
	}
	v, _ := ss.Value(name, labels...)
	return v
}

// replicaCompartment returns a replica's view of compartment name; it may run off the test's
// goroutine.
func replicaCompartment(r *harness.Replica, name string) (policy.CompartmentView, error) {
	var out struct {
		Compartments []policy.CompartmentView `json:"compartments"`
	}
	if err := r.Get("/admin/compartments", &out); err != nil {
		return policy.CompartmentView{}, err
	}
	for _, c := range out.Compartments {
		if c.Name == name {
			return c, nil
		}
	}
	return policy.CompartmentView{}, fmt.Errorf("%s has no compartment %s", r.Name, name)
}

func mustCompartment(t *testing.T, r *harness.Replica, name string) policy.CompartmentView {
	t.Helper()
	c, err := replicaCompartment(r, name)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// startMockLLM serves the mock LLM on a loopback port and returns an upstream reaching it.
func startMockLLM(t *testing.T, o mock.Options) *envoysim.HTTPUpstream {
	t.Helper()
	m, err := mock.New(o)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx, ln, time.Second) }()
	up, err := envoysim.NewHTTPUpstream("http://" + ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		up.CloseIdleConnections()
		cancel()
		<-done
	})
	return up
}

// slotKey is the Redis hash holding each replica's slots in a compartment.
func slotKey(prefix, compartment string) string { return "{" + prefix + "}:c:" + compartment }

// redisSlots returns the slots each replica holds in a compartment, as Redis has them.
func redisSlots(rd *redistest.Server, prefix, compartment string) (map[string]int64, error) {
	out, err := rd.Do("HGETALL", slotKey(prefix, compartment))
	if err != nil {
		return nil, err
	}
	held := map[string]int64{}
	if out == "" {
		return held, nil
	}
	f := strings.Split(out, "\n")
	for i := 0; i+1 < len(f); i += 2 {
		if id, ok := strings.CutPrefix(f[i], "n:"); ok {
			n, err := strconv.ParseInt(f[i+1], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("%s %s = %q", slotKey(prefix, compartment), f[i], f[i+1])
			}
			held[id] = n
		}
	}
	return held, nil
}

func sumHeld(m map[string]int64) int64 {
	var s int64
	for _, v := range m {
		s += v
	}
	return s
}

// assertNothingHeld checks that no replica holds a request and that Redis holds no slot or
// lease of the deployment: every admission was released everywhere.
func assertNothingHeld(t *testing.T, rd *redistest.Server, prefix string, reps []*harness.Replica) {
	t.Helper()
	for _, r := range reps {
		if r.Exited() {
			continue
		}
		clusterWait(t, r.Name+" to hold nothing", func() bool {
			return replicaMetric(t, r, "llm_bulkhead_inflight_requests") == 0
		})
	}
	tag := "{" + prefix + "}"
	clusterWait(t, "Redis to hold no slot and no lease", func() bool {
		keys, err := rd.Do("KEYS", tag+":c:*")
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range strings.Fields(keys) {
			held, err := redisSlots(rd, prefix, strings.TrimPrefix(k, tag+":c:"))
			if err != nil {
				t.Fatal(err)
			}
			for id, n := range held {
				if n != 0 {
					t.Logf("%s: %s holds %d", k, id, n)
					return false
				}
			}
		}
		leases, err := rd.Do("KEYS", tag+":l:*")
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range strings.Fields(leases) {
			if n, err := rd.Do("HLEN", k); err != nil || n != "0" {
				t.Logf("%s: %s leases (%v)", k, n, err)
				return false
			}
		}
		// Leased admission: every compartment's leases, idle replicas' included, given back.
		hashes, err := rd.Do("KEYS", "{"+prefix+"|*}:ls")
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range strings.Fields(hashes) {
			compartment := strings.TrimSuffix(strings.TrimPrefix(k, "{"+prefix+"|"), "}:ls")
			if n := leasedSlots(t, rd, prefix, compartment); n != 0 {
				t.Logf("%s: %d slots leased", k, n)
				return false
			}
		}
		return true
	})
}

// upstreamLoad counts the requests an upstream is serving at once, and the most it served at
// once: a request reaches the upstream only once admitted, and its slot is released only after
// the upstream answered, so this never exceeds the slots held.
type upstreamLoad struct {
	cur, peak, total atomic.Int64
}

func (l *upstreamLoad) enter() {
	l.total.Add(1)
	n := l.cur.Add(1)
	for {
		p := l.peak.Load()
		if n <= p || l.peak.CompareAndSwap(p, n) {
			return
		}
	}
}

func (l *upstreamLoad) leave() { l.cur.Add(-1) }

// heldUpstream answers every request only once released (one request per release, or all of
// them once opened), reporting each arrival.
type heldUpstream struct {
	arrived  chan struct{}
	release  chan struct{}
	open     chan struct{}
	openOnce sync.Once
	load     *upstreamLoad // shared with other upstreams, may be nil
	count    atomic.Int64  // arrivals
}

func newHeldUpstream(load *upstreamLoad) *heldUpstream {
	return &heldUpstream{arrived: make(chan struct{}, 1000), release: make(chan struct{}, 1000),
		open: make(chan struct{}), load: load}
}

func (h *heldUpstream) Serve(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
	if h.load != nil {
		h.load.enter()
		defer h.load.leave()
	}
	h.count.Add(1)
	h.arrived <- struct{}{}
	select {
	case <-h.release:
	case <-h.open:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}`).Serve(ctx, req)
}

// Open answers every held request, and every later one at once.
func (h *heldUpstream) Open() { h.openOnce.Do(func() { close(h.open) }) }

// outcome is one request's result on one replica.
type outcome struct {
	replica int
	label   string
	res     *envoysim.Result
	err     error
}

// what summarises an outcome: "200", or the status and the refusal's reason.
func (o outcome) what() string {
	switch {
	case o.err != nil:
		return "error " + o.err.Error()
	case o.res.Status == 200:
		return "200"
	}
	return fmt.Sprintf("%d %s", o.res.Status, header(o.res, "x-bulkhead-reason"))
}

// flight runs requests in the background and waits for all of them.
type flight struct {
	wg  sync.WaitGroup
	out chan outcome
}

func newFlight(n int) *flight { return &flight{out: make(chan outcome, n)} }

// send runs req on replica i through up; label tells its outcome apart.
func (f *flight) send(reps []*harness.Replica, i int, label string, req *envoysim.Request, up envoysim.Upstream) {
	f.wg.Go(func() {
		r, err := reps[i].Do(context.Background(), req, up)
		f.out <- outcome{replica: i, label: label, res: r, err: err}
	})
}

// collect waits for every request sent (up to 60 s: a bound for a broken build) and returns
// their outcomes.
func (f *flight) collect(t *testing.T) []outcome {
	t.Helper()
	done := make(chan struct{})
	go func() { f.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("requests still unanswered after 60s")
	}
	close(f.out)
	var out []outcome
	for o := range f.out {
		out = append(out, o)
	}
	return out
}

const paidBatchPolicy = `
envoy: {max_message_timeout: 30s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: local
    rules: [{model_map: true}]
  model:
    rules: [{body: model}]
models:
  - {match: "deepseek-*", provider: deepseek}
  - {match: "*", provider: local}
features:
  batch_summarize:          # over its paid budget: runs on the local model
    max_concurrent: 100
    max_wait: 0s
    degrade: {provider: local, on: [token_budget]}
  batch_export:             # over its paid budget: refused
    max_concurrent: 100
    max_wait: 0s
  default: {max_concurrent: 10}
providers:
  deepseek: {max_concurrent: 200}
  local:
    max_concurrent: 200
    models: [{match: "*", model: local-llama-3.1-8b}]
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: provider, key: [provider], limits_from: provider}
  - name: paid_batch        # 50 000 tokens a minute on paid providers, per feature
    key: [feature]
    where: {feature: [batch_summarize, batch_export], provider: [deepseek]}
    limits: {tokens_per_minute: 50000}
`

// paidDocument is a 5 000-token request for a paid model: 400 prompt bytes (100 tokens at 4
// bytes a token) plus max_tokens 4 900. The mock LLM reports exactly that usage (while writing
// only a few tokens).
func paidDocument(feature string) *envoysim.Request {
	body := fmt.Sprintf(`{"model":"deepseek-chat","max_tokens":4900,"messages":[{"role":"user","content":"%s"}]}`, strings.Repeat("a", 400))
	return &envoysim.Request{
		Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: feature},
			{Key: mock.HeaderCompletionTokens, Value: "8"},
			{Key: mock.HeaderReportPrompt, Value: "100"}, {Key: mock.HeaderReportCompletion, Value: "4900"},
			{Key: mock.HeaderReportTotal, Value: "5000"}},
		Body: []byte(body),
	}
}

// sharedBudget sends 40 concurrent 5 000-token documents of each of two features round-robin to
// three replicas sharing a paid-provider budget of 50 000 tokens a minute per feature: exactly
// ten of each run on the paid provider; batch_summarize's other thirty run on the local model,
// batch_export's are refused with 429 token_budget.
//
// Settlement slack: a request's tokens are reserved at its estimate when admitted and settled to
// its reported usage when it ends; a request that used less than estimated gives the difference
// back, and that room can admit another. Here the mock LLM reports exactly the estimate (5 000),
// so settlement changes nothing and the slack is zero: exactly ten, however admissions and
// settlements interleave across replicas. (Were usage below the estimate, up to the refunds
// settled before the last admission could be spent again, which this test rules out.)
func sharedBudget(t *testing.T, cc clusterConfig) {
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	cc.prefix = "budget"
	path := writePolicy(t, paidBatchPolicy+cc.yaml())
	reps := startReplicas(t, path, "budget-a", "budget-b", "budget-c")

	const n = 40
	f := newFlight(2 * n)
	for i := range n {
		for _, feature := range []string{"batch_summarize", "batch_export"} {
			f.send(reps, i%len(reps), feature, paidDocument(feature), up)
		}
	}
	got := map[string]map[string]int{"batch_summarize": {}, "batch_export": {}}
	for _, o := range f.collect(t) {
		if o.err != nil {
			t.Errorf("replica %d: %v", o.replica, o.err)
			continue
		}
		key := o.what()
		if o.res.Status == 200 {
			md := o.res.DynamicMetadata["llm_bulkhead"].GetFields()
			key = "200 on " + upstreamHeader(o.res, "x-llm-provider")
			if md["decision"].GetStringValue() == "rerouted" {
				key += " rerouted " + md["reason"].GetStringValue()
			}
		} else {
			key += " " + header(o.res, "x-bulkhead-compartment")
		}
		got[o.label][key]++
	}
	// Leased admission admits at most the window too, but a request can be refused while part
	// of the window sits unused in other replicas' chunks (docs/cluster.md, "How exact it is"):
	// at most twice the window's even pace over a chunk's life per replica, 1 667 tokens here,
	// so three replicas' leftovers can cost at most one 5 000-token request.
	paid := map[string]int{"batch_summarize": 10, "batch_export": 10}
	if cc.admission == "leased" {
		for feature := range paid {
			got := got[feature]["200 on deepseek"]
			if got < 9 || got > 10 {
				t.Errorf("%s: leased admission ran %d documents on the paid provider, want 10 (9 when chunks are left on other replicas)", feature, got)
			}
			paid[feature] = max(min(got, 10), 9)
		}
	}
	want := map[string]map[string]int{
		"batch_summarize": {"200 on deepseek": paid["batch_summarize"], "200 on local rerouted token_budget": n - paid["batch_summarize"]},
		"batch_export":    {"200 on deepseek": paid["batch_export"], "429 token_budget paid_batch/batch_export": n - paid["batch_export"]},
	}
	for feature, w := range want {
		if fmt.Sprint(got[feature]) != fmt.Sprint(w) {
			t.Errorf("%s: %v, want %v", feature, got[feature], w)
		}
	}
	for _, r := range reps {
		clusterWait(t, r.Name+" to hold nothing", func() bool { return replicaMetric(t, r, "llm_bulkhead_inflight_requests") == 0 })
	}
}

// TestClusterSharedTokenBudget: three replicas share one paid-provider budget through a
// standalone Redis, in each admission mode.
func TestClusterSharedTokenBudget(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) {
			rd := redistest.Standalone(t)
			sharedBudget(t, clusterConfig{addrs: []string{rd.Addr()}, admission: adm})
		})
	}
}

// TestClusterSharedTokenBudgetRedisCluster: the same against a three-node Redis Cluster, where
// leased admission spreads the compartments over the shards.
func TestClusterSharedTokenBudgetRedisCluster(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) {
			rc := redistest.Cluster(t, 3)
			sharedBudget(t, clusterConfig{mode: "cluster", addrs: rc.Addrs(), admission: adm})
		})
	}
}

const chatCapacityPolicy = `
envoy: {max_message_timeout: 30s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 20, max_wait: 20s}
  default: {max_concurrent: 10}
`

// chatSampler samples, until stopped, the chat requests in flight summed over the replicas'
// own views and as Redis counts them, keeping the largest of each.
type chatSampler struct {
	stop       chan struct{}
	once       sync.Once
	done       chan struct{}
	local, rds atomic.Int64
	err        atomic.Value
}

func sampleChat(t *testing.T, reps []*harness.Replica, rd *redistest.Server, prefix string) *chatSampler {
	s := &chatSampler{stop: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(s.halt)
	raise := func(a *atomic.Int64, v int64) {
		for p := a.Load(); v > p && !a.CompareAndSwap(p, v); p = a.Load() {
		}
	}
	go func() {
		defer close(s.done)
		for {
			var local int64
			for _, r := range reps {
				c, err := replicaCompartment(r, "feature/chat")
				if err != nil {
					s.err.Store(err)
					return
				}
				local += c.InFlight
			}
			raise(&s.local, local)
			held, err := redisSlots(rd, prefix, "feature/chat")
			if err != nil {
				s.err.Store(err)
				return
			}
			raise(&s.rds, sumHeld(held))
			select {
			case <-s.stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	}()
	return s
}

// halt stops sampling and waits until the sampler is done.
func (s *chatSampler) halt() {
	s.once.Do(func() { close(s.stop) })
	<-s.done
}

// Stop stops sampling and returns the largest sums seen.
func (s *chatSampler) Stop(t *testing.T) (local, rds int64) {
	t.Helper()
	s.halt()
	if err, _ := s.err.Load().(error); err != nil {
		t.Fatalf("sampling: %v", err)
	}
	return s.local.Load(), s.rds.Load()
}

// TestClusterSharedConcurrency: three replicas share chat's 20 slots. 60 concurrent streams
// spread over them: exactly 20 run at the peak, never 21 (summed over the replicas' own counts,
// counted in Redis, and at the LLM), the other 40 wait; as streams end the waiters run, 20 at
// a time. Then a slot freed on one replica wakes a request waiting on another.
func TestClusterSharedConcurrency(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) { sharedConcurrency(t, adm) })
	}
}

func sharedConcurrency(t *testing.T, adm string) {
	rd := redistest.Standalone(t)
	const prefix = "conc"
	path := writePolicy(t, chatCapacityPolicy+clusterConfig{addrs: []string{rd.Addr()}, prefix: prefix,
		leaseTTL: 2 * time.Second, heartbeat: 500 * time.Millisecond, admission: adm}.yaml())
	reps := startReplicas(t, path, "conc-a", "conc-b", "conc-c")
	load := &upstreamLoad{}
	ups := make([]*heldUpstream, len(reps))
	for i := range ups {
		ups[i] = newHeldUpstream(load)
	}
	// Whatever happens, answer what is held before the replicas stop.
	t.Cleanup(func() {
		for _, u := range ups {
			u.Open()
		}
	})

	// The peak: 60 streams, 20 per replica.
	sampler := sampleChat(t, reps, rd, prefix)
	f := newFlight(60)
	for i := range 60 {
		f.send(reps, i%len(reps), "peak", chatRequest("chat"), ups[i%len(reps)])
	}
	queued := func() int {
		n := 0
		for _, r := range reps {
			n += mustCompartment(t, r, "feature/chat").Queued
		}
		return n
	}
	clusterWait(t, "20 streams to run and 40 to wait", func() bool {
		return load.peak.Load() > 20 || (load.cur.Load() == 20 && queued() == 40)
	})
	// Keep sampling a while at the plateau: a 21st admission would show.
	time.Sleep(300 * time.Millisecond)
	local, rds := sampler.Stop(t)
	if adm == "leased" {
		// Leases are not slots held per request: what the replicas lease adds up to at most 20.
		rds = 20
		if leased := leasedSlots(t, rd, prefix, "feature/chat"); leased > 20 {
			t.Errorf("the replicas' leases of chat add up to %d, limit 20", leased)
		}
	}
	if rds != 20 || load.peak.Load() != 20 || load.total.Load() != 20 {
		t.Fatalf("at the peak: %d slots held in Redis, %d requests at the LLM at once (%d reached it); want 20 each",
			rds, load.peak.Load(), load.total.Load())
	}
	var plateau int64
	for _, r := range reps {
		c := mustCompartment(t, r, "feature/chat")
		plateau += c.InFlight
		t.Logf("%s at the peak: %d in flight, %d queued", r.Name, c.InFlight, c.Queued)
	}
	if plateau != 20 {
		t.Errorf("at the peak the replicas report %d chat requests in flight, want 20", plateau)
	}
	// Nothing ends before the peak, so what the replicas report in flight only grows, and a
	// sum of their reports read one after the other never exceeds the real total.
	if local > 20 {
		t.Errorf("the replicas' in_flight for feature/chat summed to %d at some point (20 slots shared; "+
			"Redis never held more than %d and the LLM never saw more than %d at once)", local, rds, load.peak.Load())
	}
	// Streams end: the waiters run, never more than 20 at once.
	for _, u := range ups {
		u.Open()
	}
	got := map[string]int{}
	for _, o := range f.collect(t) {
		got[o.what()]++
	}
	if got["200"] != 60 || load.peak.Load() != 20 {
		t.Errorf("outcomes %v, %d at the LLM at most; want 60 × 200, at most 20 at once", got, load.peak.Load())
	}
	if adm == "exact" {
		assertNothingHeld(t, rd, prefix, reps)
	}

	// A slot freed on a wakes the request waiting on b.
	a, b := newHeldUpstream(nil), newHeldUpstream(nil)
	t.Cleanup(a.Open)
	t.Cleanup(b.Open)
	f = newFlight(21)
	for range 20 {
		f.send(reps, 0, "a", chatRequest("chat"), a)
	}
	clusterWait(t, "a to run 20 streams", func() bool { return a.count.Load() == 20 })
	f.send(reps, 1, "b", chatRequest("chat"), b)
	clusterWait(t, "the request on b to wait", func() bool {
		return b.count.Load() > 0 || mustCompartment(t, reps[1], "feature/chat").Queued == 1
	})
	if b.count.Load() != 0 {
		t.Fatalf("b ran a 21st stream")
	}
	a.release <- struct{}{}
	clusterWait(t, "the request waiting on b to run once a stream on a ended", func() bool { return b.count.Load() == 1 })
	a.Open()
	b.Open()
	for _, o := range f.collect(t) {
		if o.what() != "200" {
			t.Errorf("%s request: %s", o.label, o.what())
		}
	}
	if adm == "exact" {
		assertNothingHeld(t, rd, prefix, reps)
	}
}

// leasedSlots returns the slots of compartment that the replicas' leases hold in Redis.
func leasedSlots(t *testing.T, rd *redistest.Server, prefix, compartment string) int64 {
	t.Helper()
	out, err := rd.Do("HGETALL", "{"+prefix+"|"+compartment+"}:ls")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var sum int64
	for i := 0; i+1 < len(lines); i += 2 {
		if strings.HasPrefix(lines[i], "r:") {
			slots, _, _ := strings.Cut(lines[i+1], "|")
			n, _ := strconv.ParseInt(slots, 10, 64)
			sum += n
		}
	}
	return sum
}

// holdSlots runs n chat streams on replica i through up and returns once up holds them.
func holdSlots(t *testing.T, f *flight, reps []*harness.Replica, i, n int, up *heldUpstream) {
	t.Helper()
	before := up.count.Load()
	for range n {
		f.send(reps, i, reps[i].Name, chatRequest("chat"), up)
	}
	clusterWait(t, fmt.Sprintf("%s to run %d streams", reps[i].Name, n), func() bool { return up.count.Load() == before+int64(n) })
}

// replicaGone reports whether Redis no longer knows replica id: no registration, no lease and
// no slot in compartment, and no lease of it (leased admission).
func replicaGone(t *testing.T, rd *redistest.Server, prefix, id, compartment string) bool {
	t.Helper()
	tag := "{" + prefix + "}"
	if lease, err := rd.Do("HEXISTS", "{"+prefix+"|"+compartment+"}:ls", "r:"+id); err != nil || lease != "0" {
		return false
	}
	score, err := rd.Do("ZSCORE", tag+":r", id)
	if err != nil {
		t.Fatal(err)
	}
	leases, err := rd.Do("EXISTS", tag+":l:"+id)
	if err != nil {
		t.Fatal(err)
	}
	held, err := redisSlots(rd, prefix, compartment)
	if err != nil {
		t.Fatal(err)
	}
	_, holds := held[id]
	return score == "(nil)" && leases == "0" && !holds
}

// TestClusterReplicaLeavesOrDies: the slots of a replica killed with SIGKILL come back once its
// leases expire (lease_ttl 2 s, heartbeat 500 ms); a replica stopped with SIGTERM gives its
// slots back as it stops, long before its leases would expire (lease_ttl 60 s). Either way the
// other replicas then admit what they had queued.
func TestClusterReplicaLeavesOrDies(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) { replicaLeavesOrDies(t, adm) })
	}
}

func replicaLeavesOrDies(t *testing.T, adm string) {
	rd := redistest.Standalone(t)
	cases := []struct {
		name     string
		leaseTTL time.Duration
		beat     time.Duration
		stop     func(t *testing.T, r *harness.Replica)
	}{
		{"SIGKILL", 2 * time.Second, 500 * time.Millisecond, func(t *testing.T, r *harness.Replica) { r.Kill() }},
		{"SIGTERM", 60 * time.Second, 500 * time.Millisecond, func(t *testing.T, r *harness.Replica) {
			// drain_grace is short: the held streams are cut, as on a rolling restart whose
			// grace ran out; the replica then gives back everything it held and leaves.
			if err := r.Stop(20 * time.Second); err != nil {
				t.Errorf("SIGTERM: %v", err)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			prefix := "leave-" + strings.ToLower(tc.name)
			path := writePolicy(t, chatCapacityPolicy+"server: {drain_grace: 300ms}\n"+
				clusterConfig{addrs: []string{rd.Addr()}, prefix: prefix, leaseTTL: tc.leaseTTL, heartbeat: tc.beat, admission: adm}.yaml())
			reps := startReplicas(t, path, prefix+"-a", prefix+"-b", prefix+"-c")
			ups := []*heldUpstream{newHeldUpstream(nil), newHeldUpstream(nil), newHeldUpstream(nil)}
			t.Cleanup(func() {
				for _, u := range ups {
					u.Open()
				}
			})
			f := newFlight(30)
			// a and b hold chat's 20 slots; 10 requests wait on c.
			holdSlots(t, f, reps, 0, 10, ups[0])
			holdSlots(t, f, reps, 1, 10, ups[1])
			for range 10 {
				f.send(reps, 2, reps[2].Name, chatRequest("chat"), ups[2])
			}
			clusterWait(t, "10 requests to wait on c", func() bool {
				return ups[2].count.Load() > 0 || mustCompartment(t, reps[2], "feature/chat").Queued == 10
			})
			if n := ups[2].count.Load(); n != 0 {
				t.Fatalf("c ran %d streams beyond the 20 slots", n)
			}

			start := time.Now()
			tc.stop(t, reps[0])
			clusterWait(t, "c to run its 10 waiting requests", func() bool { return ups[2].count.Load() == 10 })
			t.Logf("%s: a's 10 slots ran c's requests %v after the signal (lease_ttl %v)",
				tc.name, time.Since(start).Round(10*time.Millisecond), tc.leaseTTL)
			// Its registration, leases and slots go at the survivors' next heartbeat or report
			// (an expired lease already counted for nothing).
			clusterWait(t, "Redis to forget a's registration, leases and slots", func() bool {
				return replicaGone(t, rd, prefix, reps[0].Name, "feature/chat")
			})
			if n := ups[1].count.Load() + ups[2].count.Load(); n != 20 {
				t.Errorf("%d streams reached the LLM through b and c, want 20", n)
			}

			for _, u := range ups {
				u.Open()
			}
			for _, o := range f.collect(t) {
				// a's requests ended with a: what their clients got is Envoy's business.
				if o.replica != 0 && o.what() != "200" {
					t.Errorf("%s request: %s", o.label, o.what())
				}
			}
			assertNothingHeld(t, rd, prefix, reps)
		})
	}
}

const outagePolicy = `
envoy: {max_message_timeout: 30s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 20, max_wait: 1s}
  default: {max_concurrent: 10}
`

// Phases of TestClusterRedisOutage.
const (
	phaseShared    = iota // Redis up
	phaseKilled           // Redis killed, replicas may not have noticed yet
	phaseDown             // every replica noticed and runs as on_unavailable says
	phaseRestart          // Redis restarting, replicas may not have noticed yet
	phaseRecovered        // every replica shares again
)

var phaseNames = []string{"shared", "killed", "down", "restarting", "recovered"}

// outageLoad keeps workers sending chat requests to replicas and tallies, per replica and per
// phase (a request counts in a phase when it started and ended in it), what they got.
type outageLoad struct {
	phase atomic.Int32
	stop  atomic.Bool
	wg    sync.WaitGroup

	mu   sync.Mutex
	seen []map[int]map[string]int // replica → phase → outcome → count
	errs []string
}

func (l *outageLoad) run(reps []*harness.Replica, perReplica int, up envoysim.Upstream) {
	l.seen = make([]map[int]map[string]int, len(reps))
	for i := range reps {
		l.seen[i] = map[int]map[string]int{}
		for range perReplica {
			l.wg.Go(func() {
				for !l.stop.Load() {
					p := l.phase.Load()
					res, err := reps[i].Do(context.Background(), chatRequest("chat"), up)
					o := outcome{replica: i, res: res, err: err}
					w := o.what()
					l.mu.Lock()
					if w != "200" && w != "503 bulkhead_full" && w != "503 cluster_unavailable" {
						// Anything else (an error, Envoy's 504 for a request kept waiting) is
						// a request the outage hurt.
						detail := ""
						if res != nil {
							detail = fmt.Sprintf(" (%s %s after %v, phase %d→%d)", res.Local, res.LocalDetails,
								res.Completed.Sub(res.Started).Round(time.Millisecond), p, l.phase.Load())
						}
						l.errs = append(l.errs, fmt.Sprintf("%s: %s%s", reps[i].Name, w, detail))
					}
					if l.phase.Load() == p {
						if l.seen[i][int(p)] == nil {
							l.seen[i][int(p)] = map[string]int{}
						}
						l.seen[i][int(p)][w]++
					}
					l.mu.Unlock()
				}
			})
		}
	}
}

func (l *outageLoad) count(replica int, phase int32, what string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.seen[replica][int(phase)][what]
}

// describe lists, phase by phase, what each replica's requests got.
func (l *outageLoad) describe(reps []*harness.Replica) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for i, r := range reps {
		fmt.Fprintf(&b, "\n%s:", r.Name)
		for p, name := range phaseNames {
			if got := l.seen[i][p]; len(got) > 0 {
				fmt.Fprintf(&b, " %s %v", name, got)
			}
		}
	}
	return b.String()
}

// outcomes returns a copy of what a replica's requests got in a phase.
func (l *outageLoad) outcomes(replica int, phase int32) map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string]int{}
	for k, v := range l.seen[replica][int(phase)] {
		out[k] = v
	}
	return out
}

// TestClusterRedisOutage: Redis is killed under load and restarted. Replicas with
// on_unavailable: local keep admitting, each within its part of chat's 20 slots (the parts add
// up to 20 at most);
// replicas with on_unavailable: closed refuse with 503 cluster_unavailable; no request is lost
// or kept waiting on Redis. Both recover by themselves when Redis is back, and at the end nothing
// is held anywhere, in the replicas or in Redis.
func TestClusterRedisOutage(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) { redisOutage(t, adm) })
	}
}

func redisOutage(t *testing.T, adm string) {
	rd := redistest.Standalone(t)
	up := startMockLLM(t, mock.Options{TimeScale: 0.25})
	cfg := clusterConfig{addrs: []string{rd.Addr()}, leaseTTL: 2 * time.Second, heartbeat: 500 * time.Millisecond, admission: adm}
	cfg.prefix, cfg.onUnavailable = "outage-local", "local"
	local := startReplicas(t, writePolicy(t, outagePolicy+cfg.yaml()), "local-a", "local-b", "local-c")
	cfg.prefix, cfg.onUnavailable = "outage-closed", "closed"
	closed := startReplicas(t, writePolicy(t, outagePolicy+cfg.yaml()), "closed-a", "closed-b")
	all := append(append([]*harness.Replica(nil), local...), closed...)

	// 8 workers per local replica: 24 for 20 shared slots, and more than a part while Redis is down.
	ll, cl := &outageLoad{}, &outageLoad{}
	ll.run(local, 8, up)
	cl.run(closed, 2, up)
	stopped := false
	stopLoad := func() {
		if !stopped {
			stopped = true
			ll.stop.Store(true)
			cl.stop.Store(true)
			ll.wg.Wait()
			cl.wg.Wait()
		}
	}
	t.Cleanup(stopLoad)
	clusterWait(t, "every replica to admit under load", func() bool {
		for i := range local {
			if ll.count(i, phaseShared, "200") == 0 {
				return false
			}
		}
		return cl.count(0, phaseShared, "200") > 0 && cl.count(1, phaseShared, "200") > 0
	})

	rd.Kill()
	ll.phase.Store(phaseKilled)
	cl.phase.Store(phaseKilled)
	for _, r := range all {
		clusterWait(t, r.Name+" to notice Redis is gone", func() bool { return replicaMetric(t, r, "llm_bulkhead_cluster_available") == 0 })
	}
	// The local replicas switch to their part: what Redis counted for each, plus an equal part
	// of the room then free; the parts add up to chat's 20 slots at most.
	parts := func() (sum int64) {
		for _, r := range local {
			sum += mustCompartment(t, r, "feature/chat").MaxConcurrent
		}
		return sum
	}
	for _, r := range local {
		clusterWait(t, r.Name+" to enforce its part", func() bool {
			c := mustCompartment(t, r, "feature/chat")
			return c.MaxConcurrent < 20 && c.InFlight <= c.MaxConcurrent
		})
	}
	if sum := parts(); sum > 20 {
		for _, r := range local {
			c := mustCompartment(t, r, "feature/chat")
			t.Logf("%s: part %d, in flight %d", r.Name, c.MaxConcurrent, c.InFlight)
		}
		t.Errorf("the local replicas' parts of chat's 20 slots add up to %d", sum)
	}
	if adm == "leased" {
		// A leased replica keeps admitting within its lease until the lease runs out, then
		// does as on_unavailable says.
		for i, r := range closed {
			clusterWait(t, r.Name+"'s lease to run out", func() bool { return cl.count(i, phaseKilled, "503 cluster_unavailable") > 0 })
		}
	}
	ll.phase.Store(phaseDown)
	cl.phase.Store(phaseDown)
	// While Redis is down, no local replica runs more than its part.
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) {
		for _, r := range local {
			if c := mustCompartment(t, r, "feature/chat"); c.InFlight > c.MaxConcurrent {
				t.Errorf("%s ran %d chat requests at once while Redis was down; its part is %d", r.Name, c.InFlight, c.MaxConcurrent)
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The local replicas go on serving within their parts. A replica whose requests all waited
	// while the others held every slot when Redis went has a part of 0 (what Redis counted for
	// it, and no free room): it refuses, as its part says, and the fleet serves on the others.
	admittedDown := 0
	for i := range local {
		admittedDown += ll.count(i, phaseDown, "200")
	}
	if admittedDown == 0 {
		t.Error("no local replica admitted anything while Redis was down")
	}
	for i, r := range local {
		if n := ll.count(i, phaseDown, "200"); n == 0 && mustCompartment(t, r, "feature/chat").MaxConcurrent > 0 {
			var raw struct {
				Compartments []map[string]any `json:"compartments"`
			}
			_ = r.Get("/admin/compartments", &raw)
			var chat map[string]any
			for _, c := range raw.Compartments {
				if c["name"] == "feature/chat" {
					chat = c
				}
			}
			t.Errorf("%s admitted nothing while Redis was down with a part of its own (its requests got %v); its feature/chat: %v", r.Name, ll.outcomes(i, phaseDown), chat)
		}
	}
	for i, r := range closed {
		got := cl.outcomes(i, phaseDown)
		if got["503 cluster_unavailable"] == 0 || len(got) != 1 {
			t.Errorf("%s while Redis was down: %v, want only 503 cluster_unavailable", r.Name, got)
		}
	}

	ll.phase.Store(phaseRestart)
	cl.phase.Store(phaseRestart)
	rd.Restart()
	for _, r := range all {
		clusterWait(t, r.Name+" to share again", func() bool { return replicaMetric(t, r, "llm_bulkhead_cluster_available") == 1 })
	}
	ll.phase.Store(phaseRecovered)
	cl.phase.Store(phaseRecovered)
	for _, r := range local {
		clusterWait(t, r.Name+" to enforce the whole limit again", func() bool { return mustCompartment(t, r, "feature/chat").MaxConcurrent == 20 })
	}
	clusterWait(t, "every replica to admit again", func() bool {
		for i := range local {
			if ll.count(i, phaseRecovered, "200") == 0 {
				return false
			}
		}
		return cl.count(0, phaseRecovered, "200") > 0 && cl.count(1, phaseRecovered, "200") > 0
	})
	stopLoad()
	for _, l := range []*outageLoad{ll, cl} {
		if len(l.errs) > 0 {
			t.Errorf("%d requests failed, e.g. %v", len(l.errs), l.errs[:min(len(l.errs), 5)])
		}
	}
	t.Logf("outcomes by phase (a request counts in a phase it started and ended in):%s%s", ll.describe(local), cl.describe(closed))
	assertNothingHeld(t, rd, "outage-local", local)
	assertNothingHeld(t, rd, "outage-closed", closed)
}

// TestClusterSentinel: a replica finding its Redis through a sentinel shares its limits: it
// registers with the master, admits, and reports the cluster available.
func TestClusterSentinel(t *testing.T) {
	for _, adm := range clusterAdmissions {
		t.Run(adm, func(t *testing.T) { sentinel(t, adm) })
	}
}

func sentinel(t *testing.T, adm string) {
	ss := redistest.Sentinel(t)
	up := startMockLLM(t, mock.Options{TimeScale: 0.01})
	const prefix = "sentinel"
	path := writePolicy(t, chatCapacityPolicy+clusterConfig{mode: "sentinel", addrs: []string{ss.Addr()},
		masterName: ss.MasterName(), prefix: prefix, leaseTTL: 2 * time.Second, heartbeat: 500 * time.Millisecond, admission: adm}.yaml())
	reps := startReplicas(t, path, "sentinel-a")
	res, err := reps[0].Do(context.Background(), chatRequest("chat"), up)
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != 200 {
		t.Fatalf("through the sentinel's master: %d %s", res.Status, res.Body)
	}
	if v := replicaMetric(t, reps[0], "llm_bulkhead_cluster_available"); v != 1 {
		t.Errorf("llm_bulkhead_cluster_available = %v", v)
	}
	if score, err := ss.Master().Do("ZSCORE", "{"+prefix+"}:r", "sentinel-a"); err != nil || score == "(nil)" {
		t.Errorf("the master has no registration of the replica: %q %v", score, err)
	}
	assertNothingHeld(t, ss.Master(), prefix, reps)
}
