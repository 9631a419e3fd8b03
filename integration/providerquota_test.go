package integration_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/quota"
)

// quotaStack runs the example policy with deepseek's quota in mode, in front of a mock deepseek
// that allows 5 requests a minute (qwen, its fallback, has no quota) and says so in its
// x-ratelimit-* headers.
func quotaStack(t *testing.T, mode string) *harness.Stack {
	// TimeScale 0.001 keeps the answers fast; the quota's window is simulated time too: 60 000 s
	// simulated is a real minute, longer than the test.
	return start(t, harness.Options{
		Env:  []string{"LLM_BULKHEAD_PROVIDERS__DEEPSEEK__QUOTA__MODE=" + mode},
		Mock: mock.Options{TimeScale: 0.001, Quotas: map[string]mock.RequestQuota{"deepseek": {Limit: 5, Window: 60000 * time.Second}}},
	})
}

// TestProviderQuotaKeepsProvider429sFromClients: deepseek says after each answer how many of
// its 5 requests are left (the first answer's headers are malformed: they change nothing and
// are counted). With enforce, a burst of 19 concurrent requests sends deepseek exactly the 3
// it has left (the requests in flight count against it) and re-routes the rest to qwen: no
// client sees a 429 and deepseek refuses nothing. In shadow mode the same traffic gets 429s,
// and the requests that reached deepseek beyond its quota were counted.
func TestProviderQuotaKeepsProvider429sFromClients(t *testing.T) {
	for _, mode := range []string{"enforce", "shadow"} {
		t.Run(mode, func(t *testing.T) {
			s := quotaStack(t, mode)
			ctx := context.Background()
			var quotas struct {
				Providers []policy.ProviderQuotaView `json:"providers"`
			}
			// A response whose rate-limit headers cannot be read changes nothing, and is counted.
			req := deepseekChat()
			req.Headers = append(req.Headers, envoysim.Header{Key: mock.HeaderRateLimitMalformed, Value: "true"})
			if r, err := s.Do(ctx, req); err != nil || r.Status != 200 {
				t.Fatalf("the request with malformed headers: %v %+v", err, r)
			}
			if v := metricSum(t, s, "llm_bulkhead_provider_quota_headers_invalid_total", "provider", "deepseek"); v != 2 {
				t.Errorf("malformed headers counted %v, want 2 (remaining and reset)", v)
			}
			if err := s.Get("/admin/quotas", &quotas); err != nil {
				t.Fatal(err)
			}
			if len(quotas.Providers) != 1 || len(quotas.Providers[0].Quotas) != 0 {
				t.Fatalf("/admin/quotas after malformed headers: %+v, want deepseek with no quota known", quotas.Providers)
			}

			first, err := s.Do(ctx, deepseekChat())
			if err != nil || first.Status != 200 || upstreamHeader(first, "x-llm-provider") != "deepseek" {
				t.Fatalf("the first request: %v %+v", err, first)
			}
			if err := s.Get("/admin/quotas", &quotas); err != nil {
				t.Fatal(err)
			}
			const left = 3
			if len(quotas.Providers) != 1 || len(quotas.Providers[0].Quotas) != 1 || quotas.Providers[0].Quotas[0].Remaining != left {
				t.Fatalf("/admin/quotas after the second answer: %+v, want deepseek with %d requests left", quotas.Providers, left)
			}

			const burst = 19
			var mu sync.Mutex
			got := map[string]int{}
			var wg sync.WaitGroup
			for range burst {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r, err := s.Do(ctx, deepseekChat())
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						t.Error(err)
						return
					}
					key := upstreamHeader(r, "x-llm-provider")
					if r.Status != 200 {
						key = "status " + strconv.Itoa(r.Status)
					}
					got[key]++
				}()
			}
			wg.Wait()
			quotaRefused := 0
			for _, rr := range s.Mock.Requests() {
				if rr.Outcome == mock.OutcomeQuota {
					quotaRefused++
				}
			}
			short := metricSum(t, s, "llm_bulkhead_provider_quota_short_total", "provider", "deepseek", "mode", mode)
			switch mode {
			case "enforce":
				if got["deepseek"] != left || got["qwen"] != burst-left || len(got) != 2 || quotaRefused != 0 {
					t.Errorf("enforce: %v, deepseek refused %d; want %d on deepseek, %d on qwen, no 429", got, quotaRefused, left, burst-left)
				}
				if v := metricSum(t, s, "llm_bulkhead_rerouted_total", "reason", "provider_quota"); v != burst-left {
					t.Errorf("re-routed for provider_quota: %v, want %d", v, burst-left)
				}
				if short != burst-left {
					t.Errorf("short counted %v, want %d", short, burst-left)
				}
			case "shadow":
				// Every request beyond the quota gets a 429: from deepseek, or from llm-bulkhead
				// holding the tenant back after deepseek's 429 said retry-after. Each one that
				// reached deepseek was counted short first.
				if got["deepseek"] != left || got["status 429"] != burst-left || quotaRefused == 0 {
					t.Errorf("shadow: %v, deepseek refused %d; want %d on deepseek and %d 429s", got, quotaRefused, left, burst-left)
				}
				if short != float64(quotaRefused) {
					t.Errorf("short counted %v, deepseek refused %d", short, quotaRefused)
				}
			}
		})
	}
}

