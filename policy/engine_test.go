package policy_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/config"
	"github.com/llm-bulkhead/llm-bulkhead/policy/observe"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// clock is a manual clock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock { return &clock{now: time.Date(2026, 5, 1, 9, 0, 0, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// input is a policy.Input over plain maps.
type input struct {
	headers map[string]string
	path    string
	body    map[string]string
	md      map[string]map[string]string // namespace → dotted key → value
	attrs   map[string]string
}

func (in input) Header(name string) (string, bool) { v, ok := in.headers[name]; return v, ok }
func (in input) Path() string                      { return in.path }
func (in input) BodyField(p string) (string, bool) { v, ok := in.body[p]; return v, ok }
func (in input) Metadata(ns string, key []string) (string, bool) {
	v, ok := in.md[ns][strings.Join(key, ".")]
	return v, ok
}
func (in input) Attribute(name string) (string, bool) { v, ok := in.attrs[name]; return v, ok }

func engine(t testing.TB, yaml string) (*policy.Engine, *clock) {
	t.Helper()
	p, err := config.Load("test.yaml", []byte(yaml), nil)
	if err != nil {
		t.Fatalf("policy:\n%v", err)
	}
	c := newClock()
	// The engine records into the metrics a server has (unregistered), so that tests and
	// benchmarks go through the recording the server's admissions pay for.
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	e, err := policy.NewEngine(p, policy.Options{Clock: c, Logger: log, Recorder: observe.NewMetrics(log)})
	if err != nil {
		t.Fatal(err)
	}
	return e, c
}

const classifyPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules:
      - header: x-llm-feature
      - path_regex: ^/v1/(embeddings)$
        value: embedding
      - body: metadata.feature
        map: {summarise: batch_summarize}
  tenant:
    rules:
      - metadata: {namespace: envoy.filters.http.jwt_authn, key: payload.tenant}
      - header: x-tenant-id
        trusted: true
  tier:
    rules:
      - tenant_directory: true
  provider:
    rules:
      - header: x-llm-provider
      - model_map: true
  model:
    rules:
      - body: model
tenants:
  directory:
    - {id: acme, tier: enterprise}
    - {id: globex, tier: pro}
models:
  - {match: "deepseek-*", provider: deepseek}
  - {match: "qwen-?-*", provider: qwen}
  - {match: "*", provider: local}
features:
  default: {max_concurrent: 10}
  chat: {max_concurrent: 20}
  embedding: {max_concurrent: 10}
  batch_summarize: {max_concurrent: 5}
tiers:
  enterprise: {max_concurrent: 30}
  pro: {max_concurrent: 15}
  free: {max_concurrent: 5}
providers:
  deepseek: {max_concurrent: 30}
  qwen: {max_concurrent: 15}
  local: {max_concurrent: 10}
classification_defaults_unused: null
`

func TestClassify(t *testing.T) {
	e, _ := engine(t, strings.Replace(classifyPolicy, "classification_defaults_unused: null\n", `
  default: {}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
  - {name: provider, key: [provider], limits_from: provider}
