package integration_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/llm-bulkhead/llm-bulkhead/cmd/mockllm/mock"
	"github.com/llm-bulkhead/llm-bulkhead/integration/envoysim"
	"github.com/llm-bulkhead/llm-bulkhead/integration/harness"
)

func upstreamHeader(r *envoysim.Result, name string) string {
	if r.Upstream == nil {
		return ""
	}
	for _, h := range r.Upstream.Headers {
		if h.Key == name {
			return h.Value
		}
	}
	return ""
}

// TestForgedTierIsIgnored: with the example policy, a free tenant that sends
// x-tenant-tier: enterprise is still judged as free, and jwt_authn claims forwarded by Envoy
// win over a client's x-tenant-id.
func TestForgedTierIsIgnored(t *testing.T) {
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.01}})
	ctx := context.Background()
	req := chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "initech"}, envoysim.Header{Key: "x-tenant-tier", Value: "enterprise"})
	r, err := s.Do(ctx, req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	got := upstreamHeader(r, "x-bulkhead-compartment")
	if !strings.Contains(got, "tier_feature/free/chat") || !strings.Contains(got, "tenant/initech") {
		t.Errorf("compartments %q: a free tenant claiming enterprise must stay free", got)
	}
	if md := r.DynamicMetadata["llm_bulkhead"].GetFields(); md["tier"].GetStringValue() != "free" {
		t.Errorf("metadata tier %v", md["tier"])
	}

	// A verified claim forwarded by Envoy beats the client's header.
	claims, _ := structpb.NewStruct(map[string]any{"jwt_payload": map[string]any{"tenant": "acme"}})
	req = chatRequest("chat")
	req.Headers = append(req.Headers, envoysim.Header{Key: "x-tenant-id", Value: "initech"})
	req.Metadata = map[string]*structpb.Struct{"envoy.filters.http.jwt_authn": claims}
	r, err = s.Do(ctx, req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if got := upstreamHeader(r, "x-bulkhead-compartment"); !strings.Contains(got, "tier_feature/enterprise/chat") || !strings.Contains(got, "tenant/acme") {
		t.Errorf("compartments %q, want acme's (from the jwt claim)", got)
	}
}

// TestModelMapRoutes: a request for a deepseek model is routed to the deepseek provider:
// x-llm-provider is set for Envoy's routes and the route cache is cleared.
func TestModelMapRoutes(t *testing.T) {
	s := start(t, harness.Options{Mock: mock.Options{TimeScale: 0.01}})
	req := chatRequest("chat")
	req.Body = []byte(`{"model":"deepseek-chat","messages":[{"role":"user","content":"hi"}]}`)
	r, err := s.Do(context.Background(), req)
	if err != nil || r.Status != 200 {
		t.Fatalf("%v %v", r, err)
	}
	if upstreamHeader(r, "x-llm-provider") != "deepseek" || !r.Upstream.RouteCacheCleared {
		t.Errorf("x-llm-provider %q, route cache cleared %v", upstreamHeader(r, "x-llm-provider"), r.Upstream.RouteCacheCleared)
	}
}

const headerOnlyPolicy = `
envoy: {max_message_timeout: 10s, allow_mode_override: %v}
body: {inject_include_usage: false}
classification:
  feature:
    rules: [{header: x-llm-feature}]
features:
  chat: {max_concurrent: 5}
  default: {max_concurrent: 5}
`

// TestDecisionWithoutBody: when no rule or limit needs the body, the request is decided at
// request headers; with allow_mode_override Envoy is told not to send the body at all, without
// it the body is answered unchanged. The upstream gets the body either way.
func TestDecisionWithoutBody(t *testing.T) {
	for _, allow := range []bool{true, false} {
		t.Run(map[bool]string{true: "mode_override", false: "no_override"}[allow], func(t *testing.T) {
			s := start(t, harness.Options{PolicyPath: writePolicy(t, strings.Replace(headerOnlyPolicy, "%v", map[bool]string{true: "true", false: "false"}[allow], 1)),
				Mock: mock.Options{TimeScale: 0.01}})
			req := chatRequest("chat")
			r, err := s.Do(context.Background(), req)
			if err != nil || r.Status != 200 {
				t.Fatalf("%v %v", r, err)
			}
			sentBody := false
			for _, k := range r.SentKinds() {
				if k == envoysim.KindRequestBody {
					sentBody = true
				}
			}
			if sentBody == allow {
				t.Errorf("request body sent to the server: %v (allow_mode_override %v)", sentBody, allow)
			}
			if string(r.Upstream.Body) != string(req.Body) {
				t.Errorf("upstream body %q", r.Upstream.Body)
			}
			if upstreamHeader(r, "x-bulkhead-feature") != "chat" {
				t.Errorf("x-bulkhead-feature %q", upstreamHeader(r, "x-bulkhead-feature"))
			}
		})
	}
}

const requireJSONPolicy = `
envoy: {max_message_timeout: 10s}
body: {require_valid_json: [/v1/chat/]}
features:
  default: {max_concurrent: 5}
`

// TestInvalidBody: a body that is not JSON is refused with 400 in the API's format on a route
// that requires valid JSON, and classified from headers and admitted elsewhere.
func TestInvalidBody(t *testing.T) {
	s := start(t, harness.Options{PolicyPath: writePolicy(t, requireJSONPolicy), Mock: mock.Options{TimeScale: 0.01}})
	for _, tc := range []struct {
		path, body string
		want       int
	}{
		{"/v1/chat/completions", `{"model": "x", "messages": [`, 400},
		{"/v1/chat/completions", `[1,2,3]`, 400},
		{"/v1/embeddings", `not json at all`, 0}, // admitted; the mock answers what it answers
	} {
		r, err := s.Do(context.Background(), &envoysim.Request{Method: "POST", Path: tc.path,
			Headers: envoysim.Headers{{Key: "content-type", Value: "application/json"}}, Body: []byte(tc.body)})
		if err != nil {
			t.Fatal(err)
		}
		if tc.want == 400 {
			if r.Status != 400 || header(r, "x-bulkhead-reason") != "bad_request" || r.Upstream != nil ||
				!strings.Contains(string(r.Body), `"type":"invalid_request_error"`) {
				t.Errorf("%s %q: status %d body %s", tc.path, tc.body, r.Status, r.Body)
			}
			continue
		}
		if r.Upstream == nil {
			t.Errorf("%s %q was not admitted (status %d)", tc.path, tc.body, r.Status)
		}
	}
}
