package integration_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
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
