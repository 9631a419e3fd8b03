package integration_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// verdictPolicy classifies feature, tenant and provider from headers; each test fills in its
// providers and breakers.
const verdictPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  tenant:
    rules: [{header: x-tenant-id, trusted: true}]
  provider:
    rules: [{header: x-llm-provider}]
features:
  chat: {max_concurrent: 50}
  default: {max_concurrent: 10}
providers:
  default: {}
%s
breakers:
%s
`

// verdictRequest is a chat request of tenant to provider, with extra headers (the mock LLM's
// fault headers).
func verdictRequest(provider, tenant string, extra ...envoysim.Header) *envoysim.Request {
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-provider", Value: provider}, envoysim.Header{Key: "x-tenant-id", Value: tenant})
	req.Headers = append(req.Headers, extra...)
	return req
}

// failWith asks the mock LLM to answer status.
func failWith(status int) envoysim.Header {
	return envoysim.Header{Key: mock.HeaderStatus, Value: strconv.Itoa(status)}
}

// sendSettled sends req through the stack to the mock LLM and waits until the server has
// released it — its breaker has recorded the outcome — so the next request is judged after it.
func sendSettled(t *testing.T, s *harness.Stack, req *envoysim.Request) *envoysim.Result {
	t.Helper()
	r, err := s.Do(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return s.App.Engine().InFlight() == 0 })
	return r
}

// reachedProvider fails t unless the provider's own answer, status, reached the client.
func reachedProvider(t *testing.T, r *envoysim.Result, status int, what string) {
	t.Helper()
	if r.Upstream == nil || r.Status != status || header(r, "x-bulkhead-reason") != "" {
		t.Fatalf("%s: status %d, reason %q, upstream called %v; want the provider's %d", what, r.Status,
			header(r, "x-bulkhead-reason"), r.Upstream != nil, status)
	}
}

// refusedBy fails t unless llm-bulkhead refused r itself with status and reason, without
// calling the provider, and returns its retry-after in seconds.
func refusedBy(t *testing.T, r *envoysim.Result, status int, reason, what string) int {
	t.Helper()
	if r.Upstream != nil || r.Status != status || header(r, "x-bulkhead-reason") != reason {
		t.Fatalf("%s: status %d, reason %q, upstream called %v; want %d %s from llm-bulkhead (%s)", what, r.Status,
			header(r, "x-bulkhead-reason"), r.Upstream != nil, status, reason, r.Body)
	}
	ra, err := strconv.Atoi(header(r, "retry-after"))
	if err != nil {
		t.Fatalf("%s: retry-after %q", what, header(r, "retry-after"))
	}
	return ra
}

// breakerView reads breaker name from /admin/breakers.
func breakerView(t *testing.T, s *harness.Stack, name string) policy.BreakerView {
	t.Helper()
	var out struct {
		Breakers []policy.BreakerView `json:"breakers"`
	}
	if err := s.Get("/admin/breakers", &out); err != nil {
		t.Fatal(err)
	}
	for _, b := range out.Breakers {
		if b.Name == name {
			return b
		}
	}
	t.Fatalf("no breaker %s", name)
	return policy.BreakerView{}
}

// priorityPolicy: one provider slot shared by every feature; the features' priorities order
// the provider compartment's queue.
const priorityPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: shared
    rules: [{header: x-llm-provider}]
features:
  urgent: {max_concurrent: 10, max_wait: 8s, priority: 10}
  bulk: {max_concurrent: 10, max_wait: 8s, priority: 1}
  default: {max_concurrent: 10, max_wait: 8s}
providers:
  shared: {max_concurrent: 1, max_wait: 8s}
compartments:
  - {name: feature, key: [feature], limits_from: feature}
  - {name: provider, key: [provider], limits_from: provider}
`