`, 1))
	s := e.Snapshot()
	tests := []struct {
		name string
		in   input
		want policy.Names
	}{
		{
			name: "defaults",
			in:   input{path: "/v1/chat/completions"},
			want: policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "local", Model: "unknown"},
		},
		{
			name: "header feature, normalised",
			in:   input{path: "/v1/chat/completions", headers: map[string]string{"x-llm-feature": "  Chat "}},
			want: policy.Names{Feature: "chat", Tenant: "anonymous", Tier: "free", Provider: "local", Model: "unknown"},
		},
		{
			name: "unknown feature header falls through to the next rule",
			in:   input{path: "/v1/embeddings", headers: map[string]string{"x-llm-feature": "export-everything"}},
			want: policy.Names{Feature: "embedding", Tenant: "anonymous", Tier: "free", Provider: "local", Model: "unknown"},
		},
		{
			name: "body field with a map",
			in:   input{path: "/v1/chat/completions", body: map[string]string{"metadata.feature": "summarise", "model": "DeepSeek-Chat"}},
			want: policy.Names{Feature: "batch_summarize", Tenant: "anonymous", Tier: "free", Provider: "deepseek", Model: "deepseek-chat"},
		},
		{
			name: "trusted metadata tenant wins over the header; tier from the directory",
			in: input{path: "/v1/chat/completions", headers: map[string]string{"x-tenant-id": "globex"},
				md: map[string]map[string]string{"envoy.filters.http.jwt_authn": {"payload.tenant": "acme"}}},
			want: policy.Names{Feature: "default", Tenant: "acme", Tier: "enterprise", Provider: "local", Model: "unknown"},
		},
		{
			name: "a free tenant claiming enterprise in a header stays free",
			in:   input{path: "/v1/chat/completions", headers: map[string]string{"x-tenant-id": "initech", "x-tenant-tier": "enterprise"}},
			want: policy.Names{Feature: "default", Tenant: "initech", Tier: "free", Provider: "local", Model: "unknown"},
		},
		{
			name: "provider header beats the model map",
			in:   input{path: "/v1/chat/completions", headers: map[string]string{"x-llm-provider": "qwen"}, body: map[string]string{"model": "deepseek-chat"}},
			want: policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "qwen", Model: "deepseek-chat"},
		},
		{
			name: "model glob with ?",
			in:   input{path: "/v1/chat/completions", body: map[string]string{"model": "qwen-2-72b"}},
			want: policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "qwen", Model: "qwen-2-72b"},
		},
		{
			name: "unknown provider header falls to the model map",
			in:   input{path: "/v1/chat/completions", headers: map[string]string{"x-llm-provider": "openai"}, body: map[string]string{"model": "gpt-4o"}},
			want: policy.Names{Feature: "default", Tenant: "anonymous", Tier: "free", Provider: "local", Model: "gpt-4o"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := s.Names(s.Classify(tt.in)); got != tt.want {
				t.Errorf("Classify = %+v\nwant        %+v", got, tt.want)
			}
		})
	}
}

func TestEstimate(t *testing.T) {
	e, _ := engine(t, `
estimation: {bytes_per_token: 4, default_max_tokens: 500, image_tokens: 700, max_tokens: 100000}
models:
  - {match: "long-*", default_max_tokens: 4000, bytes_per_token: 2, context_tokens: 8000}
features:
  default: {max_concurrent: 1}
