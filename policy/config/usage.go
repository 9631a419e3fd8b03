package config

import "fmt"

// Bounds and defaults of the usage section.
const (
	// DefaultUsageTableSize is usage.table_size when the policy does not set it.
	DefaultUsageTableSize = 200
	minUsageTableSize     = 10
	maxUsageTableSize     = 10000
	// MaxTenantMetrics bounds usage.tenant_metrics: each tenant named adds series of its own.
	MaxTenantMetrics = 100
)

// Usage counts what tenants and models use — tokens (prompt, completion, cached), requests,
// refusals by reason and spend — for GET /admin/usage and the dashboard, over the last hour,
// 24 hours, 7 days and the calendar month (in time_zone), in memory that does not grow with the
// number of tenants or models: each grouping (by tenant, by model, by tenant and model) keeps a
// table of at most table_size groups per bucket of time (5-minute buckets for the hour, hours
// for the day, days for the week and the month), a Space-Saving summary that keeps the groups
// that use the most exactly and reports, for each row, how much it may overcount. A single
// process keeps the tables in the state file (state.file) across restarts; in cluster mode each
// replica keeps its own (docs/operations.md). Prometheus metrics carry no tenant label but for
// the tenants tenant_metrics names. Requests refused before they were classified (bad_request,
// server_busy) have no tenant and are not counted.
type Usage struct {
	// Enabled counts usage. Off, the tables are dropped (a reload turning it on again starts
	// empty) and /admin/usage answers 404. Default true.
	Enabled *bool `koanf:"enabled" json:"enabled,omitempty"`
	// TableSize is the most groups a table keeps, from 10 to 10000. A report's rows may
	// overcount by at most its window's weight (tokens plus one per request and refusal) over
	// the table size: once for 1h, twice for 24h and three times for 7d and month; groups that
	// use more than that are never missed. Memory grows with it: at most 3 × 69 tables of
	// table_size rows of about 200 bytes plus their names, under 10 MiB at the default, reached
	// only when every table is full. A reload applies it to the live tables at once (a smaller
	// size drops their smallest groups) and to every bucket after. Default 200.
	TableSize int `koanf:"table_size" json:"table_size,omitempty"`
	// TenantMetrics names tenants whose usage gets Prometheus series of their own, labelled
	// with the tenant (llm_bulkhead_tenant_requests_total, _refusals_total, _tokens_total,
	// _spend_total): at most 100, so that labels stay bounded. Other tenants have no tenant
	// label in any metric. Default none.
	TenantMetrics []string `koanf:"tenant_metrics" json:"tenant_metrics,omitempty"`
}

// On reports whether usage is counted (after defaults).
func (u *Usage) On() bool { return u.Enabled == nil || *u.Enabled }

func (u *Usage) applyDefaults() {
	if u.Enabled == nil {
		u.Enabled = ptr(true)
	}
	u.TableSize = int(orInt(int64(u.TableSize), DefaultUsageTableSize))
}

// usage checks the usage section.
func (v *validator) usage() {
	u := v.p.Usage
	if u.TableSize < minUsageTableSize || u.TableSize > maxUsageTableSize {
		v.add("usage.table_size", "must be from %d to %d, got %d", minUsageTableSize, maxUsageTableSize, u.TableSize)
	}
	if len(u.TenantMetrics) > MaxTenantMetrics {
		v.add("usage.tenant_metrics", "names %d tenants, at most %d: each adds metric series of its own", len(u.TenantMetrics), MaxTenantMetrics)
	}
	if len(u.TenantMetrics) > 0 && !u.On() {
		v.add("usage.tenant_metrics", "names tenants but usage.enabled is false: their metrics count what usage counts")
	}
	seen := map[string]bool{}
	for i, t := range u.TenantMetrics {
		path := fmt.Sprintf("usage.tenant_metrics[%d]", i)
		switch err := CheckIdentity(t); {
		case err != nil:
			v.add(path, "%q cannot be a tenant: %v", t, err)
		case seen[t]:
			v.add(path, "%q is named twice", t)
		}
		seen[t] = true
	}
}
