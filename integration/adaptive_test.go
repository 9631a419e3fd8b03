package integration_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// adaptivePolicy has one provider whose limit is learned, starting at initial, between 1 and
// 16; requests wait for a slot up to 5s.
func adaptivePolicy(initial int) string {
	return fmt.Sprintf(`
envoy: {max_message_timeout: 10s}
classification:
  provider: {default: openai}
providers:
  openai:
    max_concurrent: adaptive
    max_wait: 5s
    adaptive: {min: 1, max: 16, initial: %d, interval: 200ms}
compartments:
  - {name: provider, key: [provider], limits_from: provider}
`, initial)
}

func adaptiveStreamRequest() *envoysim.Request {
	return &envoysim.Request{
		Method:  "POST",
		Path:    "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}},
		Body:    []byte(`{"model":"gpt-4o-mini","max_tokens":40,"stream":true,"messages":[{"role":"user","content":"Summarise the incident report."}]}`),
	}
}

// adaptiveState reads the provider compartment's view from /admin/compartments.
func adaptiveState(t *testing.T, s *harness.Stack) policy.CompartmentView {
	t.Helper()
	var body struct {
		Compartments []policy.CompartmentView `json:"compartments"`
	}
	if err := s.Get("/admin/compartments", &body); err != nil {
		t.Fatal(err)
	}
	views := body.Compartments
	for _, v := range views {
		if v.Name == "provider/openai" && v.Adaptive != nil {
			return v
		}
	}
	t.Fatalf("no adaptive provider/openai in %+v", views)
	return policy.CompartmentView{}
}

// load runs clients streaming requests in a loop until done is true or 30s pass, and returns
// whether done became true.
func load(t *testing.T, s *harness.Stack, clients int, done func(policy.CompartmentView) bool) bool {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for ctx.Err() == nil {
				if _, err := s.Do(ctx, adaptiveStreamRequest()); err != nil && ctx.Err() == nil {
					t.Error(err)
					return
				}
			}
		})
	}
	defer func() {
		cancel()
		wg.Wait()
	}()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if done(adaptiveState(t, s)) {
			return true
		}
		time.Sleep(100 * time.Millisecond)
	}
	return false
}

// TestAdaptiveLimitEndToEnd: through Envoy (simulated) to a mock provider that works on 4
// requests at once and queues the rest, a limit that starts at 16 comes down towards 4 as the
// first tokens slow down; with a provider of ample capacity, a limit that starts at 1 grows.
func TestAdaptiveLimitEndToEnd(t *testing.T) {
	latency := mock.LatencyModel{Base: 300 * time.Millisecond, JitterMin: 0.95, JitterMax: 1.05}
	t.Run("shrinks to a busy provider", func(t *testing.T) {
		s := start(t, harness.Options{PolicyPath: writePolicy(t, adaptivePolicy(16)), Mock: mock.Options{Capacity: 4, Latency: latency}})
		ok := load(t, s, 24, func(v policy.CompartmentView) bool {
			return v.Adaptive.Limit <= 8 && v.Adaptive.BackoffsLatency > 0
		})
		v := adaptiveState(t, s)
		t.Logf("learned %+v", *v.Adaptive)
		if !ok {
			t.Fatalf("the limit did not come down: %+v", *v.Adaptive)
		}
		if v.MaxConcurrent != v.Adaptive.Limit || v.Adaptive.BaselineTTFB == "" || v.Adaptive.BaselineInterToken == "" {
			t.Errorf("view %+v / %+v: want the learned limit in force and both baselines known", v, *v.Adaptive)
		}
		text, err := s.Scrape()
		if err != nil {
			t.Fatal(err)
		}
		samples, err := harness.ParseSamples(text)
		if err != nil {
			t.Fatal(err)
		}
		if got, ok := samples.Value("llm_bulkhead_adaptive_limit", "compartment", "provider/openai"); !ok || got > 8 {
			t.Errorf("llm_bulkhead_adaptive_limit = %v (present %v), want at most 8", got, ok)
		}
	})
	t.Run("grows with a provider that has room", func(t *testing.T) {
		s := start(t, harness.Options{PolicyPath: writePolicy(t, adaptivePolicy(1)), Mock: mock.Options{Capacity: 64, Latency: latency}})
		ok := load(t, s, 16, func(v policy.CompartmentView) bool { return v.Adaptive.Limit >= 6 })
		if v := adaptiveState(t, s); !ok || v.Adaptive.Increases == 0 {
			t.Fatalf("the limit did not grow: %+v", *v.Adaptive)
		}
	})
}