`)
	s := e.Snapshot()
	// MaxPrompt is body bytes + 4 × media estimates + 1024 unless files are referenced, at most
	// the context (here max_tokens, 100000) per prompt; MaxCompletion is max_tokens, at most the
	// context, per choice.
	tests := []struct {
		name  string
		model string
		size  policy.RequestSize
		want  policy.Estimate
	}{
		{"no body: default output only", "x", policy.RequestSize{N: 1},
			policy.Estimate{Prompt: 0, Output: 500, Total: 500, BytesPerToken: 4, MaxPrompt: 100000, MaxCompletion: 100000, Bounded: true}},
		{"bytes / 4 + max_tokens", "x", policy.RequestSize{Scanned: true, BodyBytes: 4100, PromptBytes: 4001, MaxTokens: 100, HasMaxTokens: true, N: 1},
			policy.Estimate{Prompt: 1001, Output: 100, Total: 1101, BytesPerToken: 4, MaxPrompt: 5124, MaxCompletion: 100, Bounded: true}},
		{"n choices multiply output", "x", policy.RequestSize{Scanned: true, BodyBytes: 500, PromptBytes: 400, MaxTokens: 100, HasMaxTokens: true, N: 3},
			policy.Estimate{Prompt: 100, Output: 300, Total: 400, BytesPerToken: 4, MaxPrompt: 1524, MaxCompletion: 300, Bounded: true}},
		{"images cost per item", "x", policy.RequestSize{Scanned: true, BodyBytes: 200, PromptBytes: 40, Images: 2, N: 1},
			policy.Estimate{Prompt: 1410, Media: 1400, Output: 500, Total: 1910, BytesPerToken: 4, MaxPrompt: 6824, MaxCompletion: 100000, Bounded: true}},
		{"per-model ratio, default and context", "long-ctx", policy.RequestSize{Scanned: true, BodyBytes: 500, PromptBytes: 400, N: 1},
			policy.Estimate{Prompt: 200, Output: 4000, Total: 4200, BytesPerToken: 2, MaxPrompt: 1524, MaxCompletion: 8000, Bounded: true}},
		{"referenced files: the prompt is bounded by the context only", "x", policy.RequestSize{Scanned: true, BodyBytes: 300, PromptBytes: 40, Files: 1, N: 1},
			policy.Estimate{Prompt: 2010, Media: 2000, Output: 500, Total: 2510, BytesPerToken: 4, MaxPrompt: 100000, MaxCompletion: 100000, Bounded: true}},
		{"embeddings generate nothing", "x", policy.RequestSize{Scanned: true, BodyBytes: 500, PromptBytes: 400, N: 1, NoOutput: true},
			policy.Estimate{Prompt: 100, Output: 0, Total: 100, BytesPerToken: 4, MaxPrompt: 1524, MaxCompletion: 0, Bounded: true}},
		{"a batch: every choice may use max_tokens", "x", policy.RequestSize{Scanned: true, BodyBytes: 120, PromptBytes: 42, MaxTokens: 25, HasMaxTokens: true, N: 4, Prompts: 2},
			policy.Estimate{Prompt: 11, Output: 100, Total: 111, BytesPerToken: 4, MaxPrompt: 1144, MaxCompletion: 100, Bounded: true}},
		{"without max_tokens each choice is bounded by the context", "long-ctx", policy.RequestSize{Scanned: true, BodyBytes: 300, PromptBytes: 40, N: 3},
			policy.Estimate{Prompt: 20, Output: 12000, Total: 12020, BytesPerToken: 2, MaxPrompt: 1324, MaxCompletion: 24000, Bounded: true}},
		{"each prompt of a batch has its own context", "long-ctx", policy.RequestSize{Scanned: true, BodyBytes: 300, PromptBytes: 40, Files: 1, MaxTokens: 9000, HasMaxTokens: true, N: 3, Prompts: 3},
			policy.Estimate{Prompt: 2020, Media: 2000, Output: 27000, Total: 29020, BytesPerToken: 2, MaxPrompt: 24000, MaxCompletion: 24000, Bounded: true}},
		{"absurd choices are capped at 2^20", "x", policy.RequestSize{Scanned: true, PromptBytes: 4, MaxTokens: 1 << 30, HasMaxTokens: true, N: 1 << 62},
			policy.Estimate{Prompt: 1, Output: 100000 << 20, Total: 100000, BytesPerToken: 4, MaxPrompt: 100000, MaxCompletion: 100000 << 20, Bounded: true}},
		{"absurd max_tokens is capped", "x", policy.RequestSize{Scanned: true, PromptBytes: 4, MaxTokens: 1 << 50, HasMaxTokens: true, N: 1},
			policy.Estimate{Prompt: 1, Output: 100000, Total: 100000, BytesPerToken: 4, MaxPrompt: 100000, MaxCompletion: 100000, Bounded: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := s.Estimate(tt.model, tt.size); got != tt.want {
				t.Errorf("Estimate = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestEstimateLearnsModelRatio(t *testing.T) {
	e, _ := engine(t, `
estimation: {bytes_per_token: 4, learn_weight: 0.5}
features:
  default: {max_concurrent: 10}
`)
	s := e.Snapshot()
	size := policy.RequestSize{Scanned: true, PromptBytes: 3000, MaxTokens: 10, HasMaxTokens: true, N: 1}
	for i := 0; i < 20; i++ {
		var tk policy.Ticket
		est := s.Estimate("m", size)
		dims := s.Classify(input{})
		dims.Model = "m"
		d := e.Admit(context.Background(), s, &policy.Request{Dims: dims, Estimate: est, PromptBytes: 3000}, &tk, nil)
		if d.Verdict != policy.Admit {
			t.Fatal(d.Err())
		}
		// The model really uses 2 bytes per token.
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 1500, Completion: 10, Total: 1510, Known: true, PromptKnown: true}})
	}
	got := s.Estimate("m", size)
	if got.Prompt < 1450 || got.Prompt > 1550 {
		t.Errorf("after learning, prompt estimate = %d, want about 1500 (2 bytes per token)", got.Prompt)
	}
	if other := s.Estimate("other", size); other.Prompt != 750 {
		t.Errorf("another model's estimate changed: %d", other.Prompt)
	}
}

func admit(t testing.TB, e *policy.Engine, in input, tokens int64) (policy.Decision, *policy.Ticket) {
	t.Helper()
	s := e.Snapshot()
	tk := &policy.Ticket{}
	r := policy.Request{Dims: s.Classify(in), Estimate: policy.Estimate{Prompt: tokens / 2, Output: tokens - tokens/2, Total: tokens, BytesPerToken: 4}}
	return e.Admit(context.Background(), s, &r, tk, nil), tk
}

func feature(f string) input { return input{headers: map[string]string{"x-llm-feature": f}} }

const seedPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  tier:
    rules: [{tenant_directory: true}]
tenants:
  directory:
    - {id: acme, tier: enterprise}
features:
  chat: {max_concurrent: 20, ratio: 0.4}
  batch_summarize: {max_concurrent: 5, ratio: 0.15, tokens_per_minute: 50000}
  default: {max_concurrent: 10, ratio: 0.15}
tiers:
  enterprise: {max_concurrent: 30, tokens_per_minute: 500000}
  free: {max_concurrent: 5, tokens_per_minute: 20000}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: tier_feature, key: [tier, feature], limits_from: tier, scale_by: feature}
  - {name: tenant, key: [tenant], limits_from: tenant}
`

