package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/bench"
	"github.com/llm-bulkhead/llm-bulkhead/integration/cmd/clusterdemo/fleet"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/integration/storm"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Request headers the demo sets (as the storm experiment does).
const (
	headerFeature = "x-llm-feature"
	headerTenant  = "x-tenant-id"
)

// Modes of a run: the policy with its cluster section, and without it.
const (
	ModeShared     = "shared"
	ModePerProcess = "per-process"
)

// Options configure Demo.
type Options struct {
	// PolicyPath is the policy every replica runs (its cluster section is replaced).
	PolicyPath string
	// Replicas is the number of llm-bulkhead processes (at least 2).
	Replicas int
	// Scenario is the traffic, in simulated time (storm.DefaultScenario's shape).
	Scenario storm.Scenario
	// TimeScale multiplies every simulated duration (mockllm, think times, the policy's waits).
	TimeScale float64
	// Seed fixes think times and mockllm's latencies; both runs see the same traffic.
	Seed uint64
	// Capacity is how many requests the mock LLM serves at once (0: unlimited).
	Capacity int
	// RedisTimeout is the replicas' cluster.timeout (0: the policy's default).
	RedisTimeout time.Duration
	// Modes lists the runs, in order (default: shared, then per-process).
	Modes []string
	// ReplicaArgv returns the command line of a replica running policyFile; the replica must
	// listen on free loopback ports and log "llm-bulkhead listening" with its addresses, as
	// `llm-bulkhead serve --grpc-addr 127.0.0.1:0 --admin-addr 127.0.0.1:0` does. Its replica id
	// comes from the environment.
	ReplicaArgv func(policyFile string) []string
	// Progress, when set, receives a line of what the fleet did every wall-clock second, and a
	// title line when a run starts.
	Progress io.Writer
	// RedisStarted, when set, is called with the Redis address once it answers.
	RedisStarted func(addr string)
}

// Limits are the policy's limits on the demo's traffic: they are meant for the whole fleet.
type Limits struct {
	// Batch is the tightest concurrency limit on the batch tenant's batch requests, and
	// BatchFrom the compartment it comes from; BatchFeature is feature/batch_summarize's.
	Batch        int64  `json:"batch"`
	BatchFrom    string `json:"batch_from"`
	BatchFeature int64  `json:"batch_feature"`
	// BatchTokens is the tightest token budget (per minute) on the batch tenant's batch requests
	// whatever their provider, and BatchTokensFrom its compartment (0 and "" without one).
	BatchTokens     int64  `json:"batch_tokens"`
	BatchTokensFrom string `json:"batch_tokens_from,omitempty"`
	// Chat is feature/chat's concurrency limit (every tenant's chat requests).
	Chat int64 `json:"chat"`
	// PaidTokens is the paid_batch family's tokens per minute, PaidFrom its compartment and
	// PaidProviders the providers it counts (0 and nil without such a family).
	PaidTokens    int64    `json:"paid_tokens"`
	PaidFrom      string   `json:"paid_from,omitempty"`
	PaidProviders []string `json:"paid_providers,omitempty"`
}

// Counts are what one replica (or the fleet) did with one feature's requests.
type Counts struct {
	// Admitted counts requests forwarded upstream; Degraded those of them sent to another
	// provider than the model's (a degrade rule or a breaker fallback).
	Admitted int `json:"admitted"`
	Degraded int `json:"degraded"`
	// Refused counts refusals by x-bulkhead-reason; Failed other failures by kind (timeout,
	// status_502, …).
	Refused map[string]int `json:"refused"`
	Failed  map[string]int `json:"failed,omitempty"`
}

func (c *Counts) add(o Counts) {
	c.Admitted += o.Admitted
	c.Degraded += o.Degraded
	for k, v := range o.Refused {
		if c.Refused == nil {
			c.Refused = map[string]int{}
		}
		c.Refused[k] += v
	}
	for k, v := range o.Failed {
		if c.Failed == nil {
			c.Failed = map[string]int{}
		}
		c.Failed[k] += v
	}
}

// RefusedTotal is the number of refusals.
func (c Counts) RefusedTotal() int { return total(c.Refused) }

