package policy

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// breakerSet is the breaker of one provider, or its per-model breakers, plus the tenants an
// upstream retry-after holds back.
type breakerSet struct {
	provider string
	settings config.BreakerSettings
	cfg      breaker.Config
	perModel bool
	judge    judge
	// modelGlobs are the policy's model globs that may name this provider's models: with
	// breaker_per_model, each gets a breaker of its own; models matching none share single.
	modelGlobs []string
	single     *breaker.Breaker

	mu     sync.Mutex
	models map[string]*breaker.Breaker // by glob
	engine *Engine

	holds *tenantHolds

	// shadow is set when the provider's limits run in shadow mode: its breaker's refusals (and
	// retry-after holds) are counted in shadow_rejections_total under label, not enforced, and
	// its openings count as would-open.
	shadow bool
	label  string
}

// For returns the breaker guarding calls to model: with breaker_per_model, the breaker of the
// first model glob of the policy that matches it (created on first use), else the
// provider-wide one. Breakers are keyed by the policy's globs, never by the client's model name,
// so clients cannot create breakers or metric series.
func (bs *breakerSet) For(model string) *breaker.Breaker {
	if !bs.perModel {
		return bs.single
	}
	glob := ""
	for _, g := range bs.modelGlobs {
		if globMatch(g, model) {
			glob = g
			break
		}
	}
	if glob == "" {
		return bs.single
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if b := bs.models[glob]; b != nil {
		return b
	}
	b, err := bs.engine.newBreaker(bs.provider+"/"+glob, bs.settings, bs.cfg)
	if err != nil {
		return bs.single
	}
	bs.models[glob] = b
	return b
}

// maxTenantHolds bounds the tenants held back per provider at once. Past it, expired holds are
// dropped; if none has expired, a new hold is not recorded (its calls go on to the provider,
// which will say 429 again).
const maxTenantHolds = 4096

// tenantHolds records, per tenant, until when an upstream 429's retry-after holds its calls to
// one provider back. It outlives reloads. Safe for concurrent use; admission reads a counter
// and takes the lock only while some hold exists.
type tenantHolds struct {
	n  atomic.Int64
	mu sync.Mutex
	m  map[string]int64 // tenant → Unix nanoseconds
}

func newTenantHolds() *tenantHolds { return &tenantHolds{m: map[string]int64{}} }

// until returns how long tenant is still held back at now (0 when it is not).
func (h *tenantHolds) until(tenant string, now time.Time) time.Duration {
	if h.n.Load() == 0 {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	end, ok := h.m[tenant]
	if !ok {
		return 0
	}
	if left := end - now.UnixNano(); left > 0 {
		return time.Duration(left)
	}
	delete(h.m, tenant)
	h.n.Store(int64(len(h.m)))
	return 0
}

// hold holds tenant back until now+d, extending (never shortening) an existing hold.
func (h *tenantHolds) hold(tenant string, d time.Duration, now time.Time) {
	end := now.Add(d).UnixNano()
	h.mu.Lock()
	defer h.mu.Unlock()
	if cur, ok := h.m[tenant]; ok {
		h.m[tenant] = max(cur, end)
		return
	}
	if len(h.m) >= maxTenantHolds {
		for t, e := range h.m {
			if e <= now.UnixNano() {
				delete(h.m, t)
			}
		}
		if len(h.m) >= maxTenantHolds {
			return
		}
	}
	// The key outlives the request: it must not share memory with the request's message.
	h.m[strings.Clone(tenant)] = end
	h.n.Store(int64(len(h.m)))
}

// holdFor applies an upstream retry-after of d after a call with HTTP status to the breaker b
// that judged it: capped by the policy, a 429 holds back only the tenant that got it when
// retry_after_scope is tenant, and otherwise the breaker opens for everyone.
func (bs *breakerSet) holdFor(tenant string, status int, d time.Duration, b *breaker.Breaker, now time.Time) {
	if d <= 0 {
		return
	}
	d = min(d, bs.judge.holdCap)
	if status == 429 && bs.judge.holdTenant {
		bs.holds.hold(tenant, d, now)
		return
	}
	b.OpenFor(d, now)
}

// all returns every breaker of the set, provider-wide first, then models by name.
func (bs *breakerSet) all() []*breaker.Breaker {
	out := []*breaker.Breaker{bs.single}
	bs.mu.Lock()
	names := make([]string, 0, len(bs.models))
	for n := range bs.models {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		out = append(out, bs.models[n])
	}
	bs.mu.Unlock()
	return out
}

func (e *Engine) newBreaker(name string, s config.BreakerSettings, c breaker.Config) (*breaker.Breaker, error) {
	initial, err := breaker.ParseState(s.State)
	if err != nil {
		return nil, err
	}
	return breaker.New(name, c, e.clock.Now(), breaker.WithListener(e.onBreakerEvent), breaker.WithInitialState(initial))
}

func (e *Engine) onBreakerEvent(ev breaker.Event) {
	shadowed := ev.Kind == breaker.EventTransition && ev.To == breaker.Open && ev.Reason != breaker.ReasonForced && e.breakerShadowed(ev.Name)
	e.rec.BreakerEvent(ev, shadowed, e.clock.Now())
}

// breakerShadowed reports whether the named breaker belongs to a provider whose limits run in
// shadow (breaker names are the provider's, or provider/glob).
func (e *Engine) breakerShadowed(name string) bool {
	s := e.Snapshot()
	if s == nil {
		return false
	}
	provider, _, _ := strings.Cut(name, "/")
	i, ok := s.providerIdx[provider]
	return ok && s.providers[i].breakers != nil && s.providers[i].breakers.shadow
}

// buildBreakers gives every provider with a breaker its breaker set, carrying breakers (state and
// window) over from prev by provider name.
func (s *Snapshot) buildBreakers(prev *Snapshot) error {
	old := map[string]*breakerSet{}
	if prev != nil {
		for _, pr := range prev.providers {
			if pr.breakers != nil {
				old[pr.name] = pr.breakers
			}
		}
	}
	for _, pr := range s.providers {
		pc, ok := s.policy.Providers[pr.name]
		if !ok || pc.Breaker == "" {
			continue
		}
		settings := s.policy.ResolveBreaker(pc.Breaker)
		cfg, err := settings.Config()
		if err != nil {
			return fmt.Errorf("providers.%s.breaker (%s): %w", pr.name, pc.Breaker, err)
		}
		bs := &breakerSet{provider: pr.name, settings: settings, cfg: cfg, perModel: pc.BreakerPerModel, engine: s.engine,
			judge: newJudge(settings), models: map[string]*breaker.Breaker{}, holds: newTenantHolds(),
			shadow: s.policy.Resolve(pc.Limits).Shadow, label: "provider/" + pr.name}
		for _, mr := range s.classifier.models {
			if mr.provider < 0 || s.providers[mr.provider].name == pr.name {
				bs.modelGlobs = append(bs.modelGlobs, mr.glob)
			}
		}
		if err := cfg.Validate(); err != nil {
			return fmt.Errorf("providers.%s.breaker (%s): %w", pr.name, pc.Breaker, err)
		}
		if o := old[pr.name]; o != nil {
			// Carried-over breakers keep their state; the new settings reach them only when the
			// snapshot is committed (cfg is valid, so Reconfigure cannot fail then).
			bs.holds = o.holds
			bs.single = o.single
			reconfigure := []*breaker.Breaker{o.single}
			if bs.perModel && o.perModel {
				o.mu.Lock()
				for m, b := range o.models {
					if slices.Contains(bs.modelGlobs, m) {
						bs.models[m] = b
						reconfigure = append(reconfigure, b)
					}
				}
				o.mu.Unlock()
			}
			s.onCommit(func() {
				for _, b := range reconfigure {
					_ = b.Reconfigure(cfg, s.built) // validated above
				}
			})
		} else {
			b, err := s.engine.newBreaker(pr.name, settings, cfg)
			if err != nil {
				return fmt.Errorf("providers.%s.breaker (%s): %w", pr.name, pc.Breaker, err)
			}
			bs.single = b
		}
		pr.breakers = bs
	}
	return nil
}

// applyBreakerStates moves carried-over breakers to their configured start state when the
// configuration of that state changed (an operator's forced state survives unrelated reloads).
func (s *Snapshot) applyBreakerStates(prev *Snapshot) {
	if prev == nil {
		return
	}
	for _, pr := range s.providers {
		if pr.breakers == nil {
			continue
		}
		j, ok := prev.providerIdx[pr.name]
		if !ok || prev.providers[j].breakers == nil || prev.providers[j].breakers.settings.State == pr.breakers.settings.State {
			continue
		}
		to, err := breaker.ParseState(pr.breakers.settings.State)
		if err != nil {
			continue
		}
		for _, b := range pr.breakers.all() {
			if err := b.Transition(to, s.built); err != nil {
				s.engine.log.Error("cannot move breaker to configured state", "breaker", b.Name(), "state", to.String(), "err", err)
			}
		}
	}
}

// judge is a breaker's settings for judging calls, compiled: no strings on the request path.
type judge struct {
	totalDuration bool // slow_call_measure: total (else ttfb)
	noResponse    breaker.Outcome
	rateLimited   breaker.Outcome
	retryAfter    bool
	// holdTenant: a 429's retry-after holds back only its tenant (retry_after_scope: tenant).
	holdTenant bool
	// holdCap bounds any retry-after hold.
	holdCap time.Duration
	failure statusSet
	ignore  statusSet
	// streamError is how a server error reported inside a 2xx response counts (stream_error).
	streamError breaker.Outcome
}

// statusSet is a set of HTTP status codes (0-639).
type statusSet [10]uint64

func (ss *statusSet) add(pattern string) {
	for code := 100; code < 600; code++ {
		if config.StatusMatches(pattern, code) {
			ss[code/64] |= 1 << (code % 64)
		}
	}
}

func (ss *statusSet) has(code int) bool {
	return code >= 0 && code < 640 && ss[code/64]&(1<<(code%64)) != 0
}

func newJudge(s config.BreakerSettings) judge {
	j := judge{totalDuration: s.SlowCallMeasure == "total", noResponse: breaker.Failure, rateLimited: breaker.Success, retryAfter: s.HonorRetryAfter,
		holdTenant: s.RetryAfterScope == "tenant", holdCap: s.RetryAfterCap()}
	if s.NoResponseAs == "ignore" {
		j.noResponse = breaker.Ignored
	}
	j.streamError = breaker.Failure
	if s.StreamErrorAs == "ignore" {
		j.streamError = breaker.Ignored
	}
	switch s.RateLimitedAs {
	case "failure":
		j.rateLimited = breaker.Failure
	case "ignore":
		j.rateLimited = breaker.Ignored
	}
	for _, p := range s.FailureStatuses {
		j.failure.add(p)
	}
	for _, p := range s.IgnoreStatuses {
		j.ignore.add(p)
	}
	return j
}

// outcome judges a finished call for the breaker of its provider: which outcome to record, the
// duration compared with slow_call_duration, and how long an upstream retry-after asks to hold
// calls back (0 for none). Failure statuses win over ignored ones; 429 goes by rate_limited_as.
// An error the body reported inside a 2xx response is judged first, even when the stream was
// then cut short: the provider had said the call failed. A rate-limit error counts as a 429
// (without a retry-after), a client error as a 400, any other by stream_error.
func (j *judge) outcome(o Outcome) (breaker.Outcome, time.Duration, time.Duration) {
	d := o.TTFB
	if j.totalDuration || o.Status == 0 {
		d = o.Duration
	}
	switch o.StreamError {
	case StreamErrorNone:
	case StreamErrorRateLimited:
		return j.rateLimited, d, 0
	case StreamErrorClient:
		return j.status(400), d, 0
	default:
		return j.streamError, d, 0
	}
	switch {
	case o.Cancelled:
		return breaker.Ignored, d, 0
	case o.Status == 0:
		return j.noResponse, d, 0
	}
	var openFor time.Duration
	if j.retryAfter && (o.Status == 429 || o.Status == 503) && o.RetryAfter > 0 {
		openFor = o.RetryAfter
	}
	return j.status(o.Status), d, openFor
}

// status judges a call by its HTTP status alone.
func (j *judge) status(code int) breaker.Outcome {
	switch {
	case code == 429:
		return j.rateLimited
	case j.failure.has(code):
		return breaker.Failure
	case j.ignore.has(code):
		return breaker.Ignored
	}
	return breaker.Success
}