func TestAdmitAcrossFamilies(t *testing.T) {
	e, _ := engine(t, seedPolicy)
	// tier × feature: free chat = max(1, 5 × 0.4) = 2.
	free := input{headers: map[string]string{"x-llm-feature": "chat", "x-tenant-id": "initech"}}
	var tickets []*policy.Ticket
	for i := 0; i < 2; i++ {
		d, tk := admit(t, e, free, 100)
		if d.Verdict != policy.Admit {
			t.Fatalf("free chat %d refused: %v", i+1, d.Err())
		}
		tickets = append(tickets, tk)
	}
	d, _ := admit(t, e, free, 100)
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonBulkheadFull || d.Compartment != "tier_feature/free/chat" {
		t.Fatalf("third free chat: %+v", d)
	}
	if !errors.Is(d.Err(), policy.ErrBulkheadFull) {
		t.Errorf("Err() = %v", d.Err())
	}
	// An enterprise tenant is in its own compartments.
	if d, _ := admit(t, e, input{headers: map[string]string{"x-llm-feature": "chat", "x-tenant-id": "acme"}}, 100); d.Verdict != policy.Admit {
		t.Fatalf("enterprise chat refused: %+v", d)
	}
	if got := tickets[0].Compartments(); strings.Join(got, ",") != "feature/chat,tier_feature/free/chat,tenant/initech" {
		t.Errorf("compartments = %v", got)
	}
	if got := tickets[0].JoinCompartments(); got != "feature/chat,tier_feature/free/chat,tenant/initech" {
		t.Errorf("joined compartments = %q", got)
	}
	for _, tk := range tickets {
		tk.Done(policy.Outcome{Status: 200})
		tk.Done(policy.Outcome{Status: 200}) // idempotent
	}
	if e.InFlight() != 1 {
		t.Errorf("in flight = %d, want 1", e.InFlight())
	}
}

func TestTokenBudgetRetryAfterAndSettlement(t *testing.T) {
	e, clk := engine(t, seedPolicy)
	batch := input{headers: map[string]string{"x-llm-feature": "batch_summarize", "x-tenant-id": "acme"}}
	// 50 000 TPM admits ten 5 000-token requests...
	for i := 0; i < 10; i++ {
		d, tk := admit(t, e, batch, 5000)
		if d.Verdict != policy.Admit {
			t.Fatalf("request %d refused: %+v", i+1, d)
		}
		// (finish each at once so concurrency is not what refuses)
		tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 2500, Completion: 2500, Total: 5000, Known: true, PromptKnown: true}})
		clk.Advance(time.Second)
	}
	// ...then refuses with the real time until enough budget ages out.
	d, _ := admit(t, e, batch, 5000)
	if d.Reason != policy.ReasonTokenBudget || d.Compartment != "feature/batch_summarize" || d.RetryAfter != 50*time.Second {
		t.Fatalf("11th: %+v, want token_budget on feature/batch_summarize, retry after 50s", d)
	}
	// An over-estimate is refunded: settle one at 1 000 actual tokens... (new request)
	clk.Advance(60 * time.Second)
	d, tk := admit(t, e, batch, 5000)
	if d.Verdict != policy.Admit {
		t.Fatalf("after the window: %+v", d)
	}
	tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 500, Completion: 500, Total: 1000, Known: true, PromptKnown: true}})
	for _, c := range e.Compartments() {
		if c.Name == "feature/batch_summarize" {
			if b := c.Budgets[0]; b.Used != 1000 {
				t.Errorf("after settlement used = %d, want 1000 (the real use)", b.Used)
			}
		}
	}
}

