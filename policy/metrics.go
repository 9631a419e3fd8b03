package policy

import (
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
	"github.com/llm-bulkhead/llm-bulkhead/policy/bulkhead"
)

// Namespace prefixes every metric name.
const Namespace = "llm_bulkhead"

// reasons indexes per-reason counters on the hot path.
var reasons = [...]Reason{ReasonTokenBudget, ReasonRateLimit, ReasonBulkheadFull, ReasonCircuitOpen, ReasonBadRequest, ReasonServerBusy, ReasonCancelled, ReasonSpendBudget, ReasonUnknownKey, ReasonProviderQuota, ReasonClusterUnavailable}

func reasonIndex(r Reason) int {
	for i, x := range reasons {
		if x == r {
			return i
		}
	}
	return len(reasons) - 1
}

// metrics are the engine's Prometheus metrics. Counters the hot path touches are resolved per
// feature once (featureMetrics); gauges of compartments, budgets, breakers and pools are read
// from live state at scrape time by the collector, so admission pays nothing for them.
type metrics struct {
	engine *Engine

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
	quotaShort     *prometheus.CounterVec
	quotaInvalid   *prometheus.CounterVec
	unknownFeature prometheus.Counter
	// invalidValue counts, per dimension (dimFeature…), requests a rule of which read a value
	// classification could not use (config.CheckIdentity).
	invalidValue [numDims]prometheus.Counter

	mu       sync.Mutex
	features map[string]*featureMetrics
	shadow   map[shadowKey]*atomic.Uint64
	// shadowOpenings counts, by breaker, the automatic openings of breakers of providers in
	// shadow mode (part of breaker_would_open_total).
	shadowOpenings map[string]uint64
}

type shadowKey struct {
	compartment string
	reason      Reason
}

// featureMetrics are one feature's hot-path counters.
type featureMetrics struct {
	name              string
	admittedN         atomic.Uint64
	rejectedN         [len(reasons)]atomic.Uint64
	admitted          prometheus.Counter
	rejected          [len(reasons)]prometheus.Counter
	tokensReserved    prometheus.Counter
	promptSettled     prometheus.Counter
	completionSettled prometheus.Counter
	usageUnknown      prometheus.Counter
	usageClamped      prometheus.Counter
	estimateError     prometheus.Observer
}

func newMetrics(e *Engine, reg prometheus.Registerer) *metrics {
	m := &metrics{
		engine:   e,
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
	}
	m.quotaShort, m.quotaInvalid = newQuotaMetrics()
	m.unknownFeature = m.classifyErrors.WithLabelValues("unknown_feature")
	for i, dim := range dimNames {
		m.invalidValue[i] = m.classifyErrors.WithLabelValues("invalid_" + dim)
	}
	if reg != nil {
		reg.MustRegister(m.admitted, m.rejected, m.rerouted, m.rerouteNoModel, m.tokensReserved, m.tokensSettled, m.usageUnknown,
			m.usageClamped, m.estimateError, m.queueWait, m.classifyErrors, m.transitions,
			m.quotaShort, m.quotaInvalid, &stateCollector{m: m}, quotaCollector{e: m.engine})
	}
	return m
}

// ClassifyError counts a request classified from headers and defaults because of reason
// (e.g. "invalid_json", "field_type").
func (e *Engine) ClassifyError(reason string) {
	e.metrics.classifyErrors.WithLabelValues(reason).Inc()
}

func (m *metrics) feature(name string) *featureMetrics {
	m.mu.Lock()
	defer m.mu.Unlock()
	if f := m.features[name]; f != nil {
		return f
	}
	f := &featureMetrics{
		name:              name,
		admitted:          m.admitted.WithLabelValues(name),
		tokensReserved:    m.tokensReserved.WithLabelValues(name),
		promptSettled:     m.tokensSettled.WithLabelValues(name, "prompt"),
		completionSettled: m.tokensSettled.WithLabelValues(name, "completion"),
		usageUnknown:      m.usageUnknown.WithLabelValues(name),
		usageClamped:      m.usageClamped.WithLabelValues(name),
		estimateError:     m.estimateError.WithLabelValues(name),
	}
	for i, r := range reasons {
		f.rejected[i] = m.rejected.WithLabelValues(name, string(r))
	}
	m.features[name] = f
	return f
}

