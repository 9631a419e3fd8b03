package observe

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// quotaMetrics count what providers' quotas (providers.<name>.quota) do to requests.
type quotaMetrics struct {
	short, invalid, overflow *prometheus.CounterVec
}

func (m *quotaMetrics) init() {
	*m = quotaMetrics{
		short: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "provider_quota_short_total",
			Help: "Requests a provider's quota (as its rate-limit headers last told it, less the requests in flight) could not cover, by provider, quota (requests, tokens, input_tokens, output_tokens) and mode: in enforce they were re-routed along the fallback or refused provider_quota, in shadow they went as before."}, []string{"provider", "quota", "mode"}),
		invalid: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "provider_quota_headers_invalid_total",
			Help: "Rate-limit headers of a provider's responses whose value was malformed or absurd (negative, beyond a million billion, a reset more than 31 days ahead) and changed nothing, by provider."}, []string{"provider"}),
		overflow: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "provider_quota_account_overflow_total",
			Help: "Requests of a provider whose account was beyond the accounts its quota tracks apart (quota.max_accounts): they share the quota of account _other, by provider."}, []string{"provider"}),
	}
}

// collectors returns the quota counters and the collector that reads engine e's provider
// quotas at scrape time.
func (m *quotaMetrics) collectors(e *policy.Engine) []prometheus.Collector {
	return []prometheus.Collector{m.short, m.invalid, m.overflow, quotaCollector{e: e}}
}

// QuotaShort counts a request a provider's quota could not cover.
func (m *Metrics) QuotaShort(provider, quota, mode string) {
	m.quota.short.WithLabelValues(provider, quota, mode).Inc()
}

// QuotaHeadersInvalid counts n rate-limit headers of a provider's response that could not be
// believed.
func (m *Metrics) QuotaHeadersInvalid(provider string, n int) {
	m.quota.invalid.WithLabelValues(provider).Add(float64(n))
}

// QuotaAccountOverflow counts a request whose account shares the _other account's quota.
func (m *Metrics) QuotaAccountOverflow(provider string) {
	m.quota.overflow.WithLabelValues(provider).Inc()
}

var (
	descQuotaLeft  = prometheus.NewDesc(Namespace+"_provider_quota_remaining", "What a provider's rate-limit headers last said is left of a quota (after its reset: its limit), by provider, account (quota.account; empty for a provider without one) and quota (requests, tokens, input_tokens, output_tokens).", []string{"provider", "account", "quota"}, nil)
	descQuotaLimit = prometheus.NewDesc(Namespace+"_provider_quota_limit", "A provider's quota limit as its rate-limit headers said it (0: not said), by provider, account and quota.", []string{"provider", "account", "quota"}, nil)
	descQuotaHeld  = prometheus.NewDesc(Namespace+"_provider_quota_held", "What the requests to a provider hold of its quota that what its headers said is left may not count yet (in flight, or answered after a request sent later), by provider, account and quota.", []string{"provider", "account", "quota"}, nil)
)

// quotaCollector reports the followed providers' quotas at scrape time.
type quotaCollector struct{ e *policy.Engine }

func (c quotaCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descQuotaLeft
	ch <- descQuotaLimit
	ch <- descQuotaHeld
}

func (c quotaCollector) Collect(ch chan<- prometheus.Metric) {
	if c.e.Snapshot() == nil {
		return
	}
	for _, v := range c.e.ProviderQuotas() {
		for _, q := range v.Quotas {
			ch <- prometheus.MustNewConstMetric(descQuotaLeft, prometheus.GaugeValue, float64(q.Remaining), v.Provider, v.Account, q.Kind)
			ch <- prometheus.MustNewConstMetric(descQuotaLimit, prometheus.GaugeValue, float64(q.Limit), v.Provider, v.Account, q.Kind)
			ch <- prometheus.MustNewConstMetric(descQuotaHeld, prometheus.GaugeValue, float64(q.Pending), v.Provider, v.Account, q.Kind)
		}
	}
}
