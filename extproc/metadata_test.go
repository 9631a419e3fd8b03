package extproc_test

import (
	"context"
	"strconv"
	"testing"

	"time"

	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
)

// TestDynamicMetadata: what Envoy decodes from the reply that carries the metadata, key by key,
// for an admitted and settled request, a re-routed one and a refused one.
func TestDynamicMetadata(t *testing.T) {
	const pol = `
envoy: {max_message_timeout: 10s}
classification:
  provider: {default: main, rules: [{model_map: true}]}
  model: {rules: [{body: model}]}
providers:
  main: {breaker: b, fallback: spare}
  spare:
    models: [{match: "m*", model: spare-m}]
models:
  - {match: "m*", provider: main}
breakers:
  b: {minimum_calls: 1, sliding_window_size: 1, failure_rate_threshold: 50, wait_in_open: 1h}
features:
  default: {max_concurrent: 1, tokens_per_minute: 1000000}
`
	cfg := buffered
	cfg.ReceivingNamespaces = []string{"llm_bulkhead"}
	s := serve(t, pol, cfg)
	usage := `{"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":3}}}`
	common := map[string]any{"feature": "default", "tenant": "anonymous", "tier": "none", "model": "m",
		"estimated_tokens": float64(0)}
	want := func(extra map[string]any) *structpb.Struct {
		m := map[string]any{}
		for k, v := range common {
			m[k] = v
		}
		for k, v := range extra {
			m[k] = v
		}
		st, err := structpb.NewStruct(m)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	check := func(name string, r *envoysim.Result, w *structpb.Struct) {
		t.Helper()
		got := r.DynamicMetadata["llm_bulkhead"]
		if got != nil {
			// The estimate depends on the estimator, not on the encoding: compare it apart.
			if got.Fields["estimated_tokens"].GetNumberValue() <= 0 {
				t.Errorf("%s: estimated_tokens %v", name, got.Fields["estimated_tokens"])
			}
			w.Fields["estimated_tokens"] = got.Fields["estimated_tokens"]
		}
		if !proto.Equal(w, got) {
			t.Errorf("%s: metadata\n%s\nwant\n%s", name, prototext.Format(got), prototext.Format(w))
		}
	}

	// Admitted, then settled from the reported usage.
	r, err := s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(200, nil, usage))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	check("admitted", r, want(map[string]any{"provider": "main", "decision": "admitted",
		"compartment": "feature/default", "prompt_tokens": 7, "completion_tokens": 5,
		"total_tokens": 12, "cached_tokens": 3, "reasoning_tokens": 0, "usage_reported": true}))

	// A failure opens the breaker; the next request is re-routed to the fallback.
	if r, err = s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(500, nil, `{}`)); err != nil || r.Status != 500 {
		t.Fatalf("%v %v", r, err)
	}
	r, err = s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(200, nil, usage))
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	check("rerouted", r, want(map[string]any{"provider": "spare", "decision": "rerouted", "reason": "circuit_open",
		"model": "spare-m", "original_model": "m",
		"compartment": "feature/default", "prompt_tokens": 7, "completion_tokens": 5,
		"total_tokens": 12, "cached_tokens": 3, "reasoning_tokens": 0, "usage_reported": true}))
	// The fallback was sent the model spare's map names for m, and a content-length that fits.
	if got := string(r.Upstream.Body); got != `{"model":"spare-m","messages":[{"role":"user","content":"hi"}]}` {
		t.Errorf("re-routed body %s", got)
	}
	if cl := r.Upstream.Headers.Get("content-length"); cl != strconv.Itoa(len(r.Upstream.Body)) {
		t.Errorf("content-length %q for a %d-byte body", cl, len(r.Upstream.Body))
	}

	// Refused: the only slot is held by a request whose upstream has not answered.
	held := make(chan struct{})
	first := make(chan *envoysim.Result, 1)
	go func() {
		r, _ := s.sim.RoundTrip(context.Background(), request(), envoysim.UpstreamFunc(func(ctx context.Context, req *envoysim.UpstreamRequest) (*envoysim.UpstreamResponse, error) {
			<-held
			return envoysim.Respond(200, nil, usage).Serve(ctx, req)
		}))
		first <- r
	}()
	for deadline := time.Now().Add(5 * time.Second); s.eng.InFlight() != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first request was not admitted")
		}
	}
	r, err = s.sim.RoundTrip(context.Background(), request(), envoysim.Respond(200, nil, usage))
	close(held)
	<-first
	if err != nil || r.Status != 503 {
		t.Fatalf("%v %v", r, err)
	}
	check("rejected", r, want(map[string]any{"provider": "spare", "decision": "rejected", "reason": "bulkhead_full",
		"model": "spare-m", "original_model": "m", "compartment": "feature/default"}))
}
