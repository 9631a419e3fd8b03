package config_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

// TestAdaptiveDefaults: `max_concurrent: adaptive` alone gets the documented bounds; set keys
// win, and an unset initial or max follows the others.
func TestAdaptiveDefaults(t *testing.T) {
	data := `classification: {provider: {default: a}}
providers:
  a: {max_concurrent: adaptive}
  b: {max_concurrent: adaptive, adaptive: {min: 2, max: 20, initial: 10, tolerance: 2, interval: 500ms, remeasure_interval: 1m}}
  c: {max_concurrent: adaptive, adaptive: {max: 4}}
  d: {max_concurrent: adaptive, adaptive: {initial: 3}}
  e: {max_concurrent: 7}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`
	p, err := config.Load("p.yaml", []byte(data), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]config.AdaptiveLimit{
		"a": {Min: 1, Max: 100, Initial: 10, Tolerance: 1.5, Interval: time.Second, RemeasureInterval: 5 * time.Minute},
		"b": {Min: 2, Max: 20, Initial: 10, Tolerance: 2, Interval: 500 * time.Millisecond, RemeasureInterval: time.Minute},
		"c": {Min: 1, Max: 4, Initial: 4, Tolerance: 1.5, Interval: time.Second, RemeasureInterval: 5 * time.Minute},
		"d": {Min: 1, Max: 30, Initial: 3, Tolerance: 1.5, Interval: time.Second, RemeasureInterval: 5 * time.Minute},
	}
	for name, w := range want {
		r := p.Resolve(p.Providers[name].Limits)
		if r.Adaptive != w {
			t.Errorf("%s: adaptive = %+v, want %+v", name, r.Adaptive, w)
		}
		if r.MaxConcurrent != w.Max || r.QueueDepth != 10*w.Max {
			t.Errorf("%s: max_concurrent %d, queue_depth %d; want adaptive.max %d and 10 × it", name, r.MaxConcurrent, r.QueueDepth, w.Max)
		}
	}
	if r := p.Resolve(p.Providers["e"].Limits); r.Adaptive.On() || r.MaxConcurrent != 7 {
		t.Errorf("a fixed limit resolved to %+v", r)
	}
	b, err := json.Marshal(p.Providers["a"].Limits)
	if err != nil || !strings.Contains(string(b), `"max_concurrent":"adaptive"`) {
		t.Errorf("JSON = %s, %v; want max_concurrent written as adaptive", b, err)
	}
}

// TestAdaptiveInheritedFromTemplate: a template's adaptive block and max_concurrent reach the
// limit sets that name it, and a tenant override may switch a tier's fixed limit to adaptive.
func TestAdaptiveInheritedFromTemplate(t *testing.T) {
	data := `templates:
  learned: {max_concurrent: adaptive, adaptive: {min: 3, max: 9}}
classification: {provider: {default: a}}
providers:
  a: {template: learned}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`
	p, err := config.Load("p.yaml", []byte(data), nil)
	if err != nil {
		t.Fatal(err)
	}
	if a := p.Resolve(p.Providers["a"].Limits).Adaptive; a.Min != 3 || a.Max != 9 || a.Initial != 9 {
		t.Errorf("inherited adaptive = %+v, want min 3, max 9, initial 9", a)
	}
	env := []string{"LLM_BULKHEAD_PROVIDERS__A__MAX_CONCURRENT=12"}
	p, err = config.Load("p.yaml", []byte(data), env)
	if err != nil {
		t.Fatal(err)
	}
	if r := p.Resolve(p.Providers["a"].Limits); r.Adaptive.On() || r.MaxConcurrent != 12 {
		t.Errorf("an environment override to 12 resolved to %+v", r)
	}
}

// TestAdaptiveValidation: every bad adaptive value is reported with its path, and adaptive
// settings without max_concurrent: adaptive are refused rather than silently ignored.
func TestAdaptiveValidation(t *testing.T) {
	data := `classification: {provider: {default: e}}
providers:
  a: {max_concurrent: adaptive, adaptive: {min: 0, max: -1, initial: 0}}
  b: {max_concurrent: adaptive, adaptive: {min: 5, max: 4}}
  c: {max_concurrent: adaptive, adaptive: {min: 2, max: 8, initial: 9, tolerance: 1, interval: 5ms}}
  d: {max_concurrent: 4, adaptive: {max: 8}}
  e: {max_concurrent: adaptive, adaptive: {interval: 2s, remeasure_interval: 10s, tolerance: 11}}
  f: {max_concurrent: adaptive, adaptive: {mx: 3}}
  g: {max_concurrent: adaptiv}
  h: {max_concurrent: 2.5}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`
	wantProblems(t, loadProblems(t, data, nil), []string{
		`p.yaml:3: providers.a.adaptive.min: must be at least 1, got 0`,
		`p.yaml:3: providers.a.adaptive.max: must be at least 1, got -1`,
		`p.yaml:3: providers.a.adaptive.initial: must be at least 1, got 0`,
		`p.yaml:4: providers.b.adaptive.max: 4 is below min 5`,
		`p.yaml:5: providers.c.adaptive.initial: 9 is above max 8`,
		`p.yaml:5: providers.c.adaptive.tolerance: must be more than 1 and at most 10, got 1`,
		`p.yaml:5: providers.c.adaptive.interval: must be from 10ms to 1m, got 5ms`,
		`p.yaml:6: providers.d.adaptive: adaptive settings take effect only with max_concurrent: adaptive`,
		`p.yaml:7: providers.e.adaptive.remeasure_interval: 10s is shorter than 10 intervals (20s)`,
		`p.yaml:7: providers.e.adaptive.tolerance: must be more than 1 and at most 10, got 11`,
		`p.yaml:8: providers.f.adaptive.mx: unknown key "mx" (did you mean "max"?)`,
		`p.yaml:9: providers.g.max_concurrent: expected an integer or adaptive, got the string "adaptiv"`,
		`p.yaml:10: providers.h.max_concurrent: expected an integer or adaptive, got 2.5`,
	})
}

// FuzzConcurrency: max_concurrent text either parses to adaptive or a number that prints back
// to the same value, or is refused; no number reads as adaptive.
func FuzzConcurrency(f *testing.F) {
	for _, s := range []string{"adaptive", "20", "-1", " adaptive ", "-9223372036854775808", "Adaptive", "1e3", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var v config.Concurrency
		if err := v.UnmarshalText([]byte(s)); err != nil {
			return
		}
		if v.IsAdaptive() != (strings.TrimSpace(s) == "adaptive") {
			t.Fatalf("%q parsed to %s", s, v)
		}
		var back config.Concurrency
		if err := back.UnmarshalText([]byte(v.String())); err != nil || back != v {
			t.Fatalf("%q → %s → %s (%v)", s, v, back, err)
		}
		b, err := json.Marshal(v)
		if err != nil || (v.IsAdaptive() != (string(b) == `"adaptive"`)) {
			t.Fatalf("%q → JSON %s (%v)", s, b, err)
		}
	})
}