// FailedTotal is the number of failures other than refusals.
func (c Counts) FailedTotal() int { return total(c.Failed) }

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// Run is one run of the scenario through the fleet.
type Run struct {
	Mode string `json:"mode"`
	// Replicas holds per replica (in order) and Fleet over all of them the counts per feature.
	Replicas []map[string]*Counts `json:"replicas"`
	Fleet    map[string]*Counts   `json:"fleet"`
	// Peak is the most requests of each feature the upstream served at once, fleet-wide.
	Peak map[string]int `json:"peak"`
	// PaidTokens and PaidRequests are the tokens (reported usage) and number of the batch
	// requests answered by the paid providers.
	PaidTokens   int64 `json:"paid_tokens"`
	PaidRequests int   `json:"paid_requests"`
	// BatchTokens is the tokens (reported usage) of every batch request answered.
	BatchTokens int64 `json:"batch_tokens"`
	// BatchDone counts documents summarised, of BatchDocuments.
	BatchDone      int `json:"batch_done"`
	BatchDocuments int `json:"batch_documents"`
	// ChatP50 and ChatP99 are the answered chat requests' latencies in simulated seconds.
	ChatP50 float64 `json:"chat_p50"`
	ChatP99 float64 `json:"chat_p99"`
	// WithoutRedis counts admissions the replicas decided without the shared state (Redis too
	// slow or gone): the shared limits are then only approximately held.
	WithoutRedis int64 `json:"without_redis"`
	// Wall is the run's wall time in seconds, replicas' start and stop included.
	Wall float64 `json:"wall_seconds"`
}

// Result is the whole demo.
type Result struct {
	Limits Limits `json:"limits"`
	Runs   []*Run `json:"runs"`
	// RedisAddr is where the shared state was kept.
	RedisAddr string `json:"redis_addr"`
}

// Run returns the run of mode, nil when it did not run.
func (r *Result) Run(mode string) *Run {
	for _, run := range r.Runs {
		if run.Mode == mode {
			return run
		}
	}
	return nil
}

// Demo runs the scenario through the fleet once per mode and returns what happened. Cancelling
// ctx stops it; every process it started is stopped before it returns.
func Demo(ctx context.Context, o Options) (*Result, error) {
	if o.Replicas < 2 {
		return nil, fmt.Errorf("%d replicas: a fleet needs at least 2", o.Replicas)
	}
	if o.TimeScale <= 0 {
		return nil, fmt.Errorf("time scale %v must be positive", o.TimeScale)
	}
	if o.ReplicaArgv == nil {
		return nil, errors.New("no replica command line")
	}
	sc := o.Scenario
	sc.Storm = true
	if err := sc.Validate(); err != nil {
		return nil, err
	}
	if len(o.Modes) == 0 {
		o.Modes = []string{ModeShared, ModePerProcess}
	}
	for _, m := range o.Modes {
		if m != ModeShared && m != ModePerProcess {
			return nil, fmt.Errorf("unknown mode %q (known: %s, %s)", m, ModeShared, ModePerProcess)
		}
	}
	src, err := os.ReadFile(o.PolicyPath)
	if err != nil {
		return nil, err
	}
	// The policy's waits and breaker timings follow the time scale, as in the storm experiment.
	scaled, err := storm.DerivePolicy(o.PolicyPath, src, storm.Variant{TimeScale: o.TimeScale})
	if err != nil {
		return nil, err
	}
	p, err := config.Load(o.PolicyPath, scaled, []string{})
	if err != nil {
		return nil, err
	}
	res := &Result{}
	if res.Limits, err = limitsOf(p, sc); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "clusterdemo-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)

	var rd *fleet.Redis
	if slices.Contains(o.Modes, ModeShared) {
		if rd, err = fleet.StartRedis(ctx); err != nil {
			return nil, err
		}
		defer rd.Stop()
		res.RedisAddr = rd.Addr
		if o.RedisStarted != nil {
			o.RedisStarted(rd.Addr)
		}
	}
	for i, mode := range o.Modes {
		var b []byte
		if mode == ModeShared {
			b, err = fleet.WithCluster(o.PolicyPath, scaled, fleet.Cluster{Addrs: []string{rd.Addr},
				KeyPrefix: fmt.Sprintf("clusterdemo-%d-%d", os.Getpid(), i), Timeout: o.RedisTimeout})
		} else {
			b, err = fleet.WithoutCluster(o.PolicyPath, scaled)
		}
		if err != nil {
			return nil, err
		}
		file := filepath.Join(dir, fmt.Sprintf("%d-%s.yaml", i, mode))
		if err := os.WriteFile(file, b, 0o600); err != nil {
			return nil, err
		}
		run, err := runMode(ctx, o, sc, p, res.Limits, mode, file)
		if err != nil {
			return nil, fmt.Errorf("%s run: %w", mode, err)
		}
		res.Runs = append(res.Runs, run)
	}
	return res, nil
}

