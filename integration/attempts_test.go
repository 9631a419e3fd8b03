package integration_test

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
)

// attemptsStack runs the example policy with deepseek's quota followed (shadow) in front of a
// mock deepseek allowing 100 requests a minute, saying so in its rate-limit headers on every
// answer, failures included. upstreamFilter turns envoy.upstream_filter on.
func attemptsStack(t *testing.T, upstreamFilter bool) *harness.Stack {
	env := []string{"LLM_BULKHEAD_PROVIDERS__DEEPSEEK__QUOTA__MODE=shadow"}
	if upstreamFilter {
		env = append(env, "LLM_BULKHEAD_ENVOY__UPSTREAM_FILTER=true")
	}
	return start(t, harness.Options{Env: env,
		Mock: mock.Options{TimeScale: 0.001, Quotas: map[string]mock.RequestQuota{"deepseek": {Limit: 100, Window: 60000 * time.Second}}}})
}

// upstreamFilterSim is a simulator of the upstream ext_proc filter as envoy/upstream.yaml
// configures it on the provider clusters.
func upstreamFilterSim(t *testing.T, s *harness.Stack) (*envoysim.Sim, envoysim.FilterConfig) {
	t.Helper()
	cfg, err := harness.UpstreamFilter()
	if err != nil {
		t.Fatal(err)
	}
	sim, err := envoysim.New(s.App.GRPCAddr(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sim.Close() })
	return sim, cfg
}

// failingFirst is mock deepseek behind Envoy's router: attempts 1 and 2 of every request (the
// router's x-envoy-attempt-count) are told to answer 503.
func failingFirst(s *harness.Stack) envoysim.Upstream {
	return envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		if n, _ := strconv.Atoi(req.Headers.Get("x-envoy-attempt-count")); n < 3 {
			req.Headers.Set(mock.HeaderStatus, "503")
		}
		return s.Upstream.Serve(ctx, req)
	})
}

// retryingRouter is Envoy's router with envoy.yaml's retry policy (back-off shortened) and
// x-envoy-attempt-count, in front of up; onAttempt runs after each attempt.
func retryingRouter(up envoysim.Upstream, onAttempt func()) envoysim.Upstream {
	return envoysim.Retrying(up, envoysim.RetryPolicy{NumRetries: 2, RetriableStatusCodes: []int{503, 429}, OnFailure: true,
		BackOff: time.Millisecond, IncludeAttemptCount: true, OnAttempt: func(int, bool) { onAttempt() }})
}

func deepseekCalls(t *testing.T, s *harness.Stack) breaker.Counts {
	t.Helper()
	for _, b := range s.App.Engine().Breakers() {
		if b.Name == "deepseek" {
			return b.Calls
		}
	}
	t.Fatal("no deepseek breaker")
	return breaker.Counts{}
}

// chatTokensUsed is what the chat feature's tokens_per_minute budget has charged, and the
// requests its compartment admitted.
func chatTokensUsed(t *testing.T, s *harness.Stack) (used, admitted int64) {
	t.Helper()
	for _, c := range s.App.Engine().Compartments() {
		if c.Name != "feature/chat" {
			continue
		}
		for _, b := range c.Budgets {
			if b.Kind == "tokens_per_minute" {
				return b.Used, int64(c.Admitted)
			}
		}
	}
	t.Fatal("no chat tokens_per_minute budget")
	return 0, 0
}

// deepseekRemaining is the requests quota deepseek's rate-limit headers last told of.
func deepseekRemaining(t *testing.T, s *harness.Stack) int64 {
	t.Helper()
	for _, p := range s.App.Engine().ProviderQuotas() {
		if p.Provider != "deepseek" {
			continue
		}
		for _, q := range p.Quotas {
			if q.Kind == "requests" {
				return q.Remaining
			}
		}
	}
	return -1
}

