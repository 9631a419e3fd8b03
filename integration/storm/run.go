package storm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/extproc"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// Options configure Run. The zero value of each field is documented on it.
type Options struct {
	// Scenario is the traffic; DefaultScenario is the batch-export storm. Scenario.Storm is
	// overridden per configuration.
	Scenario Scenario
	// Configurations run in this order within each repetition. Required.
	Configurations []Configuration
	// TimeScale multiplies every simulated duration (0 means 1: real time).
	TimeScale float64
	// Seed fixes the users' think times and mockllm's latency draws; a configuration's
	// repetition r uses Seed+r, so every configuration sees the same traffic in a repetition.
	Seed uint64
	// Capacity is how many requests the mock LLM serves at once (the shared upstream pool); the
	// rest wait in FIFO order. 0 means unlimited. A scenario with a brownout sets the capacity
	// itself (Scenario.Brownout), and Capacity is not used.
	Capacity int
	// Repeat is how many times each configuration runs (0 means 1).
	Repeat int
	// Progress, when set, is called every ProgressInterval of wall time during a run, from one
	// goroutine, with what happened since the previous call.
	Progress func(Tick)
	// ProgressInterval is the wall time between Progress calls (0 means one second).
	ProgressInterval time.Duration
	// RunDone, when set, is called after each run with its result.
	RunDone func(*RunResult)
	// Logs receives the server's JSON logs (nil: discarded).
	Logs io.Writer
}

func (o Options) scale() float64 {
	if o.TimeScale == 0 {
		return 1
	}
	return o.TimeScale
}

func (o Options) repeat() int { return max(o.Repeat, 1) }

// ErrOptions marks an error of Run caused by its Options; check with errors.Is.
var ErrOptions = errors.New("invalid options")

// scenario is the scenario with Storm set when any configuration runs the storm, so that the
// batch job's settings are checked and reported only when it runs.
func (o Options) scenario() Scenario {
	sc := o.Scenario
	sc.Storm = slices.ContainsFunc(o.Configurations, func(c Configuration) bool { return c.Storm })
	return sc
}

// validate reports every nonsensical option at once.
func (o Options) validate() error {
	var errs []error
	if err := o.scenario().Validate(); err != nil {
		errs = append(errs, err)
	}
	if len(o.Configurations) == 0 {
		errs = append(errs, errors.New("no configuration to run"))
	}
	seen := map[string]bool{}
	for _, c := range o.Configurations {
		if c.Name == "" || seen[c.Name] {
			errs = append(errs, fmt.Errorf("configuration names must be unique and not empty (%q)", c.Name))
		}
		seen[c.Name] = true
		if c.Shadow && c.PassThrough() {
			errs = append(errs, fmt.Errorf("configuration %s: shadow mode needs a policy", c.Name))
		}
		if c.ProviderQuota && o.Scenario.QuotaProvider == "" {
			errs = append(errs, fmt.Errorf("configuration %s: a provider quota needs the scenario's quota provider", c.Name))
		}
	}
	if s := o.scale(); !(s > 0) || math.IsInf(s, 0) {
		errs = append(errs, fmt.Errorf("time scale %v must be a positive finite number", o.TimeScale))
	}
	if o.Capacity < 0 {
		errs = append(errs, fmt.Errorf("capacity %d must not be negative", o.Capacity))
	}
	if o.Repeat < 0 {
		errs = append(errs, fmt.Errorf("repeat %d must not be negative", o.Repeat))
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrOptions, errors.Join(errs...))
	}
	return nil
}

// Outcomes of a request as its client saw it.
const (
	OutcomeOK      = "ok"
	OutcomeRefused = "refused"
	OutcomeError   = "error"
)

// Sample is one chat request, or one batch document (all its attempts), as the client saw it.
// Times are simulated seconds.
type Sample struct {
	Tenant string `json:"tenant"`
	// Start is when the (first) request was sent, since the run began.
	Start float64 `json:"start"`
	// Latency is from Start to the answer of the last attempt.
	Latency float64 `json:"latency"`
	// Outcome is ok, refused or error (of the last attempt).
	Outcome string `json:"outcome"`
	// Reason is the x-bulkhead-reason of a refusal or the kind of an error.
	Reason string `json:"reason,omitempty"`
	// Attempts counts the requests sent for a batch document.
	Attempts int `json:"attempts,omitempty"`
	// Compartment is a refusal's x-bulkhead-compartment: the compartment that said no.
	Compartment string `json:"compartment,omitempty"`
	// RetryAfter is a refusal's retry-after in simulated seconds (0 when it had none). A batch
	// document refused on its last attempt was given up because this wait would have ended
	// after the run.
	RetryAfter float64 `json:"retry_after,omitempty"`
	// ProviderWait is how long the request (a document: all its attempts) waited in the
	// upstream's own queue for a slot, as mockllm reported it (x-mockllm-queue-wait).
	ProviderWait float64 `json:"provider_wait,omitempty"`
	// ProxyWait is how long it took from being sent to reaching the upstream (or to its answer,
	// when it never reached it): queueing in llm-bulkhead plus the proxy's own time.
	ProxyWait float64 `json:"proxy_wait,omitempty"`
}

