package integration_test

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
	"github.com/llm-bulkhead/llm-bulkhead/internal/syncbuf"
	"github.com/llm-bulkhead/llm-bulkhead/policy"
	"github.com/llm-bulkhead/llm-bulkhead/policy/breaker"
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

// TestBreakerEventsEndpoint: GET /admin/breakers/{name}/events serves a per-model breaker (a
// name with a slash) its transitions with the calls before them, beside the POST route of the
// same names; refusals are logged once per breaker per second with a count of the rest.
func TestBreakerEventsEndpoint(t *testing.T) {
	clk := newManualClock()
	logs := &syncbuf.Buffer{}
	s := start(t, harness.Options{Clock: clk, Logs: logs, Mock: mock.Options{TimeScale: 0.001, Seed: 7},
		Env: []string{"LLM_BULKHEAD_ADMIN_TOKEN=s3cret", "LLM_BULKHEAD_PROVIDERS__DEEPSEEK__BREAKER_PER_MODEL=true"}})
	const name = "deepseek/deepseek-*"
	ctx := context.Background()
	if err := s.Mock.SetFaults([]mock.FaultRule{{Provider: "deepseek", Fault: mock.Fault{Status: 503}}}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 10; i++ { // minimum_calls 10, all failing: the tenth opens the breaker
		if _, err := s.Do(ctx, deepseekChat()); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 5; i++ { // refused by the open breaker, re-routed to qwen
		r, err := s.Do(ctx, deepseekChat())
		if err != nil {
			t.Fatal(err)
		}
		if p := upstreamHeader(r, "x-llm-provider"); p != "qwen" {
			t.Fatalf("call %d with %s open went to %q (%d)", i, name, p, r.Status)
		}
	}

	var out struct {
		Breaker     string                 `json:"breaker"`
		HistorySize int                    `json:"history_size"`
		Events      []breaker.HistoryEntry `json:"events"`
	}
	if err := s.Get("/admin/breakers/"+name+"/events", &out); err != nil {
		t.Fatal(err)
	}
	if out.Breaker != name || out.HistorySize != breaker.HistorySize || len(out.Events) != 1 {
		t.Fatalf("events of %s: %+v", name, out)
	}
	ev := out.Events[0]
	if ev.From != breaker.Closed || ev.To != breaker.Open || ev.Reason != breaker.ReasonFailureRate || ev.FailureRate != 100 {
		t.Fatalf("event %+v", ev)
	}
	if len(ev.Calls) != breaker.RecentCalls {
		t.Fatalf("%d calls with the event, want %d", len(ev.Calls), breaker.RecentCalls)
	}
	for _, c := range ev.Calls {
		if c.Status != 503 || c.Kind != "failure" || c.Provider != "deepseek" {
			t.Errorf("call %+v, want a 503 failure from deepseek", c)
		}
	}

	// The POST route of the same name still forces the breaker.
	req, _ := http.NewRequest("POST", s.AdminURL()+"/admin/breakers/"+name, bytes.NewBufferString(`{"state":"CLOSED"}`))
	req.Header.Set("Authorization", "Bearer s3cret")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("POST %s: %d", name, resp.StatusCode)
	}
	if err := s.Get("/admin/breakers/"+name+"/events", &out); err != nil {
		t.Fatal(err)
	}
	if n := len(out.Events); n != 2 || out.Events[1].To != breaker.Closed || out.Events[1].Reason != breaker.ReasonForced {
		t.Errorf("after the forced close: %+v", out.Events)
	}
	for _, path := range []string{"/admin/breakers/" + name, "/admin/breakers/nosuch/events", "/admin/breakers/events"} {
		resp, err := http.Get(s.AdminURL() + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 404 {
			t.Errorf("GET %s: %d, want 404", path, resp.StatusCode)
		}
	}

	// Five refusals at one instant: one line. A second later the next says how many it held back.
	if n := strings.Count(logs.String(), `"msg":"breaker refused a call"`); n != 1 {
		t.Errorf("%d refusal lines for five refusals within a second, want 1:\n%s", n, logs)
	}
	if err := s.App.Engine().ForceBreaker(name, "FORCED_OPEN"); err != nil {
		t.Fatal(err)
	}
	clk.Advance(1500 * time.Millisecond)
	if _, err := s.Do(ctx, deepseekChat()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(logs.String(), `"suppressed":4`) {
		t.Errorf("no refusal line counting the 4 held back:\n%s", logs)
	}
}

// TestRouterRetriesOneBreakerOutcome: with Envoy's router retrying 503s behind the ext_proc
// filter (envoy/envoy.yaml's retry_policy), the breaker records one outcome per client request,
// the last attempt's: a request whose first attempt got 503 and whose retry succeeded is one
// success, one whose every attempt got 503 is one failure. The retried attempts are invisible.
func TestRouterRetriesOneBreakerOutcome(t *testing.T) {
	s := start(t, harness.Options{NoMock: true})
	ctx := context.Background()
	jsonCT := envoysim.Headers{{Key: "content-type", Value: "application/json"}}
	ok := envoysim.Respond(200, jsonCT, `{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":10,"total_tokens":20}}`)
	unavailable := envoysim.Respond(503, jsonCT, `{"error":{"message":"overloaded","type":"server_error"}}`)
	var failing atomic.Int64 // attempts still to answer 503
	up := envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
		if failing.Add(-1) >= 0 {
			return unavailable.Serve(ctx, req)
		}
		return ok.Serve(ctx, req)
	})
	var attempts atomic.Int64
	router := envoysim.Retrying(up, envoysim.RetryPolicy{NumRetries: 2, RetriableStatusCodes: []int{503, 429}, OnFailure: true,
		BackOff: time.Millisecond, MaxRetryAfter: time.Second, OnAttempt: func(int, bool) { attempts.Add(1) }})
	calls := func() breaker.Counts {
		for _, b := range s.App.Engine().Breakers() {
			if b.Name == "deepseek" {
				return b.Calls
			}
		}
		t.Fatal("no deepseek breaker")
		return breaker.Counts{}
	}

	failing.Store(1)
	r, err := s.Sim.RoundTrip(ctx, deepseekChat(), router)
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 200 || attempts.Load() != 2 {
		t.Fatalf("status %d after %d attempts, want 200 after 2", r.Status, attempts.Load())
	}
	if c := calls(); c.Success != 1 || c.Failure != 0 {
		t.Fatalf("breaker calls %+v after a retried success, want one success", c)
	}

	attempts.Store(0)
	failing.Store(3)
	if r, err = s.Sim.RoundTrip(ctx, deepseekChat(), router); err != nil {
		t.Fatal(err)
	}
	if r.Status != 503 || attempts.Load() != 3 {
		t.Fatalf("status %d after %d attempts, want 503 after 3", r.Status, attempts.Load())
	}
	if c := calls(); c.Success != 1 || c.Failure != 1 {
		t.Fatalf("breaker calls %+v after retries ran out, want one success and one failure", c)
	}
}