// TestQueuePriority: with the provider's only slot held, two low-priority requests queue, then a
// high-priority one; when the slot frees, the high-priority request goes first, though it came
// last (a request's priority is the highest of its compartments' limit sets: here its
// feature's), then the low-priority ones in their order.
func TestQueuePriority(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, priorityPolicy), NoMock: true})
	g := newGate()
	order := make(chan string, 10)
	up := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		feature := ""
		for _, h := range req.Headers {
			if h.Key == "x-llm-feature" {
				feature = h.Value
			}
		}
		order <- feature
		return g.Serve(ctx, req)
	})
	next := func() string {
		t.Helper()
		select {
		case f := <-order:
			return f
		case <-time.After(30 * time.Second):
			t.Fatal("no request reached the provider within 30s")
			return ""
		}
	}
	results := make(chan *envoysim.Result, 4)
	send := func(feature string) {
		go func() {
			r, err := s.Sim.RoundTrip(context.Background(), chatRequest(feature), up)
			if err != nil {
				t.Error(err)
			}
			results <- r
		}()
	}
	send("default")
	if f := next(); f != "default" {
		t.Fatalf("%s took the slot, want default", f)
	}
	for i, f := range []string{"bulk", "bulk", "urgent"} {
		send(f)
		waitFor(t, func() bool { return compartment(t, s, "provider/shared").Queued == i+1 })
	}
	for _, want := range []string{"urgent", "bulk", "bulk"} {
		g.release <- struct{}{}
		if got := next(); got != want {
			t.Fatalf("%s was admitted next, want %s (priorities: urgent 10, bulk 1)", got, want)
		}
	}
	g.release <- struct{}{}
	for range 4 {
		if r := <-results; r == nil || r.Status != 200 {
			t.Fatalf("a request ended with %v", r)
		}
	}
}

// TestClientErrorsIgnoredByBreaker: a provider answering 404 and 400 many times over its breaker's
// window stays CLOSED, every call recorded as ignored (client errors say nothing about the
// provider); the same number of 503s opens it and the next call is refused circuit_open.
func TestClientErrorsIgnoredByBreaker(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, fmt.Sprintf(verdictPolicy,
		"  picky: {breaker: small}", "  small: {sliding_window_size: 4, minimum_calls: 4, wait_in_open: 1m}")),
		Mock: mock.Options{TimeScale: 0.001}})
	for _, status := range []int{404, 400} {
		for i := range 6 {
			r := sendSettled(t, s, verdictRequest("picky", "acme", failWith(status)))
			reachedProvider(t, r, status, fmt.Sprintf("%d #%d", status, i))
		}
	}
	b := breakerView(t, s, "picky")
	if st := b.Snapshot.State.String(); st != "CLOSED" {
		t.Fatalf("picky breaker %s after 12 client errors, want CLOSED", st)
	}
	if b.Calls.Ignored != 12 || b.Calls.Failure != 0 || b.Calls.Success != 0 {
		t.Errorf("picky breaker calls %+v, want 12 ignored", b.Calls)
	}
	for i := range 4 {
		reachedProvider(t, sendSettled(t, s, verdictRequest("picky", "acme", failWith(503))), 503, fmt.Sprintf("503 #%d", i))
	}
	if st := breakerState(t, s, "picky"); st != "OPEN" {
		t.Fatalf("picky breaker %s after 4 of 4 calls failed, want OPEN", st)
	}
	refusedBy(t, sendSettled(t, s, verdictRequest("picky", "acme")), 503, "circuit_open", "after the 503s")
}