// limitsOf reads the limits that apply to the scenario's traffic from the policy as built.
func limitsOf(p *config.Policy, sc storm.Scenario) (Limits, error) {
	eng, err := policy.NewEngine(p, policy.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return Limits{}, err
	}
	defer eng.Close(context.Background())
	views := map[string]policy.CompartmentView{}
	for _, v := range eng.Compartments() {
		views[v.Name] = v
	}
	var l Limits
	tier := p.Tenants.DefaultTier
	for _, t := range p.Tenants.Directory {
		if t.ID == sc.BatchTenant {
			tier = t.Tier
		}
	}
	// The batch tenant's batch requests pass through these compartments whatever their provider
	// (and through their provider's, looser in the example policy).
	for _, name := range []string{"feature/" + storm.FeatureBatch, "tier_feature/" + tier + "/" + storm.FeatureBatch, "tenant/" + sc.BatchTenant} {
		v, ok := views[name]
		if !ok {
			continue
		}
		for _, b := range v.Budgets {
			if b.Kind == "tokens_per_minute" && b.Capacity > 0 && (l.BatchTokens == 0 || b.Capacity < l.BatchTokens) {
				l.BatchTokens, l.BatchTokensFrom = b.Capacity, name
			}
		}
		if v.MaxConcurrent <= 0 {
			continue
		}
		if name == "feature/"+storm.FeatureBatch {
			l.BatchFeature = v.MaxConcurrent
		}
		if l.Batch == 0 || v.MaxConcurrent < l.Batch {
			l.Batch, l.BatchFrom = v.MaxConcurrent, name
		}
	}
	l.Chat = views["feature/"+storm.FeatureChat].MaxConcurrent
	for _, f := range p.Compartments {
		if f.Name != "paid_batch" {
			continue
		}
		name := "paid_batch/" + storm.FeatureBatch
		for _, b := range views[name].Budgets {
			if b.Kind == "tokens_per_minute" {
				l.PaidTokens, l.PaidFrom, l.PaidProviders = b.Capacity, name, f.Where[config.DimProvider]
			}
		}
	}
	if l.Batch == 0 {
		return l, fmt.Errorf("the policy sets no concurrency limit on %s requests", storm.FeatureBatch)
	}
	return l, nil
}

// fleetRun is the state of one run.
type fleetRun struct {
	o        Options
	sc       Scenario
	scale    float64
	sims     []*envoysim.Sim
	up       *countingUpstream
	next     atomic.Uint64
	paid     map[string]bool
	provider string // the provider the scenario's model maps to
	t0       time.Time

	mu        sync.Mutex
	counts    []map[string]*Counts
	tick      map[string]*Counts
	chatLat   []float64
	paidTok   int64
	paidReqs  int
	batchTok  int64
	batchDone int
}

// Scenario is storm.Scenario (kept short in this file).
type Scenario = storm.Scenario

