package observe

import (
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// Namespace prefixes every metric name.
const Namespace = "llm_bulkhead"

// reasons lists the refusal reasons, indexing each feature's per-reason counters.
var reasons = policy.Reasons()

func reasonIndex(r policy.Reason) int {
	for i, x := range reasons {
		if x == r {
			return i
		}
	}
	return len(reasons) - 1
}

// Metrics are the runtime's Prometheus metrics and its logs of state changes. As the Engine's
// Recorder they count what admission, settlement and the breakers do — counters the hot path
// touches are resolved per feature once — and their collectors read compartments, budgets,
// breakers, pools, spend budgets and provider quotas from the engine's live state at scrape
// time, so admission pays nothing for those. Safe for concurrent use.
type Metrics struct {
	log *slog.Logger

	admitted       *prometheus.CounterVec
	rejected       *prometheus.CounterVec
	rerouted       *prometheus.CounterVec
	rerouteNoModel *prometheus.CounterVec
	tokensReserved *prometheus.CounterVec
	tokensSettled  *prometheus.CounterVec
	usageUnknown   *prometheus.CounterVec
	usageClamped   *prometheus.CounterVec
	estimateError  *prometheus.HistogramVec
	queueWait      *prometheus.HistogramVec
	classifyErrors *prometheus.CounterVec
	transitions    *prometheus.CounterVec
	unavailable    *prometheus.CounterVec
	// classifyKnown are the classify_errors_total series made at start (unknown_feature and
	// invalid_<dimension>), by reason.
	classifyKnown map[string]prometheus.Counter

	spend spendMetrics
	quota quotaMetrics

	mu       sync.Mutex
	features map[string]*featureMetrics
	shadow   map[shadowKey]*atomic.Uint64
	// shadowOpenings counts, by breaker, the automatic openings of breakers of providers in
	// shadow mode (part of breaker_would_open_total).
	shadowOpenings map[string]uint64

	// breakerLogs rate-limits each breaker's log lines.
	breakerLogs breakerLogs
}

var _ policy.Recorder = (*Metrics)(nil)

type shadowKey struct {
	compartment string
	reason      policy.Reason
}

// featureMetrics are one feature's hot-path counters. admittedN and rejectedN count the same
// decisions as admitted and rejected, for Decisions.
type featureMetrics struct {
	admittedN         atomic.Uint64
	rejectedN         []atomic.Uint64
	admitted          prometheus.Counter
	rejected          []prometheus.Counter
	tokensReserved    prometheus.Counter
	promptSettled     prometheus.Counter
	completionSettled prometheus.Counter
	usageUnknown      prometheus.Counter
	usageClamped      prometheus.Counter
	estimateError     prometheus.Observer
}

// NewMetrics returns the metrics of one engine: pass them as its Options.Recorder, then register
// Collectors. Breaker events and refusals are logged to log (default slog.Default()).
func NewMetrics(log *slog.Logger) *Metrics {
	if log == nil {
		log = slog.Default()
	}
	m := &Metrics{
		log:      log,
		features: map[string]*featureMetrics{},
		shadow:   map[shadowKey]*atomic.Uint64{},
		admitted: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "admitted_total",
			Help: "Requests admitted, by feature."}, []string{"feature"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "rejected_total",
			Help: "Requests refused, by feature and reason (token_budget, rate_limit, bulkhead_full, circuit_open, bad_request, spend_budget, unknown_key, provider_quota, cluster_unavailable, cancelled)."}, []string{"feature", "reason"}),
		rerouted: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "rerouted_total",
			Help: "Requests re-routed to another provider instead of refused, by feature, from and to provider, and the reason the first provider refused."}, []string{"feature", "from", "to", "reason"}),
		rerouteNoModel: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "reroute_unmapped_total",
			Help: "Re-routes not made because the target provider's models map names no model for the request (or the body could not be rewritten); the request got the refusal of the provider it came from. By feature, from and to provider."}, []string{"feature", "from", "to"}),
		tokensReserved: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "tokens_reserved_total",
			Help: "Estimated tokens of admitted requests, by feature."}, []string{"feature"}),
		tokensSettled: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "tokens_settled_total",
			Help: "Tokens settled from responses, by feature and kind (prompt, completion)."}, []string{"feature", "kind"}),
		usageUnknown: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "usage_unknown_total",
			Help: "Admitted requests whose response reported no usage (settled to a partial estimate), by feature."}, []string{"feature"}),
		usageClamped: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "usage_clamped_total",
			Help: "Responses whose reported usage was more than the request could have cost (prompt size, max_tokens × n, the model's context) and was settled at that bound instead, by feature."}, []string{"feature"}),
		estimateError: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "estimate_ratio",
			Help:    "Actual tokens divided by the estimate, for requests whose usage was reported, by feature.",
			Buckets: []float64{0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.1, 1.25, 1.5, 2, 4}}, []string{"feature"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "queue_wait_seconds",
			Help:    "Time requests spent queued for a slot, by compartment family and result (admitted, refused).",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30}}, []string{"family", "result"}),
		classifyErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "classify_errors_total",
			Help: "Requests classified from headers and defaults because something was wrong, by reason (invalid_json, field_type, field_value, unknown_feature; invalid_<dimension>: a rule read a value with control characters, bytes that are not UTF-8 or more than 256 bytes, and was skipped)."}, []string{"reason"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "breaker_transitions_total",
			Help: "Breaker state transitions, by breaker, from and to state."}, []string{"breaker", "from", "to"}),
		unavailable: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "cluster_unavailable_admissions_total",
			Help: "Admissions decided while the shared state was unavailable: local (this replica's share enforced here) or refused (cluster_unavailable)."},
			[]string{"action"}),
		classifyKnown: map[string]prometheus.Counter{},
	}
	m.classifyKnown["unknown_feature"] = m.classifyErrors.WithLabelValues("unknown_feature")
	for _, dim := range policy.DimensionNames() {
		m.classifyKnown["invalid_"+dim] = m.classifyErrors.WithLabelValues("invalid_" + dim)
	}
	// Both actions from the start, at 0: a rate or an alert over them needs the series before
	// the first outage.
	for _, action := range []string{"local", "refused"} {
		m.unavailable.WithLabelValues(action)
	}
	m.spend.init()
	m.quota.init()
	return m
}