// TestBreakerBaseInheritance: a breaker whose base chain (derived → middle → strict) gives it a
// window of 4 calls opens after 4 failures, while a breaker with the same wait_in_open and no
// base (Resilience4j's 100-call defaults) stays closed; the derived breaker's own wait_in_open
// (20s) wins over its base's (40s): the refusal's retry-after and the half-open probe say so.
func TestBreakerBaseInheritance(t *testing.T) {
	clk := newManualClock()
	s := start(t, harness.Options{Clock: clk, PolicyPath: writePolicy(t, fmt.Sprintf(verdictPolicy, `
  inherits: {breaker: derived}
  alone: {breaker: plain}`, `
  strict: {sliding_window_size: 4, minimum_calls: 4, failure_rate_threshold: 50, wait_in_open: 40s}
  middle: {base: strict, permitted_calls_in_half_open: 1}
  derived: {base: middle, wait_in_open: 20s}
  plain: {wait_in_open: 20s}`)), Mock: mock.Options{TimeScale: 0.001}})
	for _, p := range []string{"inherits", "alone"} {
		for i := range 4 {
			reachedProvider(t, sendSettled(t, s, verdictRequest(p, "acme", failWith(503))), 503, fmt.Sprintf("%s 503 #%d", p, i))
		}
	}
	b := breakerView(t, s, "inherits")
	if st := b.Snapshot.State.String(); st != "OPEN" {
		t.Fatalf("inherits breaker %s after 4 of 4 calls failed, want OPEN (window of 4 from its base)", st)
	}
	if b.Snapshot.WaitRemaining != 20*time.Second {
		t.Errorf("inherits breaker waits %v in OPEN, want its own wait_in_open 20s", b.Snapshot.WaitRemaining)
	}
	if st := breakerState(t, s, "alone"); st != "CLOSED" {
		t.Errorf("alone breaker %s after 4 failures, want CLOSED (minimum_calls 100 by default)", st)
	}
	if ra := refusedBy(t, sendSettled(t, s, verdictRequest("inherits", "acme")), 503, "circuit_open", "inherits while open"); ra != 20 {
		t.Errorf("retry-after %d, want 20 (derived's wait_in_open, not strict's 40)", ra)
	}
	reachedProvider(t, sendSettled(t, s, verdictRequest("alone", "acme")), 200, "alone")

	// OPEN lasts until strictly after its wait, as in Resilience4j.
	clk.Advance(20*time.Second + time.Millisecond)
	reachedProvider(t, sendSettled(t, s, verdictRequest("inherits", "acme")), 200, "inherits probe after 20s")
	// One probe permitted (from middle) and it succeeded: the breaker closes.
	if st := breakerState(t, s, "inherits"); st != "CLOSED" {
		t.Errorf("inherits breaker %s after its one probe succeeded, want CLOSED", st)
	}
}

