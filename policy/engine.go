package policy

// The engine and its snapshot in one file: a snapshot is built, committed and retired by the
// engine's Apply, and the classification it compiles is read only through the snapshot.

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/internal/stall"
	"github.com/llm-bulkhead/llm-bulkhead/internal/throttle"
	"github.com/llm-bulkhead/llm-bulkhead/policy/apikey"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

// Clock tells the time. Policy code asks a Clock instead of calling time.Now, so tests can
// use fixed instants.
type Clock interface {
	Now() time.Time
}

// SystemClock is the real clock.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// StallMeter measures this process's own stalls (a CPU-throttled container, a loaded machine,
// a long garbage collection), which adaptive limits discount from the waits they judge (see
// package internal/stall).
type StallMeter interface {
	// Start starts measuring; it is called on every admission into an adaptive compartment,
	// so it must return at once when the meter runs. Stop stops it.
	Start()
	Stop()
	// Stalled returns the stalled time up to now (the engine's clock), a stall in progress
	// included; it never decreases while the meter runs. Total returns the stalled time
	// recorded.
	Stalled(now time.Time) time.Duration
	Total() time.Duration
}

// Options configure an Engine.
type Options struct {
	// Clock defaults to SystemClock.
	Clock Clock
	// Recorder hears what admission, settlement and the breakers do (package policy/observe
	// counts and logs it); nil records nothing.
	Recorder Recorder
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Cluster connects to the shared state the policy's cluster section names (the server does;
	// validation does not). Without it, or without a cluster section, limits are per process.
	Cluster bool
	// SpendStore keeps the sums of spend budgets. Default: in this process's memory.
	SpendStore spend.Store
	// Stalls measures the process's stalls, from the first admission into a compartment with
	// an adaptive limit until Close. Default: with the system clock, a stall.Meter; with
	// another clock, none (no stall is discounted).
	Stalls StallMeter
}

// Engine holds the live policy and all state that outlives a policy reload: compartments,
// budgets, breakers and estimates. Safe for concurrent use.
type Engine struct {
	clock Clock
	log   *slog.Logger
	sched *bulkhead.Scheduler
	// rec hears what the engine does (Options.Recorder).
	rec Recorder
	cur atomic.Pointer[Snapshot]
	gen atomic.Uint64
	// applyMu serialises Apply.
	applyMu sync.Mutex
	// inflight counts admitted requests not yet done.
	inflight atomic.Int64
	est      *estimator
	// retired and retiredDyn keep the compartments a reload removed (static ones by name,
	// tenant-keyed stores by family identity) until nothing holds them and their budgets have
	// aged out, so a later reload that brings them back finds their state. Guarded by applyMu.
	retired    map[string]*instance
	retiredDyn map[string]*dynStore
	// afterBuildStep, set only by tests, may fail a reload after a build step.
	afterBuildStep func(step string) error
	// clampLog lets a clamped settlement be logged once a minute.
	clampLog throttle.Gate
	// invalidLog lets a classification value that cannot be used be logged once a minute.
	invalidLog throttle.Gate
	// cluster is the shared state of cluster mode (nil without one).
	cluster *clusterState
	// share divides every limit while the shared state is unavailable (1 otherwise); snapshots
	// are built with it.
	share atomic.Int64
	// ledger keeps spend budgets' windows.
	ledger *spend.Ledger
	// usage counts what tenants and models use (usage section).
	usage *usage.Tracker
	// stalls measures the process's stalls for adaptive limits (nil: none).
	stalls StallMeter
}