func TestRefusedLaterStepHoldsNothing(t *testing.T) {
	e, _ := engine(t, `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 1, tokens_per_minute: 100000, requests_per_minute: 100}
`)
	_, first := admit(t, e, input{}, 1000)
	d, _ := admit(t, e, input{}, 1000)
	if d.Reason != policy.ReasonBulkheadFull {
		t.Fatalf("second: %+v", d)
	}
	for _, c := range e.Compartments() {
		for _, b := range c.Budgets {
			want := int64(1000)
			if b.Kind == "requests_per_minute" {
				want = 1
			}
			if b.Used != want {
				t.Errorf("%s used %d after a refusal at the concurrency step, want %d (reservation returned)", b.Kind, b.Used, want)
			}
		}
	}
	first.Done(policy.Outcome{Status: 200})
}

func TestRateLimit(t *testing.T) {
	e, clk := engine(t, `
features:
  default: {requests_per_minute: 3}
`)
	for i := 0; i < 3; i++ {
		d, tk := admit(t, e, input{}, 10)
		if d.Verdict != policy.Admit {
			t.Fatalf("%d: %+v", i, d)
		}
		tk.Done(policy.Outcome{Status: 200})
		clk.Advance(10 * time.Second)
	}
	d, _ := admit(t, e, input{}, 10)
	if d.Reason != policy.ReasonRateLimit || d.RetryAfter != 30*time.Second || d.RetryAfterSeconds() != 30 {
		t.Fatalf("fourth: %+v", d)
	}
	if !strings.Contains(d.Message(), "Retry after 30 seconds") {
		t.Errorf("message = %q", d.Message())
	}
}

func TestShadowBudgetCountsButAdmits(t *testing.T) {
	e, _ := engine(t, `
features:
  default: {tokens_per_minute: 1000, mode: shadow, max_concurrent: 1}
`)
	for i := 0; i < 3; i++ {
		if d, _ := admit(t, e, input{}, 800); d.Verdict != policy.Admit {
			t.Fatalf("shadow refused: %+v", d)
		}
	}
	c := e.Compartments()[0]
	if c.InFlight != 3 || c.ShadowRefusals != 2 {
		t.Errorf("compartment = %+v, want 3 in flight, 2 shadow refusals (concurrency)", c)
	}
}

const breakerPolicy = `
envoy: {max_message_timeout: 10s}
classification:
  provider:
    rules: [{header: x-llm-provider}]
features:
  default: {max_concurrent: 100}
providers:
  deepseek: {breaker: std, fallback: qwen}
  qwen: {breaker: std}
  default: {}
breakers:
  std:
    sliding_window_size: 4
    minimum_calls: 4
    failure_rate_threshold: 50
    wait_in_open: 10s
    permitted_calls_in_half_open: 2
`

func TestBreakerOpensAndFallsBack(t *testing.T) {
	e, clk := engine(t, breakerPolicy)
	ds := input{headers: map[string]string{"x-llm-provider": "deepseek"}}
	for i := 0; i < 4; i++ {
		d, tk := admit(t, e, ds, 10)
		if d.Verdict != policy.Admit || d.Rerouted {
			t.Fatalf("%d: %+v", i, d)
		}
		tk.Done(policy.Outcome{Status: 503, TTFB: time.Millisecond})
	}
	// deepseek is open: the request moves to qwen.
	d, tk := admit(t, e, ds, 10)
	if d.Verdict != policy.Admit || !d.Rerouted || e.Snapshot().ProviderName(d.Dims.Provider) != "qwen" || d.Reason != policy.ReasonCircuitOpen {
		t.Fatalf("with deepseek open: %+v", d)
	}
	tk.Done(policy.Outcome{Status: 200, TTFB: time.Millisecond})
	// Without a fallback, an open breaker refuses with the remaining open time.
	for i := 0; i < 4; i++ {
		_, tk := admit(t, e, input{headers: map[string]string{"x-llm-provider": "qwen"}}, 10)
		tk.Done(policy.Outcome{Status: 0}) // no response headers: a failure
	}
	clk.Advance(3 * time.Second)
	d, _ = admit(t, e, ds, 10)
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonCircuitOpen || d.RetryAfter != 7*time.Second {
		t.Fatalf("deepseek and qwen open: %+v, want circuit_open with 7s left", d)
	}
	// After the wait, probes go to deepseek again and close it.
	clk.Advance(8 * time.Second)
	for i := 0; i < 2; i++ {
		d, tk := admit(t, e, ds, 10)
		if d.Verdict != policy.Admit || d.Rerouted {
			t.Fatalf("probe %d: %+v", i, d)
		}
		tk.Done(policy.Outcome{Status: 200, TTFB: time.Millisecond})
	}
	for _, b := range e.Breakers() {
		if b.Name == "deepseek" && b.Snapshot.State.String() != "CLOSED" {
			t.Errorf("deepseek = %s after good probes", b.Snapshot.State)
		}
	}
}

