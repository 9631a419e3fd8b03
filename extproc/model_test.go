package extproc_test

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// degradePolicy degrades batch requests over their paid budget to local, whose models map
// sends every model as local-llama.
const degradePolicy = `
envoy: {max_message_timeout: 10s}
classification:
  feature: {rules: [{header: x-llm-feature}]}
  model: {rules: [{body: model}]}
features:
  default: {}
  batch: {degrade: {provider: local}}
providers:
  default: {}
  local:
    models: [{match: "*", model: local-llama}]
compartments:
  - {name: paid, key: [feature], where: {provider: [default]}, limits: {tokens_per_minute: 100}}
`

// spendPaid spends batch's whole paid budget (a request larger than a budget is admitted into an
// empty one), so the next batch request degrades.
func spendPaid(t *testing.T, s *server) {
	t.Helper()
	req := request()
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-feature", Value: "batch"})
	req.Body = []byte(`{"model":"m","max_tokens":60,"messages":[{"role":"user","content":"hi"}]}`)
	r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{"usage":{"prompt_tokens":50,"completion_tokens":50,"total_tokens":100}}`))
	if err != nil || r.Status != 200 || upstreamProvider(r) != "default" {
		t.Fatalf("spending the paid budget: %v %v", r, err)
	}
}

func upstreamProvider(r *envoysim.Result) string {
	if r.Upstream == nil {
		return ""
	}
	return r.Upstream.Headers.Get("x-llm-provider")
}

// TestRerouteRewritesModelAndIncludeUsageInOneMutation: a streamed request degraded to local
// reaches it with local's model and stream_options.include_usage, in one body mutation whose
// content-length fits, every other byte as the client sent it.
func TestRerouteRewritesModelAndIncludeUsageInOneMutation(t *testing.T) {
	cfg := buffered
	cfg.ReceivingNamespaces = []string{"llm_bulkhead"}
	s := serve(t, degradePolicy, cfg)
	spendPaid(t, s)
	req := request()
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-feature", Value: "batch"})
	req.Body = []byte(`{"model":"DeepSeek-Chat","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"hi"}]}`)
	sse := "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"total_tokens\":3}}\n\ndata: [DONE]\n\n"
	r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, envoysim.Headers{{Key: "content-type", Value: "text/event-stream"}}, sse))
	if err != nil || r.Status != 200 || len(r.Problems) > 0 {
		t.Fatalf("%v %v", r, err)
	}
	want := `{"model":"local-llama","stream":true,"max_tokens":500,"messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}}`
	if got := string(r.Upstream.Body); got != want {
		t.Errorf("upstream body\n%s\nwant\n%s", got, want)
	}
	if cl := r.Upstream.Headers.Get("content-length"); cl != strconv.Itoa(len(want)) {
		t.Errorf("content-length %q, want %d", cl, len(want))
	}
	if p := upstreamProvider(r); p != "local" {
		t.Errorf("x-llm-provider %q", p)
	}
	md := r.DynamicMetadata["llm_bulkhead"].GetFields()
	if md["model"].GetStringValue() != "local-llama" || md["original_model"].GetStringValue() != "deepseek-chat" ||
		md["decision"].GetStringValue() != "rerouted" || md["provider"].GetStringValue() != "local" {
		t.Errorf("metadata %v", md)
	}
}

// TestRerouteWithoutABodyToRewriteIsRefused: a request without a body has no model to rewrite,
// so it gets the refusal (and is counted) instead of reaching local with a model local may not
// serve; with a body the same request is re-routed.
func TestRerouteWithoutABodyToRewriteIsRefused(t *testing.T) {
	s := serve(t, degradePolicy, buffered)
	spendPaid(t, s)
	req := request()
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-feature", Value: "batch"})
	req.Body = nil
	r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != 429 || r.Upstream != nil {
		t.Fatalf("without a body: %d (upstream called: %v), want 429 token_budget", r.Status, r.Upstream != nil)
	}
	if got := counter(t, s.reg, "llm_bulkhead_reroute_unmapped_total"); got != 1 {
		t.Errorf("reroute_unmapped_total %v", got)
	}
	// With a body the same request is re-routed and rewritten.
	req = request()
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-feature", Value: "batch"})
	req.Body = []byte(`{"model":"m","max_tokens":500,"messages":[]}`)
	if r, err = s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{}`)); err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if got := string(r.Upstream.Body); got != `{"model":"local-llama","max_tokens":500,"messages":[]}` {
		t.Errorf("upstream body %s", got)
	}
}

// TestRerouteRewritesTheModelOfEveryAPI: the rewrite works on every API's body (the model is a
// top-level member of each), with content-length to match.
func TestRerouteRewritesTheModelOfEveryAPI(t *testing.T) {
	s := serve(t, degradePolicy, buffered)
	spendPaid(t, s)
	long := strings.Repeat("x", 2400)
	for _, c := range []struct{ path, body string }{
		{"/v1/completions", `{"model":"m","max_tokens":500,"prompt":"hi"}`},
		{"/v1/embeddings", `{"input":"` + long + `","model":"m"}`},
		{"/v1/responses", `{"model":"m","input":"hi","max_output_tokens":500}`},
		{"/v1/messages", `{"model":"claude-sonnet-4","max_tokens":500,"messages":[{"role":"user","content":"hi"}]}`},
	} {
		req := request()
		req.Path = c.path
		req.Headers = append(req.Headers, envoysim.Header{Key: "x-llm-feature", Value: "batch"})
		req.Body = []byte(c.body)
		r, err := s.sim.RoundTrip(context.Background(), req, envoysim.Respond(200, nil, `{}`))
		if err != nil || r.Status != 200 || upstreamProvider(r) != "local" {
			t.Fatalf("%s: %v %v", c.path, r, err)
		}
		var got map[string]any
		if err := json.Unmarshal(r.Upstream.Body, &got); err != nil || got["model"] != "local-llama" {
			t.Errorf("%s arrived as %s", c.path, r.Upstream.Body)
		}
		want := strings.Replace(c.body, `"model":"claude-sonnet-4"`, `"model":"local-llama"`, 1)
		want = strings.Replace(want, `"model":"m"`, `"model":"local-llama"`, 1)
		if string(r.Upstream.Body) != want {
			t.Errorf("%s: other bytes changed:\n%s\nwant\n%s", c.path, r.Upstream.Body, want)
		}
		if cl := r.Upstream.Headers.Get("content-length"); cl != strconv.Itoa(len(want)) {
			t.Errorf("%s: content-length %q, want %d", c.path, cl, len(want))
		}
	}
}