// TestUpstreamFilterCountsEveryAttempt: with llm-bulkhead also in Envoy's upstream ext_proc
// position (one stream per attempt), a request whose first two attempts get 503 and whose third
// succeeds is three outcomes in deepseek's breaker — two failures and a success — while the
// chat budget charges it once, with the final response's usage, and its compartment admitted
// it once. Every attempt's rate-limit headers reach deepseek's quota as the attempt answers.
func TestUpstreamFilterCountsEveryAttempt(t *testing.T) {
	s := attemptsStack(t, true)
	up, cfg := upstreamFilterSim(t, s)
	ctx := context.Background()
	attempt := 0
	var quotaSeen []int64
	router := retryingRouter(envoysim.UpstreamFilter(up, cfg, failingFirst(s)), func() {
		attempt++
		// The attempt's stream read its headers before the router saw them.
		quotaSeen = append(quotaSeen, deepseekRemaining(t, s))
	})
	r, err := s.Sim.RoundTrip(ctx, deepseekChat(), router)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 200 || attempt != 3 {
		t.Fatalf("status %d after %d attempts, want 200 after 3", r.Status, attempt)
	}
	if c := deepseekCalls(t, s); c.Failure != 2 || c.Success != 1 {
		t.Errorf("breaker calls %+v, want 2 failures and 1 success (one per attempt)", c)
	}
	if want := []int64{99, 98, 97}; len(quotaSeen) != 3 || quotaSeen[0] != want[0] || quotaSeen[1] != want[1] || quotaSeen[2] != want[2] {
		t.Errorf("deepseek's remaining requests after each attempt %v, want %v", quotaSeen, want)
	}
	var body struct {
		Usage struct {
			Total int64 `json:"total_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(r.Body, &body); err != nil || body.Usage.Total == 0 {
		t.Fatalf("response usage: %v %s", err, r.Body)
	}
	if used, admitted := chatTokensUsed(t, s); used != body.Usage.Total || admitted != 1 {
		t.Errorf("chat budget charged %d tokens for %d admissions, want the response's %d for one", used, admitted, body.Usage.Total)
	}
	if v := metricSum(t, s, "llm_bulkhead_extproc_attempt_streams_total"); v != 3 {
		t.Errorf("%v attempt streams, want 3", v)
	}
	if v := metricSum(t, s, "llm_bulkhead_extproc_attempts_total", "result", "recorded"); v != 2 {
		t.Errorf("%v retried attempts recorded, want 2", v)
	}
}

// TestWithoutUpstreamFilterOneOutcome: the same retries with llm-bulkhead only in the
// downstream position are one outcome, the last attempt's; and with the option on but no
// upstream filter configured in Envoy, the request still counts once.
func TestWithoutUpstreamFilterOneOutcome(t *testing.T) {
	for _, on := range []bool{false, true} {
		t.Run("upstream_filter="+strconv.FormatBool(on), func(t *testing.T) {
			s := attemptsStack(t, on)
			attempts := 0
			router := retryingRouter(failingFirst(s), func() { attempts++ })
			r, err := s.Sim.RoundTrip(context.Background(), deepseekChat(), router)
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != 200 || attempts != 3 {
				t.Fatalf("status %d after %d attempts, want 200 after 3", r.Status, attempts)
			}
			if c := deepseekCalls(t, s); c.Failure != 0 || c.Success != 1 {
				t.Errorf("breaker calls %+v, want the last attempt's success only", c)
			}
		})
	}
}

// TestUpstreamFilterNeverRefuses: the upstream stream admits nothing. A request the downstream
// filter admitted goes through its attempt's stream even when its own compartments are full and
// the breaker is forced open — it was admitted once, before either — and the attempt's request
// and response pass unchanged.
func TestUpstreamFilterNeverRefuses(t *testing.T) {
	s := attemptsStack(t, true)
	up, cfg := upstreamFilterSim(t, s)
	ctx := context.Background()
	var seen *envoysim.UpstreamRequest
	forced := false
	inner := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		c := *req
		c.Headers = req.Headers.Clone()
		seen = &c
		return s.Upstream.Serve(ctx, req)
	})
	// The breaker is forced open between admission and the attempt: a second admission would be
	// refused, the attempt must not be.
	admitted := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		if err := s.App.Engine().ForceBreaker("deepseek", "FORCED_OPEN"); err != nil {
			t.Error(err)
		}
		forced = true
		return envoysim.UpstreamFilter(up, cfg, inner).Serve(ctx, req)
	})
	r, err := s.Sim.RoundTrip(ctx, deepseekChat(), admitted)
	if err != nil {
		t.Fatal(err)
	}
	if !forced || r.Status != 200 || seen == nil {
		t.Fatalf("status %d (breaker forced: %v, upstream reached: %v), want 200 through the attempt", r.Status, forced, seen != nil)
	}
	if r.Upstream.Headers.Get("x-llm-provider") != seen.Headers.Get("x-llm-provider") || len(seen.Headers) != len(r.Upstream.Headers) {
		t.Errorf("the upstream filter changed the attempt's headers:\n%v\n%v", r.Upstream.Headers, seen.Headers)
	}
	if v := metricSum(t, s, "llm_bulkhead_extproc_attempt_streams_total"); v != 1 {
		t.Errorf("%v attempt streams, want 1", v)
	}
}