func TestClientCancelDoesNotCountAgainstBreaker(t *testing.T) {
	e, _ := engine(t, breakerPolicy)
	ds := input{headers: map[string]string{"x-llm-provider": "deepseek"}}
	for i := 0; i < 10; i++ {
		_, tk := admit(t, e, ds, 10)
		tk.Done(policy.Outcome{Status: 200, Cancelled: true, TTFB: time.Millisecond})
	}
	if d, _ := admit(t, e, ds, 10); d.Rerouted {
		t.Fatalf("cancelled calls opened the breaker: %+v", d)
	}
}

func TestDegradeReroutesOnBudget(t *testing.T) {
	in := input{headers: map[string]string{"x-llm-feature": "batch_summarize", "x-llm-provider": "deepseek"}}
	e2, _ := engine(t, `
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    rules: [{header: x-llm-provider}]
features:
  default: {}
  batch_summarize:
    degrade: {provider: local}
providers:
  deepseek: {tokens_per_minute: 10000}
  local: {}
  default: {}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`)
	d, _ := admit(t, e2, in, 8000)
	if d.Verdict != policy.Admit || d.Rerouted {
		t.Fatalf("first: %+v", d)
	}
	d, _ = admit(t, e2, in, 8000)
	if d.Verdict != policy.Admit || !d.Rerouted || e2.Snapshot().ProviderName(d.Dims.Provider) != "local" || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("over budget: %+v, want re-routed to local", d)
	}
	// A feature without degrade is refused.
	d, _ = admit(t, e2, input{headers: map[string]string{"x-llm-provider": "deepseek"}}, 8000)
	if d.Verdict != policy.Reject || d.Reason != policy.ReasonTokenBudget {
		t.Fatalf("default feature: %+v", d)
	}
}

