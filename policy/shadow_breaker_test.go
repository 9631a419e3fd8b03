package policy_test

import (
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

// metricValue returns the value of the series of name whose labels include want, or -1.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue series
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return -1
}

// TestShadowProviderBreaker: the breaker of a provider whose limits run in shadow opens as it
// would, but refuses and re-routes nothing: its refusals are shadow rejections and its opening
// is a would-open. A METRICS_ONLY breaker counts a would-open where CLOSED would have opened.
func TestShadowProviderBreaker(t *testing.T) {
	yaml := strings.Replace(breakerPolicy, "deepseek: {breaker: std, fallback: qwen}", "deepseek: {breaker: std, fallback: qwen, mode: shadow}", 1)
	yaml = strings.Replace(yaml, "qwen: {breaker: std}", "qwen: {breaker: watch}", 1)
	yaml += `  watch:
    base: std
    state: METRICS_ONLY
`
	p, err := config.Load("test.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatalf("policy:\n%v", err)
	}
	reg := prometheus.NewRegistry()
	e, err := observe.NewEngine(p, policy.Options{Clock: newClock(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, reg)
	if err != nil {
		t.Fatal(err)
	}
	ds := input{headers: map[string]string{"x-llm-provider": "deepseek"}}
	for i := 0; i < 4; i++ {
		d, tk := admit(t, e, ds, 10)
		if d.Verdict != policy.Admit || d.Rerouted {
			t.Fatalf("%d: %+v", i, d)
		}
		tk.Done(policy.Outcome{Status: 503, TTFB: time.Millisecond})
	}
	for _, b := range e.Breakers() {
		if b.Name == "deepseek" && b.Snapshot.State.String() != "OPEN" {
			t.Fatalf("shadow deepseek's breaker is %s after 4 failures, want OPEN", b.Snapshot.State)
		}
	}
	for i := 0; i < 3; i++ {
		d, tk := admit(t, e, ds, 10)
		if d.Verdict != policy.Admit || d.Rerouted || e.Snapshot().ProviderName(d.Dims.Provider) != "deepseek" {
			t.Fatalf("with shadow deepseek open: %+v, want admitted to deepseek", d)
		}
		tk.Done(policy.Outcome{Status: 503, TTFB: time.Millisecond}) // no permit: not recorded
	}
	if v := metricValue(t, reg, "llm_bulkhead_shadow_rejections_total", map[string]string{"compartment": "provider/deepseek", "reason": "circuit_open"}); v != 3 {
		t.Errorf("shadow circuit_open rejections = %v, want 3", v)
	}
	if v := metricValue(t, reg, "llm_bulkhead_breaker_would_open_total", map[string]string{"breaker": "deepseek"}); v != 1 {
		t.Errorf("deepseek would_open = %v, want 1", v)
	}

	qw := input{headers: map[string]string{"x-llm-provider": "qwen"}}
	for i := 0; i < 6; i++ {
		d, tk := admit(t, e, qw, 10)
		if d.Verdict != policy.Admit {
			t.Fatalf("METRICS_ONLY qwen refused: %+v", d)
		}
		tk.Done(policy.Outcome{Status: 503, TTFB: time.Millisecond})
	}
	if v := metricValue(t, reg, "llm_bulkhead_breaker_would_open_total", map[string]string{"breaker": "qwen"}); v != 1 {
		t.Errorf("qwen would_open = %v, want 1 (one stay in METRICS_ONLY)", v)
	}
}
