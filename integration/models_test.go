package integration_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

// modelRequest is a chat request for model with the given body after the model.
func modelRequest(feature, tenant, model, rest string) *envoysim.Request {
	return &envoysim.Request{
		Method: "POST", Path: "/v1/chat/completions",
		Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}, {Key: "x-llm-feature", Value: feature},
			{Key: "x-tenant-id", Value: tenant}},
		Body: []byte(`{"model":"` + model + `",` + rest),
	}
}

// arrived checks that r reached provider through the mock LLM with the body the client sent
// but model as sent (and extra appended, if the server adds something), a content-length that
// fits it, and metadata naming both models.
func arrived(t *testing.T, s *harness.Stack, r *envoysim.Result, err error, provider, asked, sent, rest, extra string) {
	t.Helper()
	if err != nil || r.Status != 200 || r.Upstream == nil {
		t.Fatalf("%s: %v %v", asked, r, err)
	}
	if p := upstreamHeader(r, "x-llm-provider"); p != provider {
		t.Errorf("%s went to %s, want %s", asked, p, provider)
	}
	want := `{"model":"` + sent + `",` + rest
	if extra != "" {
		want = strings.TrimSuffix(want, "}") + extra + "}"
	}
	if got := string(r.Upstream.Body); got != want {
		t.Errorf("%s arrived as\n%s\nwant\n%s", asked, got, want)
	}
	if cl := upstreamHeader(r, "content-length"); cl != strconv.Itoa(len(r.Upstream.Body)) {
		t.Errorf("%s: content-length %q for %d bytes", asked, cl, len(r.Upstream.Body))
	}
	md := r.DynamicMetadata["llm_bulkhead"].GetFields()
	if md["decision"].GetStringValue() != "rerouted" || md["provider"].GetStringValue() != provider ||
		md["model"].GetStringValue() != sent || md["original_model"].GetStringValue() != asked {
		t.Errorf("%s: metadata %v", asked, md)
	}
	reqs := s.Mock.Requests()
	if last := reqs[len(reqs)-1]; last.Provider != provider || last.Model != sent || last.Status != 200 {
		t.Errorf("%s: the mock LLM saw %s for %s, answered %d", asked, last.Model, last.Provider, last.Status)
	}
}

// TestReroutesArriveWithTheTargetsModel: with the example policy, behind a mock LLM that answers
// 404 model_not_found to a model its provider does not serve, a breaker fallback deepseek → qwen
// and batch_summarize's degrade to local reach the mock with qwen's and local's models, the rest
// of the body as sent (include_usage added in the same rewrite), a content-length that fits, and
// both models in the dynamic metadata.
func TestReroutesArriveWithTheTargetsModel(t *testing.T) {
	clk := newManualClock()
	s := start(t, harness.Options{Clock: clk, CheckModels: true, Mock: mock.Options{TimeScale: 0.001}})
	ctx := context.Background()

	// The mock checks: a model sent unchanged to another provider is what a re-route without
	// the rewrite would have met.
	wrong := modelRequest("chat", "acme", "deepseek-chat", `"max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`)
	wrong.Headers = append(wrong.Headers, envoysim.Header{Key: "x-llm-provider", Value: "qwen"})
	if r, err := s.Do(ctx, wrong); err != nil || r.Status != 404 || !strings.Contains(string(r.Body), "model_not_found") {
		t.Fatalf("deepseek-chat sent to qwen: %v %v, want the mock's 404 model_not_found", r, err)
	}

	// Breaker fallback: deepseek forced open, its models go to qwen as qwen's.
	if err := s.App.Engine().ForceBreaker("deepseek", "FORCED_OPEN"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ asked, sent, rest, extra string }{
		{"deepseek-chat", "qwen-plus", `"max_tokens":10,"messages":[{"role":"user","content":"hello"}]}`, ""},
		{"deepseek-reasoner", "qwen-max", `"stream":true,"max_tokens":10,"messages":[{"role":"user","content":"why?"}]}`,
			`,"stream_options":{"include_usage":true}`},
	} {
		r, err := s.Do(ctx, modelRequest("chat", "acme", c.asked, c.rest))
		arrived(t, s, r, err, "qwen", c.asked, c.sent, c.rest, c.extra)
		if md := r.DynamicMetadata["llm_bulkhead"].GetFields(); md["reason"].GetStringValue() != "circuit_open" {
			t.Errorf("%s: reason %v", c.asked, md["reason"])
		}
	}
	if err := s.App.Engine().ForceBreaker("deepseek", "CLOSED"); err != nil {
		t.Fatal(err)
	}

	// Degrade: batch_summarize pays for ten 5 000-token documents a minute on paid providers;
	// the eleventh runs on local, as local's model.
	rest := fmt.Sprintf(`"max_tokens":500,"messages":[{"role":"user","content":"%s"}]}`, strings.Repeat("a", 18000))
	for i := 0; i < 10; i++ {
		r, err := s.Do(ctx, modelRequest("batch_summarize", "acme", "deepseek-chat", rest))
		if err != nil || r.Status != 200 || upstreamHeader(r, "x-llm-provider") != "deepseek" {
			t.Fatalf("document %d: %v %v", i, r, err)
		}
		clk.Advance(time.Second)
	}
	r, err := s.Do(ctx, modelRequest("batch_summarize", "acme", "deepseek-chat", rest))
	arrived(t, s, r, err, "local", "deepseek-chat", "local-llama-3.1-8b", rest, "")
	if md := r.DynamicMetadata["llm_bulkhead"].GetFields(); md["reason"].GetStringValue() != "token_budget" {
		t.Errorf("degraded: reason %v", md["reason"])
	}
}