// Collectors returns the collectors of engine e's metrics, for the process's registry: the
// counters above, the spend and provider quota counters, the state read at scrape time, and
// the metrics of the engine's cluster store when it has one.
func (m *Metrics) Collectors(e *policy.Engine) []prometheus.Collector {
	out := []prometheus.Collector{m.admitted, m.rejected, m.rerouted, m.rerouteNoModel, m.tokensReserved, m.tokensSettled, m.usageUnknown,
		m.usageClamped, m.estimateError, m.queueWait, m.classifyErrors, m.transitions, &stateCollector{m: m, e: e}}
	out = append(out, m.spend.collectors(e)...)
	out = append(out, m.quota.collectors(e)...)
	out = append(out, usageCollector{engine: e})
	if st := e.Cluster(); st != nil {
		out = append(out, m.unavailable)
		out = append(out, st.Collectors()...)
	}
	return out
}

// ClassifyErrors counts n requests classified from headers and defaults because of reason.
func (m *Metrics) ClassifyErrors(reason string, n int) {
	if c, ok := m.classifyKnown[reason]; ok {
		c.Add(float64(n))
		return
	}
	m.classifyErrors.WithLabelValues(reason).Add(float64(n))
}

// ClusterUnavailable counts an admission decided while the shared state was unavailable.
func (m *Metrics) ClusterUnavailable(action string) {
	m.unavailable.WithLabelValues(action).Inc()
}

// Rerouted counts a request admitted by another provider than the one that refused it.
func (m *Metrics) Rerouted(feature, from, to string, reason policy.Reason) {
	m.rerouted.WithLabelValues(feature, from, to, string(reason)).Inc()
}

// RerouteUnmapped counts a re-route not made for want of a model at the target.
func (m *Metrics) RerouteUnmapped(feature, from, to string) {
	m.rerouteNoModel.WithLabelValues(feature, from, to).Inc()
}

// Feature returns the named feature's counters, making its series on first use.
func (m *Metrics) Feature(name string) policy.FeatureRecorder {
	m.mu.Lock()
	defer m.mu.Unlock()
	if f := m.features[name]; f != nil {
		return f
	}
	f := &featureMetrics{
		admitted:          m.admitted.WithLabelValues(name),
		tokensReserved:    m.tokensReserved.WithLabelValues(name),
		promptSettled:     m.tokensSettled.WithLabelValues(name, "prompt"),
		completionSettled: m.tokensSettled.WithLabelValues(name, "completion"),
		usageUnknown:      m.usageUnknown.WithLabelValues(name),
		usageClamped:      m.usageClamped.WithLabelValues(name),
		estimateError:     m.estimateError.WithLabelValues(name),
	}
	f.rejected, f.rejectedN = make([]prometheus.Counter, len(reasons)), make([]atomic.Uint64, len(reasons))
	for i, r := range reasons {
		f.rejected[i] = m.rejected.WithLabelValues(name, string(r))
	}
	m.features[name] = f
	return f
}

