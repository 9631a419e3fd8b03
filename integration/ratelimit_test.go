package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/envoy"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// sharedBudgetPolicy leaves llm-bulkhead's own limits out of the way: only the rate limit
// service's shared budget refuses anything in this test.
const sharedBudgetPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: true}
features:
  default: {max_concurrent: 100, tokens_per_minute: 100000000}
`

// rateLimitService is a small RateLimitService like envoyproxy/ratelimit with a fixed-window
// counter per domain and descriptor: each descriptor adds its hits_addend (or the request's, at
// least 1) to its counter, and the answer is OVER_LIMIT when a counter is then above its
// limit. The window is one minute of a clock the test holds still, so it never rolls over.
type rateLimitService struct {
	rlsv3.UnimplementedRateLimitServiceServer
	limits map[string]uint64 // descriptor key of the last entry → requests_per_unit per minute
	now    func() time.Time

	mu     sync.Mutex
	counts map[string]uint64 // window|domain|entries → hits
	calls  int
}

func (s *rateLimitService) ShouldRateLimit(_ context.Context, r *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	window := s.now().Unix() / 60
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK}
	for _, d := range r.GetDescriptors() {
		var parts []string
		last := ""
		for _, e := range d.GetEntries() {
			parts = append(parts, e.GetKey()+"="+e.GetValue())
			last = e.GetKey()
		}
		hits := uint64(max(r.GetHitsAddend(), 1))
		if d.GetHitsAddend() != nil {
			hits = d.GetHitsAddend().GetValue()
		}
		key := fmt.Sprintf("%d|%s|%s", window, r.GetDomain(), strings.Join(parts, ","))
		s.counts[key] += hits
		limit, ok := s.limits[last]
		st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
		if ok && s.counts[key] > limit {
			st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
			resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
		}
		resp.Statuses = append(resp.Statuses, st)
	}
	return resp, nil
}

// count is the current window's counter of one descriptor, given as "key=value,...".
func (s *rateLimitService) count(domain, entries string) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts[fmt.Sprintf("%d|%s|%s", s.now().Unix()/60, domain, entries)]
}

func startRateLimitService(t *testing.T, limits map[string]uint64) (*rateLimitService, string) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fixed := time.Date(2026, 1, 1, 12, 0, 30, 0, time.UTC)
	s := &rateLimitService{limits: limits, now: func() time.Time { return fixed }, counts: map[string]uint64{}}
	gs := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(gs, s)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	t.Cleanup(func() {
		gs.Stop()
		<-done
	})
	return s, lis.Addr().String()
}

// reportedTotal is the usage.total_tokens mockllm reported in a JSON chat completion.
func reportedTotal(t *testing.T, r *envoysim.Result) uint64 {
	t.Helper()
	var body struct {
		Usage *struct {
			TotalTokens uint64 `json:"total_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(r.Body, &body); err != nil || body.Usage == nil || body.Usage.TotalTokens == 0 {
		t.Fatalf("no usage in the answer (%v): %s", err, r.Body)
	}
	return body.Usage.TotalTokens
}

// TestSharedTokenBudgetAcrossTwoEnvoys runs envoy/ratelimit.yaml as written: two Envoys (each
// an llm-bulkhead, a mock LLM and the simulator with the rate limit filter before ext_proc)
// share one rate limit service. Tenant acme's requests alternate between them; each is checked
// on the request path (one hit on tenant_tokens) and charged, when its stream is done, the
// total_tokens llm-bulkhead settled from the usage the mock LLM reported. Once the shared
// counter is over the budget, the next request through either Envoy is refused 429 by the
// rate limit filter, before llm-bulkhead or the LLM sees it, and the counter holds exactly the
// reported usage plus one per request: the charge misses nothing and adds nothing. Requests go
// one at a time, so the budget is overrun by at most the one request in flight when the
// counter crossed it (docs/envoy.md).
func TestSharedTokenBudgetAcrossTwoEnvoys(t *testing.T) {
	const budget = 400
	rls, addr := startRateLimitService(t, map[string]uint64{"tenant": 1000, "tenant_tokens": budget})
	domain, rules, err := envoysim.RateLimitFromVirtualHostYAML(envoy.RateLimit)
	if err != nil {
		t.Fatal(err)
	}
	policy := writePolicy(t, sharedBudgetPolicy)
	var stacks [2]*harness.Stack
	for i := range stacks {
		stacks[i] = start(t, harness.Options{PolicyPath: policy, Mock: mock.Options{TimeScale: 0.01},
			Filter: func(f *envoysim.FilterConfig) {
				// A generous timeout: a starved machine must not turn the check into a failure,
				// which this filter (failure_mode_deny unset, Envoy's default) would let through.
				f.RateLimit = &envoysim.RateLimit{Addr: addr, Domain: domain, Rules: rules, Timeout: 10 * time.Second}
			}})
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	do := func(i int) *envoysim.Result {
		t.Helper()
		req := chatRequest("chat")
		req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "acme"})
		res, err := stacks[i].Do(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}

	var requests, reported, largest uint64
	admitted := [2]int{}
	refusedAt := -1
	for n := 0; n < 100 && refusedAt < 0; n++ {
		i := n % 2
		res := do(i)
		requests++
		switch res.Status {
		case 200:
			tokens := reportedTotal(t, res)
			reported += tokens
			largest = max(largest, tokens)
			admitted[i]++
			if c := res.RateLimitCalls; len(c) != 2 || !c[1].OnStreamDone || c[1].Err != nil {
				t.Fatalf("request %d: rate limit calls %+v, want the check and the charge", n, c)
			}
		case 429:
			refusedAt = n
		default:
			t.Fatalf("request %d through envoy %d: %d %s", n, i, res.Status, res.Body)
		}
	}
	if refusedAt < 0 {
		t.Fatalf("the budget of %d never refused anything", budget)
	}
	if admitted[0] == 0 || admitted[1] == 0 {
		t.Fatalf("admitted per envoy %v: the budget was not spent through both", admitted)
	}
	// Both Envoys now refuse, at the rate limit filter.
	for i := range stacks {
		before := len(stacks[i].Mock.Requests())
		res := do(i)
		requests++
		if res.Status != 429 || res.Local != envoysim.LocalRateLimited || res.Headers.Get("x-envoy-ratelimited") != "true" {
			t.Errorf("envoy %d after the budget: %d local %v headers %v", i, res.Status, res.Local, res.Headers)
		}
		if res.Stream != envoysim.StreamNotOpened || res.Upstream != nil || len(stacks[i].Mock.Requests()) != before {
			t.Errorf("envoy %d: a refused request reached llm-bulkhead or the LLM", i)
		}
		if len(res.RateLimitCalls) != 1 {
			t.Errorf("envoy %d: a refused request made %d rate limit calls, want the check only", i, len(res.RateLimitCalls))
		}
	}
	count := rls.count(domain, "tenant_tokens=acme")
	if want := reported + requests; count != want {
		t.Errorf("tenant_tokens counter %d, want the %d tokens the LLM reported plus %d checks", count, reported, requests)
	}
	// Without the refused checks, the counter is what the admitted requests spent. The last one
	// passed its check with the counter at most at the budget, then charged its tokens; the
	// next check found it at least at the budget.
	spent := count - (requests - uint64(admitted[0]+admitted[1]))
	if spent < budget || spent > budget+largest {
		t.Errorf("spent %d of a %d budget: outside the bound of one request in flight (%d tokens)", spent, budget, largest)
	}
	if n := rls.count(domain, "tenant=acme"); n != requests {
		t.Errorf("tenant counter %d, want %d requests", n, requests)
	}
	t.Logf("budget %d: %d requests admitted (%v per envoy), %d tokens reported, counter %d", budget,
		admitted[0]+admitted[1], admitted, reported, count)
}