func runMode(ctx context.Context, o Options, sc Scenario, p *config.Policy, lim Limits, mode, policyFile string) (*Run, error) {
	wall := time.Now()
	if o.Progress != nil {
		title := "shared: the policy with a cluster section, limits kept in Redis"
		if mode == ModePerProcess {
			title = "per process: the same policy without its cluster section, each replica on its own"
		}
		fmt.Fprintf(o.Progress, "\n== %s ==\n", title)
	}
	// The mock LLM: one pool of capacity behind every replica, as in the storm experiment.
	mo := mock.Options{TimeScale: o.TimeScale, Seed: o.Seed, Capacity: o.Capacity}
	for _, m := range p.Models {
		if m.Provider != "" {
			mo.ModelProviders = append(mo.ModelProviders, mock.ModelProvider{Match: m.Match, Provider: m.Provider})
		}
	}
	m, err := mock.New(mo)
	if err != nil {
		return nil, fmt.Errorf("mockllm: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mockCtx, stopMock := context.WithCancel(context.Background())
	mockDone := make(chan error, 1)
	go func() { mockDone <- m.Run(mockCtx, ln, time.Second) }()
	defer func() {
		stopMock()
		<-mockDone
	}()
	upstream, err := envoysim.NewHTTPUpstream("http://" + ln.Addr().String())
	if err != nil {
		return nil, err
	}
	defer upstream.CloseIdleConnections()

	env := replicaEnv()
	replicas, err := fleet.StartReplicas(o.Replicas, func(i int) bench.Spec {
		id := fmt.Sprintf("r%d", i+1)
		e := env
		if mode == ModeShared {
			e = append(slices.Clone(env), "LLM_BULKHEAD_CLUSTER__REPLICA_ID="+id)
		}
		return bench.Spec{Name: id, Argv: o.ReplicaArgv(policyFile), Env: e, ReadyMsg: bench.BinaryReadyMessage}
	})
	if err != nil {
		return nil, err
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = fleet.StopReplicas(replicas)
		}
	}()

	filter, err := harness.FilterFromPolicy(p)
	if err != nil {
		return nil, err
	}
	r := &fleetRun{o: o, sc: sc, scale: o.TimeScale, up: newCountingUpstream(upstream), paid: map[string]bool{},
		provider: providerOf(p, sc.Model), tick: map[string]*Counts{}}
	for _, pr := range lim.PaidProviders {
		r.paid[pr] = true
	}
	for range replicas {
		r.counts = append(r.counts, map[string]*Counts{})
	}
	for _, rep := range replicas {
		s, err := envoysim.New(rep.GRPCAddr, filter)
		if err != nil {
			return nil, err
		}
		r.sims = append(r.sims, s)
	}
	defer func() {
		for _, s := range r.sims {
			_ = s.Close()
		}
	}()

	if err := r.drive(ctx); err != nil {
		return nil, err
	}
	_, peak := r.up.snapshot()

	run := &Run{Mode: mode, Replicas: r.counts, Fleet: map[string]*Counts{}, Peak: peak,
		PaidTokens: r.paidTok, PaidRequests: r.paidReqs, BatchTokens: r.batchTok,
		BatchDone: r.batchDone, BatchDocuments: sc.BatchDocuments()}
	for _, rc := range r.counts {
		for f, c := range rc {
			if run.Fleet[f] == nil {
				run.Fleet[f] = &Counts{Refused: map[string]int{}}
			}
			run.Fleet[f].add(*c)
		}
	}
	slices.Sort(r.chatLat)
	run.ChatP50, run.ChatP99 = quantile(r.chatLat, 0.5), quantile(r.chatLat, 0.99)
	if mode == ModeShared {
		for _, rep := range replicas {
			ms, err := rep.Metrics(ctx)
			if err != nil {
				return nil, err
			}
			run.WithoutRedis += int64(ms.Sum("llm_bulkhead_cluster_unavailable_admissions_total"))
		}
	}
	stopped = true
	if err := fleet.StopReplicas(replicas); err != nil {
		return nil, err
	}
	run.Wall = time.Since(wall).Seconds()
	return run, nil
}

// replicaEnv is this process's environment without LLM_BULKHEAD_ variables, so that the
// caller's shell cannot change the policy under demonstration.
func replicaEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, config.EnvPrefix) {
			env = append(env, kv)
		}
	}
	return env
}