func (m *metrics) countShadow(compartment string, r Reason) {
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

func (m *metrics) observeWait(c *bulkhead.Compartment, waited time.Duration, admitted bool) {
	fam, _, _ := strings.Cut(c.Name(), "/")
	result := "refused"
	if admitted {
		result = "admitted"
	}
	m.queueWait.WithLabelValues(fam, result).Observe(waited.Seconds())
}

func (m *metrics) shadowOpening(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.shadowOpenings == nil {
		m.shadowOpenings = map[string]uint64{}
	}
	m.shadowOpenings[name]++
}

func (m *metrics) breakerEvent(ev breaker.Event) {
	if ev.Kind == breaker.EventTransition {
		m.transitions.WithLabelValues(ev.Name, ev.From.String(), ev.To.String()).Inc()
	}
}

// stateCollector reports live state at scrape time.
type stateCollector struct{ m *metrics }

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
	e := c.m.engine
	s := e.Snapshot()
	if s == nil {
		return
	}
	now := e.clock.Now()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(descInflightReq, float64(e.InFlight()))
	gauge(descGen, float64(s.gen))

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
	budgets := func(name string, in *instance) {
		if in.tpm != nil {
			b := in.tpm.State(now)
			gauge(descBudget, float64(b.Remaining), name, "minute")
			gauge(descBudgetCap, float64(b.Capacity), name, "minute")
		}
		if in.tpd != nil {
			b := in.tpd.State(now)
			gauge(descBudget, float64(b.Remaining), name, "day")
			gauge(descBudgetCap, float64(b.Capacity), name, "day")
		}
		if in.rpm != nil {
			gauge(descRate, float64(in.rpm.State(now).Remaining), name)
		}
	}
	shadowBulkhead := map[string]uint64{}
	for _, in := range s.staticInstances() {
		st := e.sched.Stats(in.c)
		emit(in.name, in.family.name, st, true)
		budgets(in.name, in)
		collectAdaptive(ch, in.name, in)
		shadowBulkhead[in.name] += st.ShadowRefusals
	}
	tenantLabel := s.policy.Admin.TenantLabel
	agg := map[string]*bulkhead.Stats{}
	var aggOrder []string
	for _, in := range s.dynamicInstances() {
		st := e.sched.Stats(in.c)
		if tenantLabel {
			emit(in.name, in.family.name, st, true)
			budgets(in.name, in)
			collectAdaptive(ch, in.name, in)
			shadowBulkhead[in.name] += st.ShadowRefusals
			continue
		}
		name := in.family.name + "/*"
		a := agg[name]
		if a == nil {
			a = &bulkhead.Stats{Name: in.family.name}
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
			counter(descShadow, float64(n), name, string(ReasonBulkheadFull))
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
	for _, p := range e.sched.PoolStats() {
		gauge(descPoolIn, float64(p.InFlight), p.Name)
		gauge(descPoolCap, float64(p.Capacity), p.Name)
	}
	for _, pr := range s.providers {
		if pr.breakers == nil {
			continue
		}
		for _, b := range pr.breakers.all() {
			snap := b.Snapshot(now)
			for _, st := range breakerStates {
				v := 0.0
				if snap.State == st {
					v = 1
				}
				gauge(descBrState, v, b.Name(), st.String())
			}
			gauge(descBrRate, snap.FailureRate, b.Name())
			gauge(descBrSlow, snap.SlowRate, b.Name())
			k := b.Counts()
			for _, kv := range []struct {
				kind string
				n    uint64
			}{{"success", k.Success}, {"failure", k.Failure}, {"slow_success", k.SlowSuccess}, {"slow_failure", k.SlowFailure},
				{"not_permitted", k.NotPermitted}, {"ignored", k.Ignored}, {"stale", k.Stale}} {
				counter(descBrCalls, float64(kv.n), b.Name(), kv.kind)
			}
			c.m.mu.Lock()
			shadowOpened := c.m.shadowOpenings[b.Name()]
			c.m.mu.Unlock()
			counter(descBrWouldOpen, float64(k.WouldOpen+shadowOpened), b.Name())
		}
	}
}