// EngineCounts is what llm-bulkhead itself counted during a run.
type EngineCounts struct {
	// Decisions are the engine's admissions and refusals per feature.
	Decisions []observe.FeatureDecisions `json:"decisions"`
	// ShadowRejections counts what shadow-mode compartments would have refused, per compartment
	// and reason; a request over the limit of two compartments counts in both.
	ShadowRejections map[string]map[string]int `json:"shadow_rejections,omitempty"`
	// BreakerOpenings counts breaker transitions to OPEN.
	BreakerOpenings int `json:"breaker_openings"`
	// Rerouted counts requests sent to another provider instead of being refused; Reroutes
	// splits them by feature, providers and reason.
	Rerouted int       `json:"rerouted"`
	Reroutes []Reroute `json:"reroutes,omitempty"`
	// QuotaShort counts the requests a provider's quota, as its headers told it, could not
	// cover (in shadow mode: would have re-routed or refused), per provider.
	QuotaShort map[string]int `json:"quota_short,omitempty"`
	// Limits holds, for every compartment that refused a request of the run (see
	// RunResult.RefusedBy), what it allows.
	Limits map[string]CompartmentLimits `json:"limits,omitempty"`
}

// Reroute counts requests of one feature that one provider refused for Reason and that were
// sent to another instead (a breaker's fallback or a feature's degrade rule).
type Reroute struct {
	Feature string `json:"feature"`
	From    string `json:"from"`
	To      string `json:"to"`
	Reason  string `json:"reason"`
	Count   int    `json:"count"`
}

// CompartmentLimits is what one compartment allows, as the server held it at the end of a run.
// Zero means no such limit.
type CompartmentLimits struct {
	// MaxConcurrent is how many requests it holds at once (a pool's whole size when it borrows).
	MaxConcurrent int64 `json:"max_concurrent,omitempty"`
	// MaxWait is the compartment's own max_wait, in simulated time. A request queues at most
	// the shortest max_wait of all its compartments, which may be another one's.
	MaxWait string `json:"max_wait,omitempty"`
	// TokensPerMinute, TokensPerDay and RequestsPerMinute are its budgets' capacities. Budgets
	// are not time-scaled: a run, shorter than a minute, never sees them refill.
	TokensPerMinute   int64 `json:"tokens_per_minute,omitempty"`
	TokensPerDay      int64 `json:"tokens_per_day,omitempty"`
	RequestsPerMinute int64 `json:"requests_per_minute,omitempty"`
}

// RunResult is one run of one configuration.
type RunResult struct {
	Configuration string `json:"configuration"`
	Repetition    int    `json:"repetition"`
	Seed          uint64 `json:"seed"`
	// WallSeconds is how long the run took in real time, stack start and stop included.
	WallSeconds float64 `json:"wall_seconds"`
	// StormStart and StormEnd bracket the batch job (simulated seconds; absent without storm).
	StormStart *float64 `json:"storm_start,omitempty"`
	StormEnd   *float64 `json:"storm_end,omitempty"`
	Chat       []Sample `json:"chat"`
	Batch      []Sample `json:"batch,omitempty"`
	// Admitted counts, per feature, requests that reached the upstream.
	Admitted map[string]int `json:"admitted"`
	// Answered counts, per feature, requests answered successfully.
	Answered map[string]int `json:"answered"`
	// Refusals counts refused requests per feature and x-bulkhead-reason.
	Refusals map[string]map[string]int `json:"refusals"`
	// RefusedBy counts refused requests per feature, x-bulkhead-compartment and
	// x-bulkhead-reason: which compartment said no, and why.
	RefusedBy map[string]map[string]map[string]int `json:"refused_by,omitempty"`
	// Errors counts failed requests that were not refusals, per feature and kind.
	Errors map[string]map[string]int `json:"errors"`
	// UpstreamPeakInFlight and UpstreamPeakQueued are the most requests the mock LLM was
	// serving and holding in its queue at once (sampled every 10 ms of wall time).
	UpstreamPeakInFlight int `json:"upstream_peak_in_flight"`
	UpstreamPeakQueued   int `json:"upstream_peak_queued"`
	// UpstreamByProvider counts the requests the mock LLM received per provider, and
	// ProviderQuotaRefused those it refused with 429 because the account's quota was used up.
	UpstreamByProvider   map[string]int64 `json:"upstream_by_provider,omitempty"`
	ProviderQuotaRefused int64            `json:"provider_quota_refused"`
	// StallMillis is the longest a 10 ms wall-clock tick of the sampler came late, in
	// milliseconds of wall time: how long the process was kept from running (machine load,
	// garbage collection). Multiplied by 1/TimeScale it is the simulated delay a request could
	// have suffered from it.
	StallMillis float64 `json:"stall_ms"`
	// Engine is nil for pass-through configurations.
	Engine *EngineCounts `json:"engine,omitempty"`
	// Trace samples the upstream and the proxy's provider compartments about every quarter of
	// a simulated second (with a brownout; empty otherwise).
	Trace   []TracePoint `json:"trace,omitempty"`
	Summary RunSummary   `json:"summary"`
}