// NewEngine builds an engine running policy p.
func NewEngine(p *config.Policy, o Options) (*Engine, error) {
	if o.Clock == nil {
		o.Clock = SystemClock{}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	e := &Engine{clock: o.Clock, log: o.Logger, sched: &bulkhead.Scheduler{Now: o.Clock.Now},
		retired: map[string]*instance{}, retiredDyn: map[string]*dynStore{}, stalls: o.Stalls}
	if _, system := o.Clock.(SystemClock); system && e.stalls == nil {
		e.stalls = stall.New()
	}
	e.est = newEstimator()
	e.ledger = spend.NewLedger(o.SpendStore)
	e.usage = usage.New(usageReasons)
	e.rec = o.Recorder
	if e.rec == nil {
		e.rec = nopRecorder{}
	}
	e.sched.OnWait = func(c *bulkhead.Compartment, waited time.Duration, admitted bool) {
		e.rec.QueueWait(c.Name(), waited, admitted)
	}
	e.share.Store(1)
	if _, err := e.Apply(p); err != nil {
		return nil, err
	}
	if o.Cluster {
		if err := e.openCluster(p); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// logDue reports whether a line of a kind logged at most once a minute may be written now, by
// the engine's clock. What is held back is counted by the kind's metric.
func (e *Engine) logDue(g *throttle.Gate) bool {
	ok, _ := g.Allow(e.clock.Now(), time.Minute)
	return ok
}

// Close stops the meter of the process's stalls and disconnects from the shared state (giving
// this replica's slots back at once); ctx bounds it.
func (e *Engine) Close(ctx context.Context) error {
	if e.stalls != nil {
		e.stalls.Stop()
	}
	return e.closeCluster(ctx)
}

// ProcessStalled returns how long this process has been stalled, as far as its meter has
// measured (it runs from the first admission into an adaptive compartment); 0 without one.
func (e *Engine) ProcessStalled() time.Duration {
	if e.stalls == nil {
		return 0
	}
	return e.stalls.Total()
}

// stalled returns the process's stalled time up to now, for adaptive limits.
func (e *Engine) stalled(now time.Time) time.Duration {
	if e.stalls == nil {
		return 0
	}
	return e.stalls.Stalled(now)
}

// Snapshot returns the live policy. A request should use one Snapshot from start to end.
func (e *Engine) Snapshot() *Snapshot { return e.cur.Load() }

// InFlight returns the number of admitted requests whose ticket is not done yet.
func (e *Engine) InFlight() int64 { return e.inflight.Load() }

// Now returns the engine clock's time.
func (e *Engine) Now() time.Time { return e.clock.Now() }

// SystemClock reports that the engine's clock is the system clock (SystemClock), whose readings
// carry the monotonic clock: time.Since measures from them as the clock would.
func (e *Engine) SystemClock() bool {
	_, ok := e.clock.(SystemClock)
	return ok
}

// Apply builds a snapshot for p aside and swaps it in atomically. State (in-flight counts,
// queued waiters, budget levels, breaker state) carries over for every compartment, budget and
// breaker whose identity is unchanged; removed ones drain as their requests finish. p must be
// validated (config.Load does that).
func (e *Engine) Apply(p *config.Policy) (Diff, error) {
	e.applyMu.Lock()
	defer e.applyMu.Unlock()
	prev := e.cur.Load()
	s, err := buildSnapshot(e, p, prev, e.gen.Load()+1)
	if err != nil {
		return Diff{}, err
	}
	// Every step succeeded: only now is live state changed.
	e.gen.Store(s.gen)
	e.sched.SetPools(s.poolSpecs)
	for _, f := range s.commit {
		f()
	}
	s.commit, s.committed = nil, true
	e.cur.Store(s)
	s.applyBreakerStates(prev)
	e.retire(prev, s)
	return diffSnapshots(prev, s), nil
}

// retire moves the compartments prev had and next does not into the retired set, and forgets
// retired ones that next brought back or whose state no longer matters. applyMu is held.
func (e *Engine) retire(prev, next *Snapshot) {
	if prev == nil {
		return
	}
	live := map[string]bool{}
	for _, in := range next.staticInstances() {
		live[in.name] = true
	}
	liveDyn := map[string]bool{}
	for _, f := range next.families {
		if f.dyn != nil {
			liveDyn[familyIdentity(f.cfg)] = true
		}
	}
	for _, in := range prev.staticInstances() {
		if !live[in.name] {
			e.retired[in.name] = in
		}
	}
	for _, f := range prev.families {
		if id := familyIdentity(f.cfg); f.dyn != nil && !liveDyn[id] {
			e.retiredDyn[id] = f.dyn
		}
	}
	now := e.clock.Now()
	for name, in := range e.retired {
		if live[name] {
			delete(e.retired, name)
		} else if e.sched.Idle(in.c) && in.budgetsEmpty(now) {
			delete(e.retired, name)
			in.closeFleet()
		}
	}
	for id, st := range e.retiredDyn {
		if liveDyn[id] || st.drained(now) {
			delete(e.retiredDyn, id)
		}
	}
}

// Snapshot is one immutable, compiled policy plus references to the live state it uses.
// Safe for concurrent use.
type Snapshot struct {
	// policy is the validated policy this snapshot was built from; only building reads it.
	policy *config.Policy
	engine *Engine
	gen    uint64
	built  time.Time
	// share divides every limit (live replicas, while the cluster's shared state is unavailable).
	share int64
	// spendCarried and spendCarryErr are what configuring the spend ledger with this snapshot's
	// time zone carried (see spend.Ledger.Configure), for the reload's diff.
	spendCarried  int
	spendCarryErr error

	features  []*featureEntry
	tiers     []string
	providers []*providerEntry
	// topPriority is the highest queue priority the policy gives (config.Policy.TopPriority):
	// only such requests use a provider quota's reserve.
	topPriority int64
	featureIdx  map[string]int
	tierIdx     map[string]int
	providerIdx map[string]int

	limits resolvedLimits

	// modelGroups are the values of the model dimension in compartment keys (config's
	// ModelGroups); otherModels indexes the group of models no glob matches, -1 when a glob is
	// "*". modelKeyed is set when some family keys or filters by model.
	modelGroups   []string
	modelGroupIdx map[string]int
	otherModels   int
	modelKeyed    bool

	classifier classifier
	families   []*family
	estimation estimationSettings

	poolSpecs []bulkhead.PoolSpec
	// commit holds the changes to live state (carried-over compartments, budgets, breakers and
	// tenant stores) that building found; Apply runs them only once the whole build succeeded.
	commit []func()
	// committed is set when the snapshot goes live; later changes (refreshing a tenant
	// compartment) apply at once.
	committed bool

	// tenantLabel: metrics of tenant-keyed compartments name the tenant (admin.tenant_label).
	tenantLabel bool

	// stripHeaders are the headers admitted requests go upstream without (strip_client_key).
	stripHeaders []string

	// NeedsBodyForRules reports whether classification reads the request body.
	NeedsBodyForRules bool
	// QuotaPath is quota_endpoint.path when the quota endpoint is enabled, else empty: a GET of
	// it is answered with the caller's ClientQuota.
	QuotaPath string
	// RewritesModels reports whether a provider has a models map: a re-route may have to rewrite
	// the body's model, so decisions should wait for the body.
	RewritesModels bool
	// TokenLimits reports whether any compartment limits tokens (so estimates matter).
	TokenLimits bool
	// ProviderQuota reports whether a provider's quota is tracked (shadow or enforce): requests
	// are held against it at their estimate, so estimates matter.
	ProviderQuota bool
	// SpendLimits reports whether any compartment has a spend budget (so estimates, and the
	// model a response names, matter).
	SpendLimits bool
	// prices is the compiled prices list.
	prices *spend.Prices
	// usageOn: usage is counted; usagePrices: the policy has prices, so every request's cost
	// is counted, spend budget or not.
	usageOn, usagePrices bool
}

// buildSteps names the steps of building a snapshot, in order.
var buildSteps = []string{"classifier", "families", "pools", "breakers"}

// buildStep runs the test hook after a build step.
func (e *Engine) buildStep(name string) error {
	if e.afterBuildStep == nil {
		return nil
	}
	return e.afterBuildStep(name)
}

// onCommit runs f when the snapshot is committed, or now if it already is. Building a snapshot
// never changes live state itself: a reload that fails at any step leaves everything as it was.
func (s *Snapshot) onCommit(f func()) {
	if s.committed {
		f()
		return
	}
	s.commit = append(s.commit, f)
}

// featureEntry is everything per feature the hot path needs, resolved once per snapshot.
type featureEntry struct {
	name    string
	ratio   float64
	degrade *config.Degrade
	// rec records the feature's requests.
	rec FeatureRecorder
	// spend records the feature's spend (nil while the policy has no spend budget).
	spend SpendRecorder
}

// providerEntry is everything per provider the hot path needs.
type providerEntry struct {
	name     string
	fallback int // -1 when none
	breakers *breakerSet
	// quota follows the provider's rate-limit headers (nil: quota.mode off).
	quota *providerQuota
	// models is the provider's models map (nil: re-routed requests keep their model).
	models []modelTarget
}

// modelTarget is one entry of a provider's models map.
type modelTarget struct {
	glob  string
	model string
	// keep sends the request's model unchanged (model "*").
	keep bool
}

// StripHeaders returns the request headers an admitted request goes upstream without: those
// api_key rules with strip_client_key read the client's key from. The caller must not change
// the slice; its capacity is its length, so an append copies it.
func (s *Snapshot) StripHeaders() []string { return s.stripHeaders }

// Gen returns the snapshot's generation (1 for the first policy, +1 per reload).
func (s *Snapshot) Gen() uint64 { return s.gen }

// Policy returns the policy the snapshot was built from, for adapters that compile settings of
// their own from it (extproc's body modes and stream bounds). Read-only.
func (s *Snapshot) Policy() *config.Policy { return s.policy }

// Features, Tiers and Providers return how many values each dimension has: indexes of Dims
// run from 0 to these counts.
func (s *Snapshot) Features() int { return len(s.features) }

// Tiers returns the number of tiers.
func (s *Snapshot) Tiers() int { return len(s.tiers) }

// Providers returns the number of providers.
func (s *Snapshot) Providers() int { return len(s.providers) }

// FeatureName returns the name of feature index i.
func (s *Snapshot) FeatureName(i int) string { return s.features[i].name }

// TierName returns the name of tier index i.
func (s *Snapshot) TierName(i int) string { return s.tiers[i] }

// ProviderName returns the name of provider index i.
func (s *Snapshot) ProviderName(i int) string { return s.providers[i].name }

func buildSnapshot(e *Engine, p *config.Policy, prev *Snapshot, gen uint64) (*Snapshot, error) {
	s := &Snapshot{policy: p, engine: e, gen: gen, built: e.clock.Now(), share: max(e.share.Load(), 1)}
	s.featureIdx, s.tierIdx, s.providerIdx = map[string]int{}, map[string]int{}, map[string]int{}
	for i, name := range p.FeatureNames() {
		f := &featureEntry{name: name, ratio: 1}
		if fc, ok := p.Features[name]; ok {
			if fc.Ratio != nil {
				f.ratio = *fc.Ratio
			}
			f.degrade = fc.Degrade
		}
		s.onCommit(func() { f.rec = e.rec.Feature(name) })
		s.features = append(s.features, f)
		s.featureIdx[name] = i
	}
	s.tiers = p.TierNames()
	if len(s.tiers) == 0 {
		// No tiers configured: every request is in one unnamed tier.
		s.tiers = []string{p.Classification.Tier.Default}
		if s.tiers[0] == "" {
			s.tiers[0] = "none"
		}
	}
	for i, name := range s.tiers {
		s.tierIdx[name] = i
	}
	for i, name := range p.ProviderNames() {
		s.providers = append(s.providers, &providerEntry{name: name, fallback: -1})
		s.providerIdx[name] = i
	}
	foldModels := !p.Classification.Model.CaseSensitive
	for i, name := range p.ProviderNames() {
		if fb := p.Providers[name].Fallback; fb != "" {
			s.providers[i].fallback = s.providerIdx[fb]
		}
		for _, m := range p.Providers[name].Models {
			glob := m.Match
			if foldModels {
				glob = strings.ToLower(glob)
			}
			s.providers[i].models = append(s.providers[i].models, modelTarget{glob: glob, model: m.Model, keep: m.Model == "*"})
		}
	}
	s.buildModelGroups()
	s.RewritesModels = p.RewritesModels()
	if p.QuotaEndpoint.Enabled {
		s.QuotaPath = p.QuotaEndpoint.Path
	}
	s.resolveLimits()
	s.tenantLabel = p.Admin.TenantLabel
	s.buildClassifier()
	s.estimation = newEstimationSettings(p.Estimation)
	s.NeedsBodyForRules = p.RulesReadBody()
	if err := e.buildStep("classifier"); err != nil {
		return nil, err
	}
	s.buildFamilies(prev)
	s.TokenLimits = p.AnyTokenLimits()
	s.ProviderQuota = p.TracksProviderQuota()
	s.buildSpend()
	s.buildUsage()
	if err := e.buildStep("families"); err != nil {
		return nil, err
	}
	if err := s.buildPools(); err != nil {
		return nil, err
	}
	if err := e.buildStep("pools"); err != nil {
		return nil, err
	}
	s.buildQuotas(prev)
	if err := s.buildBreakers(prev); err != nil {
		return nil, err
	}
	if err := e.buildStep("breakers"); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Snapshot) buildClassifier() {
	p := s.policy
	c := &s.classifier
	c.feature = compileDimension(p.Classification.Feature, true)
	c.tenant = compileDimension(p.Classification.Tenant, false)
	c.tier = compileDimension(p.Classification.Tier, true)
	c.provider = compileDimension(p.Classification.Provider, true)
	c.model = compileDimension(p.Classification.Model, true)
	c.priority, c.levels = compileDimension(config.Dimension{Rules: p.Classification.Priority.Rules}, true), p.Classification.Priority.Levels
	srcs, _ := p.AccountSources()
	for _, a := range srcs {
		c.accounts = append(c.accounts, compileDimension(config.Dimension{Default: a.Default, Rules: []config.Rule{a.AccountRule()}, CaseSensitive: true}, false))
	}
	c.featureIdx, c.tierIdx, c.providerIdx = s.featureIdx, s.tierIdx, s.providerIdx
	c.tiers = s.tiers
	for _, pr := range s.providers {
		c.providers = append(c.providers, pr.name)
	}
	c.tenantTier = map[string]int{}
	var keys apikey.Builder
	for i, t := range p.Tenants.Directory {
		c.tenantTier[t.ID] = s.tierIdx[t.Tier]
		for _, hx := range t.KeySHA256 {
			if h, err := apikey.ParseHash(strings.TrimSpace(hx)); err == nil {
				keys.Add(h, t.ID, i+1)
			}
		}
	}
	// Validation refused a key listed twice.
	c.dirKeys, _ = keys.Table()
	c.fileKeys = p.Tenants.KeysFromFile()
	c.rejectUnknownKey = p.Tenants.UnknownKey == config.UnknownKeyReject
	s.stripHeaders = slices.Clip(p.StripHeaders())
	for _, m := range p.Models {
		mr := modelRule{glob: strings.ToLower(m.Match), provider: -1, bpt: m.BytesPerToken, maxOut: m.DefaultMaxTokens, context: m.ContextTokens}
		if m.Provider != "" {
			mr.provider = s.providerIdx[m.Provider]
		}
		c.models = append(c.models, mr)
	}
}

// buildModelGroups compiles the values the model dimension takes in compartment keys.
func (s *Snapshot) buildModelGroups() {
	p := s.policy
	s.modelGroups = p.ModelGroups()
	s.modelGroupIdx = make(map[string]int, len(s.modelGroups))
	s.otherModels = -1
	for i, g := range s.modelGroups {
		s.modelGroupIdx[g] = i
		if g == config.OtherModels && i == len(s.modelGroups)-1 {
			s.otherModels = i
		}
	}
	for _, f := range p.Compartments {
		if slices.Contains(f.Key, config.DimModel) || len(f.Where[config.DimModel]) > 0 {
			s.modelKeyed = true
		}
	}
}

// modelGroup returns the index of model's group: the first glob of the models list that
// matches it, else the group of unmatched models.
func (s *Snapshot) modelGroup(model string) int {
	for i, g := range s.modelGroups {
		if i == s.otherModels {
			break
		}
		if globMatch(g, model) {
			return i
		}
	}
	return max(s.otherModels, 0)
}

func (s *Snapshot) buildPools() error {
	byName := map[string]*instance{}
	for _, in := range s.staticInstances() {
		byName[in.name] = in
	}
	for _, pc := range s.policy.Pools {
		spec := bulkhead.PoolSpec{Name: pc.Name, Capacity: pc.MaxConcurrent}
		for _, m := range pc.Members {
			in := byName[m.Compartment]
			if in == nil {
				return fmt.Errorf("pool %s: compartment %s does not exist", pc.Name, m.Compartment)
			}
			if in.limits.Adaptive.On() {
				return fmt.Errorf("pool %s: compartment %s has max_concurrent: adaptive; a pool member's concurrency is its share of the pool, so it cannot also be learned", pc.Name, m.Compartment)
			}
			maxv := m.Max
			if maxv == 0 {
				maxv = pc.MaxConcurrent
			}
			spec.Members = append(spec.Members, bulkhead.PoolMember{Compartment: in.c, Guaranteed: m.Guaranteed, Max: maxv})
		}
		s.poolSpecs = append(s.poolSpecs, spec)
	}
	return nil
}

// Classify computes the dimensions of the request in. It does not allocate unless a rule
// uses a regular expression with expansion.
func (s *Snapshot) Classify(in Input) Dims {
	c := &s.classifier
	var d Dims
	fv, unknown, bad := c.feature.eval(in, c, &d, func(v string) bool { _, ok := c.featureIdx[v]; return ok })
	if unknown > 0 {
		s.engine.rec.ClassifyErrors("unknown_feature", unknown)
	}
	s.invalidValue(dimFeature, bad)
	d.Feature = c.featureIdx[fv]
	d.Tenant, _, bad = c.tenant.eval(in, c, &d, nil)
	s.invalidValue(dimTenant, bad)
	d.Model, _, bad = c.model.eval(in, c, &d, nil)
	s.invalidValue(dimModel, bad)
	tv, _, bad := c.tier.eval(in, c, &d, func(v string) bool { _, ok := c.tierIdx[v]; return ok })
	s.invalidValue(dimTier, bad)
	d.Tier = c.tierIdx[tv]
	pv, _, bad := c.provider.eval(in, c, &d, func(v string) bool { _, ok := c.providerIdx[v]; return ok })
	s.invalidValue(dimProvider, bad)
	d.Provider = c.providerIdx[pv]
	if len(c.levels) > 0 {
		// A value that is not a level, or cannot be a value at all, gives no priority of its
		// own: the request waits at its compartments'.
		if v, _, _ := c.priority.eval(in, c, &d, func(v string) bool { _, ok := c.levels[v]; return ok }); v != "" {
			d.Priority, d.HasPriority = c.levels[v], true
		}
	}
	if len(c.accounts) > 0 {
		d.accounts = s.classifyAccounts(in, &d)
	}
	return d
}

// classifyAccounts reads the providers' quota account sources for request in, their values
// joined by NUL (see Dims.accounts). Only a policy with several sources allocates, once.
func (s *Snapshot) classifyAccounts(in Input, d *Dims) string {
	c := &s.classifier
	var vals [config.MaxAccountSources]string
	n := 0
	for i := range c.accounts {
		v, _, bad := c.accounts[i].eval(in, c, d, nil)
		if bad.rule >= 0 {
			s.invalidValueOf(&c.accounts[i].rules[bad.rule], "invalid_account", "providers' quota account", bad.err)
		}
		vals[i] = v
		n += len(v) + 1
	}
	if len(c.accounts) == 1 {
		return vals[0]
	}
	var b strings.Builder
	b.Grow(n)
	for i := range c.accounts {
		if i > 0 {
			b.WriteByte(0)
		}
		b.WriteString(vals[i])
	}
	return b.String()
}

// invalidValue counts a request one of whose rules for dimension d read a value that cannot be
// a dimension's value (bad.rule ≥ 0), and logs it at most once a minute. The value itself is
// not logged: a rule may read a header that holds a secret (an API key mapped to a tenant).
func (s *Snapshot) invalidValue(d dim, bad invalidValue) {
	if bad.rule < 0 {
		return
	}
	s.invalidValueOf(&s.classifier.dimension(d).rules[bad.rule], "invalid_"+dimNames[d], fmt.Sprintf("classification.%s.rules[%d]", dimNames[d], bad.rule), bad.err)
}

// invalidValueOf counts a request rule r (at where in the policy) read a value of that cannot
// be a dimension's value (err) under reason, and logs it at most once a minute.
func (s *Snapshot) invalidValueOf(r *rule, reason, where string, err error) {
	e := s.engine
	e.rec.ClassifyErrors(reason, 1)
	if !e.logDue(&e.invalidLog) {
		return
	}
	e.log.Warn("classification skipped a value with control characters, bytes that are not UTF-8 or too many bytes, as if its rule had read nothing "+
		"(further cases this minute are only counted in llm_bulkhead_classify_errors_total)",
		"rule", where, "source", r.source(), "problem", err.Error(), "reason", reason)
}

// Names is a request's dimensions as names, for headers, logs and metadata.
type Names struct {
	Feature, Tenant, Tier, Provider, Model string
}

// Names resolves d's indexes to names.
func (s *Snapshot) Names(d Dims) Names {
	return Names{Feature: s.features[d.Feature].name, Tenant: d.Tenant, Tier: s.tiers[d.Tier], Provider: s.providers[d.Provider].name, Model: d.Model}
}