func (f *featureMetrics) Admitted() {
	f.admitted.Inc()
	f.admittedN.Add(1)
}

func (f *featureMetrics) Rejected(r policy.Reason) {
	i := reasonIndex(r)
	f.rejected[i].Inc()
	f.rejectedN[i].Add(1)
}

func (f *featureMetrics) TokensReserved(tokens int64) { f.tokensReserved.Add(float64(tokens)) }
func (f *featureMetrics) UsageUnknown()               { f.usageUnknown.Inc() }
func (f *featureMetrics) EstimateRatio(ratio float64) { f.estimateError.Observe(ratio) }
func (f *featureMetrics) Settled(prompt, completion int64, clamped bool) {
	f.promptSettled.Add(float64(prompt))
	f.completionSettled.Add(float64(completion))
	if clamped {
		f.usageClamped.Inc()
	}
}

// ShadowRefusal counts a refusal a shadow-mode compartment, budget or provider would have made.
func (m *Metrics) ShadowRefusal(compartment string, r policy.Reason) {
	k := shadowKey{compartment, r}
	m.mu.Lock()
	c := m.shadow[k]
	if c == nil {
		c = &atomic.Uint64{}
		m.shadow[k] = c
	}
	m.mu.Unlock()
	c.Add(1)
}

// QueueWait observes a request's wait in a compartment's queue, by the compartment's family.
func (m *Metrics) QueueWait(compartment string, waited time.Duration, admitted bool) {
	fam, _, _ := strings.Cut(compartment, "/")
	result := "refused"
	if admitted {
		result = "admitted"
	}
	m.queueWait.WithLabelValues(fam, result).Observe(waited.Seconds())
}

// BreakerEvent counts a breaker's transition (and an opening of a breaker of a provider in
// shadow mode, part of breaker_would_open_total), and logs the event.
func (m *Metrics) BreakerEvent(ev breaker.Event, shadowed bool, now time.Time) {
	if ev.Kind == breaker.EventTransition {
		m.transitions.WithLabelValues(ev.Name, ev.From.String(), ev.To.String()).Inc()
	}
	if shadowed {
		m.mu.Lock()
		if m.shadowOpenings == nil {
			m.shadowOpenings = map[string]uint64{}
		}
		m.shadowOpenings[ev.Name]++
		m.mu.Unlock()
	}
	m.logBreakerEvent(ev, now)
}

// stateCollector reports live state at scrape time.
type stateCollector struct {
	m *Metrics
	e *policy.Engine
}

