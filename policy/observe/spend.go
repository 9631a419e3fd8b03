package observe

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/spend"
)

// spendCounters are one feature's spend counters.
type spendCounters struct {
	reserved, settled, refunded prometheus.Counter
}

func (c *spendCounters) Reserved(amount spend.Micros) { c.reserved.Add(amount.Float()) }
func (c *spendCounters) Settled(amount spend.Micros)  { c.settled.Add(amount.Float()) }
func (c *spendCounters) Refunded(amount spend.Micros) { c.refunded.Add(amount.Float()) }

// spendMetrics are the spend counters, resolved per feature only once a policy with spend
// budgets is live (a policy without them adds no series).
type spendMetrics struct {
	reserved, settled, refunded *prometheus.CounterVec

	mu        sync.Mutex
	byFeature map[string]*spendCounters
}

func (m *spendMetrics) init() {
	*m = spendMetrics{
		byFeature: map[string]*spendCounters{},
		reserved: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "spend_reserved_total",
			Help: "Worst-case cost reserved in spend budgets by admitted requests, in units of the policy's currency, by feature."}, []string{"feature"}),
		settled: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "spend_settled_total",
			Help: "Real cost of finished requests settled in spend budgets, in units of the policy's currency, by feature."}, []string{"feature"}),
		refunded: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "spend_refunded_total",
			Help: "Reservations given back whole because the request never reached the provider, in units of the policy's currency, by feature."}, []string{"feature"}),
	}
}

// collectors returns the spend counters and the collectors that read engine e's spend ledger
// and spend budgets at scrape time.
func (m *spendMetrics) collectors(e *policy.Engine) []prometheus.Collector {
	l := e.Ledger()
	fellBack := prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: Namespace, Name: "spend_store_fallbacks_total",
		Help: "Spend reservations decided in this replica's memory because the shared spend store (Redis) did not answer in time or was unavailable: each against this replica's share of what Redis last showed left, and added to Redis once it answers."},
		func() float64 { return float64(l.FellBack()) })
	pending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: Namespace, Name: "spend_local_pending",
		Help: "Spend this replica counted in its own memory while Redis did not answer that Redis has not applied yet (settled spend and reservations in flight, net of reservations that ended), in units of the policy's currency, each request once whatever its budgets; 0 without a cluster."},
		func() float64 { return l.PendingTotal().Float() })
	return []prometheus.Collector{m.reserved, m.settled, m.refunded, fellBack, pending, &spendCollector{e: e}}
}

// Spend returns the named feature's spend counters, making their series on first use.
func (m *Metrics) Spend(feature string) policy.SpendRecorder { return m.spend.feature(feature) }

func (m *spendMetrics) feature(name string) *spendCounters {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.byFeature[name]
	if c == nil {
		c = &spendCounters{reserved: m.reserved.WithLabelValues(name), settled: m.settled.WithLabelValues(name),
			refunded: m.refunded.WithLabelValues(name)}
		m.byFeature[name] = c
	}
	return c
}

var (
	descSpendLimit = prometheus.NewDesc(Namespace+"_spend_budget_limit", "A spend budget's limit per window, in units of the policy's currency, by compartment and period (hour, day, month).", []string{"compartment", "period"}, nil)
	descSpendUsed  = prometheus.NewDesc(Namespace+"_spend_budget_used", "Spend counted in a spend budget's current window (settled plus reserved by requests in flight), in units of the policy's currency, by compartment and period.", []string{"compartment", "period"}, nil)
	descSpendLeft  = prometheus.NewDesc(Namespace+"_spend_budget_remaining", "What a spend budget has left in its current window, less the chunks of it replicas hold unused with leased cluster admission (negative when settlement overran it), in units of the policy's currency, by compartment and period.", []string{"compartment", "period"}, nil)
	descSpendRatio = prometheus.NewDesc(Namespace+"_spend_budget_used_ratio", "Used divided by limit for a spend budget's current window, by compartment and period; for tenant-keyed compartments without tenant labels (<family>/*), the highest ratio among the family's tenants.", []string{"compartment", "period"}, nil)
	descSpendReset = prometheus.NewDesc(Namespace+"_spend_budget_reset_timestamp_seconds", "When a spend budget's current window ends and the budget resets (Unix time), by compartment and period.", []string{"compartment", "period"}, nil)
)

// spendCollector reports the spend budgets' windows at scrape time.
type spendCollector struct{ e *policy.Engine }

func (c *spendCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSpendLimit, descSpendUsed, descSpendLeft, descSpendRatio, descSpendReset} {
		ch <- d
	}
}

func (c *spendCollector) Collect(ch chan<- prometheus.Metric) {
	e := c.e
	s := e.Snapshot()
	if s == nil || !s.SpendLimits {
		return
	}
	now := e.Now()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	for _, b := range s.SpendBudgets(now) {
		switch {
		case b.Aggregate:
			gauge(descSpendRatio, b.UsedRatio(), b.Label, b.Period)
			continue
		case b.Tenant && !s.TenantLabel():
			continue // counted in the family's aggregate: tenants are unbounded
		}
		gauge(descSpendLimit, b.Limit.Float(), b.Label, b.Period)
		gauge(descSpendUsed, (b.Spent + b.Reserved).Float(), b.Label, b.Period)
		gauge(descSpendLeft, (b.Limit - b.Spent - b.Reserved - b.Leased).Float(), b.Label, b.Period)
		gauge(descSpendRatio, b.UsedRatio(), b.Label, b.Period)
		gauge(descSpendReset, float64(b.End.Unix()), b.Label, b.Period)
	}
}
