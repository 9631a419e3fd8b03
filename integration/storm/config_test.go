package storm

import (
	"encoding/json"
	"errors"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
)

const (
	examplePolicy = "../../examples/policy.yaml"
	pooledPolicy  = "../../examples/policy-pooled.yaml"
)

// derive runs DerivePolicy on a file and loads the result.
func derive(t *testing.T, path string, v Variant) *config.Policy {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out, err := DerivePolicy(path, src, v)
	if err != nil {
		t.Fatalf("DerivePolicy: %v", err)
	}
	p, err := config.Load("derived", out, []string{})
	if err != nil {
		t.Fatalf("the derived policy does not load: %v", err)
	}
	return p
}

func TestDerivePolicyScalesWaitsAndBreakerTimings(t *testing.T) {
	// Given the example policy, when time runs ten times faster,
	p := derive(t, examplePolicy, Variant{TimeScale: 0.1})

	// then queue waits and breaker timings shrink with it,
	waits := map[string]time.Duration{
		"features.chat":            p.Features["chat"].MaxWait.D(),
		"features.batch_summarize": p.Features["batch_summarize"].MaxWait.D(),
		"tiers.enterprise":         p.Tiers["enterprise"].MaxWait.D(),
		"tiers.free":               p.Tiers["free"].MaxWait.D(),
		"breakers.standard.slow":   p.Breakers["standard"].SlowCallDuration.D(),
		"breakers.standard.open":   p.Breakers["standard"].WaitInOpen.D(),
	}
	want := map[string]time.Duration{
		"features.chat": 500 * time.Millisecond, "features.batch_summarize": 10 * time.Millisecond,
		"tiers.enterprise": 800 * time.Millisecond, "tiers.free": 200 * time.Millisecond,
		"breakers.standard.slow": 80 * time.Millisecond, "breakers.standard.open": time.Second,
	}
	for k, w := range want {
		if waits[k] != w {
			t.Errorf("%s = %v, want %v", k, waits[k], w)
		}
	}
	// while per-minute budgets, Envoy's timeouts and the drain grace stay as they were,
	if got := *p.Features["chat"].TokensPerMinute; got != 200000 {
		t.Errorf("chat tokens_per_minute = %d, want 200000", got)
	}
	if got := p.Envoy.MessageTimeout.D(); got != 200*time.Millisecond {
		t.Errorf("envoy message_timeout = %v, want 200ms", got)
	}
	if got := p.Server.DrainGrace.D(); got != 15*time.Second {
		t.Errorf("drain_grace = %v, want 15s", got)
	}
	// and nothing turns to shadow mode.
	for _, f := range p.Compartments {
		if f.Mode != "" {
			t.Errorf("family %s has mode %q, want none", f.Name, f.Mode)
		}
	}
}

func TestDerivePolicyShadow(t *testing.T) {
	for _, path := range []string{examplePolicy, pooledPolicy} {
		t.Run(path, func(t *testing.T) {
			p := derive(t, path, Variant{Shadow: true})
			if len(p.Compartments) == 0 {
				t.Fatal("no compartment families")
			}
			for _, f := range p.Compartments {
				if f.Mode != "shadow" {
					t.Errorf("family %s: mode %q, want shadow", f.Name, f.Mode)
				}
			}
			for name, b := range p.Breakers {
				if b.State == nil || *b.State != "METRICS_ONLY" {
					t.Errorf("breaker %s: state %v, want METRICS_ONLY", name, b.State)
				}
			}
			// Limits themselves are untouched: shadow mode measures against them.
			if got := *p.Features["batch_summarize"].MaxConcurrent; got != 5 {
				t.Errorf("batch max_concurrent = %d, want 5", got)
			}
			if got := p.Features["chat"].MaxWait.D(); got != 5*time.Second {
				t.Errorf("chat max_wait = %v, want 5s (no time scale)", got)
			}
		})
	}
}

func TestDerivePolicyKeepsPools(t *testing.T) {
	p := derive(t, pooledPolicy, Variant{Shadow: true, TimeScale: 0.1})
	if len(p.Pools) != 1 || p.Pools[0].MaxConcurrent != 25 || len(p.Pools[0].Members) != 2 {
		t.Fatalf("pools = %+v, want the example's one pool of 25 with two members", p.Pools)
	}
}

