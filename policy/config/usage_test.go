package config_test

import (
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// TestUsageDefaults: usage is counted by default in tables of 200, with no tenant metrics; the
// environment can set the section.
func TestUsageDefaults(t *testing.T) {
	p, err := config.Load("p.yaml", []byte(stateBase), nil)
	if err != nil {
		t.Fatal(err)
	}
	if u := p.Usage; !u.On() || u.TableSize != config.DefaultUsageTableSize || len(u.TenantMetrics) != 0 {
		t.Fatalf("defaults: %+v", u)
	}
	p, err = config.Load("p.yaml", []byte(stateBase+"usage: {table_size: 1000, tenant_metrics: [acme, initech]}\n"),
		[]string{"LLM_BULKHEAD_USAGE__ENABLED=true"})
	if err != nil {
		t.Fatal(err)
	}
	if u := p.Usage; !u.On() || u.TableSize != 1000 || strings.Join(u.TenantMetrics, ",") != "acme,initech" {
		t.Fatalf("set: %+v", u)
	}
	p, err = config.Load("p.yaml", []byte(stateBase+"usage: {enabled: false}\n"), nil)
	if err != nil || p.Usage.On() {
		t.Fatalf("off: %+v %v", p.Usage, err)
	}
}

// TestUsageRefused: every problem of the section is reported, each at its key.
func TestUsageRefused(t *testing.T) {
	many := make([]string, config.MaxTenantMetrics+1)
	for i := range many {
		many[i] = "t" + strings.Repeat("x", i)
	}
	for _, tc := range []struct{ yaml, want string }{
		{"usage: {table_size: 5}\n", "usage.table_size: must be from 10 to 10000, got 5"},
		{"usage: {table_size: 20000}\n", "usage.table_size: must be from 10 to 10000, got 20000"},
		{"usage: {table_size: -1}\n", "usage.table_size: must be from 10 to 10000, got -1"},
		{"usage: {tenant_metrics: [acme, acme]}\n", `usage.tenant_metrics[1]: "acme" is named twice`},
		{"usage: {tenant_metrics: [\"a\\tb\"]}\n", `usage.tenant_metrics[0]: "a\tb" cannot be a tenant: control character U+0009 at byte 1`},
		{"usage: {enabled: false, tenant_metrics: [acme]}\n", "usage.tenant_metrics: names tenants but usage.enabled is false"},
		{"usage: {tenant_metrics: [" + strings.Join(many, ", ") + "]}\n", "usage.tenant_metrics: names 101 tenants, at most 100"},
		{"usage: {size: 10}\n", "usage.size"},
		{"usage: {table_size: ten}\n", "usage.table_size"},
	} {
		_, err := config.Load("p.yaml", []byte(stateBase+tc.yaml), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error containing %q", tc.yaml, err, tc.want)
		}
	}
	// All at once.
	_, err := config.Load("p.yaml", []byte(stateBase+"usage: {table_size: 5, tenant_metrics: [a, a]}\n"), nil)
	if err == nil || !strings.Contains(err.Error(), "usage.table_size") || !strings.Contains(err.Error(), "usage.tenant_metrics[1]") {
		t.Errorf("both problems: %v", err)
	}
}