// providerOf returns the provider the policy's model map gives model.
func providerOf(p *config.Policy, model string) string {
	for _, m := range p.Models {
		if ok, _ := path.Match(m.Match, model); ok {
			return m.Provider
		}
	}
	return p.Classification.Provider.Default
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// drive runs the chat users and the batch job until the scenario is over and every request
// has its answer.
func (r *fleetRun) drive(ctx context.Context) error {
	tickCtx, stopTicks := context.WithCancel(ctx)
	var ticks sync.WaitGroup
	if r.o.Progress != nil {
		ticks.Go(func() { r.progress(tickCtx) })
	}
	r.t0 = time.Now()
	var wg sync.WaitGroup
	u := 0
	for _, share := range r.sc.Chat {
		for range share.Users {
			id, tenant := u, share.Tenant
			wg.Go(func() { r.chatUser(ctx, id, tenant) })
			u++
		}
	}
	wg.Go(func() { r.storm(ctx) })
	wg.Wait()
	stopTicks()
	ticks.Wait()
	return ctx.Err()
}

// simSince is the simulated time since the run began.
func (r *fleetRun) simSince() time.Duration {
	return time.Duration(float64(time.Since(r.t0)) / r.scale)
}

// sleep waits d of simulated time; false when ctx ended first.
func (r *fleetRun) sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(time.Duration(float64(d) * r.scale))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func uniform(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(rng.Float64()*float64(hi-lo))
}

func (r *fleetRun) chatUser(ctx context.Context, u int, tenant string) {
	rng := rand.New(rand.NewPCG(r.o.Seed, uint64(u)))
	body, err := storm.RequestBody(r.sc.Model, fmt.Sprintf("user-%02d", u), r.sc.ChatTokens, r.o.Seed<<8+uint64(u))
	if err != nil {
		return
	}
	// The first request comes after a pause in [0, ThinkMax), if that is before the end.
	if first := uniform(rng, 0, r.sc.ThinkMax); first >= r.sc.Duration || !r.sleep(ctx, first) {
		return
	}
	for r.simSince() < r.sc.Duration {
		reqCtx, cancel := context.WithTimeout(ctx, time.Duration(float64(r.sc.ChatTimeout)*r.scale))
		res, replica, err := r.send(reqCtx, storm.FeatureChat, tenant, body)
		cancel()
		if ctx.Err() != nil {
			return
		}
		r.record(replica, storm.FeatureChat, res, err)
		think := uniform(rng, r.sc.ThinkMin, r.sc.ThinkMax)
		if r.simSince()+think >= r.sc.Duration || !r.sleep(ctx, think) {
			return
		}
	}
}

func (r *fleetRun) storm(ctx context.Context) {
	if !r.sleep(ctx, r.sc.StormAt) {
		return
	}
	var wg sync.WaitGroup
	for w := range r.sc.BatchWorkers {
		wg.Go(func() {
			slots := make(chan struct{}, r.sc.BatchWorkerConcurrency)
			var docs sync.WaitGroup
			for d := range r.sc.BatchPerWorker {
				select {
				case slots <- struct{}{}:
				case <-ctx.Done():
					docs.Wait()
					return
				}
				doc := w*r.sc.BatchPerWorker + d
				docs.Go(func() {
					defer func() { <-slots }()
					r.document(ctx, doc)
				})
			}
			docs.Wait()
		})
	}
	wg.Wait()
}

// document summarises one document, honouring refusals' retry-after until the run is over.
func (r *fleetRun) document(ctx context.Context, doc int) {
	body, err := storm.RequestBody(r.sc.Model, fmt.Sprintf("export-doc-%02d", doc), r.sc.BatchTokens, r.o.Seed<<16+uint64(doc)+1<<12)
	if err != nil {
		return
	}
	limit := time.Duration(float64(r.sc.Duration+r.sc.ChatTimeout) * r.scale)
	for {
		reqCtx, cancel := context.WithTimeout(ctx, limit)
		res, replica, err := r.send(reqCtx, storm.FeatureBatch, r.sc.BatchTenant, body)
		cancel()
		if ctx.Err() != nil {
			return
		}
		outcome := r.record(replica, storm.FeatureBatch, res, err)
		if outcome == storm.OutcomeOK {
			r.mu.Lock()
			r.batchDone++
			r.mu.Unlock()
		}
		retry := retryAfter(res)
		if outcome != storm.OutcomeRefused || !r.sc.BatchRetry || r.simSince()+retry >= r.sc.Duration {
			return
		}
		if !r.sleep(ctx, retry) {
			return
		}
	}
}

// retryAfter reads a refusal's retry-after as simulated seconds (the replicas compute it from
// scaled waits), at least one second.
func retryAfter(res *envoysim.Result) time.Duration {
	if res == nil {
		return time.Second
	}
	n, err := strconv.Atoi(strings.TrimSpace(res.Headers.Get(extproc.HeaderRetryAfter)))
	if err != nil || n < 1 {
		return time.Second
	}
	return time.Duration(n) * time.Second
}

// send runs one request through the next replica (round robin) and returns which one it was.
func (r *fleetRun) send(ctx context.Context, feature, tenant string, body []byte) (*envoysim.Result, int, error) {
	i := int(r.next.Add(1)-1) % len(r.sims)
	req := &envoysim.Request{
		Method: "POST",
		Path:   "/v1/chat/completions",
		Headers: envoysim.Headers{
			{Key: "content-type", Value: "application/json"},
			{Key: headerFeature, Value: feature},
			{Key: headerTenant, Value: tenant},
		},
		Body: body,
	}
	res, err := r.sims[i].RoundTrip(ctx, req, r.up)
	return res, i, err
}

// record counts one request's outcome at the replica that decided it.
func (r *fleetRun) record(replica int, feature string, res *envoysim.Result, err error) string {
	outcome, reason := storm.OutcomeError, "simulator"
	if err == nil && res != nil {
		outcome, reason = storm.Classify(res)
	}
	var tokens int64
	paid := false
	degraded := false
	if err == nil && res != nil && res.Upstream != nil {
		prov := res.Upstream.Headers.Get(extproc.HeaderProvider)
		degraded = prov != "" && prov != r.provider
		if feature == storm.FeatureBatch && outcome == storm.OutcomeOK {
			tokens = usageTokens(res.Body)
			paid = r.paid[prov]
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range []map[string]*Counts{r.counts[replica], r.tick} {
		c := m[feature]
		if c == nil {
			c = &Counts{Refused: map[string]int{}}
			m[feature] = c
		}
		if err == nil && res != nil && res.Upstream != nil {
			c.Admitted++
			if degraded {
				c.Degraded++
			}
		}
		switch outcome {
		case storm.OutcomeRefused:
			c.Refused[reason]++
		case storm.OutcomeError:
			if c.Failed == nil {
				c.Failed = map[string]int{}
			}
			c.Failed[reason]++
		}
	}
	r.batchTok += tokens
	if paid {
		r.paidTok += tokens
		r.paidReqs++
	}
	if feature == storm.FeatureChat && outcome == storm.OutcomeOK {
		r.chatLat = append(r.chatLat, res.Completed.Sub(res.Started).Seconds()/r.scale)
	}
	return outcome
}

// usageTokens reads usage.total_tokens from an OpenAI chat completion.
func usageTokens(body []byte) int64 {
	var v struct {
		Usage struct {
			Total int64 `json:"total_tokens"`
		} `json:"usage"`
	}
	if json.Unmarshal(body, &v) != nil {
		return 0
	}
	return v.Usage.Total
}

// progress prints, every wall-clock second, what the fleet did since the last line.
func (r *fleetRun) progress(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		inFlight, _ := r.up.snapshot()
		r.mu.Lock()
		tick := r.tick
		r.tick = map[string]*Counts{}
		r.mu.Unlock()
		var parts []string
		for _, f := range []string{storm.FeatureChat, storm.FeatureBatch} {
			c := tick[f]
			if c == nil {
				c = &Counts{}
			}
			s := fmt.Sprintf("%-5s %3d admitted", short(f), c.Admitted)
			if c.Degraded > 0 {
				s += fmt.Sprintf(" (%d degraded)", c.Degraded)
			}
			if n := c.RefusedTotal(); n > 0 {
				s += fmt.Sprintf(", %3d refused", n)
			}
			if n := c.FailedTotal(); n > 0 {
				s += fmt.Sprintf(", %d failed", n)
			}
			parts = append(parts, s)
		}
		fmt.Fprintf(r.o.Progress, "t=%4.1fs  %-52s | in flight now: chat %2d, batch %2d\n", r.simSince().Seconds(),
			strings.Join(parts, " | "), inFlight[storm.FeatureChat], inFlight[storm.FeatureBatch])
	}
}

func short(feature string) string {
	if feature == storm.FeatureBatch {
		return "batch"
	}
	return feature
}