func TestDerivePolicyInline(t *testing.T) {
	const src = `
envoy: {max_message_timeout: 10s}
classification:
  provider: {default: p1}
features:
  default: {max_concurrent: 1}
  chat: {max_concurrent: 2, max_wait: 2s}
templates:
  slow: {max_wait: 1m}
breakers:
  plain: {failure_rate_threshold: 50}
  derived: {base: plain, minimum_calls: 5}
  timed: {sliding_window_type: TIME_BASED, sliding_window_size: 30, slow_call_duration: 1s, wait_in_open: 5s}
providers:
  p1: {breaker: plain}
  p2: {breaker: derived}
  p3: {breaker: timed}
`
	out, err := DerivePolicy("inline", []byte(src), Variant{Shadow: true, TimeScale: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	p, err := config.Load("inline", out, []string{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		got, want any
	}{
		{"feature wait", p.Features["chat"].MaxWait.D(), 200 * time.Millisecond},
		{"template wait", p.Templates["slow"].MaxWait.D(), 6 * time.Second},
		{"default slow call written scaled", p.Breakers["plain"].SlowCallDuration.D(), 6 * time.Second},
		{"default open wait written scaled", p.Breakers["plain"].WaitInOpen.D(), 6 * time.Second},
		{"a breaker with a base inherits", p.Breakers["derived"].SlowCallDuration == nil, true},
		{"time-based window in seconds", *p.Breakers["timed"].SlidingWindowSize, 3},
		{"time-based slow call", p.Breakers["timed"].SlowCallDuration.D(), 100 * time.Millisecond},
		{"default family added for shadow", len(p.Compartments), 1},
		{"default family in shadow", p.Compartments[0].Mode, "shadow"},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s: got %v, want %v", tt.name, tt.got, tt.want)
		}
	}
}

func TestDerivePolicyRefusesNonsense(t *testing.T) {
	tests := []struct {
		name string
		src  string
		v    Variant
	}{
		{"not a mapping", "- a\n- b\n", Variant{Shadow: true}},
		{"bad duration", "features:\n  chat: {max_wait: soon}\n", Variant{TimeScale: 0.5}},
		{"compartments not a list", "compartments: {a: b}\n", Variant{Shadow: true}},
		{"negative scale", "features: {}\n", Variant{TimeScale: -1}},
		{"invalid policy", "features:\n  chat: {max_concurrent: many}\n", Variant{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := DerivePolicy("bad", []byte(tt.src), tt.v); err == nil {
				t.Fatal("no error")
			}
		})
	}
}

func TestScaleDuration(t *testing.T) {
	tests := []struct {
		d     time.Duration
		scale float64
		want  time.Duration
	}{
		{5 * time.Second, 0.1, 500 * time.Millisecond},
		{100 * time.Millisecond, 0.1, 10 * time.Millisecond},
		{100 * time.Millisecond, 0.001, time.Millisecond}, // never below a millisecond
		{0, 0.1, 0},
		{time.Second, 2, 2 * time.Second},
	}
	for _, tt := range tests {
		if got := scaleDuration(tt.d, tt.scale); got != tt.want {
			t.Errorf("scaleDuration(%v, %v) = %v, want %v", tt.d, tt.scale, got, tt.want)
		}
	}
}

func TestSelectConfigurations(t *testing.T) {
	all := StandardConfigurations("p.yaml", "pooled.yaml")
	got, err := SelectConfigurations(all, []string{ConfigPooled, ConfigBaseline})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Name != ConfigBaseline || got[1].Name != ConfigPooled {
		t.Fatalf("got %+v, want baseline then pooled (table order)", got)
	}
	if _, err := SelectConfigurations(all, []string{"policy", "nope"}); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("unknown name: err = %v", err)
	}
	for _, name := range DefaultConfigurationNames {
		if !slices.ContainsFunc(all, func(c Configuration) bool { return c.Name == name }) {
			t.Errorf("default configuration %s is not standard", name)
		}
	}
	for _, c := range all {
		if c.Shadow && c.PassThrough() {
			t.Errorf("%s: shadow without a policy", c.Name)
		}
		if (c.Name == ConfigBaseline || c.Name == ConfigNoPolicy) != c.PassThrough() {
			t.Errorf("%s: pass-through = %v", c.Name, c.PassThrough())
		}
	}
}

func TestScenarioValidate(t *testing.T) {
	if err := DefaultScenario().Validate(); err != nil {
		t.Fatalf("the default scenario: %v", err)
	}
	tests := []struct {
		name   string
		change func(*Scenario)
	}{
		{"a minute or longer", func(s *Scenario) { s.Duration = time.Minute }},
		{"no chat", func(s *Scenario) { s.Chat = nil }},
		{"empty think range", func(s *Scenario) { s.ThinkMax = s.ThinkMin }},
		{"storm after the end", func(s *Scenario) { s.StormAt = s.Duration }},
		{"worker concurrency above its documents", func(s *Scenario) { s.BatchWorkerConcurrency = s.BatchPerWorker + 1 }},
		{"no tokens", func(s *Scenario) { s.ChatTokens.Prompt = 0 }},
		{"no model", func(s *Scenario) { s.Model = "" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := DefaultScenario()
			tt.change(&s)
			if err := s.Validate(); err == nil {
				t.Fatal("no error")
			}
		})
	}
	s := DefaultScenario()
	s.Storm, s.StormAt = false, time.Hour
	if err := s.Validate(); err != nil {
		t.Fatalf("storm settings are ignored without a storm: %v", err)
	}
}

func TestOptionsValidate(t *testing.T) {
	o := Options{Scenario: DefaultScenario(), Configurations: StandardConfigurations("p", "q")[:1], TimeScale: -1, Capacity: -1}
	err := o.validate()
	if !errors.Is(err, ErrOptions) {
		t.Fatalf("err = %v, want ErrOptions", err)
	}
	for _, want := range []string{"time scale", "capacity"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}
	shadowOnly := Options{Scenario: DefaultScenario(), Configurations: []Configuration{{Name: "x", Shadow: true}}}
	if err := shadowOnly.validate(); err == nil {
		t.Error("shadow without a policy accepted")
	}
}

func TestPromptText(t *testing.T) {
	for _, tokens := range []int{1, 7, 1500, 4000} {
		s := PromptText(tokens, 3)
		if len(s) != tokens*4 {
			t.Errorf("PromptText(%d) has %d bytes, want %d", tokens, len(s), tokens*4)
		}
		for _, c := range []byte(s) {
			if c < ' ' || c > '~' {
				t.Fatalf("PromptText(%d) has byte %q", tokens, c)
			}
		}
	}
	if a, b := PromptText(100, 1), PromptText(100, 1); a != b {
		t.Error("same seed, different text")
	}
	if PromptText(100, 1) == PromptText(100, 2) {
		t.Error("different seeds, same text")
	}
	if PromptText(0, 1) != "" {
		t.Error("zero tokens gave text")
	}
}

func TestRequestBody(t *testing.T) {
	b, err := RequestBody("deepseek-chat", "user-01", Tokens{Prompt: 1500, Completion: 500}, 9)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Model     string `json:"model"`
		MaxTokens int    `json:"max_tokens"`
		User      string `json:"user"`
		Messages  []struct {
			Role, Content string
		} `json:"messages"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatalf("not JSON: %v", err)
	}
	if got.Model != "deepseek-chat" || got.MaxTokens != 500 || got.User != "user-01" || len(got.Messages) != 1 ||
		got.Messages[0].Role != "user" || len(got.Messages[0].Content) != 6000 {
		t.Fatalf("body = model %q, max_tokens %d, user %q, %d messages", got.Model, got.MaxTokens, got.User, len(got.Messages))
	}
}

func TestScenarioJSONWritesDurations(t *testing.T) {
	b, err := json.Marshal(DefaultScenario())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"duration":"30s"`, `"think_min":"7s"`, `"storm_at":"5s"`, `"batch_workers":10`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("%s lacks %s", b, want)
		}
	}
}