// TracePoint is the state of the upstream and of the proxy's provider compartments at one
// instant of a run.
type TracePoint struct {
	// At is simulated seconds since the run began.
	At float64 `json:"at"`
	// Capacity, UpstreamInFlight and UpstreamQueued are the mock LLM's capacity in force, the
	// requests it was serving and those waiting in its queue.
	Capacity         int `json:"capacity"`
	UpstreamInFlight int `json:"upstream_in_flight"`
	UpstreamQueued   int `json:"upstream_queued"`
	// Limit, InFlight and Queued sum the provider compartments' limits (an adaptive limit's
	// current value), requests admitted and requests queued, as llm-bulkhead held them (0 for
	// pass-through).
	Limit    int64 `json:"limit"`
	InFlight int64 `json:"in_flight"`
	Queued   int   `json:"queued"`
	// Adaptive is the adaptive limit's state (its baselines, last signals and counts of cuts
	// and raises) when a provider compartment has one.
	Adaptive *policy.AdaptiveView `json:"adaptive,omitempty"`
}

// Tick reports what happened during one Options.ProgressInterval of a run.
type Tick struct {
	Configuration string
	Repetition    int
	// At is the simulated time of the tick since the run began.
	At time.Duration
	// Features holds the chat and batch counts since the previous tick.
	Features []FeatureTick
	// UpstreamInFlight and UpstreamQueued are the mock LLM's occupancy at the tick.
	UpstreamInFlight, UpstreamQueued int
}

// FeatureTick counts one feature's requests during a tick.
type FeatureTick struct {
	Feature string
	// Admitted counts requests forwarded upstream (admitted by the server, or passed through).
	Admitted int
	// Refused counts refusals by reason; Errors other failures.
	Refused map[string]int
	Errors  int
	// Answered counts requests answered successfully; Slowest is the longest of their
	// latencies in simulated seconds.
	Answered int
	Slowest  float64
}