var (
	descInflight    = prometheus.NewDesc(Namespace+"_compartment_inflight", "Requests in flight in a compartment.", []string{"compartment", "family"}, nil)
	descLimit       = prometheus.NewDesc(Namespace+"_compartment_max_concurrent", "A compartment's concurrency limit (0 = none; a pool member's borrowing ceiling).", []string{"compartment", "family"}, nil)
	descTokens      = prometheus.NewDesc(Namespace+"_compartment_inflight_tokens", "Estimated tokens of the requests in flight in a compartment.", []string{"compartment", "family"}, nil)
	descTokLimit    = prometheus.NewDesc(Namespace+"_compartment_max_inflight_tokens", "A compartment's in-flight token limit (0 = none).", []string{"compartment", "family"}, nil)
	descQueued      = prometheus.NewDesc(Namespace+"_compartment_queued", "Requests waiting for a slot, by the compartment that holds them back.", []string{"compartment", "family"}, nil)
	descAdmitted    = prometheus.NewDesc(Namespace+"_compartment_admitted_total", "Slots granted in a compartment.", []string{"compartment", "family"}, nil)
	descRefused     = prometheus.NewDesc(Namespace+"_compartment_full_total", "Requests a compartment refused for lack of capacity (bulkhead_full).", []string{"compartment", "family"}, nil)
	descTimedOut    = prometheus.NewDesc(Namespace+"_compartment_queue_timeouts_total", "Requests that waited their max_wait in a compartment's queue without a slot.", []string{"compartment", "family"}, nil)
	descShadow      = prometheus.NewDesc(Namespace+"_shadow_rejections_total", "Requests a shadow-mode compartment or budget would have refused, by compartment and reason.", []string{"compartment", "reason"}, nil)
	descBudget      = prometheus.NewDesc(Namespace+"_budget_remaining_tokens", "Tokens a budget can still admit in its window (negative in debt), by compartment and window (minute, day).", []string{"compartment", "window"}, nil)
	descBudgetCap   = prometheus.NewDesc(Namespace+"_budget_capacity_tokens", "A token budget's capacity per window, by compartment and window.", []string{"compartment", "window"}, nil)
	descRate        = prometheus.NewDesc(Namespace+"_rate_remaining_requests", "Requests a per-minute rate can still admit, by compartment.", []string{"compartment"}, nil)
	descPoolIn      = prometheus.NewDesc(Namespace+"_pool_inflight", "Requests in flight across a pool's members.", []string{"pool"}, nil)
	descPoolCap     = prometheus.NewDesc(Namespace+"_pool_capacity", "A pool's capacity.", []string{"pool"}, nil)
	descBrState     = prometheus.NewDesc(Namespace+"_breaker_state", "1 for a breaker's current state, 0 for the others.", []string{"breaker", "state"}, nil)
	descBrCalls     = prometheus.NewDesc(Namespace+"_breaker_calls_total", "Calls seen by a breaker, by kind (success, failure, slow_success, slow_failure, not_permitted, ignored, stale).", []string{"breaker", "kind"}, nil)
	descBrRate      = prometheus.NewDesc(Namespace+"_breaker_failure_rate", "A breaker's failure rate in percent over its window (-1 below minimum calls).", []string{"breaker"}, nil)
	descBrSlow      = prometheus.NewDesc(Namespace+"_breaker_slow_call_rate", "A breaker's slow-call rate in percent over its window (-1 below minimum calls).", []string{"breaker"}, nil)
	descBrWouldOpen = prometheus.NewDesc(Namespace+"_breaker_would_open_total", "Times a breaker would have opened without doing so: a METRICS_ONLY breaker's rate reached its threshold (once per stay), or a breaker of a provider in shadow mode opened (refusing nothing).", []string{"breaker"}, nil)
	descInflightReq = prometheus.NewDesc(Namespace+"_inflight_requests", "Admitted requests not finished yet.", nil, nil)
	descGen         = prometheus.NewDesc(Namespace+"_policy_generation", "Generation of the live policy (1 at start, +1 per successful reload).", nil, nil)
	breakerStates   = []breaker.State{breaker.Closed, breaker.Open, breaker.HalfOpen, breaker.Disabled, breaker.ForcedOpen, breaker.MetricsOnly}
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descInflight, descLimit, descTokens, descTokLimit, descQueued, descAdmitted, descRefused,
		descTimedOut, descShadow, descBudget, descBudgetCap, descRate, descPoolIn, descPoolCap, descBrState, descBrCalls, descBrRate,
		descBrSlow, descBrWouldOpen, descInflightReq, descGen} {
		ch <- d
	}
	for _, d := range adaptiveDescs {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	e := c.e
	s := e.Snapshot()
	if s == nil {
		return
	}
	now := e.Now()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(descInflightReq, float64(e.InFlight()))
	gauge(descGen, float64(s.Gen()))
	counter(descProcessStall, e.ProcessStalled().Seconds())

	emit := func(name, fam string, st bulkhead.Stats, limits bool) {
		gauge(descInflight, float64(st.InFlight), name, fam)
		gauge(descTokens, float64(st.InFlightTokens), name, fam)
		gauge(descQueued, float64(st.Queued), name, fam)
		counter(descAdmitted, float64(st.Admitted), name, fam)
		counter(descRefused, float64(st.Refused), name, fam)
		counter(descTimedOut, float64(st.TimedOutInQueue), name, fam)
		if limits {
			lim := st.Limits.MaxConcurrent
			if st.Pool != "" {
				lim = st.PoolMax
			}
			gauge(descLimit, float64(lim), name, fam)
			gauge(descTokLimit, float64(st.Limits.MaxInflightTokens), name, fam)
		}
	}
	budgets := func(c *policy.CompartmentState) {
		if b := c.TPM; b != nil {
			gauge(descBudget, float64(b.Remaining), c.Name, "minute")
			gauge(descBudgetCap, float64(b.Capacity), c.Name, "minute")
		}
		if b := c.TPD; b != nil {
			gauge(descBudget, float64(b.Remaining), c.Name, "day")
			gauge(descBudgetCap, float64(b.Capacity), c.Name, "day")
		}
		if b := c.RPM; b != nil {
			gauge(descRate, float64(b.Remaining), c.Name)
		}
	}
	shadowBulkhead := map[string]uint64{}
	tenantLabel := s.TenantLabel()
	agg := map[string]*bulkhead.Stats{}
	var aggOrder []string
	states := e.CompartmentStates(s, now)
	for i := range states {
		in := &states[i]
		st := in.Stats
		if !in.Tenant || tenantLabel {
			emit(in.Name, in.Family, st, true)
			budgets(in)
			collectAdaptive(ch, in)
			shadowBulkhead[in.Name] += st.ShadowRefusals
			continue
		}
		name := in.Family + "/*"
		a := agg[name]
		if a == nil {
			a = &bulkhead.Stats{Name: in.Family}
			agg[name] = a
			aggOrder = append(aggOrder, name)
		}
		a.InFlight += st.InFlight
		a.InFlightTokens += st.InFlightTokens
		a.Queued += st.Queued
		a.Admitted += st.Admitted
		a.Refused += st.Refused
		a.TimedOutInQueue += st.TimedOutInQueue
		shadowBulkhead[name] += st.ShadowRefusals
	}
	for _, name := range aggOrder {
		emit(name, agg[name].Name, *agg[name], false)
	}
	for name, n := range shadowBulkhead {
		if n > 0 {
			counter(descShadow, float64(n), name, string(policy.ReasonBulkheadFull))
		}
	}
	c.m.mu.Lock()
	keys := make([]shadowKey, 0, len(c.m.shadow))
	for k := range c.m.shadow {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return keys[i].compartment+string(keys[i].reason) < keys[j].compartment+string(keys[j].reason)
	})
	vals := make([]uint64, len(keys))
	for i, k := range keys {
		vals[i] = c.m.shadow[k].Load()
	}
	c.m.mu.Unlock()
	for i, k := range keys {
		counter(descShadow, float64(vals[i]), k.compartment, string(k.reason))
	}
	for _, p := range e.PoolStats() {
		gauge(descPoolIn, float64(p.InFlight), p.Name)
		gauge(descPoolCap, float64(p.Capacity), p.Name)
	}
	for _, b := range e.Breakers() {
		snap := b.Snapshot
		for _, st := range breakerStates {
			v := 0.0
			if snap.State == st {
				v = 1
			}
			gauge(descBrState, v, b.Name, st.String())
		}
		gauge(descBrRate, snap.FailureRate, b.Name)
		gauge(descBrSlow, snap.SlowRate, b.Name)
		k := b.Calls
		for _, kv := range []struct {
			kind string
			n    uint64
		}{{"success", k.Success}, {"failure", k.Failure}, {"slow_success", k.SlowSuccess}, {"slow_failure", k.SlowFailure},
			{"not_permitted", k.NotPermitted}, {"ignored", k.Ignored}, {"stale", k.Stale}} {
			counter(descBrCalls, float64(kv.n), b.Name, kv.kind)
		}
		c.m.mu.Lock()
		shadowOpened := c.m.shadowOpenings[b.Name]
		c.m.mu.Unlock()
		counter(descBrWouldOpen, float64(k.WouldOpen+shadowOpened), b.Name)
	}
}

