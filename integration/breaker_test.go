package integration_test

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

func deepseekChat() *envoysim.Request {
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "acme"})
	req.Body = []byte(`{"model":"deepseek-chat","max_tokens":10,"messages":[{"role":"user","content":"hello"}]}`)
	return req
}

func breakerState(t *testing.T, s *harness.Stack, name string) string {
	t.Helper()
	var out struct {
		Breakers []policy.BreakerView `json:"breakers"`
	}
	if err := s.Get("/admin/breakers", &out); err != nil {
		t.Fatal(err)
	}
	for _, b := range out.Breakers {
		if b.Name == name {
			return b.Snapshot.State.String()
		}
	}
	t.Fatalf("no breaker %s", name)
	return ""
}

// TestBreakerFallbackAndRecovery: with the example policy and 60 % of deepseek's calls failing,
// deepseek's breaker opens within one window, traffic moves to qwen (its fallback), and it
// returns to deepseek once the provider recovers and the half-open probes succeed.
func TestBreakerFallbackAndRecovery(t *testing.T) {
	clk := newManualClock()
	s := start(t, harness.Options{Clock: clk, Mock: mock.Options{TimeScale: 0.001, Seed: 7}})
	if err := s.Mock.SetFaults([]mock.FaultRule{{Provider: "deepseek", Fault: mock.Fault{FailRate: 0.6, Status: 503}}}); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	deepseekCalls := 0
	opened := -1
	for i := 0; i < 40; i++ {
		r, err := s.Do(ctx, deepseekChat())
		if err != nil {
			t.Fatal(err)
		}
		switch upstreamHeader(r, "x-llm-provider") {
		case "deepseek":
			deepseekCalls++
		case "qwen":
			if opened < 0 {
				opened = deepseekCalls
			}
			if r.Status != 200 {
				t.Fatalf("fallback call failed: %d", r.Status)
			}
		}
		clk.Advance(100 * time.Millisecond)
	}
	if opened < 0 || opened > 20 {
		t.Fatalf("breaker opened after %d deepseek calls, want within one window (20)", opened)
	}
	if st := breakerState(t, s, "deepseek"); st != "OPEN" {
		t.Fatalf("deepseek breaker %s", st)
	}
	if deepseekCalls != opened {
		t.Errorf("%d calls reached deepseek after it opened", deepseekCalls-opened)
	}

	// The provider recovers; after wait_in_open the probes go to deepseek and close the breaker.
	if err := s.Mock.SetFaults(nil); err != nil {
		t.Fatal(err)
	}
	clk.Advance(11 * time.Second)
	for i := 0; i < 8; i++ {
		r, err := s.Do(ctx, deepseekChat())
		if err != nil {
			t.Fatal(err)
		}
		if p := upstreamHeader(r, "x-llm-provider"); p != "deepseek" || r.Status != 200 {
			t.Fatalf("call %d after recovery went to %s with %d", i, p, r.Status)
		}
	}
	if st := breakerState(t, s, "deepseek"); st != "CLOSED" {
		t.Errorf("deepseek breaker %s after good probes", st)
	}
}

// TestBreakerAdmin: an operator forces a breaker open with the admin token; without it the
// request is refused.
func TestBreakerAdmin(t *testing.T) {
	s := start(t, harness.Options{Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret"}, Mock: mock.Options{TimeScale: 0.001}})
	post := func(token, body string) int {
		req, _ := http.NewRequest("POST", s.AdminURL()+"/admin/breakers/qwen", bytes.NewBufferString(body))
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post("", `{"state":"FORCED_OPEN"}`); code != 401 {
		t.Errorf("without token: %d", code)
	}
	if code := post("wrong", `{"state":"FORCED_OPEN"}`); code != 401 {
		t.Errorf("wrong token: %d", code)
	}
	if code := post("s3cret", `{"state":"SIDEWAYS"}`); code != 400 {
		t.Errorf("bad state: %d", code)
	}
	if code := post("s3cret", `{"state":"FORCED_OPEN"}`); code != 200 {
		t.Fatalf("forcing: %d", code)
	}
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-provider", Value: "qwen"})
	r, err := s.Do(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 503 || header(r, "x-bulkhead-reason") != "circuit_open" || header(r, "x-bulkhead-compartment") != "provider/qwen" ||
		!strings.Contains(string(r.Body), "paused") {
		t.Errorf("with qwen forced open: %d %v %s", r.Status, r.Headers, r.Body)
	}
	if code := post("s3cret", `{"state":"closed"}`); code != 200 {
		t.Fatalf("closing: %d", code)
	}
	if r, _ := s.Do(context.Background(), req); r.Status != 200 {
		t.Errorf("after reset: %d", r.Status)
	}
}