// Run executes every configuration opts.Repeat times and returns the report. Cancelling ctx
// stops the experiment between and within runs and returns ctx's error.
func Run(ctx context.Context, opts Options) (*Report, error) {
	if err := opts.validate(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "storm-policies-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	paths, err := derivePolicies(dir, opts)
	if err != nil {
		return nil, err
	}
	rep := newReport(opts)
	started := time.Now()
	for r := range opts.repeat() {
		for _, c := range opts.Configurations {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			res, err := runOne(ctx, opts, c, paths[c.Name], r)
			if err != nil {
				return nil, fmt.Errorf("%s (repetition %d): %w", c.Name, r+1, err)
			}
			if opts.RunDone != nil {
				opts.RunDone(res)
			}
			rep.Runs = append(rep.Runs, res)
		}
	}
	rep.WallSeconds = time.Since(started).Seconds()
	rep.LoadAverageEnd = harness.LoadAverage()
	rep.summarize()
	return rep, nil
}

// derivePolicies writes the policy each configuration runs, scaled to the experiment's time,
// into dir, and returns the paths by configuration name.
func derivePolicies(dir string, opts Options) (map[string]string, error) {
	out := map[string]string{}
	for i, c := range opts.Configurations {
		if c.PassThrough() {
			continue
		}
		src := c.PolicyText
		if src == nil {
			var err error
			if src, err = os.ReadFile(c.PolicyPath); err != nil {
				return nil, fmt.Errorf("configuration %s: %w", c.Name, err)
			}
		}
		b, err := DerivePolicy(c.PolicyPath, src, c.variant(opts.scale()))
		if err != nil {
			return nil, fmt.Errorf("configuration %s: %w", c.Name, err)
		}
		p := filepath.Join(dir, fmt.Sprintf("%02d-%s.yaml", i, c.Name))
		if err := os.WriteFile(p, b, 0o600); err != nil {
			return nil, err
		}
		out[c.Name] = p
	}
	return out, nil
}

// run is the state of one run. Its counters are guarded by mu.
type run struct {
	opts  Options
	sc    Scenario
	cfg   Configuration
	rep   int
	seed  uint64
	scale float64
	stack *harness.Stack
	t0    time.Time

	mu        sync.Mutex
	chat      []Sample
	batch     []Sample
	admitted  map[string]int
	answered  map[string]int
	refusals  map[string]map[string]int
	refusedBy map[string]map[string]map[string]int
	errs      map[string]map[string]int
	tick      map[string]*FeatureTick
	peakIn    int
	peakQueue int
	stall     time.Duration
	stormEnd  time.Time
	trace     []TracePoint
}

func runOne(ctx context.Context, opts Options, c Configuration, policyPath string, rep int) (*RunResult, error) {
	wall := time.Now()
	r := &run{
		opts: opts, sc: opts.Scenario, cfg: c, rep: rep, seed: opts.Seed + uint64(rep), scale: opts.scale(),
		admitted: map[string]int{}, answered: map[string]int{}, refusals: map[string]map[string]int{}, errs: map[string]map[string]int{},
		refusedBy: map[string]map[string]map[string]int{}, tick: map[string]*FeatureTick{},
	}
	r.sc.Storm = c.Storm
	if c.FollowCapacity {
		// The run rewrites its policy as the capacity changes: it gets a copy of its own.
		b, err := os.ReadFile(policyPath)
		if err != nil {
			return nil, err
		}
		dir, err := os.MkdirTemp("", "storm-follow-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		policyPath = filepath.Join(dir, "policy.yaml")
		if err := os.WriteFile(policyPath, b, 0o600); err != nil {
			return nil, err
		}
	}
	mo := mock.Options{TimeScale: r.scale, Seed: r.seed, Capacity: opts.Capacity, ChunkTokens: r.sc.ChunkTokens}
	switch {
	case c.Brownout:
		mo.Capacity, mo.CapacitySchedule = 0, r.sc.Brownout
	case len(r.sc.Brownout) > 0:
		mo.Capacity = r.sc.Brownout[0].Capacity
	}
	if c.ProviderQuota {
		mo.Quotas = map[string]mock.RequestQuota{r.sc.QuotaProvider: r.sc.ProviderQuota}
	}
	ho := harness.Options{
		PolicyPath: policyPath,
		Env:        []string{},
		Mock:       mo,
		Logs:       opts.Logs,
		// The mock LLM serves each provider only the models the policy gives it: a batch
		// request degraded to local must arrive as local's model, or it fails.
		CheckModels: true,
	}
	if c.PassThrough() {
		// The server runs (the harness always starts one) but the filter never calls it.
		ho.Filter = func(f *envoysim.FilterConfig) {
			f.Mode = envoysim.ProcessingMode{RequestHeader: envoysim.HeaderSkip, ResponseHeader: envoysim.HeaderSkip}
		}
	}
	st, err := harness.Start(ho)
	if err != nil {
		return nil, err
	}
	running := true
	defer func() {
		if running {
			st.Close()
		}
	}()
	r.stack = st
	if !c.PassThrough() {
		// Open the gRPC connection now, so the first request does not pay for it.
		raw, err := st.Sim.OpenRaw(ctx)
		if err != nil {
			return nil, fmt.Errorf("connecting to the server: %w", err)
		}
		raw.Reset()
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	// The run starts now: the mock LLM's counters and capacity schedule with it.
	st.Mock.Reset()
	r.t0 = time.Now()
	var bg sync.WaitGroup
	bg.Go(func() { r.sample(runCtx) })
	var followErr error
	if c.FollowCapacity {
		bg.Go(func() { followErr = r.followCapacity(runCtx, policyPath) })
	}

	var wg sync.WaitGroup
	user := 0
	for _, share := range r.sc.Chat {
		for range share.Users {
			u, tenant := user, share.Tenant
			wg.Go(func() { r.chatUser(ctx, u, tenant) })
			user++
		}
	}
	var stormStart time.Time
	switch {
	case r.sc.Storm && r.sc.BatchSteady:
		wg.Go(func() { stormStart = r.steadyBatch(ctx) })
	case r.sc.Storm:
		wg.Go(func() { stormStart = r.storm(ctx) })
	}
	wg.Wait()
	cancel()
	bg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if followErr != nil {
		return nil, followErr
	}

	res := &RunResult{
		Configuration: c.Name, Repetition: rep, Seed: r.seed,
		Chat: r.chat, Batch: r.batch, Admitted: r.admitted, Answered: r.answered, Refusals: r.refusals, RefusedBy: r.refusedBy, Errors: r.errs,
		UpstreamPeakInFlight: r.peakIn, UpstreamPeakQueued: r.peakQueue,
		StallMillis: float64(r.stall.Microseconds()) / 1000, Trace: r.trace,
	}
	if !stormStart.IsZero() {
		s, e := r.sim(stormStart), r.sim(r.stormEnd)
		res.StormStart, res.StormEnd = &s, &e
	}
	sort.Slice(res.Chat, func(i, j int) bool { return res.Chat[i].Start < res.Chat[j].Start })
	sort.Slice(res.Batch, func(i, j int) bool { return res.Batch[i].Start < res.Batch[j].Start })
	ms := st.Mock.Stats()
	res.UpstreamByProvider, res.ProviderQuotaRefused = ms.ByProvider, ms.ByOutcome[mock.OutcomeQuota]
	if !c.PassThrough() {
		res.Engine = engineCounts(st)
		res.Engine.Limits = compartmentLimits(st.App.Engine().Compartments(), res.RefusedBy, r.scale)
	}
	running = false
	st.Close()
	res.Summary = summarizeRun(res, r.sc)
	res.WallSeconds = time.Since(wall).Seconds()
	return res, nil
}

// sim converts a wall-clock instant to simulated seconds since the run began.
func (r *run) sim(t time.Time) float64 { return t.Sub(r.t0).Seconds() / r.scale }

// simSince is the simulated time elapsed since the run began.
func (r *run) simSince() time.Duration {
	return time.Duration(float64(time.Since(r.t0)) / r.scale)
}

// sleep waits d of simulated time; it returns false when ctx ended first.
func (r *run) sleep(ctx context.Context, d time.Duration) bool {
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

// uniform returns a duration uniformly drawn from [lo, hi).
func uniform(rng *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(rng.Float64()*float64(hi-lo))
}

// chatUser sends chat requests with think times until the scenario's duration is over.
func (r *run) chatUser(ctx context.Context, u int, tenant string) {
	rng := rand.New(rand.NewPCG(r.seed, uint64(u)))
	name := fmt.Sprintf("user-%02d", u)
	body, err := requestBody(r.sc.Model, name, r.sc.ChatTokens, r.seed<<8+uint64(u), r.sc.Stream)
	if err != nil {
		r.record(FeatureChat, Sample{Tenant: tenant, Outcome: OutcomeError, Reason: "body"}, true)
		return
	}
	if !r.sleep(ctx, uniform(rng, 0, r.sc.ThinkMax)) {
		return
	}
	for r.simSince() < r.sc.Duration {
		reqCtx, cancel := context.WithTimeout(ctx, time.Duration(float64(r.sc.ChatTimeout)*r.scale))
		res, called, err := r.send(reqCtx, FeatureChat, tenant, body)
		cancel()
		if ctx.Err() != nil {
			return
		}
		s := r.sampleOf(res, called, err, tenant)
		r.record(FeatureChat, s, true)
		think := uniform(rng, r.sc.ThinkMin, r.sc.ThinkMax)
		if r.simSince()+think >= r.sc.Duration || !r.sleep(ctx, think) {
			return
		}
	}
}

// storm runs the batch job from the scenario's start time and returns when it started.
func (r *run) storm(ctx context.Context) time.Time {
	if !r.sleep(ctx, r.sc.StormAt) {
		return time.Time{}
	}
	start := time.Now()
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
	return start
}

// document summarises one document: it sends the request and, when refused and the scenario
// says so, waits the retry-after and tries again until the run is over.
func (r *run) document(ctx context.Context, doc int) {
	tenant := r.sc.BatchTenant
	body, err := requestBody(r.sc.Model, fmt.Sprintf("export-doc-%02d", doc), r.sc.BatchTokens, r.seed<<16+uint64(doc)+1<<12, r.sc.Stream)
	if err != nil {
		r.recordDoc(Sample{Tenant: tenant, Outcome: OutcomeError, Reason: "body"})
		return
	}
	first := time.Now()
	// A batch request is never hung up on before the run is over and every answer is in.
	limit := time.Duration(float64(r.sc.Duration+r.sc.ChatTimeout) * r.scale)
	var providerWait, proxyWait float64
	for attempt := 1; ; attempt++ {
		reqCtx, cancel := context.WithTimeout(ctx, limit)
		res, called, err := r.send(reqCtx, FeatureBatch, tenant, body)
		cancel()
		if ctx.Err() != nil {
			return
		}
		s := r.sampleOf(res, called, err, tenant)
		providerWait += s.ProviderWait
		proxyWait += s.ProxyWait
		outcome, reason, retry := s.Outcome, s.Reason, retryAfter(res)
		r.record(FeatureBatch, s, false)
		done := outcome == OutcomeOK || outcome == OutcomeError || !r.sc.BatchRetry ||
			r.simSince()+retry >= r.sc.Duration
		if done {
			s = Sample{Tenant: tenant, Start: r.sim(first), Latency: time.Since(first).Seconds() / r.scale,
				Outcome: outcome, Reason: reason, Attempts: attempt, Compartment: s.Compartment, RetryAfter: s.RetryAfter,
				ProviderWait: providerWait, ProxyWait: proxyWait}
			r.recordDoc(s)
			return
		}
		if !r.sleep(ctx, retry) {
			return
		}
	}
}

// retryAfter returns a refusal's retry-after, read as simulated seconds (the server computes it
// from scaled waits, rounded up to whole seconds), at least one second.
func retryAfter(res *envoysim.Result) time.Duration {
	if d, ok := retryAfterHeader(res); ok {
		return d
	}
	return time.Second
}

// retryAfterHeader returns a response's retry-after of at least one second, read as simulated
// seconds; false when there is none.
func retryAfterHeader(res *envoysim.Result) (time.Duration, bool) {
	if res == nil {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(res.Headers.Get(extproc.HeaderRetryAfter)))
	if err != nil || n < 1 {
		return 0, false
	}
	return time.Duration(n) * time.Second, true
}

// followCapacity rewrites the run's policy file (its own copy) with every provider's
// max_concurrent set to the upstream's new capacity at each change of the brownout (FollowDelay
// after it), and reloads it, until ctx ends.
func (r *run) followCapacity(ctx context.Context, path string) error {
	src := r.cfg.PolicyText
	if src == nil {
		var err error
		if src, err = os.ReadFile(r.cfg.PolicyPath); err != nil {
			return err
		}
	}
	for _, st := range r.sc.Brownout[1:] {
		if !r.sleep(ctx, st.At+r.cfg.FollowDelay-r.simSince()) {
			return nil
		}
		v := r.cfg.variant(r.scale)
		v.ProviderLimit = strconv.Itoa(st.Capacity)
		b, err := DerivePolicy(r.cfg.PolicyPath, src, v)
		if err != nil {
			return err
		}
		if err := os.WriteFile(path, b, 0o600); err != nil {
			return err
		}
		if err := r.stack.App.Reload("storm: the provider's capacity is now " + v.ProviderLimit); err != nil {
			return fmt.Errorf("following the capacity: %w", err)
		}
	}
	return nil
}

// steadyBatch runs the steady batch load from the scenario's start time: every worker sends one
// document after another until the run is over. It returns when the load started.
func (r *run) steadyBatch(ctx context.Context) time.Time {
	if !r.sleep(ctx, r.sc.StormAt) {
		return time.Time{}
	}
	start := time.Now()
	var wg sync.WaitGroup
	for w := range r.sc.BatchWorkers {
		wg.Go(func() {
			// The workers start spread over a second, so that their documents do not finish in
			// step and free the slots in waves, as a long-running job's would not.
			if !r.sleep(ctx, time.Duration(w)*time.Second/time.Duration(r.sc.BatchWorkers)) {
				return
			}
			// Documents are numbered per worker so that no two workers send the same one.
			for d := 0; r.simSince() < r.sc.Duration && ctx.Err() == nil; d++ {
				r.document(ctx, d*r.sc.BatchWorkers+w)
			}
		})
	}
	wg.Wait()
	return start
}

// send runs one chat/completions request through the simulator to the mock LLM. called is when
// the simulator called the upstream (zero when it never did).
func (r *run) send(ctx context.Context, feature, tenant string, body []byte) (res *envoysim.Result, called time.Time, err error) {
	var mu sync.Mutex
	req := &envoysim.Request{
		Method: "POST",
		Path:   "/v1/chat/completions",
		Headers: envoysim.Headers{
			{Key: "content-type", Value: "application/json"},
			{Key: headerFeature, Value: feature},
			{Key: headerTenant, Value: tenant},
		},
		Body: body,
		OnEvent: func(e envoysim.Event) envoysim.Action {
			if e.Kind == envoysim.EventUpstreamCalled {
				r.countAdmitted(feature)
				mu.Lock()
				called = e.At
				mu.Unlock()
			}
			return envoysim.Proceed
		},
	}
	res, err = r.stack.Do(ctx, req)
	mu.Lock()
	defer mu.Unlock()
	return res, called, err
}

// sampleOf turns a result into a sample (start, latency and waits in simulated seconds);
// called is when the upstream was called (zero: never).
func (r *run) sampleOf(res *envoysim.Result, called time.Time, err error, tenant string) Sample {
	if err != nil || res == nil {
		now := r.sim(time.Now())
		return Sample{Tenant: tenant, Start: now, Outcome: OutcomeError, Reason: "simulator"}
	}
	outcome, reason := Classify(res)
	s := Sample{
		Tenant: tenant, Start: r.sim(res.Started), Latency: res.Completed.Sub(res.Started).Seconds() / r.scale,
		Outcome: outcome, Reason: reason,
	}
	reached := res.Completed
	if !called.IsZero() {
		reached = called
	}
	s.ProxyWait = max(0, reached.Sub(res.Started).Seconds()/r.scale)
	if w, err := strconv.ParseFloat(res.Headers.Get(mock.HeaderQueueWait), 64); err == nil && w >= 0 {
		s.ProviderWait = w
	}
	if outcome == OutcomeRefused {
		s.Compartment = res.Headers.Get(extproc.HeaderCompartment)
		if d, ok := retryAfterHeader(res); ok {
			s.RetryAfter = d.Seconds()
		}
	}
	return s
}

// Classify tells what the client got: an answer (ok), a refusal by llm-bulkhead (refused, with
// its x-bulkhead-reason) or any other failure (error, with its kind).
func Classify(res *envoysim.Result) (outcome, reason string) {
	switch {
	case res.Canceled:
		return OutcomeError, "timeout"
	case res.Local == envoysim.LocalImmediate:
		if reason := res.Headers.Get(extproc.HeaderReason); reason != "" {
			return OutcomeRefused, reason
		}
		return OutcomeError, fmt.Sprintf("immediate_%d", res.Status)
	case res.Local != envoysim.NotLocal:
		return OutcomeError, res.Local.String()
	case res.Reset:
		return OutcomeError, "reset"
	case res.Status < 200 || res.Status > 299:
		return OutcomeError, fmt.Sprintf("status_%d", res.Status)
	}
	return OutcomeOK, ""
}

func (r *run) countAdmitted(feature string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.admitted[feature]++
	r.tickFor(feature).Admitted++
}

// tickFor returns the current tick's counts of feature; r.mu must be held.
func (r *run) tickFor(feature string) *FeatureTick {
	ft := r.tick[feature]
	if ft == nil {
		ft = &FeatureTick{Feature: feature, Refused: map[string]int{}}
		r.tick[feature] = ft
	}
	return ft
}

// record counts one request's outcome; keep adds it to the chat samples.
func (r *run) record(feature string, s Sample, keep bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ft := r.tickFor(feature)
	switch s.Outcome {
	case OutcomeRefused:
		inc(r.refusals, feature, s.Reason)
		if r.refusedBy[feature] == nil {
			r.refusedBy[feature] = map[string]map[string]int{}
		}
		inc(r.refusedBy[feature], s.Compartment, s.Reason)
		ft.Refused[s.Reason]++
	case OutcomeError:
		inc(r.errs, feature, s.Reason)
		ft.Errors++
	default:
		r.answered[feature]++
		ft.Answered++
		ft.Slowest = max(ft.Slowest, s.Latency)
	}
	if keep {
		r.chat = append(r.chat, s)
	}
}

func (r *run) recordDoc(s Sample) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.batch = append(r.batch, s)
	r.stormEnd = time.Now()
}

func inc(m map[string]map[string]int, a, b string) {
	if m[a] == nil {
		m[a] = map[string]int{}
	}
	m[a][b]++
}

// sample watches the mock LLM's pool for its peaks and the process for stalls, and reports
// progress every ProgressInterval.
func (r *run) sample(ctx context.Context) {
	const period = 10 * time.Millisecond
	// The trace takes a tick about every quarter of a simulated second, with a brownout only.
	traceEvery := max(1, int(math.Round(float64(traceStep)*r.scale/float64(period))))
	traced := len(r.sc.Brownout) > 0
	fast := time.NewTicker(period)
	defer fast.Stop()
	last := time.Now()
	tick := 0
	every := r.opts.ProgressInterval
	if every <= 0 {
		every = time.Second
	}
	next := time.Now().Add(every)
	for {
		select {
		case <-ctx.Done():
			return
		case <-fast.C:
			now := time.Now()
			late := now.Sub(last) - period
			last = now
			g := r.stack.Mock.Stats().Global
			tick++
			var tp *TracePoint
			if traced && tick%traceEvery == 1%traceEvery {
				tp = r.tracePoint(g)
			}
			r.mu.Lock()
			if tp != nil {
				r.trace = append(r.trace, *tp)
			}
			r.stall = max(r.stall, late)
			r.peakIn = max(r.peakIn, g.InFlight)
			r.peakQueue = max(r.peakQueue, g.Queued)
			var t *Tick
			if r.opts.Progress != nil && !now.Before(next) {
				next = next.Add(every)
				t = r.takeTick(g)
			}
			r.mu.Unlock()
			if t != nil {
				r.opts.Progress(*t)
			}
		}
	}
}

// traceStep is the simulated time between two trace points (rounded to whole sampler ticks).
const traceStep = 250 * time.Millisecond

// tracePoint reads the upstream's pool g and the proxy's provider compartments.
func (r *run) tracePoint(g mock.PoolStats) *TracePoint {
	tp := &TracePoint{At: r.simSince().Seconds(), Capacity: g.Capacity, UpstreamInFlight: g.InFlight, UpstreamQueued: g.Queued}
	if r.cfg.PassThrough() {
		return tp
	}
	for _, v := range r.stack.App.Engine().Compartments() {
		if v.Family == "provider" {
			tp.Limit += compartmentLimit(v)
			tp.InFlight += v.InFlight
			tp.Queued += v.Queued
			if v.Adaptive != nil && tp.Adaptive == nil {
				tp.Adaptive = v.Adaptive
			}
		}
	}
	return tp
}

// takeTick returns the counts since the previous tick and starts a new one; r.mu must be held.
func (r *run) takeTick(g mock.PoolStats) *Tick {
	t := &Tick{Configuration: r.cfg.Name, Repetition: r.rep, At: r.simSince(),
		UpstreamInFlight: g.InFlight, UpstreamQueued: g.Queued}
	for _, f := range []string{FeatureChat, FeatureBatch} {
		if ft := r.tick[f]; ft != nil {
			t.Features = append(t.Features, *ft)
		} else {
			t.Features = append(t.Features, FeatureTick{Feature: f, Refused: map[string]int{}})
		}
	}
	r.tick = map[string]*FeatureTick{}
	return t
}

// engineCounts reads the server's own decisions and metrics.
func engineCounts(st *harness.Stack) *EngineCounts {
	ec := &EngineCounts{Decisions: st.App.Decisions(), ShadowRejections: map[string]map[string]int{}}
	mfs, err := st.App.Registry().Gather()
	if err != nil {
		return ec
	}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "llm_bulkhead_shadow_rejections_total":
			for _, m := range mf.GetMetric() {
				var comp, reason string
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "compartment":
						comp = l.GetValue()
					case "reason":
						reason = l.GetValue()
					}
				}
				if n := int(m.GetCounter().GetValue()); n > 0 {
					if ec.ShadowRejections[reason] == nil {
						ec.ShadowRejections[reason] = map[string]int{}
					}
					ec.ShadowRejections[reason][comp] += n
				}
			}
		case "llm_bulkhead_breaker_transitions_total":
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "to" && l.GetValue() == "OPEN" {
						ec.BreakerOpenings += int(m.GetCounter().GetValue())
					}
				}
			}
		case "llm_bulkhead_provider_quota_short_total":
			for _, m := range mf.GetMetric() {
				n := int(m.GetCounter().GetValue())
				for _, l := range m.GetLabel() {
					if l.GetName() == "provider" && n > 0 {
						if ec.QuotaShort == nil {
							ec.QuotaShort = map[string]int{}
						}
						ec.QuotaShort[l.GetValue()] += n
					}
				}
			}
		case "llm_bulkhead_rerouted_total":
			for _, m := range mf.GetMetric() {
				n := int(m.GetCounter().GetValue())
				ec.Rerouted += n
				if n == 0 {
					continue
				}
				rr := Reroute{Count: n}
				for _, l := range m.GetLabel() {
					switch l.GetName() {
					case "feature":
						rr.Feature = l.GetValue()
					case "from":
						rr.From = l.GetValue()
					case "to":
						rr.To = l.GetValue()
					case "reason":
						rr.Reason = l.GetValue()
					}
				}
				ec.Reroutes = append(ec.Reroutes, rr)
			}
		}
	}
	return ec
}