func TestReloadKeepsState(t *testing.T) {
	e, _ := engine(t, `
features:
  default: {max_concurrent: 4, tokens_per_minute: 10000}
  chat: {max_concurrent: 2}
classification:
  feature:
    rules: [{header: x-llm-feature}]
`)
	_, a := admit(t, e, input{}, 3000)
	_, b := admit(t, e, input{}, 3000)
	_, c := admit(t, e, feature("chat"), 10)
	// Reload: default lowered to 1, chat removed.
	p, err := config.Load("v2.yaml", []byte(`
features:
  default: {max_concurrent: 1, tokens_per_minute: 10000}
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	diff, err := e.Apply(p)
	if err != nil {
		t.Fatal(err)
	}
	if diff.String() != "added: none; removed: feature/chat; changed: feature/default" {
		t.Errorf("diff = %s", diff)
	}
	views := e.Compartments()
	if len(views) != 1 || views[0].InFlight != 2 || views[0].Budgets[0].Used != 6000 {
		t.Fatalf("after reload: %+v", views)
	}
	// Lowered below use: nothing new.
	if d, _ := admit(t, e, input{}, 10); d.Verdict == policy.Admit {
		t.Fatal("admitted above the lowered limit")
	}
	a.Done(policy.Outcome{Status: 200})
	b.Done(policy.Outcome{Status: 200})
	c.Done(policy.Outcome{Status: 200}) // the removed compartment drains
	if e.InFlight() != 0 || e.Compartments()[0].InFlight != 0 {
		t.Fatalf("in flight after drain: %d", e.InFlight())
	}
	if d, _ := admit(t, e, input{}, 10); d.Verdict != policy.Admit {
		t.Fatalf("refused after drain: %+v", d)
	}
}

func TestSettle(t *testing.T) {
	tk := &policy.Ticket{}
	e, _ := engine(t, "allow_empty: true\nfeatures: {default: {}}\n")
	s := e.Snapshot()
	r := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Prompt: 1000, Output: 500, Total: 1500, BytesPerToken: 4}}
	if d := e.Admit(context.Background(), s, &r, tk, nil); d.Verdict != policy.Admit {
		t.Fatal(d)
	}
	tests := []struct {
		name string
		o    policy.Outcome
		want policy.Settled
	}{
		{"reported usage", policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 900, Completion: 300, Total: 1200, Known: true}}, policy.Settled{Prompt: 900, Completion: 300, Total: 1200}},
		{"cancelled mid-stream: prompt estimate + content seen", policy.Outcome{Status: 200, Cancelled: true, Usage: policy.Usage{ContentBytes: 400}}, policy.Settled{Prompt: 1000, Completion: 100, Total: 1100, Estimated: true}},
		{"cancelled mid-stream with the prompt reported", policy.Outcome{Status: 200, Cancelled: true, Usage: policy.Usage{Prompt: 800, PromptKnown: true, ContentBytes: 40}}, policy.Settled{Prompt: 800, Completion: 10, Total: 810, Estimated: true}},
		{"cancelled before any response", policy.Outcome{Cancelled: true}, policy.Settled{Prompt: 1000, Total: 1000, Estimated: true}},
		{"upstream failure", policy.Outcome{Status: 503}, policy.Settled{Estimated: true}},
		{"no response headers", policy.Outcome{}, policy.Settled{Estimated: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tk.Settle(tt.o); got != tt.want {
				t.Errorf("Settle = %+v, want %+v", got, tt.want)
			}
		})
	}
	tk.Done(policy.Outcome{Status: 200})
}

func TestQueuedRequestCancelled(t *testing.T) {
	e, _ := engine(t, `
envoy: {max_message_timeout: 10s}
features:
  default: {max_concurrent: 1, max_wait: 5s}
`)
	_, first := admit(t, e, input{}, 10)
	s := e.Snapshot()
	ctx, cancel := context.WithCancel(context.Background())
	queued := make(chan time.Duration, 1)
	done := make(chan policy.Decision)
	go func() {
		tk := &policy.Ticket{}
		r := policy.Request{Dims: s.Classify(input{}), Estimate: policy.Estimate{Total: 10}}
		done <- e.Admit(ctx, s, &r, tk, func(d time.Duration) { queued <- d })
	}()
	if d := <-queued; d != 5*time.Second {
		t.Errorf("onQueue(%s), want 5s", d)
	}
	cancel()
	if d := <-done; d.Reason != policy.ReasonCancelled {
		t.Fatalf("decision = %+v", d)
	}
	if c := e.Compartments()[0]; c.Queued != 0 || c.InFlight != 1 {
		t.Errorf("after cancel: %+v", c)
	}
	first.Done(policy.Outcome{Status: 200})
}

// BenchmarkAdmitDone measures the admission fast path: classify, estimate, admit across the
// example policy's families, and release.
func BenchmarkAdmitDone(b *testing.B) {
	e, _ := engine(b, seedPolicy)
	s := e.Snapshot()
	in := &input{headers: map[string]string{"x-llm-feature": "chat", "x-tenant-id": "acme"}}
	size := policy.RequestSize{Scanned: true, PromptBytes: 4000, MaxTokens: 500, HasMaxTokens: true, N: 1}
	tk := &policy.Ticket{}
	ctx := context.Background()
	// Settling to zero refunds every reservation, so the budgets never run out on a frozen clock.
	o := policy.Outcome{Status: 200, Usage: policy.Usage{Known: true, PromptKnown: true}}
	b.ReportAllocs()
	for b.Loop() {
		d := s.Classify(in)
		r := policy.Request{Dims: d, Estimate: s.Estimate(d.Model, size), PromptBytes: 4000}
		if dec := e.Admit(ctx, s, &r, tk, nil); dec.Verdict != policy.Admit {
			b.Fatal(dec.Err())
		}
		tk.Done(o)
	}
}

func TestTenantCompartmentsBoundedAndEvicted(t *testing.T) {
	e, clk := engine(t, `
classification:
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
tiers:
  free: {max_concurrent: 1}
compartments:
  - {name: tenant, key: [tenant], limits_from: tenant, max_instances: 2, idle_ttl: 1m}
`)
	tenant := func(id string) input { return input{headers: map[string]string{"x-tenant-id": id}} }
	names := func() []string {
		var out []string
		for _, c := range e.Compartments() {
			out = append(out, c.Name)
		}
		return out
	}
	// a and b hold their slots; c finds the store full with nothing idle: it shares the overflow.
	_, a := admit(t, e, tenant("a"), 1)
	_, b := admit(t, e, tenant("b"), 1)
	d, c := admit(t, e, tenant("c"), 1)
	if d.Verdict != policy.Admit || c.Compartments()[0] != "tenant/_overflow" {
		t.Fatalf("c: %+v in %v", d, c.Compartments())
	}
	// a finishes; d evicts the least recently used idle instance (a).
	a.Done(policy.Outcome{Status: 200})
	clk.Advance(time.Second)
	if _, dd := admit(t, e, tenant("d"), 1); dd.Compartments()[0] != "tenant/d" {
		t.Fatalf("d in %v", dd.Compartments())
	}
	if got := strings.Join(names(), ","); got != "tenant/_overflow,tenant/b,tenant/d" {
		t.Errorf("compartments %s", got)
	}
	b.Done(policy.Outcome{Status: 200})
	c.Done(policy.Outcome{Status: 200})
	// Idle for the TTL: swept when the next tenant arrives.
	clk.Advance(2 * time.Minute)
	admit(t, e, tenant("e"), 1)
	if got := strings.Join(names(), ","); got != "tenant/_overflow,tenant/d,tenant/e" {
		t.Errorf("after the TTL: %s (b idle for 2m should be gone; d still holds a slot)", got)
	}
}

func TestSettlementAfterReload(t *testing.T) {
	e, clk := engine(t, "features: {default: {tokens_per_minute: 10000}}\n")
	_, tk := admit(t, e, input{}, 6000)
	// The budget is lowered while the request runs; it settles against the carried-over window.
	p, err := config.Load("v2.yaml", []byte("features: {default: {tokens_per_minute: 5000}}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.Apply(p); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	tk.Done(policy.Outcome{Status: 200, Usage: policy.Usage{Prompt: 1000, Completion: 1000, Total: 2000, Known: true, PromptKnown: true}})
	b := e.Compartments()[0].Budgets[0]
	if b.Capacity != 5000 || b.Used != 2000 || b.Remaining != 3000 {
		t.Fatalf("after settling across a reload: %+v", b)
	}
}

// TestWhereFilterOnDimensionOutsideKey is the regression test for instances of a family keyed
// by feature and filtered by provider being dropped when the first provider was not allowed.
func TestWhereFilterOnDimensionOutsideKey(t *testing.T) {
	e, _ := engine(t, `
classification:
  provider:
    rules: [{header: x-llm-provider}]
features: {default: {}}
providers: {aaa: {}, zzz: {}, default: {}}
compartments:
  - name: paid
    key: [feature]
    where: {provider: [zzz]}
    limits: {tokens_per_minute: 1000}
`)
	d, tk := admit(t, e, input{headers: map[string]string{"x-llm-provider": "zzz"}}, 10)
	if d.Verdict != policy.Admit || strings.Join(tk.Compartments(), ",") != "paid/default" {
		t.Fatalf("zzz: %+v in %v", d, tk.Compartments())
	}
	_, tk = admit(t, e, input{headers: map[string]string{"x-llm-provider": "aaa"}}, 10)
	if len(tk.Compartments()) != 0 {
		t.Errorf("aaa is not filtered out: %v", tk.Compartments())
	}
}

func TestClassifyFromAttributesAndMetadataNumbers(t *testing.T) {
	e, _ := engine(t, `
allow_empty: true
classification:
  feature:
    rules:
      - attribute: xds.route_name
        map: {chat-route: chat}
  tenant:
    rules:
      - metadata: {namespace: auth, key: claims.org}
features: {default: {}, chat: {}}
`)
	s := e.Snapshot()
	n := s.Names(s.Classify(input{attrs: map[string]string{"xds.route_name": "chat-route"}, md: map[string]map[string]string{"auth": {"claims.org": "org-42"}}}))
	if n.Feature != "chat" || n.Tenant != "org-42" {
		t.Errorf("names %+v", n)
	}
	// An unmapped attribute value is not a feature: the default applies.
	if n := s.Names(s.Classify(input{attrs: map[string]string{"xds.route_name": "other-route"}})); n.Feature != "default" {
		t.Errorf("unmapped attribute gave feature %q", n.Feature)
	}
}