// quotaFormatsPolicy sends every request to the provider x-llm-provider names, each following
// its quota in enforce mode, with no fallback and no breaker: a request the quota cannot cover
// is refused provider_quota.
const quotaFormatsPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
classification:
  feature:
    rules: [{header: x-llm-feature}]
  provider:
    default: openai
    rules: [{header: x-llm-provider}]
  model:
    rules: [{body: model}]
features:
  chat: {max_concurrent: 50}
  default: {max_concurrent: 10}
providers:
  openai: {quota: {mode: enforce}}
  anthropic: {quota: {mode: enforce}}
`

// TestProviderQuotaHeaderFormatsAndReset: for OpenAI's x-ratelimit-* and Anthropic's
// anthropic-ratelimit-* headers alike, the mock's quota of 10 requests and 16 tokens a window
// and the server share one stepped clock. A response whose headers are malformed changes
// nothing and is counted; the next answer (11 tokens: 3 of prompt, 8 asked for) leaves 5
// tokens, fewer than any request needs, so the next request is refused provider_quota with
// retry-after the provider's reset and never reaches the provider. Once the clock passes the
// reset instant the quota is full again: the request goes through.
func TestProviderQuotaHeaderFormatsAndReset(t *testing.T) {
	for _, api := range []string{"openai", "anthropic"} {
		t.Run(api, func(t *testing.T) {
			clk := newManualClock()
			// At time scale 0.001 the hour's window is 3.6 s of the shared clock.
			q := mock.RequestQuota{Limit: 10, Tokens: 16, Window: time.Hour}
			s := start(t, harness.Options{PolicyPath: writePolicy(t, quotaFormatsPolicy), Clock: clk,
				Mock: mock.Options{TimeScale: 0.001, QuotaClock: clk.Now, Quotas: map[string]mock.RequestQuota{api: q}}})
			ctx := context.Background()
			quotas := func() []quota.State {
				t.Helper()
				var got struct {
					Providers []policy.ProviderQuotaView `json:"providers"`
				}
				if err := s.Get("/admin/quotas", &got); err != nil {
					t.Fatal(err)
				}
				for _, p := range got.Providers {
					if p.Provider == api {
						return p.Quotas
					}
				}
				t.Fatalf("/admin/quotas has no %s: %+v", api, got.Providers)
				return nil
			}

			req := streamRequest(api, api)
			req.Headers = append(req.Headers, envoysim.Header{Key: mock.HeaderRateLimitMalformed, Value: "true"})
			if r, err := s.Do(ctx, req); err != nil || r.Status != 200 {
				t.Fatalf("the request with malformed headers: %v %+v", err, r)
			}
			// Remaining and reset of requests and of tokens: four values not believed.
			if v := metricSum(t, s, "llm_bulkhead_provider_quota_headers_invalid_total", "provider", api); v != 4 {
				t.Errorf("malformed headers counted %v, want 4", v)
			}
			if got := quotas(); len(got) != 0 {
				t.Fatalf("quotas known after malformed headers: %+v", got)
			}
			// The mock counted that request: a fresh window for the rest of the test.
			s.Mock.Reset()

			if r, err := s.Do(ctx, streamRequest(api, api)); err != nil || r.Status != 200 {
				t.Fatalf("the first request: %v %+v", err, r)
			}
			reset := clk.Now().Add(3600 * time.Millisecond)
			got := quotas()
			if len(got) != 2 || got[0].Kind != "requests" || got[0].Remaining != 9 || got[0].Limit != 10 || !got[0].Reset.Equal(reset) ||
				got[1].Kind != "tokens" || got[1].Remaining != 5 || got[1].Limit != 16 || !got[1].Reset.Equal(reset) {
				t.Fatalf("quotas after the first answer: %+v; want 9 of 10 requests and 5 of 16 tokens until %v", got, reset)
			}

			r, err := s.Do(ctx, streamRequest(api, api))
			if err != nil || r.Status != 429 || r.Headers.Get("x-bulkhead-reason") != "provider_quota" || r.Headers.Get("retry-after") != "4" {
				t.Fatalf("the request the tokens left cannot cover: %v %+v; want 429 provider_quota, retry-after 4", err, r)
			}
			if n := s.Mock.Stats().ByOutcome[mock.OutcomeQuota]; n != 0 {
				t.Fatalf("the provider refused %d requests", n)
			}

			clk.Advance(3600 * time.Millisecond)
			if r, err := s.Do(ctx, streamRequest(api, api)); err != nil || r.Status != 200 {
				t.Fatalf("after the reset: %v %+v; want the quota full again", err, r)
			}
			if got := quotas(); len(got) != 2 || got[0].Remaining != 9 || got[1].Remaining != 5 {
				t.Fatalf("quotas after the reset and one request: %+v", got)
			}
		})
	}
}

// TestProviderQuotaShadowChangesNothing: the same sequence of requests gets the same answers
// with deepseek's quota off and in shadow mode (deepseek allows 5; the sixth is its 429, whose
// retry-after then holds the tenant back); only shadow counts the request that its quota, as
// deepseek's headers told it, could not cover.
func TestProviderQuotaShadowChangesNothing(t *testing.T) {
	outcomes := map[string][]string{}
	for _, mode := range []string{"off", "shadow"} {
		s := quotaStack(t, mode)
		for range 8 {
			r, err := s.Do(context.Background(), deepseekChat())
			if err != nil {
				t.Fatal(err)
			}
			outcomes[mode] = append(outcomes[mode], fmt.Sprintf("%d %s %s", r.Status, r.Headers.Get("x-bulkhead-reason"), upstreamHeader(r, "x-llm-provider")))
		}
		short := metricSum(t, s, "llm_bulkhead_provider_quota_short_total", "provider", "deepseek")
		if refused := s.Mock.Stats().ByOutcome[mock.OutcomeQuota]; refused != 1 {
			t.Errorf("%s: deepseek refused %d requests, want 1 (the rest were held back after its 429)", mode, refused)
		}
		if want := map[string]float64{"off": 0, "shadow": 1}[mode]; short != want {
			t.Errorf("%s: short counted %v, want %v", mode, short, want)
		}
	}
	if !slices.Equal(outcomes["off"], outcomes["shadow"]) {
		t.Errorf("shadow changed the answers:\noff    %q\nshadow %q", outcomes["off"], outcomes["shadow"])
	}
}

// TestProviderQuotaPerAccount: the platform reaches deepseek with one key per team (the route
// sets x-llm-account, trusted), and the mock deepseek allows each key 3 requests a window. Team
// a uses up its key: its next request is re-routed to qwen before deepseek can refuse it, while
// team b's three requests still go to deepseek. No client sees a 429, and /admin/quotas shows
// each account.
func TestProviderQuotaPerAccount(t *testing.T) {
	s := start(t, harness.Options{
		Env: []string{
			"LLM_BULKHEAD_PROVIDERS__DEEPSEEK__QUOTA__MODE=enforce",
			"LLM_BULKHEAD_PROVIDERS__DEEPSEEK__QUOTA__ACCOUNT__HEADER=x-llm-account",
			"LLM_BULKHEAD_PROVIDERS__DEEPSEEK__QUOTA__ACCOUNT__TRUSTED=true",
		},
		Mock: mock.Options{TimeScale: 0.001, QuotaAccountHeader: "x-llm-account",
			Quotas: map[string]mock.RequestQuota{"deepseek": {Limit: 3, Window: 60000 * time.Second}}},
	})
	ctx := context.Background()
	send := func(account string) string {
		t.Helper()
		req := deepseekChat()
		req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-account", Value: account})
		r, err := s.Do(ctx, req)
		if err != nil || r.Status != 200 {
			t.Fatalf("a request of %s: %v %+v", account, err, r)
		}
		return upstreamHeader(r, "x-llm-provider")
	}
	var got []string
	for _, account := range []string{"team-a", "team-a", "team-a", "team-a", "team-b", "team-b", "team-b", "team-a"} {
		got = append(got, account+":"+send(account))
	}
	want := []string{"team-a:deepseek", "team-a:deepseek", "team-a:deepseek", "team-a:qwen", "team-b:deepseek", "team-b:deepseek", "team-b:deepseek", "team-a:qwen"}
	if !slices.Equal(got, want) {
		t.Errorf("sent to %v\nwant %v", got, want)
	}
	if n := s.Mock.Stats().ByOutcome[mock.OutcomeQuota]; n != 0 {
		t.Errorf("deepseek refused %d requests for its quota", n)
	}
	var quotas struct {
		Providers []policy.ProviderQuotaView `json:"providers"`
	}
	if err := s.Get("/admin/quotas", &quotas); err != nil {
		t.Fatal(err)
	}
	var accounts []string
	for _, p := range quotas.Providers {
		if len(p.Quotas) == 1 {
			accounts = append(accounts, fmt.Sprintf("%s/%s:%d", p.Provider, p.Account, p.Quotas[0].Remaining))
		}
	}
	if !slices.Equal(accounts, []string{"deepseek/team-a:0", "deepseek/team-b:0"}) {
		t.Errorf("/admin/quotas: %v, want deepseek's team-a and team-b with nothing left", accounts)
	}
}