// TestSharedTokenBudgetConcurrentOverrun: the same two Envoys with eight clients at once (four
// per Envoy), each sending until refused. The counter still holds exactly the reported usage
// plus one per request, and the overrun stays within docs/envoy.md's bound: the tokens of the
// requests in flight when the counter crossed the budget, at most one per client.
func TestSharedTokenBudgetConcurrentOverrun(t *testing.T) {
	const budget, clientsPerEnvoy = 1500, 4
	rls, addr := startRateLimitService(t, map[string]uint64{"tenant_tokens": budget})
	domain, rules, err := envoysim.RateLimitFromVirtualHostYAML(envoy.RateLimit)
	if err != nil {
		t.Fatal(err)
	}
	policy := writePolicy(t, sharedBudgetPolicy)
	var stacks [2]*harness.Stack
	for i := range stacks {
		stacks[i] = start(t, harness.Options{PolicyPath: policy, Mock: mock.Options{TimeScale: 0.01},
			Filter: func(f *envoysim.FilterConfig) {
				f.RateLimit = &envoysim.RateLimit{Addr: addr, Domain: domain, Rules: rules, Timeout: 10 * time.Second}
			}})
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var (
		mu                                  sync.Mutex
		requests, admitted, reported, large uint64
		failures                            []string
		wg                                  sync.WaitGroup
	)
	for c := range 2 * clientsPerEnvoy {
		wg.Add(1)
		go func(s *harness.Stack) {
			defer wg.Done()
			for range 200 {
				req := chatRequest("chat")
				req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "acme"})
				res, err := s.Do(ctx, req)
				mu.Lock()
				requests++
				switch {
				case err != nil:
					failures = append(failures, err.Error())
				case res.Status == 200:
					var body struct {
						Usage struct {
							TotalTokens uint64 `json:"total_tokens"`
						} `json:"usage"`
					}
					if json.Unmarshal(res.Body, &body) != nil || body.Usage.TotalTokens == 0 {
						failures = append(failures, "no usage: "+string(res.Body))
					}
					admitted++
					reported += body.Usage.TotalTokens
					large = max(large, body.Usage.TotalTokens)
				case res.Status == 429 && res.Local == envoysim.LocalRateLimited:
					mu.Unlock()
					return
				default:
					failures = append(failures, fmt.Sprintf("%d %s", res.Status, res.Body))
				}
				stop := len(failures) > 0
				mu.Unlock()
				if stop {
					return
				}
			}
		}(stacks[c%2])
	}
	wg.Wait()
	if len(failures) > 0 {
		t.Fatalf("unexpected answers: %v", failures)
	}
	count := rls.count(domain, "tenant_tokens=acme")
	if count != reported+requests {
		t.Errorf("tenant_tokens counter %d, want the %d tokens the LLM reported plus %d checks", count, reported, requests)
	}
	spent := reported + admitted
	if bound := budget + 2*clientsPerEnvoy*large; spent < budget || spent > bound {
		t.Errorf("spent %d of a %d budget: outside [budget, budget + %d clients × %d tokens]", spent, budget, 2*clientsPerEnvoy, large)
	}
	t.Logf("budget %d: %d of %d requests admitted, %d tokens reported, overrun %d", budget, admitted, requests, reported, int64(spent)-budget)
}
