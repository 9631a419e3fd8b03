package observe

import (
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/usage"
)

var (
	descTenantRequests = prometheus.NewDesc(Namespace+"_tenant_requests_total",
		"Requests admitted and finished, of each tenant usage.tenant_metrics names (no other tenant has series).", []string{"tenant"}, nil)
	descTenantRefusals = prometheus.NewDesc(Namespace+"_tenant_refusals_total",
		"Requests refused, by reason, of each tenant usage.tenant_metrics names.", []string{"tenant", "reason"}, nil)
	descTenantTokens = prometheus.NewDesc(Namespace+"_tenant_tokens_total",
		"Tokens settled, by kind (prompt, completion, and cached: prompt tokens served from a cache, part of prompt), of each tenant usage.tenant_metrics names.", []string{"tenant", "kind"}, nil)
	descTenantSpend = prometheus.NewDesc(Namespace+"_tenant_spend_total",
		"What the finished requests cost, in units of the policy's currency (what spend budgets charged, or what the prices say), of each tenant usage.tenant_metrics names.", []string{"tenant"}, nil)
	descUsageRows = prometheus.NewDesc(Namespace+"_usage_table_rows",
		"Rows the usage tables hold, over every bucket of time, by grouping (tenant, model, tenant_model).", []string{"by"}, nil)
	descUsageTables = prometheus.NewDesc(Namespace+"_usage_tables",
		"Usage tables held (one per bucket of time), by grouping.", []string{"by"}, nil)
	descUsageEvictions = prometheus.NewDesc(Namespace+"_usage_evictions_total",
		"Groups displaced from a full usage table by another group (Space-Saving), by grouping: when it grows fast, rows overcount more and usage.table_size may be too small.", []string{"by"}, nil)
)

// usageCollector reports the usage tracker at scrape time: the totals of the tenants
// usage.tenant_metrics names, and the size of the tables.
type usageCollector struct{ engine *policy.Engine }

func (c usageCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descTenantRequests, descTenantRefusals, descTenantTokens, descTenantSpend, descUsageRows, descUsageTables, descUsageEvictions} {
		ch <- d
	}
}

func (c usageCollector) Collect(ch chan<- prometheus.Metric) {
	tr := c.engine.Usage()
	if !tr.Enabled() {
		return
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	reasons := tr.Reasons()
	for _, t := range tr.TenantTotals() {
		counter(descTenantRequests, float64(t.Counts.Requests), t.Tenant)
		for i, r := range reasons {
			counter(descTenantRefusals, float64(t.Counts.Refusals[i]), t.Tenant, r)
		}
		counter(descTenantTokens, float64(t.Counts.Prompt), t.Tenant, "prompt")
		counter(descTenantTokens, float64(t.Counts.Completion), t.Tenant, "completion")
		counter(descTenantTokens, float64(t.Counts.Cached), t.Tenant, "cached")
		counter(descTenantSpend, t.Counts.Spend.Float(), t.Tenant)
	}
	st := tr.Stats()
	for _, by := range usage.Groupings() {
		name := strings.ReplaceAll(by.String(), ",", "_")
		ch <- prometheus.MustNewConstMetric(descUsageRows, prometheus.GaugeValue, float64(st.Rows[by]), name)
		ch <- prometheus.MustNewConstMetric(descUsageTables, prometheus.GaugeValue, float64(st.Tables[by]), name)
		counter(descUsageEvictions, float64(st.Evictions[by]), name)
	}
}