// NewEngine builds a policy engine running p whose metrics are registered on reg, and whose
// breaker logs go to o.Logger: NewMetrics, policy.NewEngine and Collectors in one call, for
// tools and tests that run one engine on a registry of their own.
func NewEngine(p *config.Policy, o policy.Options, reg prometheus.Registerer) (*policy.Engine, error) {
	m := NewMetrics(o.Logger)
	o.Recorder = m
	e, err := policy.NewEngine(p, o)
	if err != nil {
		return nil, err
	}
	reg.MustRegister(m.Collectors(e)...)
	return e, nil
}

// FeatureDecisions counts one feature's admissions and refusals since the process started.
type FeatureDecisions struct {
	Feature  string            `json:"feature"`
	Admitted uint64            `json:"admitted"`
	Rejected map[string]uint64 `json:"rejected"`
}

// Decisions returns the admission counts of every feature of snapshot s, in feature order.
func (m *Metrics) Decisions(s *policy.Snapshot) []FeatureDecisions {
	out := make([]FeatureDecisions, 0, s.Features())
	for i := 0; i < s.Features(); i++ {
		name := s.FeatureName(i)
		m.mu.Lock()
		f := m.features[name]
		m.mu.Unlock()
		fd := FeatureDecisions{Feature: name, Rejected: map[string]uint64{}}
		if f != nil {
			fd.Admitted = f.admittedN.Load()
			for j, r := range reasons {
				if n := f.rejectedN[j].Load(); n > 0 {
					fd.Rejected[string(r)] = n
				}
			}
		}
		out = append(out, fd)
	}
	return out
}