// compartmentLimits returns the limits of every compartment named in refusedBy (feature →
// compartment → reason), from the server's view of its compartments; waits are converted to
// simulated time by dividing by scale.
func compartmentLimits(views []policy.CompartmentView, refusedBy map[string]map[string]map[string]int, scale float64) map[string]CompartmentLimits {
	want := map[string]bool{}
	for _, byComp := range refusedBy {
		for comp := range byComp {
			want[comp] = true
		}
	}
	out := map[string]CompartmentLimits{}
	for _, v := range views {
		if !want[v.Name] {
			continue
		}
		l := CompartmentLimits{MaxConcurrent: v.MaxConcurrent}
		if d, err := time.ParseDuration(v.MaxWait); err == nil && v.MaxWait != "" {
			l.MaxWait = time.Duration(float64(d) / scale).Round(time.Millisecond).String()
		}
		for _, b := range v.Budgets {
			switch b.Kind {
			case "tokens_per_minute":
				l.TokensPerMinute = b.Capacity
			case "tokens_per_day":
				l.TokensPerDay = b.Capacity
			case "requests_per_minute":
				l.RequestsPerMinute = b.Capacity
			}
		}
		out[v.Name] = l
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// machine describes where the experiment ran.
type machine struct {
	OS         string `json:"os"`
	Arch       string `json:"arch"`
	CPUs       int    `json:"cpus"`
	GoVersion  string `json:"go_version"`
	GOMAXPROCS int    `json:"gomaxprocs"`
}

func thisMachine() machine {
	return machine{OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), GoVersion: runtime.Version(),
		GOMAXPROCS: runtime.GOMAXPROCS(0)}
}

// compartmentLimit is the concurrency limit a compartment holds now: an adaptive limit's
// current value.
func compartmentLimit(v policy.CompartmentView) int64 {
	if v.Adaptive != nil {
		return v.Adaptive.Limit
	}
	return v.MaxConcurrent
}