// TestMetricsOnlyThenClosedOnReload: a breaker configured METRICS_ONLY records failures past its
// threshold and refuses nothing; a reload that removes the state (CLOSED by default) moves it
// to CLOSED, and the next failures open it and refuse with circuit_open.
func TestMetricsOnlyThenClosedOnReload(t *testing.T) {
	body := func(state string) string {
		return fmt.Sprintf(verdictPolicy, "  watched: {breaker: watch}",
			"  watch: {sliding_window_size: 4, minimum_calls: 4, wait_in_open: 1m"+state+"}")
	}
	path := writePolicy(t, body(", state: METRICS_ONLY"))
	s := start(t, harness.Options{PolicyPath: path, Mock: mock.Options{TimeScale: 0.001}})
	for i := range 8 {
		reachedProvider(t, sendSettled(t, s, verdictRequest("watched", "acme", failWith(503))), 503, fmt.Sprintf("METRICS_ONLY 503 #%d", i))
	}
	b := breakerView(t, s, "watched")
	if st := b.Snapshot.State.String(); st != "METRICS_ONLY" {
		t.Fatalf("watched breaker %s, want METRICS_ONLY", st)
	}
	if b.Calls.Failure != 8 || b.Calls.WouldOpen != 1 || b.Snapshot.FailureRate != 100 {
		t.Errorf("watched breaker calls %+v, failure rate %v; want 8 failures, one would-open, 100%%", b.Calls, b.Snapshot.FailureRate)
	}

	if err := os.WriteFile(path, []byte(body("")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.App.Reload("test"); err != nil {
		t.Fatal(err)
	}
	if st := breakerState(t, s, "watched"); st != "CLOSED" {
		t.Fatalf("watched breaker %s after the reload, want CLOSED", st)
	}
	failures := 0
	for {
		r := sendSettled(t, s, verdictRequest("watched", "acme", failWith(503)))
		if r.Upstream == nil {
			refusedBy(t, r, 503, "circuit_open", "after the reload")
			break
		}
		reachedProvider(t, r, 503, fmt.Sprintf("CLOSED 503 #%d", failures))
		if failures++; failures > 4 {
			t.Fatalf("%d failures after the reload reached the provider: the breaker (window 4) never opened", failures)
		}
	}
	if st := breakerState(t, s, "watched"); st != "OPEN" {
		t.Errorf("watched breaker %s, want OPEN", st)
	}
}

// TestUpstreamRetryAfter: the mock LLM answers one tenant 429 with retry-after: 30, beyond the
// breaker's cap (max_wait_in_open 12s). With the default retry_after_scope (tenant), that
// tenant is refused 429 rate_limit by llm-bulkhead for the cap, not the provider's 30s, without
// reaching the provider, while another tenant's calls go through and the breaker stays closed.
// With retry_after_scope: provider, the breaker opens for everyone, for the cap.
func TestUpstreamRetryAfter(t *testing.T) {
	const capSeconds = 12
	stack := func(t *testing.T, scope string) (*harness.Stack, *manualClock) {
		clk := newManualClock()
		s := start(t, harness.Options{Clock: clk, PolicyPath: writePolicy(t, fmt.Sprintf(verdictPolicy, "  limited: {breaker: polite}",
			"  polite: {sliding_window_size: 10, minimum_calls: 10, wait_in_open: 5s, max_wait_in_open: 12s"+scope+"}")),
			Mock: mock.Options{TimeScale: 0.001}})
		return s, clk
	}
	limited := func(t *testing.T, s *harness.Stack, tenant string, extra ...envoysim.Header) *envoysim.Result {
		t.Helper()
		return sendSettled(t, s, verdictRequest("limited", tenant, extra...))
	}
	rateLimited := []envoysim.Header{failWith(429), {Key: mock.HeaderRetryAfter, Value: "30"}}

	t.Run("tenant", func(t *testing.T) {
		s, clk := stack(t, "")
		r := limited(t, s, "acme", rateLimited...)
		reachedProvider(t, r, 429, "acme's 429")
		if ra := header(r, "retry-after"); ra != "30" {
			t.Errorf("the provider's retry-after reached the client as %q, want 30", ra)
		}
		ra := refusedBy(t, limited(t, s, "acme"), 429, "rate_limit", "acme after its 429")
		if ra < 1 || ra > capSeconds {
			t.Errorf("acme's retry-after %d, want within (0, %d]", ra, capSeconds)
		}
		reachedProvider(t, limited(t, s, "globex"), 200, "globex while acme is held back")
		if st := breakerState(t, s, "limited"); st != "CLOSED" {
			t.Errorf("limited breaker %s, want CLOSED (only acme is held)", st)
		}
		// The hold lasts the cap (12s), not the provider's 30s nor wait_in_open's 5s.
		clk.Advance((capSeconds - 1) * time.Second)
		refusedBy(t, limited(t, s, "acme"), 429, "rate_limit", "acme 1s before the cap")
		clk.Advance(time.Second)
		reachedProvider(t, limited(t, s, "acme"), 200, "acme at the cap")
	})

	t.Run("provider", func(t *testing.T) {
		s, clk := stack(t, ", retry_after_scope: provider")
		reachedProvider(t, limited(t, s, "acme", rateLimited...), 429, "acme's 429")
		if st := breakerState(t, s, "limited"); st != "OPEN" {
			t.Fatalf("limited breaker %s after a 429 with retry-after, want OPEN", st)
		}
		ra := refusedBy(t, limited(t, s, "globex"), 503, "circuit_open", "globex while the breaker is open")
		if ra < 1 || ra > capSeconds {
			t.Errorf("globex's retry-after %d, want within (0, %d]", ra, capSeconds)
		}
		clk.Advance((capSeconds - 1) * time.Second)
		refusedBy(t, limited(t, s, "globex"), 503, "circuit_open", "globex 1s before the cap")
		// OPEN lasts until strictly after its wait, as in Resilience4j.
		clk.Advance(time.Second + time.Millisecond)
		reachedProvider(t, limited(t, s, "globex"), 200, "globex at the cap")
	})
}
